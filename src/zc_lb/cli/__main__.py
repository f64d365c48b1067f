"""``python -m zc_lb.cli``: the ``zc-lb`` command, as the console script
runs it (and as zc-lb starts its own processes: ``--processes``, ``-w``,
a successor on SIGUSR2)."""

import sys

from zc_lb.cli import main

sys.exit(main())
