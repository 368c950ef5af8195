import sys

from tools.kvctl.cli import main

sys.exit(main())
