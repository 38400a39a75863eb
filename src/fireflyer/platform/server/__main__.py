"""``python -m fireflyer.platform.server serve|user ...``: the same as ``fireflyer platform serve|user ...``."""

import sys

from fireflyer.errors import UserError
from fireflyer.platform.server.cli import main

try:
    sys.exit(main(sys.argv[1:]))
except UserError as exc:
    print(f"fireflyer: {exc}", file=sys.stderr)
    sys.exit(2)
