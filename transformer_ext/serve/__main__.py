"""``python -m transformer_ext.serve``: see :mod:`transformer_ext.serve.cli`."""

import sys

from ..commands import require

require("transformer_ext.serve")

from .cli import main  # noqa: E402

sys.exit(main())
