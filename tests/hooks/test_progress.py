"""Progress bar: rank 0 only, total/initial, advanced every step, postfix on logging steps, one close; no bar
without a terminal; other libraries' bars follow progress.enabled."""

from __future__ import annotations

import io
import sys
import types

import pytest
import torch
import tqdm as tqdm_module

from fntrain.hooks import progress as progress_module
from fntrain.hooks.progress import ProgressConfig, format_postfix, progress_hook, set_library_progress_bars
from fntrain.loop import Event, StepInfo
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from tests.helpers.waiting import run_to_end
from tests.hooks.drive import drive, state_at


class FakeBar:
    instances: list[FakeBar] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.n = kwargs.get("initial", 0)
        self.postfixes: list[tuple[int, str]] = []  # (count the update drew it with, postfix), when set
        self.new_postfix: str | None = None
        self.descriptions: list[str] = []
        self.closed = 0
        FakeBar.instances.append(self)

    def update(self, n):
        self.n += n
        if self.new_postfix is not None:
            self.postfixes.append((self.n, self.new_postfix))
            self.new_postfix = None

    def set_postfix_str(self, text, refresh=True):
        self.new_postfix = text

    def set_description(self, text, refresh=True):
        self.descriptions.append(text)

    def close(self):
        self.closed += 1


@pytest.fixture
def fake_tqdm(monkeypatch):
    FakeBar.instances = []
    monkeypatch.setattr(tqdm_module, "tqdm", FakeBar)
    monkeypatch.setattr(progress_module, "_stderr_is_terminal", lambda: True)  # as in a terminal
    return FakeBar


def step_info(loss: float = 2.0) -> StepInfo:
    return StepInfo({"loss": torch.tensor(loss), "grad_norm": torch.tensor(0.5), "lr": 1e-3}, 10, 1, 0.1)


def test_bar_counts_the_whole_run_from_the_restored_step(fake_tqdm):
    hook = progress_hook(ProgressConfig(redirect_logging=False), Runtime(), total=20, latest=dict)
    hook(Event.TRAIN_BEGIN, state_at(5), None)
    (bar,) = fake_tqdm.instances
    assert bar.kwargs["total"] == 20 and bar.kwargs["initial"] == 5
    drive(hook, 3, start=state_at(5), info=step_info(), begin=False, end=None)
    assert bar.n == 8


def test_postfix_refreshed_only_on_the_steps_the_metrics_hook_logged(fake_tqdm):
    latest: dict = {}
    hook = progress_hook(ProgressConfig(redirect_logging=False), Runtime(), total=10, latest=lambda: latest)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    for step in range(1, 6):
        if step % 2 == 0:  # what the metrics log holds after the metrics hook's logging steps
            latest.clear()
            latest.update(
                {
                    "loss": 2.0,
                    "grad_norm": 0.5,
                    "lr": 3e-4,
                    "tokens_per_s": 12345.6,
                    "step_time_s": 0.25,
                    "step": step,
                }
            )
        hook(Event.STEP_END, state_at(step), step_info())
    (bar,) = fake_tqdm.instances
    assert [n for n, _ in bar.postfixes] == [2, 4]
    assert bar.postfixes[0][1] == "loss=2.0000, grad_norm=0.500, lr=3.000e-04, tok/s=1.235e+04, step=0.25s"


def test_without_a_board_postfix_comes_from_the_step_every_log_every(fake_tqdm):
    hook = progress_hook(ProgressConfig(redirect_logging=False), Runtime(), total=10, log_every=3)
    drive(hook, 6, info=lambda state: step_info(loss=float(state.global_step)), end=None)
    (bar,) = fake_tqdm.instances
    assert bar.postfixes == [
        (3, "loss=3.0000, grad_norm=0.500, lr=1.000e-03"),
        (6, "loss=6.0000, grad_norm=0.500, lr=1.000e-03"),
    ]


