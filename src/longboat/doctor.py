"""``python -m longboat.doctor``: the same as ``longboat doctor`` (e.g. under ``longboat launch -m``)."""

import sys

from longboat.tools.doctor import main

if __name__ == "__main__":
    sys.exit(main())
