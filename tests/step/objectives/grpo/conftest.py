"""Fixtures the GRPO run tests share."""

from pathlib import Path

import pytest

from tests.step.objectives.grpo.helpers import grpo_inputs


@pytest.fixture(scope="module")
def grpo_run_inputs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model, prompts, the reward module's directory): tests/step/objectives/grpo/helpers.py's, 16 prompts."""
    return grpo_inputs(tmp_path_factory.mktemp("grpo_run"))
