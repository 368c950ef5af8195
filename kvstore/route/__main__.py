import sys

from kvstore.route.service import main

sys.exit(main())
