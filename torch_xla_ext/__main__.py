"""``python -m torch_xla_ext``: the command line (:mod:`torch_xla_ext.cli.main`)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
