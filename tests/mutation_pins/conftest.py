"""Fixtures the pins of several modules share."""

import datetime

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo default group whose collective timeout (the run's --runtime.timeout-s) is 77 s: a
    hook told of more ranks runs its multi-rank paths over it, and a group it makes can be checked for
    the run's timeout."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=77))  # fmt: skip
    yield
    dist.destroy_process_group()
