"""``python -m memfit.cli``: the same as the ``memfit`` command."""

import sys

from memfit.cli import main

sys.exit(main())
