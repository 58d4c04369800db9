"""Preference tuning and distillation at `--parallel.strategy fsdp2` on 2 ranks (torchrun, gloo, CPU)
train as one process does: the same per-step loss, rewards / KD parts and grad_norm over 3 steps, the
frozen model (DPO's reference copy, the KD teacher) sharded like the trained one. Also DPO with a LoRA
adapter and the adapter-off reference. Slow tier (torchrun).

Every job runs in one launch of tests/step/objectives/dpo_dist_worker.py per layout (one start-up for all): 2 ranks
under torchrun, then the same jobs in one process. A micro-batch of 1 (one pair, one text) keeps every
micro-batch the same in both layouts (no padding that depends on which rows share it); SGD, because
Adam turns float-level gradient differences into lr-sized steps where a gradient is near 0 (as in
tests/recipes/test_hf_causal_lm.py's tensor-parallel test). Tolerance: tests/runtime/test_distributed.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.fork_server import DPO_PRELOAD, started
from tests.helpers.waiting import run_to_end
from tests.helpers.workers import worker_env
from tests.step.objectives.dpo_helpers import CORPUS, bigger_teacher, preference_rows, tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
TIGHT = {"rel": 1e-5, "abs": 1e-6}  # tests/runtime/test_distributed.py's rtol 1e-5, atol 1e-6
STEPS = 3
COMMON = [
    "--train.train-iters", str(STEPS), "--train.global-batch-size", "4", "--train.micro-batch-size", "1",
    "--optim.name", "sgd", "--optim.lr", "0.5", "--schedule.kind", "constant", "--schedule.warmup-iters", "0",
    "--log-every", "1", "--progress.no-enabled", "--evaluate.no-with-validation", "--loader.no-shuffle",
    "--checkpoint.save-every", "0", "--checkpoint.no-export",
]  # fmt: skip
LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--lora.dropout", "0", "--lora.target-modules", "q_proj", "v_proj"]  # fmt: skip
DPO_METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")  # fmt: skip
KD_METRICS = ("loss", "grad_norm", "kd/ce", "kd/kl")


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[str]:
    """The worker's cases: DPO with a frozen reference copy, DPO with LoRA and the adapter-off reference,
    KD from a bigger teacher."""
    root = tmp_path_factory.mktemp("dpo_dist")
    student = tiny_llama(root / "llama", max_positions=64)
    teacher = bigger_teacher(student, root / "teacher")
    prefs = root / "prefs.jsonl"
    prefs.write_text("".join(json.dumps(row) + "\n" for row in preference_rows(4 * STEPS, seed=3)))
    texts = root / "text.jsonl"
    lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()][: 4 * STEPS]
    texts.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    dpo = [*COMMON, "--model.path", str(student), "--data.path", str(prefs), "--dpo.beta", "0.5"]
    kd = [*COMMON, "--model.path", str(student), "--data.path", str(texts), "--data.max-length", "32",
          "--kd.teacher-path", str(teacher), "--kd.ratio", "0.5", "--kd.temperature", "2.0"]  # fmt: skip
    return [
        f"dpo=dpo:{json.dumps(dpo)}",
        f"lora=dpo:{json.dumps([*dpo, *LORA, '--dpo.reference', 'adapter-off', '--optim.lr', '2.0'])}",
        f"kd=kd:{json.dumps(kd)}",
    ]


def launch_cases(root: Path, cases: list[str], ranks: int, env: dict[str, str]) -> Path:
    strategy = "fsdp2" if ranks > 1 else "none"
    torchrun = ["torchrun", "--standalone", f"--nproc_per_node={ranks}"]
    command = [*(torchrun if ranks > 1 else [env["PYTHON_FORK"]]), "-m", "tests.step.objectives.dpo_dist_worker", strategy, str(root),
               *cases]  # fmt: skip
    names = ", ".join(case.split("=", 1)[0] for case in cases)
    what = f"the {strategy} DPO/KD worker on {ranks} rank(s) (cases {names})"
    result = run_to_end(command, what, 500, cwd=ROOT, env=env)
    assert result.returncode == 0, (
        f"{ranks} rank(s) failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )
    return root


@pytest.fixture(scope="module")
def dpo_layout_runs(cases, tmp_path_factory) -> dict[str, Path]:
    """layout -> the root of its run directories. The launches (torchrun's agent and workers, the one
    process) fork from one process that imported torch and transformers once (tests/helpers/fork_server.py)."""
    dpo_flags = json.loads(cases[0].removeprefix("dpo=dpo:"))
    tensor_parallel = f"tp=dpo:{json.dumps([*dpo_flags, '--parallel.tp-size', '2'])}"  # 2 ranks only
    with started(worker_env(), DPO_PRELOAD) as env:
        return {
            "fsdp2": launch_cases(tmp_path_factory.mktemp("fsdp2"), [*cases, tensor_parallel], 2, env),
            "one": launch_cases(tmp_path_factory.mktemp("one"), cases, 1, env),
        }


def _steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


def _assert_same_steps(fsdp2: Path, one: Path, names: tuple[str, ...]) -> list[dict]:
    sharded, reference = _steps(fsdp2), _steps(one)
    assert [row["step"] for row in sharded] == [row["step"] for row in reference] == list(range(1, STEPS + 1))
    for step, (got, want) in enumerate(zip(sharded, reference, strict=True), start=1):
        for name in names:
            assert got[name] == pytest.approx(want[name], **TIGHT), (step, name, got, want)
    return reference


def _world(run_dir: Path) -> int:
    return json.loads((run_dir / "run_metadata.json").read_text())["world_size"]


@pytest.mark.parametrize("case", ["dpo", "lora"])
def test_dpo_under_fsdp2_on_two_ranks_matches_one_process(dpo_layout_runs, case):
    """The policy and (for `dpo`) the frozen reference copy sharded over 2 ranks; `lora`: the adapter
    trains, its reference is the policy with the adapter switched off."""
    assert (_world(dpo_layout_runs["fsdp2"] / case), _world(dpo_layout_runs["one"] / case)) == (2, 1)
    reference = _assert_same_steps(dpo_layout_runs["fsdp2"] / case, dpo_layout_runs["one"] / case, DPO_METRICS)
    # Step 1 starts at the reference (loss log 2, rewards 0); later steps moved away from it, so the
    # numbers compared are not just equal zeros.
    assert reference[0]["loss"] == pytest.approx(0.6931, abs=1e-4) and reference[0]["rewards/margins"] == 0
    assert all(
        abs(row["rewards/margins"]) > 1e-2 and row["loss"] != reference[0]["loss"] for row in reference[1:]
    )


def test_kd_under_fsdp2_on_two_ranks_matches_one_process(dpo_layout_runs):
    """The student and the bigger frozen teacher both sharded over 2 ranks."""
    assert (_world(dpo_layout_runs["fsdp2"] / "kd"), _world(dpo_layout_runs["one"] / "kd")) == (2, 1)
    reference = _assert_same_steps(dpo_layout_runs["fsdp2"] / "kd", dpo_layout_runs["one"] / "kd", KD_METRICS)
    assert all(row["kd/kl"] > 0 for row in reference)
    assert reference[-1]["loss"] < reference[0]["loss"]


def test_dpo_under_tensor_parallelism_matches_one_process(dpo_layout_runs):
    """tp 2: the policy and the reference split by the Llama plan, their vocabulary-split logits
    gathered whole by the objective: the numbers of one process."""
    assert _world(dpo_layout_runs["fsdp2"] / "tp") == 2
    _assert_same_steps(dpo_layout_runs["fsdp2"] / "tp", dpo_layout_runs["one"] / "dpo", DPO_METRICS)
