"""``python -m edgetrain.cli``: the same as the ``edgetrain`` command."""

import sys

from .main import main

sys.exit(main())
