"""`fntrain eval SOURCE --tasks T1,T2 [options]`: a model scored by the LM Evaluation Harness (lm-eval,
the `eval` extra; `fntrain.models.harness`).

SOURCE is a Hugging Face causal-LM directory, a run directory (its latest verified checkpoint) or a
checkpoint (a step_<N>/ or a checkpoint root). A run's or checkpoint's weights are exported to a
temporary Hugging Face directory first, as `fntrain export --format hf` writes them (the tiny GPT as a
GPT-2, with the tokenizer it reads text with: UTF-8 bytes, or its token shards'), and removed
afterwards; `--recipe` names the recipe that rebuilds it when the run recorded none or another, as for
`fntrain generate`. Results (lm-eval's JSON, per-sample records and a table) go to
<run_dir>/eval/<timestamp>/ for a run or checkpoint, else to <--output>/<timestamp>/; the table is
printed. Every bad input is one line before any model is loaded or file written.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fntrain.cli.errors import CommandError
from fntrain.cli.parse import parse
from fntrain.config import as_flags, first_line

__all__ = ["command"]

_WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json")


@dataclass(frozen=True)
class _Source:
    """What SOURCE names: an HF directory (`hf_dir`) or a verified checkpoint (`checkpoint`, with its
    meta.json and the run directory results go under, when it sits in one)."""

    hf_dir: Path | None = None
    checkpoint: Path | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    run_dir: Path | None = None


def command(args: list[str]) -> Any:
    """`fntrain eval`: lm-eval's results dict; a bad input is a `CommandError`, raised before the model
    is loaded or anything is written."""
    import tyro

    from fntrain.models import harness

    positional = tyro.conf.Positional
    command_cls = dataclasses.make_dataclass(
        "Eval",
        [
            ("source", Annotated[str, positional, tyro.conf.arg(metavar="SOURCE", help=_SOURCE_HELP)]),
            ("options", Annotated[harness.EvalOptions, tyro.conf.arg(name="")]),
        ],
        frozen=True,
    )
    parsed = parse(command_cls, args, prog="fntrain eval", description=__doc__.split("\n\n")[0])  # one-line errors
    options = parsed.options
    try:
        _check_options(options)
        source = _resolve(parsed.source)
        export = _export_plan(parsed.source, source, options)
        manager = harness.task_manager(options)  # tens of seconds: once per command
        tasks = harness.load_tasks(manager, options)
    except (ValueError, OSError, KeyError) as error:  # a bad flag, source or task: no traceback
        raise CommandError(first_line(error)) from error
    out_dir = _out_dir(source, options)
    with tempfile.TemporaryDirectory(prefix="fntrain-eval-") as scratch:
        try:
            hf_dir = _hf_dir(source, Path(scratch) / "hf", export)
        except (ValueError, OSError, KeyError) as error:  # a model with no HF counterpart (a MoE tiny GPT)
            raise CommandError(first_line(error)) from error
        results = harness.evaluate(hf_dir, tasks, manager, options)
    harness.write_results(results, out_dir)
    print(harness.results_table(results))
    print(f"results: {out_dir}")
    return results


_SOURCE_HELP = "a Hugging Face model directory, a run directory (its latest checkpoint) or a checkpoint"


def _check_options(options: Any) -> None:
    """The option rules, with each field named as its flag; lm-eval installed."""
    from fntrain.models import harness

    try:
        options.validate("")
    except ValueError as error:
        raise ValueError(as_flags(first_line(error), [f.name for f in dataclasses.fields(options)])) from None
    harness.require_lm_eval()


def _resolve(source: str) -> _Source:
    """The `_Source` SOURCE names; a missing path, a run without checkpoints or a damaged checkpoint is
    a ValueError / OSError of one line (the verified-checkpoint error for a damaged one)."""
    from fntrain.checkpoint.hf_export import export_source
    from fntrain.checkpoint.restorer import read_meta

    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"SOURCE {source!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"SOURCE {source!r} is not a directory (a model, run or checkpoint directory)")
    if (path / "checkpoints").is_dir():  # a run directory: its latest verified checkpoint
        checkpoint = export_source(path / "checkpoints")
    elif (path / "config.json").is_file() and any(any(path.glob(p)) for p in _WEIGHTS):
        return _Source(hf_dir=path)
    else:
        checkpoint = export_source(path)
    run_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    return _Source(checkpoint=checkpoint, meta=read_meta(checkpoint), run_dir=run_dir)


@dataclass(frozen=True)
class _Export:
    """How a checkpoint becomes the HF directory lm-eval loads, as `fntrain export --format hf` writes
    it: the recipe's conversion and the writer of its tokenizer (None: the weights' own names; an HF
    model's export copies its model directory's tokenizer files)."""

    convert: Any = None
    tokenizer: Any = None


def _export_plan(given: str, source: _Source, options: Any) -> _Export:
    """The export of a checkpoint SOURCE, and where the evaluated model's tokenizer comes from, decided
    before any model work: --tokenizer, the HF directory's own, the recipe's (`--recipe`, else the one
    the checkpoint records: tiny_gpt's bytes or its shards' tokenizer), or the run's model directory's;
    a ValueError naming what is missing when there is none."""
    from fntrain.checkpoint.export_options import ExportOptions
    from fntrain.cli.commands.export import _hf_conversion
    from fntrain.models.tokenizer_files import TOKENIZER_FILES, has_tokenizer

    if source.hf_dir is not None:
        if options.tokenizer is None and not has_tokenizer(source.hf_dir):
            raise ValueError(f"SOURCE {given!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): pass --tokenizer DIR")
        return _Export()
    convert, tokenizer = _hf_conversion(str(source.checkpoint), None, ExportOptions(format="hf", recipe=options.recipe))
    if options.tokenizer is not None or tokenizer is not None:  # lm-eval takes --tokenizer as model_args tokenizer=
        return _Export(convert, tokenizer)
    config = source.meta.get("config") or {}
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    assets = config.get("assets") if isinstance(config.get("assets"), dict) else {}
    for directory in (assets.get("tokenizer_path"), model.get("path")):
        if convert is None and directory and has_tokenizer(Path(str(directory)).expanduser()):
            return _Export()  # the export copies the model directory's tokenizer files
    raise ValueError(f"SOURCE {given!r}: the run records no tokenizer this command can find: pass --tokenizer DIR")


def _hf_dir(source: _Source, scratch: Path, export: _Export) -> Path:
    """The HF directory lm-eval loads: SOURCE's own, or the checkpoint exported to `scratch` as
    `fntrain export --format hf` writes it, with its tokenizer."""
    if source.hf_dir is not None:
        return source.hf_dir
    from fntrain.checkpoint.export_options import ExportOptions, export_checkpoint

    export_checkpoint(source.checkpoint, scratch, ExportOptions(format="hf"), export.convert, export.tokenizer)
    return scratch


def _out_dir(source: _Source, options: Any) -> Path:
    """<run_dir>/eval/<timestamp>/ for a checkpoint in a run directory (unless --output names
    another place), else <--output or ./eval_results>/<timestamp>/; a new directory each time."""
    if options.output is not None:
        base = Path(options.output).expanduser()
    elif source.run_dir is not None:
        base = source.run_dir / "eval"
    else:
        base = Path("eval_results")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out, n = base / stamp, 1
    while out.exists():
        n += 1
        out = base / f"{stamp}-{n}"
    return out
