"""`python -m placement ...`: see :mod:`placement.cli`."""

import sys

from placement.cli import main

sys.exit(main())
