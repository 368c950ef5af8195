"""``python -m tools.replay --help``."""

import sys

from tools.replay.cli import main

sys.exit(main())
