"""`python -m fntrain ...` is the `fntrain` command (handy under torchrun: torchrun ... -m fntrain run ...)."""

import sys

from fntrain.cli import main

sys.exit(main())
