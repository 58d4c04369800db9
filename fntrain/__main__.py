"""`python -m fntrain ...` is the `fntrain` command (handy under torchrun: torchrun ... -m fntrain run ...)."""

from fntrain.cli import main
from fntrain.runtime.process import run_main

run_main(main)
