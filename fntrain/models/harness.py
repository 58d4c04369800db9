"""The LM Evaluation Harness (lm-eval, the `eval` extra) over a Hugging Face causal-LM directory:
`fntrain eval`'s library side.

    options = EvalOptions(tasks="tiny_mc", include_path="my_tasks/", device="cpu")
    manager = task_manager(options)              # indexes every task lm-eval knows: build it once
    tasks = load_tasks(manager, options)         # unknown names, missing data files: a ValueError
    results = evaluate(hf_dir, tasks, manager, options)
    print(results_table(results)); write_results(results, out_dir)

The model is handed to lm-eval as `model="hf", model_args={"pretrained": hf_dir, ...}`, as lm-eval's own
command line does (`python -m lm_eval --model hf --model_args pretrained=DIR`), so both load it the same
way and score the same log-likelihoods. Every task is loaded (its dataset read) before the model, so a
bad task costs no model load. Nothing is downloaded: the Hub's offline switches are set before lm-eval,
datasets or transformers are imported, and a task over local files (`dataset_path: json` with
`dataset_kwargs: {data_files: ...}`) whose file is missing is one line naming the task and the file.

lm-eval is imported only inside these functions: `import fntrain` never pulls it in.
"""

from __future__ import annotations

import glob
import importlib.util
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fntrain.checkpoint.hf_load import set_offline
from fntrain.config import first_line, require_int, require_str

__all__ = [
    "EvalOptions",
    "MISSING_HINT",
    "require_lm_eval",
    "task_manager",
    "load_tasks",
    "evaluate",
    "results_table",
    "write_results",
]

MISSING_HINT = "fntrain eval needs lm-eval: pip install 'fntrain[eval]'"


@dataclass(frozen=True)
class EvalOptions:
    """What `fntrain eval` evaluates, and how."""

    tasks: str
    """Comma-separated lm-eval task, group or tag names (`lm-eval --tasks list`), or those of --include-path's YAMLs."""
    include_path: str | None = None
    """A directory of task YAML files of your own (local data files, nothing is downloaded)."""
    limit: int | None = None
    """Evaluate only the first N documents of each task (None: all)."""
    batch_size: int = 1
    """Requests per forward pass."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt (None: each task's own setting)."""
    device: str | None = None
    """The device lm-eval runs the model on (cpu, cuda, cuda:1, npu, ...; None: cuda when available, else cpu)."""
    output: str | None = None
    """Where results go for an HF directory (<output>/<timestamp>/); a run's go to <run_dir>/eval/<timestamp>/ (None: ./eval_results)."""
    tokenizer: str | None = None
    """A local tokenizer directory, for a model directory that has none (a byte-level tiny GPT needs none)."""
    recipe: str | None = None
    """The recipe that rebuilds a run's or checkpoint's model, and its tokenizer, for lm-eval (None: the one the run recorded)."""

    def validate(self, prefix: str = "eval.") -> None:
        require_str(f"{prefix}tasks", self.tasks, non_empty=True)
        if not task_names(self.tasks):
            raise ValueError(f"{prefix}tasks must name at least one task, got {self.tasks!r}")
        require_str(f"{prefix}include_path", self.include_path, optional=True, non_empty=True)
        if self.include_path is not None and not Path(self.include_path).expanduser().is_dir():
            raise ValueError(f"{prefix}include_path {self.include_path!r} is not a directory")
        if self.limit is not None:
            require_int(f"{prefix}limit", self.limit, min=1)
        require_int(f"{prefix}batch_size", self.batch_size, min=1)
        if self.num_fewshot is not None:
            require_int(f"{prefix}num_fewshot", self.num_fewshot, min=0)
        require_str(f"{prefix}device", self.device, optional=True, non_empty=True)
        require_str(f"{prefix}output", self.output, optional=True, non_empty=True)
        require_str(f"{prefix}tokenizer", self.tokenizer, optional=True, non_empty=True)
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().is_dir():
            raise ValueError(f"{prefix}tokenizer {self.tokenizer!r} is not a directory")
        require_str(f"{prefix}recipe", self.recipe, optional=True, non_empty=True)


def task_names(tasks: str) -> list[str]:
    """The names of a comma-separated --tasks value, blanks dropped, in order, each once."""
    return list(dict.fromkeys(name.strip() for name in tasks.split(",") if name.strip()))


