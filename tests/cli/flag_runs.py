"""What the flag table (tests/cli/flag_table.py) observes: one tiny in-process run of a recipe per
(recipe, flags), cached, with what a user can see afterwards (its run directory: metrics.jsonl,
samples.jsonl, checkpoints, logs) and what the run built (the optimizer, the model's weights before the
first step, the micro-batches the loss was given).

    runs = FlagRuns(tmp_root)
    outcome = runs.observe("tiny_gpt", ("--optim.lr", "0.01"))
    outcome.train_rows[0]["lr"], outcome.optimizer.param_groups, outcome.train_batches[0].shape

An argument may name a file the runs make once: `{root}` (a fresh folder per run), `{llama}` (a tiny
Llama with its tokenizer), `{chat}`, `{pref}`, `{prompts}` (JSONL inputs), `{rewards}` (a reward module).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

TINY_GPT = (
    "--model.context", "16", "--model.n-layer", "1", "--model.n-head", "2", "--model.d-model", "16",
    "--train.train-iters", "3", "--train.global-batch-size", "2", "--train.micro-batch-size", "1",
    "--log-every", "1", "--progress.no-enabled", "--checkpoint.save-every", "0", "--checkpoint.no-export",
    "--evaluate.eval-every", "0", "--evaluate.no-at-end", "--sample.prompts", "--schedule.warmup-iters", "0",
    "--schedule.kind", "constant", "--throughput.no-measure-flops",
)  # fmt: skip
"""tiny_gpt at its smallest: one block of width 16, 3 steps of 2 sequences of 16 bytes, a constant lr,
every step logged, nothing saved, evaluated or sampled unless a flag asks."""

HF_COMMON = (
    "--model.path", "{llama}", "--train.train-iters", "2", "--train.global-batch-size", "2",
    "--train.micro-batch-size", "1", "--log-every", "1", "--progress.no-enabled", "--schedule.kind", "constant",
    "--throughput.no-measure-flops", "--checkpoint.save-every-minutes", "0",
)  # fmt: skip
BASE = {
    "tiny_gpt": TINY_GPT,
    "hf_causal_lm": (*HF_COMMON, "--data.path", "{chat}", "--data.max-length", "48", "--optim.lr", "1e-2"),
    "dpo": (*HF_COMMON, "--data.path", "{pref}", "--data.max-length", "48", "--optim.lr", "1e-2"),
    "kd": (*HF_COMMON, "--data.path", "{chat}", "--data.max-length", "48", "--kd.teacher-path", "{llama}",
           "--optim.lr", "1e-2"),  # fmt: skip
    "grpo": (*HF_COMMON, "--data.path", "{prompts}", "--grpo.reward-funcs", "flag_rewards:even_share",
             "--grpo.num-generations", "2", "--grpo.max-completion-length", "6", "--optim.lr", "1e-2"),  # fmt: skip
    "vlm": ("--model.cache-dir", "{llava}", "--train.train-iters", "2", "--train.global-batch-size", "2",
            "--train.micro-batch-size", "1", "--log-every", "1", "--progress.no-enabled", "--data.train-samples", "8",
            "--data.val-samples", "2", "--evaluate.eval-every", "0", "--evaluate.no-at-end", "--answer-tokens", "0",
            "--throughput.no-measure-flops", "--checkpoint.save-every-minutes", "0"),  # fmt: skip
}
"""Each recipe's tiny run; a table entry's flags come after these and win."""

FILES = ("llama", "chat", "pref", "prompts", "llava", "corpus", "abc")
"""The inputs an argument may name as {name}: each made once, by FlagRuns._make_<name>."""

REWARDS = '''"""A reward the flag table's GRPO runs score completions with (tests/cli/flag_runs.py)."""


