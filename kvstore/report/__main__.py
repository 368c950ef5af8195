import sys

from kvstore.report.cli import main

sys.exit(main())
