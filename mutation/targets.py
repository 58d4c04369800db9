"""The core modules under mutation testing, each with the default-tier test files that pin it.

mutmut runs only these files for a module (and, inside them, only the tests that reach the mutated
function: it records that while running them once unmutated), so one module's run fits the 2-core
machine. The module's pin file joins its list by itself when it exists: `tests/<the module's folder under
fntrain/>/test_<stem>_pins.py` (`pin_file`), beside the module's other tests, is where the tests written to
kill a surviving mutant live. `goal` is the issue's target score (0.9 for the
modules a wrong number or a lost file hurts most, 0.8 elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pin_file(module: str) -> str:
    """Where the pins of `module` live: `fntrain/checkpoint/retention.py` -> `tests/checkpoint/test_retention_pins.py`,
    `fntrain/loop.py` -> `tests/test_loop_pins.py`."""
    path = Path(module).relative_to("fntrain")
    return (Path("tests") / path.parent / f"test_{path.stem}_pins.py").as_posix()


@dataclass(frozen=True)
class Target:
    """One module to mutate, the test files run against its mutants, and its goal score."""

    module: str
    tests: tuple[str, ...]
    goal: float = 0.8
    skip: tuple[str, ...] = ()  # test ids left out (pytest --deselect): each says why beside the target

    def test_files(self, pins: bool = True) -> tuple[str, ...]:
        """The listed test files plus, unless `pins` is false, the module's pin file when there is one."""
        pin = pin_file(self.module)
        if not pins or pin in self.tests or not (ROOT / pin).exists():
            return self.tests
        return (*self.tests, pin)


def _t(module: str, *tests: str, goal: float = 0.8, skip: tuple[str, ...] = ()) -> Target:
    return Target(module, tuple(tests), goal, skip)


