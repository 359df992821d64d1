"""`python -m cairn._cli`: the `cairn` command without its entry point."""

import sys

from .main import main

sys.exit(main())