def require_lm_eval() -> None:
    """A ValueError with the install hint when lm-eval is not installed (found without importing it)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(MISSING_HINT)


def task_manager(options: EvalOptions) -> Any:
    """lm-eval's TaskManager over its own tasks and `options.include_path`'s YAMLs. It indexes every
    task lm-eval ships (tens of seconds): build one per command."""
    require_lm_eval()
    set_offline()  # before lm-eval imports datasets and transformers: they read the switches at import
    from lm_eval.tasks import TaskManager

    include = str(Path(options.include_path).expanduser()) if options.include_path else None
    return TaskManager(include_path=include)


def load_tasks(manager: Any, options: EvalOptions, flag: str = "--tasks") -> list[Any]:
    """The tasks `options.tasks` names, loaded (their datasets read), for `evaluate`; a ValueError of
    one line for a name lm-eval does not know, a local data file that is missing, or a dataset that
    cannot be read without a download."""
    names = task_names(options.tasks)
    for name in names:
        if name not in manager.task_index:
            raise ValueError(f"{flag}: unknown task {name!r} (see lm-eval --tasks list)")
        for path in _missing_data_files(manager.task_index[name]):
            raise ValueError(f"task {name!r} needs the data file {path!r} (nothing is downloaded): provide it")
    loaded = []
    for name in names:
        try:
            built = manager.load([name])
        except Exception as error:  # noqa: BLE001 - any dataset failure is the user's one line
            raise ValueError(
                f"task {name!r} could not load its dataset (nothing is downloaded): {first_line(error)}"
            ) from error
        # A task or group goes on as the built object (its dataset is not read again); a tag as its tasks.
        top = built["groups"].get(name) or built["tasks"].get(name)
        loaded.extend([top] if top is not None else built["tasks"].values())
    return loaded


def _missing_data_files(entry: Any) -> list[str]:
    """The local data files a task's YAML names (`dataset_kwargs.data_files`, a path, list or split ->
    path(s) mapping; globs allowed) that match nothing, as written."""
    config = getattr(entry, "cfg", None) or {}
    kwargs = config.get("dataset_kwargs") if isinstance(config, Mapping) else None
    files = kwargs.get("data_files") if isinstance(kwargs, Mapping) else None
    if files is None:
        return []
    groups = files.values() if isinstance(files, Mapping) else [files]
    paths = [p for group in groups for p in ([group] if isinstance(group, str) else list(group or []))]
    return [p for p in paths if "://" not in str(p) and not glob.glob(str(Path(str(p)).expanduser()))]


def evaluate(hf_dir: str | Path, tasks: Sequence[Any], manager: Any, options: EvalOptions) -> dict[str, Any]:
    """lm-eval's results dict (`simple_evaluate`'s, per-sample records under "samples") for the model
    directory `hf_dir` on `tasks` (from `load_tasks`)."""
    set_offline()
    import torch
    from lm_eval import simple_evaluate

    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_args: dict[str, Any] = {"pretrained": str(hf_dir)}
    if options.tokenizer is not None:
        model_args["tokenizer"] = str(Path(options.tokenizer).expanduser())
    return simple_evaluate(
        model="hf",
        model_args=model_args,
        tasks=list(tasks),
        num_fewshot=options.num_fewshot,
        batch_size=options.batch_size,
        device=device,
        limit=options.limit,
        task_manager=manager,
        log_samples=True,
    )


def results_table(results: Mapping[str, Any]) -> str:
    """A plain table of `results["results"]`: task, metric (with its filter unless "none"), value,
    standard error ("-" when lm-eval gives none), one row per metric."""
    rows = [("task", "metric", "value", "stderr")]
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or "_stderr" in metric or not isinstance(value, (int, float)):  # name, sample_len
                continue
            stderr = metrics.get(f"{metric}_stderr,{filter_name}")
            name = metric if filter_name in ("", "none") else f"{metric} ({filter_name})"
            rows.append((task, name, f"{value:.4f}", f"{stderr:.4f}" if isinstance(stderr, (int, float)) else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def write_results(results: Mapping[str, Any], out_dir: Path) -> Path:
    """`out_dir`/results.json (lm-eval's results without the samples, serialised as its command line
    does), samples_<task>.jsonl (one record per document) and table.txt; returns `out_dir`."""
    from lm_eval.utils import handle_non_serializable

    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {key: value for key, value in results.items() if key != "samples"}
    dumped = json.dumps(summary, indent=2, default=handle_non_serializable, ensure_ascii=False)
    (out_dir / "results.json").write_text(dumped + "\n")
    for task, samples in (results.get("samples") or {}).items():
        lines = [json.dumps(s, default=handle_non_serializable, ensure_ascii=False) for s in samples]
        (out_dir / f"samples_{task}.jsonl").write_text("".join(line + "\n" for line in lines))
    (out_dir / "table.txt").write_text(results_table(results) + "\n")
    return out_dir
