"""The `fntrain` command: run a recipe, print its run plan, plot a run.

    fntrain run RECIPE [--config FILE] [overrides]      train (torchrun works too: torchrun ... -m fntrain run ...)
    fntrain run --nproc-per-node N [torchrun's options] RECIPE [overrides]
                                                        the same on N ranks, torchrun's agent in process
    fntrain cp RECIPE DEST.py [--force]                 copy a built-in recipe to own and change it
    fntrain plan RECIPE [--world-size N] [--json] [--config FILE] [overrides]
                                                        the resolved run plan, without a model or a device
    fntrain config RECIPE [--format toml|json] [--config FILE] [overrides]
                                                        the resolved config, ready to be fed back as --config
    fntrain plot RUN_DIR [options]                      plots of a run's metrics
    fntrain tokenize INPUT... --output DIR [options]    text/JSONL/Parquet/Arrow -> token shards
    fntrain export CKPT --format hf|dcp OUT [options]   a DCP checkpoint -> a Hugging Face directory, or back
    fntrain generate SOURCE [--prompt TEXT] [options]   text from a run, checkpoint, export or HF model directory
    fntrain eval SOURCE --tasks T1,T2 [options]         lm-eval scores of a run, checkpoint or HF model directory
    fntrain recipes                                     the recipes that can be named
    fntrain tiny-llama DIR [options]                    a tiny local Llama and tokenizer to try the HF recipes with

RECIPE is a name registered in the `fntrain.recipes` entry-point group (the built-ins and any other
project's, listed below and by `fntrain recipes`), a recipe of a source checkout's `recipes/`, a dotted
module path, or a .py file (such as one `fntrain cp` wrote; `python DEST.py` runs it too). Every bad setting is one line naming the flag,
exit status 2, before any file, model or device work. The options after it
are the recipe's own, parsed by tyro from its config dataclass (`fntrain run tiny_gpt --help` lists
the common ones, `--help-all` every one); `--config FILE` (TOML, YAML or JSON) seeds their defaults and
flags override the file.
"""

from __future__ import annotations

from fntrain.cli.recipes import available_recipes, is_built_in

__all__ = ["HELP", "usage", "full_help", "command_help", "recipe_lines"]

HELP = ("-h", "--help")  # the flags that ask for help, wherever a command accepts them


def usage() -> str:
    """The command lines of the module docstring: what a usage error prints after its line."""
    return __doc__.split("\n\n", 2)[1].strip("\n")


def full_help() -> str:
    """`fntrain --help`: the usage, what RECIPE may be, and the recipes that can be named."""
    listed = "\n".join(recipe_lines()) or "  (none found)"
    return f"usage:\n{usage()}\n\n{__doc__.split(chr(10) * 2, 2)[2].strip()}\n\nrecipes:\n{listed}\n"


def command_help(command: str) -> str:
    """`fntrain COMMAND --help` for a command that takes a RECIPE first (run, plan, config): its lines of
    the usage, where a recipe's own options are listed, and the recipes that can be named."""
    lines, mine = [], False
    for line in usage().splitlines():
        if line.strip().startswith("fntrain "):
            mine = line.strip().startswith(f"fntrain {command} ")
        if mine:
            lines.append(line)
    listed = "\n".join(recipe_lines()) or "  (none found)"
    return (f"usage:\n{chr(10).join(lines)}\n\nfntrain {command} RECIPE --help lists a recipe's common options, "
            f"--help-all all of them.\nRECIPE is a recipe's name, a dotted module path or a .py file; "
            f"the recipes:\n{listed}\n")  # fmt: skip


def recipe_lines() -> list[str]:
    """One line per recipe that can be named, from the registry: name, module, and whether it is built in."""
    return [f"  {name:<16} {module}{'  (built-in)' if is_built_in(name, module) else ''}"
            for name, module in available_recipes().items()]  # fmt: skip