TARGETS = {
    t.module: t
    for t in (
        # The order is the order of importance: `python -m mutation.run --all` runs them so.
        _t("fntrain/loop.py", "tests/test_loop.py", "tests/test_state.py", goal=0.9),
        _t("fntrain/state.py", "tests/test_state.py", "tests/test_state_errors.py", "tests/test_loop.py", goal=0.9),
        # The cross-process test starts fresh interpreters: 15 s for every mutant on 2 cores; the pins
        # state its property (the order is a function of seed and epoch alone) in one process.
        _t("fntrain/data/sampler.py", "tests/data/test_sampler.py", goal=0.9, skip=(
            "tests/data/test_sampler.py::test_order_is_identical_across_processes_and_ignores_the_global_rng",
        )),
        _t("fntrain/hooks/metrics_window.py", "tests/hooks/test_metrics.py"),
        _t("fntrain/checkpoint/retention.py", "tests/checkpoint/test_layout.py", "tests/checkpoint/test_durability.py"),
        _t("fntrain/checkpoint/verify.py", "tests/checkpoint/test_verify.py", "tests/checkpoint/test_verify_paths.py",
           goal=0.9),
        # Left out: two whole runs of recipes/tiny_gpt through run_job (5 s a mutant each); what they check of
        # the saver (a failed save is one line naming the newest good checkpoint, which a resume restores)
        # is the full-disk tests' and the pins' (a save interrupted at any point leaves the previous one).
        _t("fntrain/checkpoint/saver.py", "tests/checkpoint/test_save_restore.py", "tests/checkpoint/test_save_faults.py",
           goal=0.9, skip=(
               "tests/checkpoint/test_save_faults.py::test_a_run_stopped_by_a_full_disk_says_what_is_good_and_resumes",
               "tests/checkpoint/test_save_faults.py::test_extending_a_finished_run_saves_its_new_end",
           )),
        # tests/checkpoint/test_resume.py SIGKILLs recipe runs in fresh interpreters (tens of seconds a
        # mutant); the in-process restore tests here and the pins state what it checks of the restorer
        # (a resumed run continues bit for bit; an interrupted save leaves the previous checkpoint loadable).
        # Left out: the check that restore's warnings point at its caller (stacklevel) fails under mutmut,
        # whose trampoline adds a frame to every mutated function; it runs in the default tier as written.
        _t("fntrain/checkpoint/restorer.py", "tests/checkpoint/test_save_restore.py", "tests/checkpoint/test_verify.py",
           "tests/checkpoint/test_restart.py", goal=0.9, skip=(
               "tests/checkpoint/test_save_restore.py::test_restores_warnings_point_at_its_caller",
           )),
        # Left out: the three tests that start DataLoader worker processes for a whole epoch at every cursor
        # (5 s a mutant on 2 cores; the shorter worker tests stay) and the one that builds a whole job per
        # rank (3 s; its pipeline half, each rank reading its own shard, is the every-cursor test's). The
        # pins state what they check of this module in one process: the DataLoader gets the spec's
        # settings and an epoch-seeded worker generator, and close() shuts its workers down.
        _t("fntrain/data/pipeline.py", "tests/data/test_pipeline.py", "tests/data/test_position_pins.py", goal=0.9,
           skip=(
               "tests/data/test_pipeline.py::test_every_cursor_gives_the_tail_with_workers",
               "tests/data/test_pipeline.py::test_workers_give_identical_batches_and_leave_no_process_or_global_rng_draw",
               "tests/data/test_position_pins.py::test_each_data_parallel_rank_of_a_job_reads_its_own_shard",
           )),
        _t("fntrain/step/train_step.py", "tests/step/test_train_step.py", goal=0.9),
        _t("fntrain/step/layouts.py", "tests/step/test_layouts.py", "tests/step/test_train_step.py", goal=0.9),
        _t("fntrain/run/launch.py", "tests/run/test_launch.py", goal=0.9),
        _t("fntrain/stateful.py", "tests/hooks/test_standard.py"),
        _t("fntrain/step/optim.py", "tests/step/test_train_step.py"),
        _t("fntrain/data/stream.py", "tests/data/test_pipeline.py"),
        # Left out: the check that stop()'s timeout warning points at its caller (stacklevel; the trampoline adds a frame).
        _t("fntrain/data/prefetch.py", "tests/data/test_prefetch.py", skip=(
            "tests/data/test_prefetch.py::test_the_stop_timeout_warning_points_at_the_caller_of_stop",
        )),
        _t("fntrain/data/packing.py", "tests/data/test_packing.py", "tests/data/test_packing_paths.py"),
        _t("fntrain/data/sft.py", "tests/data/test_sft.py"),
        _t("fntrain/data/shards.py", "tests/data/test_shards.py"),
        _t("fntrain/data/mixing.py", "tests/data/test_mixing.py"),
        _t("fntrain/data/fingerprint.py", "tests/data/test_fingerprint.py"),
        _t("fntrain/checkpoint/layout.py", "tests/checkpoint/test_layout.py"),
        _t("fntrain/checkpoint/rng.py", "tests/checkpoint/test_rng.py"),
        _t("fntrain/run/checks.py", "tests/run/test_job.py"),
        _t("fntrain/run/open.py", "tests/run/test_transaction.py"),
        _t("fntrain/run/finish.py", "tests/run/test_launch.py"),
        _t("fntrain/hooks/metrics.py", "tests/hooks/test_metrics.py"),
        _t("fntrain/hooks/checkpoint.py", "tests/hooks/test_checkpoint.py", "tests/hooks/test_checkpoint_edges.py"),
        _t("fntrain/hooks/evaluate.py", "tests/hooks/test_evaluate.py"),
        _t("fntrain/hooks/throughput.py", "tests/hooks/test_throughput.py"),
        _t("fntrain/hooks/preemption.py", "tests/hooks/test_preemption.py", "tests/hooks/test_preemption_groups.py"),
        _t("fntrain/hooks/watchdog.py", "tests/hooks/test_watchdog.py"),
        # Landed since (issue 49 item 4): the sampler's row generators and draws, which every completion of
        # `fntrain generate`, the samples hook and GRPO's rollout come from.
        _t("fntrain/sampling/keys.py", "tests/sampling/test_keys.py", goal=0.9),
        _t("fntrain/sampling/pick.py", "tests/sampling/test_pick.py", goal=0.9),
        # GRPO's group advantages and which rows each rank, step and micro-batch trains on: a wrong number
        # or a row trained twice changes every update.
        _t("fntrain/step/objectives/grpo/advantages.py", "tests/step/objectives/grpo/test_advantages.py", goal=0.9),
        _t("fntrain/step/objectives/grpo/layout.py", "tests/step/objectives/grpo/test_layout.py", goal=0.9),
        # GRPO's per-token loss, its normalisation per loss type and its logged metrics: the number users train on.
        # Left out: the slow tier's TRL comparisons (tests/step/objectives/grpo/test_trl_parity.py).
        _t("fntrain/step/objectives/grpo/loss.py", "tests/step/objectives/grpo/test_loss.py", goal=0.9),
        # GRPO's phase: one generation per batch of R steps, and what a checkpoint keeps of it and resumes. Not
        # listed: tests/step/objectives/grpo/test_resume.py and test_recipe.py (jobs and launches); test_rollout.py
        # and the pins drive the phase in-process.
        _t("fntrain/step/objectives/grpo/phase.py", "tests/step/objectives/grpo/test_rollout.py"),
        # Preference tuning and distillation: the loss every DPO/KD update follows. Left out: the recipe runs
        # (tests/step/objectives/test_dpo_recipe.py, 1 to 3 s a test building a tiny Llama; what they check of
        # these losses, the logged metrics and a refused value, is the unit tests' and the pins'), and the
        # slow tier's TRL comparisons and multi-process runs.
        _t("fntrain/step/objectives/dpo.py", "tests/step/objectives/test_dpo.py", "tests/step/objectives/test_reference.py",
           goal=0.9),
        _t("fntrain/step/objectives/reference.py", "tests/step/objectives/test_reference.py",
           "tests/step/objectives/test_dpo.py", goal=0.9),
        _t("fntrain/step/objectives/kd.py", "tests/step/objectives/test_kd.py", goal=0.9),
        # The decode loop every completion of `fntrain generate`, the samples hook and GRPO's rollout comes out of
        # (GRPO trains on its tokens): the tiny GPT's and a transformers model's paths.
        _t("fntrain/sampling/decode.py", "tests/sampling/test_tiny_gpt.py", "tests/sampling/test_hf.py", goal=0.9),
        # Which tokens of a chat example are trained on (the prompt masked): a wrong label trains on the prompt.
        _t("fntrain/data/chat.py", "tests/data/test_sft.py", "tests/data/test_vlm.py", goal=0.9),
        # DPO's pairs: which tokens are the prompt (masked) and which the completions, and how a batch pairs them.
        _t("fntrain/data/preference.py", "tests/data/test_preference.py", goal=0.9),
        _t("fntrain/data/preference_collate.py", "tests/data/test_preference.py", goal=0.9),
        # Samples during training: when, from which generator, with the model's mode and the global RNGs restored,
        # and where they go (its MLflow and W&B tests are the slow tier's).
        _t("fntrain/hooks/sample.py", "tests/hooks/test_sample.py"),
        # What torchrun told the process: a rank or world size read wrong runs every rank as another.
        _t("fntrain/runtime/launch.py", "tests/runtime/test_setup.py", goal=0.9),
    )
}
