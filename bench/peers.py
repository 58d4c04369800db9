"""fntrain against TRL 1.16 on the same SFT and DPO work: useful tokens/s step against step, and whole runs
from the command to the first step and to the end, with their peak memory and the padding each computed.

Both sides train the same random Llama (built here from a config and saved with a word-level tokenizer
made in memory: nothing is downloaded; 4 layers, hidden 256, vocabulary 4096, 5.3 M parameters, float32)
on the same JSONL rows, whose lengths are long-tailed as chat data's are: prompts of a log-normal number
of words (median 32), answers too (median 64, a wider spread), each sequence capped at 512 tokens with its
EOS. The same global batch, sequence cap, AdamW (learning rate constant, no weight decay, clipping at
1), precision (fp32, no gradient checkpointing: TRL's defaults turn on both), data order (the file's) and
one torch thread on both sides. Workloads and their variants:

- **SFT padded** (the same work): prompt/completion rows, loss on the completion; micro-batches of 4 rows
  right-padded to their longest (fntrain `--data.pad-multiple 1`, TRL's collate), global batch 8;
- **SFT packed**: fntrain `--data.packing` (best-fit-decreasing windows of 512 tokens, each example
  attending only to itself through a 4-D block-diagonal mask) against TRL `packing=True` (its default
  best-fit decreasing, which turns on its padding-free collate: a micro-batch's windows flattened into one
  row, the examples kept apart by their position ids); global batch 4 windows (micro 2), about the real
  tokens of the padded step. Not the same attention work: on a CPU, where no varlen kernel exists,
  transformers' SDPA attends over the whole flattened row under a mask;
- **DPO padded** (the same work): prompt/chosen/rejected rows, sigmoid loss, beta 0.1, a frozen copy of
  the model as the reference; chosen and rejected rows of 2 pairs per micro-batch padded to their
  longest, global batch 4 pairs. TRL 1.16's `padding_free` for DPO is disabled ("temporarily
  unavailable": it warns and pads) and fntrain has none, so there is no less-padded DPO variant.

**Steps** (in this process): each side's real pieces, fntrain's the recipe's own (`check_run`,
`build_job`, `build_step`: its collate, optimizer and step), TRL's its trainer's (`train_dataset`,
`data_collator`, `get_batch_samples`, `training_step` on each micro-batch, then the clip, `optimizer.step`,
the scheduler and `zero_grad`, what `Trainer`'s inner loop calls), one optimizer step per variant per
round, alternated by `interleave` in process CPU time; round k takes global batch k (mod the batches) on
every variant, so paired sides train the same rows. Each call counts its useful tokens (targets that
carry loss: completion tokens and the EOS), so a sample is CPU seconds per useful token. Before the
rounds, every padded batch is checked to be the same tensors on both sides.

**Whole runs** (child processes, `bench/peer_child.py`): `fntrain run hf_causal_lm|dpo ...` against a
script that builds the TRL trainer from the same directory and file, trains and saves the model, each for
the same number of steps, in paired rounds (order alternating), with `OMP_NUM_THREADS=1` and a fresh
`datasets` cache for TRL (a first run). Reported: the child's CPU time from the command to the end of
its first step and to its exit (its wall times in the notes: on a shared machine they carry the
neighbours' load), and its peak resident memory (its VmHWM).

Run: `python -m bench.peers [--quick] [--json FILE]` (`--quick`: a 2-layer, hidden-64 model, a smaller
data set, one round, and whole runs of SFT padded only, one step each: checks that it runs, in 35 s
idle, 1.5 min on busy cores; a full run is 8 to 24 step rounds and 3 whole-run rounds, 7.5 to 9 min on 2 busy cores).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.harness import Row, Target, Timing, bench_main, interleave, paired_ratio_row, quiet
from bench.hf_parts import llama, word_tokenizer, words
from bench.peer_child import PeerJob, trl_trainer

SHAPE = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=512,
)  # fmt: skip
MAX_LENGTH = 512
PROMPT_WORDS, ANSWER_WORDS = (32, 0.8), (64, 1.0)  # log-normal: median words, standard deviation of the log
ROWS = {"sft": 160, "dpo": 64}  # rows of the data file (quick: QUICK_ROWS)
QUICK_ROWS = {"sft": 24, "dpo": 8}
# quick mode checks the harness, not the figures: a smaller model, and whole runs of one variant only
QUICK_SHAPE = {**SHAPE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 2}  # fmt: skip
QUICK_WHOLE_RUNS = (("sft", "padded"),)
# (micro-batch, accumulation) per variant: the same on both sides
BATCH = {("sft", "padded"): (4, 2), ("sft", "packed"): (2, 2), ("dpo", "padded"): (2, 2)}
STEPS = {("sft", "padded"): 3, ("sft", "packed"): 2, ("dpo", "padded"): 3}  # whole runs' steps (quick: 1)
LR = {"sft": 2e-5, "dpo": 1e-6}
VARIANTS = tuple(BATCH)
WHOLE_RUN_ROUNDS = 3
WHERE = "Llama 4x256, vocab 4096, long-tailed rows capped at 512 tokens, CPU 1 thread"
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def name(side: str, variant: tuple[str, str]) -> str:
    return f"{side} {variant[0]} {variant[1]}"


# ----------------------------------------------------------------------------- model and data


def _eos() -> int:
    return SHAPE["vocab_size"] - 1


def _model_dir(root: Path, shape: dict[str, int]) -> Path:
    """The model and its tokenizer, saved: <pad> 0, words 1 .. vocabulary - 2, <eos> the last id."""
    path = root / "model"
    llama(shape, pad_token_id=0, eos_token_id=_eos(), bos_token_id=None).save_pretrained(path)
    word_tokenizer(SHAPE["vocab_size"], eos_id=_eos()).save_pretrained(path)
    return path


def _lengths(rng: np.random.Generator, shape: tuple[float, float], count: int) -> np.ndarray:
    median, sigma = shape
    return np.maximum(1, np.round(rng.lognormal(np.log(median), sigma, count))).astype(int)


def _text(rng: np.random.Generator, count: int) -> str:
    return words(rng.integers(1, _eos(), count))


def _rows(workload: str, count: int, seed: int = 0) -> list[dict[str, str]]:
    """`count` rows of long-tailed lengths: a prompt and one answer (sft) or two (dpo: chosen, rejected),
    each prompt + answer + EOS within MAX_LENGTH tokens (an answer cut to fit, a prompt to half). An
    answer starts with a space: the prompt's last word and its first stay two words."""
    rng = np.random.default_rng(seed)
    answers = ("completion",) if workload == "sft" else ("chosen", "rejected")
    prompts = np.minimum(_lengths(rng, PROMPT_WORDS, count), MAX_LENGTH // 2)
    lengths = {key: np.minimum(_lengths(rng, ANSWER_WORDS, count), MAX_LENGTH - 1 - prompts) for key in answers}
    return [{"prompt": _text(rng, int(prompts[i])), **{key: " " + _text(rng, int(lengths[key][i])) for key in answers}}
            for i in range(count)]  # fmt: skip


def _write_rows(path: Path, rows: Sequence[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ----------------------------------------------------------------------------- both sides' settings


def _job(side: str, variant: tuple[str, str], paths: dict[str, Path], steps: int, work: Path) -> PeerJob:
    workload, layout = variant
    micro, accum = BATCH[variant]
    job = PeerJob(side, workload, layout, str(paths["model"]), str(paths[workload]), str(work),
                  str(work / "marks.json"), micro, accum, MAX_LENGTH, LR[workload], steps)  # fmt: skip
    if side == "trl":
        return job
    return PeerJob(**{**job.__dict__, "argv": tuple(_fntrain_argv(job))})


def _fntrain_argv(job: PeerJob) -> list[str]:
    """fntrain's command line for `job`: the recipe, and the settings TRL is given."""
    recipe = "hf_causal_lm" if job.workload == "sft" else "dpo"
    layout = ["--data.packing"] if job.variant == "packed" else ["--data.pad-multiple", "1"]
    return [
        "run", recipe, "--run-dir", str(Path(job.work) / "run"), "--model.path", job.model, "--data.path", job.data,
        "--data.max-length", str(job.max_length), *layout, "--train.train-iters", str(job.steps),
        "--train.global-batch-size", str(job.micro * job.accum), "--train.micro-batch-size", str(job.micro),
        "--train.max-grad-norm", "1.0", "--optim.lr", str(job.lr), "--optim.weight-decay", "0",
        "--schedule.kind", "constant", "--schedule.warmup-iters", "0", "--runtime.cpu-threads", "1",
        "--loader.no-shuffle", "--log-every", "1",
        "--checkpoint.no-save-at-end", "--checkpoint.no-export", "--progress.no-enabled",
    ]  # fmt: skip


# ----------------------------------------------------------------------------- one step of each side


def counts(batch: dict[str, Any]) -> tuple[int, int, int]:
    """(positions computed, positions holding a token of an example, useful tokens: targets with a loss)."""
    ids = batch["input_ids"]
    if "document_ids" in batch:  # fntrain packed: windows padded at the tail
        real = int((batch["document_ids"] >= 0).sum())
    elif "attention_mask" in batch:
        real = int(batch["attention_mask"].sum())
    else:  # TRL padding-free: one row, no padding
        real = ids.numel()
    if "labels" in batch:
        useful = int((batch["labels"][:, 1:] != -100).sum())
    else:  # TRL's DPO collate: a completion mask, unshifted
        useful = int(batch["completion_mask"][:, 1:].sum())
    return ids.numel(), real, useful


def attended(batch: dict[str, Any]) -> int:
    """Query-key pairs the attention computes: rows x length squared (a mask skips none of them)."""
    rows, length = batch["input_ids"].shape
    return rows * length * length


@dataclass(frozen=True)
class Side:
    """One side's data for one variant: its dataset, collate and micro-batch size, and its global batches
    (sample indices, in file order). `read(k)` reads and collates batch k afresh, as a loader does."""

    dataset: Any
    collate: Callable[[list[Any]], Any]
    micro: int
    batches: tuple[tuple[int, ...], ...]

    def read(self, k: int) -> list[dict[str, Any]]:
        samples = [self.dataset[i] for i in self.batches[k]]
        return [self.collate(samples[start : start + self.micro]) for start in range(0, len(samples), self.micro)]

    def tallies(self, batches: int) -> dict[str, list[int]]:
        """Per global batch of the first `batches`: positions, real tokens, useful tokens, attended pairs."""
        tally: dict[str, list[int]] = {"positions": [], "real": [], "useful": [], "attended": []}
        for k in range(batches):
            sums = np.sum([(*counts(b), attended(b)) for b in self.read(k)], axis=0).tolist()
            for key, value in zip(tally, sums, strict=True):
                tally[key].append(int(value))
        return tally


def batched(dataset: Any, collate: Callable[[list[Any]], Any], micro: int, accum: int) -> Side:
    """`dataset` in global batches of micro x accum samples (a last partial one left out, as fntrain's
    loader leaves it)."""
    size = micro * accum
    return Side(dataset, collate, micro, tuple(tuple(range(start, start + size))
                                               for start in range(0, len(dataset) - size + 1, size)))  # fmt: skip


def _fntrain_parts(job: PeerJob, runtime: Any) -> tuple[Callable, Side]:
    """fntrain's step for `job` as its recipe builds it, and its data."""
    from fntrain.cli.config_file import parse_config_cli
    from fntrain.run.build import build_job, build_step
    from fntrain.run.checks import check_run
    from recipes import dpo, hf_causal_lm

    spec = (hf_causal_lm if job.workload == "sft" else dpo).spec
    config = parse_config_cli(spec.config, list(job.argv[2:]))
    checked = check_run(config, spec)
    step = build_step(build_job(config, spec, runtime, checked), spec)
    return step.step_fn, batched(checked.inputs.train_set, checked.inputs.collate_fn, job.micro, job.accum)


def _fntrain_variant(step_fn: Callable, side: Side, tokens: list[int]) -> Callable[[], int]:
    from fntrain.state import TrainState

    state, batch = TrainState(), itertools.count()

    def one_step() -> int:
        k = next(batch) % len(tokens)
        step_fn(state, side.read(k))
        return tokens[k]

    return one_step


def _trl_parts(job: PeerJob) -> tuple[Any, Side]:
    trainer = trl_trainer(job)
    trainer.create_optimizer_and_scheduler(num_training_steps=10**6)
    trainer.current_gradient_accumulation_steps = job.accum  # set by Trainer's inner loop, not run here
    trainer.model.train()
    return trainer, batched(trainer.train_dataset, trainer.data_collator, job.micro, job.accum)


def _trl_variant(trainer: Any, side: Side, tokens: list[int]) -> Callable[[], int]:
    model, batch = trainer.model, itertools.count()

    def one_step() -> int:
        k = next(batch) % len(tokens)
        micro_batches = side.read(k)
        micro_batches, items = trainer.get_batch_samples(iter(micro_batches), len(micro_batches), model.device)
        for micro_batch in micro_batches:
            trainer.training_step(model, micro_batch, items)
        trainer.accelerator.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        model.zero_grad()
        return tokens[k]

    return one_step


def _same_batches(variant: tuple[str, str], ours: Side, theirs: Side, batches: int) -> None:
    """A padded variant must give both sides the same tensors: the same work."""
    for k in range(batches):
        for mine, other in zip(ours.read(k), theirs.read(k), strict=True):
            keys = ("input_ids", "attention_mask")
            if any(not torch.equal(mine[key], other[key]) for key in keys):
                raise AssertionError(f"{name('', variant).strip()}: batch {k} differs between fntrain and TRL")


# ----------------------------------------------------------------------------- whole runs


def _whole_run(job: PeerJob, root: Path) -> dict[str, float]:
    """`job` in a child process: wall seconds from the command to its first step's end and to its exit,
    its CPU seconds (`wait4`'s), its peak resident MiB (its own VmHWM) and its steps."""
    Path(job.work).mkdir(parents=True)
    spec = job.write(Path(job.work) / "job.json")
    env = {**os.environ, **CHILD_ENV, "HF_DATASETS_CACHE": str(Path(job.work) / "datasets-cache")}
    with open(Path(job.work) / "output.txt", "w") as output:
        started = time.time()
        child = subprocess.Popen([sys.executable, "-m", "bench.peer_child", str(spec)], cwd=root, env=env,
                                 stdout=output, stderr=subprocess.STDOUT)  # fmt: skip
        _, status, usage = os.wait4(child.pid, 0)
        ended = time.time()
        child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        tail = (Path(job.work) / "output.txt").read_text()[-3000:]
        raise RuntimeError(f"{job.side} {job.workload} {job.variant} exited {child.returncode}:\n{tail}")
    marks = json.loads(Path(job.out).read_text())
    return {"first_step": marks["steps"][0][0] - started, "run": ended - started,
            "cpu": usage.ru_utime + usage.ru_stime, "first_step_cpu": marks["steps"][0][1],
            "rss": marks["peak_mib"], "steps": len(marks["steps"]),
            "loop_cpu": marks["steps"][-1][1] - marks["steps"][0][1]}  # fmt: skip


def _whole_runs(paths: dict[str, Path], variants: Sequence[tuple[str, str]], rounds: int, steps: dict,
                tmp: Path) -> dict[str, Timing]:  # fmt: skip
    """Paired rounds of whole runs, each of `variants` on both sides each round, the side going first
    alternating; one Timing per figure."""
    root = Path(__file__).resolve().parent.parent
    figures: dict[str, Timing] = {}
    for round_index in range(rounds):
        for variant in variants:
            sides = ("fntrain", "TRL") if round_index % 2 == 0 else ("TRL", "fntrain")
            for side in sides:
                work = tmp / f"round{round_index}" / name(side, variant).replace(" ", "-")
                result = _whole_run(_job(side.lower(), variant, paths, steps[variant], work), root)
                if result["steps"] != steps[variant]:
                    raise AssertionError(f"{name(side, variant)} ran {result['steps']} steps, not {steps[variant]}")
                for figure, value in result.items():
                    timing = figures.setdefault(figure, Timing())
                    timing.samples.setdefault(name(side, variant), []).append(value)
                    timing.outside.setdefault(name(side, variant), []).append(value)
    return figures


# ----------------------------------------------------------------------------- the run


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    from fntrain.runtime.setup import RuntimeConfig, setup_runtime

    threads = torch.get_num_threads()
    try:
        with setup_runtime(RuntimeConfig(cpu_threads=1), seed=0) as runtime:
            yield runtime
    finally:
        torch.set_num_threads(threads)


def measure(quick: bool) -> dict[str, Any]:
    """{"steps": the paired rounds of the six step variants (seconds per useful token), "runs": figure ->
    the whole runs' Timing, "tallies": per side and variant, the counts of the rounds' batches}."""
    row_counts = QUICK_ROWS if quick else ROWS
    steps = dict.fromkeys(VARIANTS, 1) if quick else STEPS
    with tempfile.TemporaryDirectory() as tmp_name, _one_thread() as runtime:
        tmp = Path(tmp_name)
        paths = {"model": _model_dir(tmp, QUICK_SHAPE if quick else SHAPE),
                 **{w: _write_rows(tmp / f"{w}.jsonl", _rows(w, n)) for w, n in row_counts.items()}}  # fmt: skip
        variants, tallies, targets = {}, {}, []
        for variant in VARIANTS:
            trainer, theirs = _trl_parts(_job("trl", variant, paths, 1, tmp / name("trl", variant)))
            step_fn, ours = _fntrain_parts(_job("fntrain", variant, paths, 1, tmp / name("fntrain", variant)), runtime)
            batches = min(len(ours.batches), len(theirs.batches))
            if variant[1] == "padded":
                _same_batches(variant, ours, theirs, batches)
            tallies[variant] = {"fntrain": ours.tallies(batches), "TRL": theirs.tallies(batches)}
            variants[name("fntrain", variant)] = _fntrain_variant(step_fn, ours, tallies[variant]["fntrain"]["useful"])
            variants[name("TRL", variant)] = _trl_variant(trainer, theirs, tallies[variant]["TRL"]["useful"])
            targets.append(Target(name("fntrain", variant), name("TRL", variant), 0.06, ratio=True))
        timing = interleave(variants, repeats=1 if quick else 8, warmup=0 if quick else 1,
                            targets=() if quick else targets, budget_s=0.0 if quick else 200.0,
                            max_repeats=24, clock=time.process_time)  # fmt: skip
        whole = QUICK_WHOLE_RUNS if quick else VARIANTS
        runs = _whole_runs(paths, whole, 1 if quick else WHOLE_RUN_ROUNDS, steps, tmp)
    return {"steps": timing, "runs": runs, "tallies": tallies}


def _share(tally: dict[str, list[int]]) -> float:
    return 1 - sum(tally["real"]) / sum(tally["positions"])


def _best(timing: Timing) -> tuple[Timing, dict[str, tuple[str, str]]]:
    """Each side's faster SFT variant (the lower median CPU seconds per useful token), as one Timing."""
    best = {}
    for side in ("fntrain", "TRL"):
        pick = min((v for v in VARIANTS if v[0] == "sft"), key=lambda v: timing.median(name(side, v)))
        best[side] = pick
    samples = {f"{side} best": timing.samples[name(side, best[side])] for side in best}
    return Timing(samples, samples, timing.groups), best


def run(quick: bool = False) -> list[Row]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        measured = measure(quick)
    return rows(measured)


def rows(measured: dict[str, Any]) -> list[Row]:
    timing, runs, tallies = measured["steps"], measured["runs"], measured["tallies"]
    table = []
    for variant in VARIANTS:
        table.append(_step_row(variant, timing, tallies[variant]))
        if name("fntrain", variant) in runs["run"].samples:
            table += _run_rows(variant, runs, tallies[variant])
        table.append(Row(f"{_label(variant)}: padding computed (share of positions)",
                         f"{_share(tallies[variant]['fntrain']):.1%}", f"{_share(tallies[variant]['TRL']):.1%}", "-",
                         "-", note="positions holding no example's token, over the rounds' batches"))  # fmt: skip
    best, picks = _best(timing)
    ours, theirs = name("fntrain", picks["fntrain"]), name("TRL", picks["TRL"])
    table.append(paired_ratio_row(
        f"SFT, each side's best: useful tokens/s, fntrain {picks['fntrain'][1]} vs TRL {picks['TRL'][1]} ({WHERE})",
        best, "fntrain best", "TRL best", goal_ratio=1.3, higher_is_better=True, unit="tokens/s", rate=1.0,
        note="rounds pair different batches of the same file: per-token rates, process CPU time",
    ))  # fmt: skip
    for side in ("fntrain", "TRL"):  # what packing buys each side: the figure the default follows
        table.append(paired_ratio_row(
            f"SFT, packing against padding: {side}'s useful tokens/s, packed vs padded ({WHERE})", timing,
            name(side, ("sft", "packed")), name(side, ("sft", "padded")), goal_ratio=None, higher_is_better=True,
            unit="tokens/s", rate=1.0, note="per-token rates of different batches of the same file, process CPU time",
        ))  # fmt: skip
    if ours in runs["rss"].samples and theirs in runs["rss"].samples:
        table.append(paired_ratio_row(f"SFT, each side's best: peak resident memory, fntrain {picks['fntrain'][1]} vs "
                                      f"TRL {picks['TRL'][1]}", runs["rss"], ours, theirs, goal_ratio=1.0, unit="MiB",
                                      scale=1.0, note="whole runs: the child's VmHWM"))  # fmt: skip
    return table


def _label(variant: tuple[str, str]) -> str:
    return f"{variant[0].upper()} {variant[1]}"


def _step_row(variant: tuple[str, str], timing: Timing, tally: dict) -> Row:
    micro, accum = BATCH[variant]
    same = variant[1] == "padded"
    work = "the same tensors on both sides" if same else (
        "not the same work: TRL attends over each micro-batch flattened into one row")  # fmt: skip
    pairs = sum(tally["TRL"]["attended"]) / sum(tally["fntrain"]["attended"])
    return paired_ratio_row(
        f"{_label(variant)}: useful tokens/s, fntrain vs TRL ({WHERE}; one optimizer step of micro {micro} x {accum})",
        timing, name("fntrain", variant), name("TRL", variant), goal_ratio=1.0 if same else None,
        higher_is_better=True, unit="tokens/s", rate=1.0,
        note=f"{work}; process CPU time; TRL attends {pairs:.2f}x fntrain's query-key pairs",
    )  # fmt: skip


def _run_rows(variant: tuple[str, str], runs: dict[str, Timing], tally: dict) -> list[Row]:
    """The whole runs of `variant`: process CPU to the first step and to the end (the wall times in the
    notes: on a shared machine they carry the neighbours' load), peak memory."""
    ours, theirs = name("fntrain", variant), name("TRL", variant)
    steps = int(runs["steps"].median(ours))
    loop = ""
    if steps > 1:  # steps 2 .. N in the real loop, useful tokens per CPU second
        rates = {side: sum(tally[side]["useful"][1:steps]) / runs["loop_cpu"].median(name(side, variant))
                 for side in ("fntrain", "TRL")}  # fmt: skip
        loop = f"; in the loop (steps 2-{steps}): fntrain {rates['fntrain']:.0f}, TRL {rates['TRL']:.0f} useful tokens/CPU s"

    def wall(figure: str) -> str:
        return f"wall: fntrain {runs[figure].median(ours):.1f} s, TRL {runs[figure].median(theirs):.1f} s"

    return [
        paired_ratio_row(f"{_label(variant)}: command to the first step's end, fntrain vs TRL (process CPU)",
                         runs["first_step_cpu"], ours, theirs, goal_ratio=None, unit="s", scale=1.0,
                         note=wall("first_step")),
        paired_ratio_row(f"{_label(variant)}: whole run of {steps} steps, fntrain vs TRL (process CPU)", runs["cpu"],
                         ours, theirs, goal_ratio=None, unit="s", scale=1.0, note=wall("run") + loop),
        paired_ratio_row(f"{_label(variant)}: peak resident memory, fntrain vs TRL", runs["rss"], ours, theirs,
                         goal_ratio=None, unit="MiB", scale=1.0, note="the child's VmHWM"),
    ]  # fmt: skip


if __name__ == "__main__":
    quiet()
    bench_main(run, "fntrain against TRL on the same SFT and DPO work", __doc__.splitlines()[0])
