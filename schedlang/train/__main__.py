"""``python -m schedlang.train``."""

import sys

from . import main

sys.exit(main(prog="python -m schedlang.train"))
