"""``python -m transformer_ext.serve``: see :mod:`transformer_ext.serve.cli`."""

import sys

from .cli import main

sys.exit(main())
