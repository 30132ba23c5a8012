"""``python -m lmpm``: the same as the ``lmpm`` command."""

import sys

from lmpm.cli import main

sys.exit(main())
