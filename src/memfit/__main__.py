"""``python -m memfit``: the same command line as the ``memfit`` script."""

from memfit.cli import console_main

raise SystemExit(console_main())
