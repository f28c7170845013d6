"""``python -m lowrank_laplace``: the same as the ``lowrank-laplace`` command."""

import sys

from lowrank_laplace.toolkit.cli import main

sys.exit(main())
