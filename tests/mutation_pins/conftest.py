"""The pins read fntrain's log lines as a fresh process has them: fntrain's loggers at WARNING unless a
test raises them (`caplog.at_level`), whatever level an earlier test in the same worker left behind."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def fresh_process_log_levels(caplog):
    for name in ("fntrain", "fntrain.checkpoint"):
        caplog.set_level(logging.WARNING, logger=name)
