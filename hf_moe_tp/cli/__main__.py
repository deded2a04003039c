"""``python -m hf_moe_tp.cli``: the ``hf-moe-tp`` command."""

import sys

from .main import main

sys.exit(main())
