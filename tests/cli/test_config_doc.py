"""docs/config.md is the current config reference: every flag of the built-in recipes with its type,
default and docstring (`fntrain.cli.config_doc`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fntrain.cli.config_doc import config_reference, field_docstrings

ROOT = Path(__file__).resolve().parents[2]


def test_docs_config_page_is_current():
    assert (ROOT / "docs" / "config.md").read_text() == config_reference(), (
        "rerun: python -m fntrain.cli.config_doc > docs/config.md"
    )


def test_the_page_has_every_flag_with_its_default_and_docstring():
    page = config_reference()
    assert ("| `--train.global-batch-size` | int | `32` | Samples per optimizer step, over all data-parallel "
            "ranks. |") in page  # fmt: skip
    assert "| `--parallel.strategy` | `none` \\| `ddp` \\| `fsdp2` | `none` |" in page
    hf = page[page.index("## `hf_causal_lm`") : page.index("## `vlm`")]
    assert "| `--optim.lr` | float | `2e-05` | Peak learning rate. |" in hf  # a default the recipe changes
    assert (
        '| `--model.path` | str | `""` | Local model directory' in hf and "### `hf_causal_lm`: `lora`" in hf
    )
    assert "| `--checkpoint.restore-from` |" in page and "| `--watchdog.exit-code` | int | `124` |" in page


@dataclass(frozen=True)
class _Base:
    a: int = 1
    """From the base."""
    b: int = 2
    """Overridden below."""


@dataclass(frozen=True)
class _Child(_Base):
    b: int = 3
    """The child's."""
    c: str = ""


def test_field_docstrings_follow_the_mro_and_skip_undocumented_fields():
    assert field_docstrings(_Child) == {"a": "From the base.", "b": "The child's."}
