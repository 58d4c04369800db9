"""Fixtures the data tests share."""

import pytest

from tests.data.test_preference import TEMPLATE, tiny_tokenizer
from tests.helpers.model_assets import Assets


@pytest.fixture(scope="module")
def assets() -> Assets:
    """The tiny chat tokenizer's assets (tests/data/test_preference.py), with its chat template."""
    tokenizer = tiny_tokenizer()
    return Assets(tokenizer, tokenizer.pad_token_id, tokenizer.eos_token_id, TEMPLATE)