def even_share(prompts, completions, completion_ids, **columns):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
'''


@dataclass
class Seen:
    """What the run's loss was given, micro-batch by micro-batch, and the process settings it ran under."""

    train_batches: list[torch.Tensor] = field(default_factory=list)
    eval_batches: list[torch.Tensor] = field(default_factory=list)
    output_dtypes: list[torch.dtype] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    gc_enabled: list[bool] = field(default_factory=list)
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    attention_calls: int = 0  # forward calls of the first attention module (activation recomputation shows)
    built: Any = None


@dataclass
class Outcome:
    """One tiny run: its config, run directory, result (or the error it raised) and what it was seen doing."""

    config: Any
    run_dir: Path
    result: Any
    error: BaseException | None
    seen: Seen

    @cached_property
    def metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / self.config.metrics.jsonl_name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def train_rows(self) -> list[dict[str, Any]]:
        return [row for row in self.metrics if "loss" in row]

    @property
    def val_rows(self) -> list[dict[str, Any]]:
        return [row for row in self.metrics if "val_loss" in row]

    @property
    def samples(self) -> list[dict[str, Any]]:
        path = self.run_dir / "samples.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> list[float]:
        return [row["loss"] for row in self.train_rows]

    @property
    def model(self) -> torch.nn.Module:
        model = self.seen.built.components.model
        return getattr(model, "module", model)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.seen.built.components.optimizers[0]

    @property
    def final(self) -> dict[str, torch.Tensor]:
        return {name: value.detach() for name, value in self.model.state_dict().items()}

    @property
    def train_batches(self) -> list[torch.Tensor]:
        return self.seen.train_batches

    @property
    def log(self) -> str:
        return "".join(path.read_text() for path in sorted((self.run_dir / "logs").glob("*.log")))

    def ok(self) -> Outcome:
        """This outcome, after asserting the run ended without an error."""
        assert self.error is None, f"the run failed: {self.error!r}"
        return self


def _recording_spec(spec: Any, seen: Seen) -> Any:
    """`spec` whose model build, loss and hooks also tell `seen` what they were given."""

    def build_model(config: Any, runtime: Any) -> Any:
        model = spec.build_model(config, runtime)
        seen.initial = {name: value.detach().clone() for name, value in model.state_dict().items()}
        attention = next(module for name, module in model.named_modules() if name.endswith(("attn", "self_attn")))
        attention.register_forward_hook(lambda *_: setattr(seen, "attention_calls", seen.attention_calls + 1))
        return model

    def loss(output: Any, micro_batch: Any) -> Any:
        logits = getattr(output, "logits", output)
        logits = logits[0] if isinstance(logits, tuple) else logits
        if logits.device.type != "meta":  # FLOP counting runs the model on meta: not a step
            (seen.train_batches if torch.is_grad_enabled() else seen.eval_batches).append(
                micro_batch["input_ids"].detach().cpu().clone())
            seen.output_dtypes.append(logits.dtype)
            seen.threads.append(torch.get_num_threads())
            seen.gc_enabled.append(gc.isenabled())
        return spec.loss(output, micro_batch)

    def hooks(built: Any) -> Any:
        seen.built = built
        return spec.hooks(built) if spec.hooks else ()

    return dataclasses.replace(spec, build_model=build_model, loss=loss, hooks=hooks)


class FlagRuns:
    """Tiny runs under `root`, one per (recipe, flags, flags of a run before it in the same directory)."""

    def __init__(self, root: Path) -> None:
        self.root, self._cache, self._files = root, {}, {}

    def observe(self, recipe: str, flags: tuple[str, ...], before: tuple[str, ...] | None = None) -> Outcome:
        """The run of `recipe` with its BASE flags then `flags` (after a run with `before`, if given, in the
        same run directory); each distinct one runs once."""
        key = (recipe, flags, before)
        if key not in self._cache:
            run_dir = self.root / f"run{len(self._cache)}"
            if before is not None:
                self._run(recipe, before, run_dir)
            self._cache[key] = self._run(recipe, flags, run_dir)
        return self._cache[key]

    def _run(self, recipe_name: str, flags: tuple[str, ...], run_dir: Path) -> Outcome:
        from fntrain.cli.config_file import parse_config_cli
        from fntrain.run.job import run_job

        recipe = importlib.import_module(f"recipes.{recipe_name}")
        args = [self._expand(arg, run_dir) for arg in ("--run-dir", str(run_dir), *BASE[recipe_name], *flags)]
        config, seen = parse_config_cli(recipe.Config, args), Seen()
        result = error = None
        try:
            result = run_job(config, _recording_spec(recipe.spec, seen))
        except Exception as raised:  # a check may expect a refusal; others assert ok()
            error = raised
        return Outcome(config, Path(config.run_dir), result, error, seen)

    def _expand(self, arg: str, run_dir: Path) -> str:
        places = {"root": lambda: str(run_dir.parent / f"{run_dir.name}_files"), "run": lambda: str(run_dir)}
        for name in (*places, *FILES):
            if "{" + name + "}" in arg:
                arg = arg.replace("{" + name + "}", places[name]() if name in places else self._file(name))
        return arg

    def _file(self, name: str) -> str:
        if name not in self._files:
            self._files[name] = str(getattr(self, f"_make_{name}")())
        return self._files[name]

    def _make_llama(self) -> Path:
        from tests.step.objectives.dpo_helpers import tiny_llama

        return tiny_llama(self.root / "llama", max_positions=64)

    def _make_llava(self) -> Path:
        return self.root / "llava"  # the vlm recipe builds its tiny LLaVA here on first use

    def _make_corpus(self) -> Path:
        """The bundled corpus's first 200 bytes: an epoch of 5 steps of 2 windows of 16 bytes."""
        from fntrain.data.corpora import corpus_path

        path = self.root / "corpus.txt"
        path.write_bytes(corpus_path("shakespeare").read_bytes()[:200])
        return path

    def _make_abc(self) -> Path:
        path = self.root / "abc.txt"
        path.write_bytes(b"abcdefgh" * 64)
        return path

    def _make_chat(self) -> Path:
        from tests.helpers.hf import CHATS

        chats = [[{"role": "user", "content": f"Say {n}."}, {"role": "assistant", "content": f"{n} it is."}]
                 for n in range(12)]  # fmt: skip
        return _jsonl(self.root / "chat.jsonl", [{"messages": chat} for chat in [*CHATS, *chats]])

    def _make_pref(self) -> Path:
        from tests.step.objectives.dpo_helpers import preference_rows

        return _jsonl(self.root / "pref.jsonl", preference_rows(12, seed=0))

    def _make_prompts(self) -> Path:
        (self.root / "flag_rewards.py").write_text(REWARDS)
        if str(self.root) not in sys.path:
            sys.path.append(str(self.root))
        return _jsonl(self.root / "prompts.jsonl", [{"prompt": f"Count to {n}:"} for n in range(8)])


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
