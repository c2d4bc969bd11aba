"""``python -m longboat.tools.doctor``: the same as ``longboat doctor``."""

import sys

from longboat.tools.doctor import main

if __name__ == "__main__":
    sys.exit(main())
