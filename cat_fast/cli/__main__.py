"""``python -m cat_fast.cli``: the same as the ``cat-fast`` command."""
import sys

from . import main

sys.exit(main())
