"""What the flag table (tests/cli/flag_table.py) observes: one tiny in-process run of a recipe per
(recipe, flags), cached, with what a user can see afterwards (its run directory: metrics.jsonl,
samples.jsonl, checkpoints, logs) and what the run built (the optimizer, the model's weights before the
first step, the micro-batches the loss was given).

    runs = FlagRuns(tmp_root)
    outcome = runs.observe("tiny_gpt", ("--optim.lr", "0.01"))
    outcome.train_rows[0]["lr"], outcome.optimizer.param_groups, outcome.train_batches[0].shape

An argument may name a file the runs make once: `{root}` (a fresh folder per run), `{llama}` (a tiny
Llama with its tokenizer), `{chat}`, `{pref}`, `{prompts}` (JSONL inputs), `{rewards}` (a reward module).

A data flag of a Hugging Face recipe is observed without a model: `runs.read(recipe, flags)` parses the
command line and reads the inputs as a run does (`fntrain.run.checks.read_inputs`: the recipe's assets,
datasets and collate), over the tiny tokenizer of tests/data/test_input_paths.py (`{model}`, a model
directory holding only a config.json and that tokenizer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import io
import json
import os
import sys
from collections.abc import Iterator
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

READ_BASE = {
    "hf_causal_lm": ("--model.path", "{model}", "--data.path", "{sft}", "--data.max-length", "48"),
    "dpo": ("--model.path", "{model}", "--data.path", "{pref}", "--data.max-length", "48"),
    "tiny_gpt": TINY_GPT,
    "vlm": ("--model.cache-dir", "{llava}", "--data.train-samples", "4", "--data.val-samples", "2"),
    "kd": ("--model.path", "{model}", "--data.path", "{sft}", "--data.max-length", "48", "--kd.teacher-path", "{model}"),
    "grpo": ("--model.path", "{model}", "--data.path", "{prompts}", "--grpo.reward-funcs", "flag_rewards:even_share"),
}
"""Each Hugging Face recipe's inputs, read without a model (`FlagRuns.read`)."""

FILES = ("llama", "chat", "pref", "prompts", "llava", "corpus", "abc", "model", "bytes", "sft", "keys", "val",
         "teacher", "pairs", "shards", "shapes", "shapes_pc", "mlflow_db", "byte_shards")  # fmt: skip
"""The inputs an argument may name as {name}: each made once, by FlagRuns._make_<name>."""