def test_closes_once_on_train_end_then_abort(fake_tqdm):
    hook = progress_hook(ProgressConfig(redirect_logging=False), Runtime(), total=3)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    hook(Event.TRAIN_END, state_at(3), None)
    hook(Event.ABORT, state_at(3), RuntimeError("late"))
    (bar,) = fake_tqdm.instances
    assert bar.closed == 1


def test_abort_closes_and_abort_before_train_begin_is_a_no_op(fake_tqdm):
    hook = progress_hook(ProgressConfig(), Runtime(), total=3)
    hook(Event.ABORT, TrainState(), RuntimeError("early"))
    assert fake_tqdm.instances == []
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    hook(Event.ABORT, state_at(1), RuntimeError("boom"))
    assert fake_tqdm.instances[0].closed == 1


def test_epoch_shown_in_the_description(fake_tqdm):
    hook = progress_hook(ProgressConfig(redirect_logging=False), Runtime(), total=3)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    hook(Event.EPOCH_BEGIN, TrainState(epoch=1, global_step=2), None)
    assert fake_tqdm.instances[0].kwargs["desc"] == "epoch 0"
    assert fake_tqdm.instances[0].descriptions == ["epoch 1"]


def test_other_ranks_and_disabled_show_no_bar(fake_tqdm):
    for hook in (
        progress_hook(ProgressConfig(), Runtime(rank=1, world_size=2), total=3),
        progress_hook(ProgressConfig(enabled=False), Runtime(), total=3),
    ):
        hook(Event.TRAIN_BEGIN, TrainState(), None)
        hook(Event.STEP_END, state_at(1), step_info())
        hook(Event.TRAIN_END, state_at(1), None)
    assert fake_tqdm.instances == []


def test_missing_tqdm_warns_once_and_shows_no_bar(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(progress_module, "_stderr_is_terminal", lambda: True)
    with pytest.warns(UserWarning, match="tqdm is not installed") as caught:
        hook = progress_hook(ProgressConfig(), Runtime(), total=3)
    assert len(caught) == 1
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    hook(Event.STEP_END, state_at(1), step_info())
    hook(Event.TRAIN_END, state_at(1), None)


def test_real_bar_draws_to_its_file():
    out = io.StringIO()
    latest: dict = {}
    hook = progress_hook(ProgressConfig(mininterval=0.0), Runtime(), total=4, latest=lambda: latest, file=out)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    for step in range(1, 5):
        latest.update({"loss": 1.5, "lr": 1e-3, "step": step})
        hook(Event.STEP_END, state_at(step), step_info())
    hook(Event.TRAIN_END, state_at(4), None)
    text = out.getvalue()
    assert "4/4" in text and "loss=1.5000" in text and "lr=1.000e-03" in text


def test_console_log_handlers_go_through_tqdm_while_the_bar_is_open():
    import logging

    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)
    root.addHandler(console)
    try:
        hook = progress_hook(ProgressConfig(), Runtime(), total=2, file=io.StringIO())
        hook(Event.TRAIN_BEGIN, TrainState(), None)
        assert console not in root.handlers
        assert any("Tqdm" in type(handler).__name__ for handler in root.handlers)
        hook(Event.ABORT, state_at(1), RuntimeError("boom"))
        assert console in root.handlers
        assert not any("Tqdm" in type(handler).__name__ for handler in root.handlers)
    finally:
        root.removeHandler(console)


def test_no_bar_when_stderr_is_not_a_terminal(monkeypatch):
    FakeBar.instances = []
    monkeypatch.setattr(tqdm_module, "tqdm", FakeBar)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # redirected: a file, not a terminal
    hook = progress_hook(ProgressConfig(), Runtime(), total=3, latest=dict)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    hook(Event.STEP_END, state_at(1), step_info())
    hook(Event.TRAIN_END, state_at(1), None)
    assert FakeBar.instances == [] and sys.stderr.getvalue() == ""


