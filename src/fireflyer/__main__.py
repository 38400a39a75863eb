"""``python -m fireflyer``: the same as the ``fireflyer`` command."""

import sys

from fireflyer.cli import main

sys.exit(main())
