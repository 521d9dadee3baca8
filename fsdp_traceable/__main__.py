"""``python -m fsdp_traceable``: see :mod:`fsdp_traceable.cli.main`."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