REWARDS = '''"""A reward the flag table's GRPO runs score completions with (tests/cli/flag_runs.py)."""


def even_share(prompts, completions, completion_ids, **columns):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def odd_share(prompts, completions, completion_ids, **columns):
    return [sum(t % 2 == 1 for t in ids) / max(len(ids), 1) for ids in completion_ids]
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
    collections: list[tuple[int, Any]] = field(default_factory=list)  # gc.collect calls: (micro-batches so far, generation)
    terminal: str = ""  # what the run drew on stderr, faked to be a terminal
    dropout_masks: list[torch.Tensor] = field(default_factory=list)  # which outputs the first dropout zeroed, per training forward
    group_timeouts: list[Any] = field(default_factory=list)  # the timeout each process group was created with


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
    def model_wrapper(self) -> torch.nn.Module:
        """The model as the run trained it (a DistributedDataParallel wrapper under ddp)."""
        return self.seen.built.components.model

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


@dataclass
class Read:
    """A recipe's parsed config (`settings`) and, read on first use, its inputs as a run reads them (no
    model): the assets, every train and validation sample through the recipe's collate in micro-batches
    of two (tensors as lists), or the error parsing or reading raised."""

    config: Any
    spec: Any
    parse_error: BaseException | None

    @cached_property
    def _read(self) -> tuple[Any, BaseException | None]:
        from fntrain.run.checks import read_inputs

        if self.parse_error is not None:
            return None, self.parse_error
        try:
            self.config.data.validate()  # as a run does first (the model directory holds no weights: not checked)
            return read_inputs(self.config, self.spec), None
        except Exception as raised:  # a check may expect a refusal; others assert ok()
            return None, raised

    @property
    def inputs(self) -> Any:
        return self._read[0]

    @property
    def error(self) -> BaseException | None:
        return self._read[1]

    @property
    def settings(self) -> Any:
        """The parsed config (its inputs not read: what an objective's or a hook's check needs)."""
        assert self.parse_error is None, f"the flags did not parse: {self.parse_error!r}"
        return self.config

    def ok(self) -> Read:
        assert self.error is None, f"reading the inputs failed: {self.error!r}"
        return self

    def _collated(self, dataset: Any) -> list[Any] | None:
        if dataset is None:
            return None
        samples = [dataset[i] for i in range(len(dataset))]
        batches = [self.inputs.collate_fn(samples[i : i + 2]) for i in range(0, len(samples), 2)]
        return [batch if isinstance(batch, list) else {k: v.tolist() for k, v in batch.items()} for batch in batches]

    @cached_property
    def train(self) -> list[Any]:
        return self._collated(self.ok().inputs.train_set)

    @cached_property
    def val(self) -> list[Any] | None:
        return self._collated(self.ok().inputs.val_set)

    @property
    def rows(self) -> list[tuple[list[int], list[int] | None]]:
        """Every train sample as (ids without padding, labels or None), in order."""
        rows = []
        for batch in self.train:
            for i, ids in enumerate(batch["input_ids"]):
                mask = batch["attention_mask"][i] if "attention_mask" in batch else [1] * len(ids)
                keep = [j for j, m in enumerate(mask) if m]
                labels = batch.get("labels")
                rows.append(([ids[j] for j in keep], None if labels is None else [labels[i][j] for j in keep]))
        return rows

    def text(self, ids: list[int]) -> str:
        return self.ok().inputs.assets.tokenizer.decode(ids)

    def trained_text(self, row: int) -> str:
        """The decoded tokens of train sample `row` whose labels are not ignored."""
        from tests.data.test_input_paths import trained_ids

        ids, labels = self.rows[row]
        return self.text(trained_ids(ids, labels))


def _recording_spec(spec: Any, seen: Seen) -> Any:
    """`spec` whose model build, loss and hooks also tell `seen` what they were given."""

    def build_model(config: Any, runtime: Any) -> Any:
        model = spec.build_model(config, runtime)
        seen.initial = {name: value.detach().clone() for name, value in model.state_dict().items()}
        attention = next(module for name, module in model.named_modules() if name.endswith(("attn", "self_attn")))
        attention.register_forward_hook(lambda *_: setattr(seen, "attention_calls", seen.attention_calls + 1))
        dropout = next((module for module in model.modules() if isinstance(module, torch.nn.Dropout) and module.p > 0), None)
        if dropout is not None:
            dropout.register_forward_hook(
                lambda module, _, output: seen.dropout_masks.append((output == 0).cpu()) if module.training else None)
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
        same run directory); each distinct one runs once: runs whose flags give the same config (but for
        the run directory) are one run, so an entry's default value shares the run of its section's base."""
        run_dir = self.root / f"run{len(self._cache)}"
        config = self._parse(recipe, flags, run_dir)
        # what identifies a run: its config but for the run directory (its flags, when they do not parse)
        same = flags if config is None else repr(config if "--run-dir" in flags else dataclasses.replace(config, run_dir=""))
        key = (recipe, same, before)
        if key not in self._cache:
            if before is not None:
                self._run(recipe, self._parse(recipe, before, run_dir))
            self._cache[key] = self._run(recipe, config)
        return self._cache[key]

    def _parse(self, recipe_name: str, flags: tuple[str, ...], run_dir: Path) -> Any:
        """`recipe_name`'s config from its BASE flags then `flags` in `run_dir` (None: they do not parse)."""
        from fntrain.cli.config_file import parse_config_cli

        module = importlib.import_module(f"recipes.{recipe_name}")
        args = [self._expand(arg, run_dir) for arg in ("--run-dir", str(run_dir), *BASE[recipe_name], *flags)]
        try:
            return parse_config_cli(module.Config, args)
        except Exception:  # a refusal to parse: no entry expects one of a run
            return None

    def read(self, recipe: str, flags: tuple[str, ...]) -> Read:
        """`recipe`'s config parsed from its READ_BASE flags then `flags`, its inputs read on first use as a
        run reads them; each once."""
        key = ("read", recipe, flags)
        if key not in self._cache:
            from fntrain.cli.config_file import parse_config_cli

            module = importlib.import_module(f"recipes.{recipe}")
            run_dir = self.root / f"read{len(self._cache)}"
            args = [self._expand(arg, run_dir) for arg in ("--run-dir", str(run_dir), *READ_BASE[recipe], *flags)]
            config = error = None
            try:
                config = parse_config_cli(module.Config, args)
            except Exception as raised:  # a check may expect a refusal; others assert settings or ok()
                error = raised
            self._cache[key] = Read(config, module.spec, error)
        return self._cache[key]

    def _run(self, recipe_name: str, config: Any) -> Outcome:
        """The run, with stderr a fake terminal (what a progress bar draws is kept) and gc.collect counted."""
        from fntrain.run.job import run_job

        assert config is not None, f"the flags of a {recipe_name} run did not parse"
        recipe, seen = importlib.import_module(f"recipes.{recipe_name}"), Seen()
        result = error = None
        collect, stderr, terminal = gc.collect, sys.stderr, _Terminal()

        def counted_collect(*args: Any, **kwargs: Any) -> int:
            seen.collections.append((len(seen.train_batches), args[0] if args else kwargs.get("generation")))
            return collect(*args, **kwargs)

        gc.collect, sys.stderr = counted_collect, terminal
        try:
            with _one_rank_group(config.parallel.strategy != "none", seen):
                result = run_job(config, _recording_spec(recipe.spec, seen))
        except Exception as raised:  # a check may expect a refusal; others assert ok()
            error = raised
        finally:
            gc.collect, sys.stderr = collect, stderr
            seen.terminal = terminal.getvalue()
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

    def _make_teacher(self) -> Path:
        from tests.step.objectives.dpo_helpers import bigger_teacher

        return bigger_teacher(Path(self._file("llama")), self.root / "teacher")

    def _make_model(self) -> Path:
        """A model directory holding a config.json and the tiny BPE tokenizer of tests/data/test_preference.py
        (BOS prepended, </s> the EOS, its chat template), as tests/data/test_input_paths.py reads it."""
        from tests.data.test_input_paths import MAX_POSITIONS
        from tests.data.test_preference import tiny_tokenizer
        from tests.helpers.hf import save_tokenizer_kinds

        tokenizer = tiny_tokenizer()
        kinds = save_tokenizer_kinds(self.root / "kinds", tokenizer, vocab_size=len(tokenizer),
                                     max_positions=MAX_POSITIONS)  # fmt: skip
        return Path(kinds["in model.path"]["model"])

    def _make_bytes(self) -> Path:
        """The byte vocabulary's fast tokenizer directory (tests.helpers.hf: byte b is id b + 3, </s> 1)."""
        from tests.helpers.hf import TEMPLATE, save_byte_tokenizer_pair

        kinds = save_byte_tokenizer_pair(self.root / "bytes", TEMPLATE.replace("{{ bos_token }}", ""), max_positions=1024)
        return Path(kinds["tokenizer.json (fast)"]["tokenizer_path"])

    def _make_sft(self) -> Path:
        from tests.data.test_input_paths import SFT_ROWS

        return _jsonl(self.root / "sft.jsonl", SFT_ROWS)

    def _make_val(self) -> Path:
        return _jsonl(self.root / "val.jsonl", [{"text": "held out one"}, {"text": "held out two"}])

    def _make_keys(self) -> Path:
        """Rows with each SFT format under two keys: the default key and another."""
        from tests.helpers.hf import CHATS

        row = {"text": "plain", "body": "other", "prompt": "ask", "question": "query", "completion": " yes",
               "answer": " no", "messages": CHATS[0], "dialog": CHATS[1]}  # fmt: skip
        return _jsonl(self.root / "keys.jsonl", [row] * 4)

    def _make_byte_shards(self) -> Path:
        """`fntrain tokenize`'s shards of some text in fntrain's byte vocabulary (bytes, then EOS 256)."""
        from fntrain.data.tokenize import tokenize_files

        source = _jsonl(self.root / "byte_text.jsonl", [{"text": f"shard line {n}: abcdefgh"} for n in range(12)])
        tokenize_files([str(source)], self.root / "byte_shards", "bytes")
        return self.root / "byte_shards"

    def _make_mlflow_db(self) -> Path:
        """An MLflow sqlite store the runs that name it share (created by the first: one schema migration)."""
        return self.root / "mlflow-shared.db"

    def _make_pairs(self) -> Path:
        """Preference pairs under the default keys and under others (question, good, bad), long enough to cut."""
        rows = [{"prompt": f"Pick a colour for pair {n}:", "chosen": " blue, the colour of the clear sky",
                 "rejected": " red, the colour of a rose in bloom", "question": f"Which colour, pair {n}?",
                 "good": " green", "bad": " grey"} for n in range(8)]  # fmt: skip
        return _jsonl(self.root / "pairs.jsonl", rows)

    def _make_shards(self) -> Path:
        """`fntrain tokenize`'s shards of some text, in the `{model}` directory's tokenizer."""
        from fntrain.data.tokenize import tokenize_files

        source = _jsonl(self.root / "shard_text.jsonl", [{"text": f"the sky is blue, line {n}"} for n in range(24)])
        tokenize_files([str(source)], self.root / "shards", self._file("model"))
        return self.root / "shards"

    def _make_shapes(self) -> Path:
        """4 generated shape images as chat rows (fntrain.data.shapes), each also under other keys: its
        `picture` the next row's image, its `dialog` the same question answered "circle"."""
        from fntrain.data.shapes import write_shapes_jsonl

        path = write_shapes_jsonl(self.root / "shapes", 4, seed=0)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for n, row in enumerate(rows):
            row["picture"] = rows[(n + 1) % 4]["image"]
            row["dialog"] = [*row["messages"][:-1], {"role": "assistant", "content": "circle"}]
        return _jsonl(path, rows)

    def _make_shapes_pc(self) -> Path:
        """The shape rows as prompt/completion pairs, under the default keys and under question/answer."""
        rows = [json.loads(line) for line in Path(self._file("shapes")).read_text().splitlines()]
        pairs = [{"image": row["image"], "prompt": "What is it?", "completion": "circle",
                  "question": "What shape is it?", "answer": "cross"} for row in rows]  # fmt: skip
        return _jsonl(Path(self._file("shapes")).parent / "shapes_pc.jsonl", pairs)

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


@contextlib.contextmanager
def _one_rank_group(wanted: bool, seen: Seen) -> Iterator[None]:
    """The environment torchrun gives a 1-process job, while `wanted` (ddp and fsdp2 need a process
    group: the run creates a gloo group of one rank from it, its timeout told to `seen`); the group is
    gone afterwards."""
    if not wanted:
        yield
        return
    import torch.distributed as dist

    from tests.helpers.ports import free_port

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    saved, init = {name: os.environ.get(name) for name in env}, dist.init_process_group

    def recorded_init(*args: Any, **kwargs: Any) -> Any:
        seen.group_timeouts.append(kwargs.get("timeout"))
        return init(*args, **kwargs)

    os.environ.update(env)
    dist.init_process_group = recorded_init
    try:
        yield
    finally:
        dist.init_process_group = init
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if dist.is_initialized():
            dist.destroy_process_group()


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal (so a progress bar draws on it) and keeps what was written."""

    def isatty(self) -> bool:
        return True


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
