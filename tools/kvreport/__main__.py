import sys

from tools.kvreport.cli import main

sys.exit(main())
