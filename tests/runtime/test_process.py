"""run_main: a torchrun worker ends with its own status without interpreter finalization."""

import pytest

from fntrain.runtime.process import launched_by_torchrun, run_main


def torchrun_env(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")


@pytest.mark.parametrize(
    ("main", "expected"),
    [
        (lambda: None, 0),
        (lambda: 0, 0),
        (lambda: 3, 3),
        (lambda: object(), 0),  # a recipe's main returns its final TrainState
    ],
)
def test_torchrun_worker_exits_with_main_status(monkeypatch, main, expected):
    torchrun_env(monkeypatch)
    codes = []
    with pytest.raises(SystemExit):
        run_main(main, exit=codes.append)
    assert codes == [expected]


def test_a_system_exit_code_survives(monkeypatch, capsys):
    torchrun_env(monkeypatch)
    codes = []

    def preempted():
        raise SystemExit(143)

    with pytest.raises(SystemExit):
        run_main(preempted, exit=codes.append)
    assert codes == [143]

    def usage_error():
        raise SystemExit("bad flag --x")

    with pytest.raises(SystemExit):
        run_main(usage_error, exit=codes.append)
    assert codes[-1] == 1 and "bad flag --x" in capsys.readouterr().err


def test_other_exceptions_propagate_unchanged(monkeypatch):
    torchrun_env(monkeypatch)
    error = RuntimeError("boom")

    def fails():
        raise error

    codes = []
    with pytest.raises(RuntimeError) as caught:
        run_main(fails, exit=codes.append)
    assert caught.value is error and codes == []


def test_outside_torchrun_it_is_a_plain_sys_exit(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not launched_by_torchrun()
    codes = []
    with pytest.raises(SystemExit) as caught:
        run_main(lambda: 5, exit=codes.append)
    assert caught.value.code == 5 and codes == []
