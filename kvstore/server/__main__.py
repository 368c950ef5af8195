"""``python -m kvstore.server`` is the ``kvstore`` console script."""

import sys

from kvstore.server.cli import main

sys.exit(main())
