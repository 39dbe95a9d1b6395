"""``python -m gradsync ...``: the same CLI as the ``gradsync`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
