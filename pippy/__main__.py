"""``python -m pippy``: the command line of :mod:`pippy.cli`."""

import sys

from pippy.cli import main

if __name__ == "__main__":
    sys.exit(main())
