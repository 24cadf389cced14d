"""``python -m asyncsave`` runs the ``asyncsave`` command."""

import sys

from ._cli import main

sys.exit(main())
