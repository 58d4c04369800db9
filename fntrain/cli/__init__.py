"""The `fntrain` command, the CLI side of the library (`fntrain --help` prints the usage).

    main.py          `fntrain COMMAND ...` dispatched to its subcommand; the console script's `main`
    usage.py         the usage text and the recipe list `--help` prints
    errors.py        the one place a bad command line or setting becomes one line and exit status 2
    parse.py         every command's tyro call: a rejected command line as that one line, --help/--help-all
    flags.py         a command's flags, types and docstrings (for "did you mean" and the short help)
    short_help.py    a recipe command's short --help: the common flags, one line each
    recipe_args.py   a recipe's command line: RECIPE, `--config FILE`s, tyro's flags over them
    commands/        one module per subcommand: run (and `python -m recipes.X`), plan, config, cp,
                     plot, tokenize, export, recipes
    config_file.py   reading `--config` files (TOML, YAML, JSON) into a recipe's config
    recipes.py       finding recipes by name, module path or file
    config_doc.py    docs/config.md from the config dataclasses
    plot.py          plots of a run's metrics.jsonl

The run itself is `fntrain.run` (a transaction that knows no command line); nothing below imports this
package. Importing it imports no torch, tyro or matplotlib: each command imports what it needs when run.
"""

from fntrain.cli.commands.plan import plan_report
from fntrain.cli.commands.run import recipe_main, run_recipe
from fntrain.cli.main import dispatch, main
from fntrain.cli.recipe_args import resolve_config

__all__ = ["main", "dispatch", "resolve_config", "plan_report", "run_recipe", "recipe_main"]
