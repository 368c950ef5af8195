"""``python -m tools.lab.replay --help``."""

import sys

from tools.lab.replay.cli import main

sys.exit(main())
