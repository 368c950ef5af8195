import sys

from kvstore.ctl.cli import main

sys.exit(main())
