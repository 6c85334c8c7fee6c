"""``python -m weir``: the same as the ``weir`` command."""

import sys

from weir.cli import main

sys.exit(main())
