"""`python -m farsight.cli`: the `farsight` command where no console script is on the PATH (e.g. under torchrun)."""

import sys

from farsight.cli import main

sys.exit(main())
