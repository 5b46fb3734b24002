"""``python -m memfit``: the same command line as the ``memfit`` script."""

from memfit.cli import main

raise SystemExit(main())