def test_redirected_run_has_log_lines_and_no_bar_redraws(tmp_path):
    # a real tqdm in a child process whose stderr is a file: the metrics lines only, no carriage returns
    code = (
        "import logging, sys, torch\n"
        "from fntrain.hooks.metrics import MetricsConfig, metrics_hook\n"
        "from fntrain.hooks.metrics_log import metrics_log\n"
        "from fntrain.hooks.progress import ProgressConfig, progress_hook\n"
        "from fntrain.loop import Event, StepInfo\n"
        "from fntrain.runtime.runtime import Runtime\n"
        "from fntrain.state import TrainState\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr, format='%(message)s')\n"
        "runtime = Runtime()\n"
        f"writer = metrics_log(MetricsConfig(jsonl=False), runtime, {str(tmp_path)!r})\n"
        "hooks = [metrics_hook(runtime, log_every=5, writer=writer),\n"
        "         progress_hook(ProgressConfig(mininterval=0.0), runtime, total=20, latest=writer.latest)]\n"
        "for hook in hooks: hook(Event.TRAIN_BEGIN, TrainState(), None)\n"
        "for step in range(1, 21):\n"
        "    info = StepInfo({'loss': torch.tensor(2.0), 'lr': 1e-3}, 10, 1, 0.1)\n"
        "    for hook in hooks: hook(Event.STEP_END, TrainState(global_step=step, cursor=step), info)\n"
        "for hook in hooks: hook(Event.TRAIN_END, TrainState(global_step=20, cursor=20), None)\n"
    )
    done = run_to_end([sys.executable, "-c", code], "the child process driving a real tqdm", 120)
    assert done.returncode == 0, done.stderr[-4000:]
    text = done.stderr
    assert "\r" not in text and "it/s" not in text and "step/s" not in text
    assert text.splitlines() == [f"step={s} epoch=0 loss=2 loss_last=2 lr=1.000e-03" for s in (5, 10, 15, 20)]


def test_library_progress_bars_follow_enabled_for_imported_libraries_only(monkeypatch):
    calls = []
    fake = types.ModuleType("transformers")
    fake_logging = types.ModuleType("transformers.utils.logging")
    fake_logging.enable_progress_bar = lambda: calls.append("on")
    fake_logging.disable_progress_bar = lambda: calls.append("off")
    monkeypatch.setitem(sys.modules, "transformers", fake)
    monkeypatch.setitem(sys.modules, "transformers.utils.logging", fake_logging)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed / not imported
    monkeypatch.delitem(sys.modules, "huggingface_hub", raising=False)
    progress_hook(ProgressConfig(enabled=False), Runtime(), total=3)
    assert calls == ["off"]
    assert set_library_progress_bars(True) == ["transformers"] and calls == ["off", "on"]
    assert "huggingface_hub" not in sys.modules  # never imported just for this


def test_format_postfix_skips_absent_metrics():
    assert format_postfix({"lr": 0.1234}) == "lr=1.234e-01"
    assert format_postfix({}) == ""


def test_importing_fntrain_and_the_hook_module_does_not_import_tqdm():
    # with tqdm blocked, any import of it fails: fntrain and the hook module must import without it
    # (torch.hub imports tqdm itself when it can, so "not in sys.modules" cannot be the test)
    code = "import sys; sys.modules['tqdm'] = None; import fntrain, fntrain.hooks.progress"
    done = run_to_end([sys.executable, "-c", code], "the import of fntrain with tqdm blocked", 120)
    assert done.returncode == 0, done.stderr[-4000:]


def test_config_validation_names_the_field():
    with pytest.raises(TypeError, match="progress.enabled"):
        ProgressConfig(enabled="yes").validate()
    with pytest.raises(ValueError, match="progress.mininterval"):
        ProgressConfig(mininterval=-1.0).validate()
    with pytest.raises(ValueError, match="total"):
        progress_hook(ProgressConfig(), Runtime(), total=0)
