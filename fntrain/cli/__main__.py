"""`python -m fntrain.cli ...` is the `fntrain` command, as `python -m fntrain ...` is."""

from fntrain.cli.main import main
from fntrain.runtime.process import run_main

run_main(main)
