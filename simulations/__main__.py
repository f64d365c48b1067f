"""``python -m simulations SCENARIO``: the same as ``simulations.cli``."""

import sys

from .cli import main

sys.exit(main())
