"""One module per `fntrain` subcommand, each with `command(args)`: run, plan, config, cp, plot,
tokenize, export, recipes. `fntrain.cli.main` dispatches to them."""
