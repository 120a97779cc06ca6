"""``python -m deltackpt`` runs the command line (see :mod:`deltackpt.cli`)."""

import sys

from deltackpt.cli import main

sys.exit(main())
