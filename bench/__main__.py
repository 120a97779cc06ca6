"""``python -m bench``: see :mod:`bench.driver`."""

import sys

from bench.driver import main

if __name__ == "__main__":
    sys.exit(main())
