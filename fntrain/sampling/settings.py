"""How the new tokens of a sequence are drawn: one frozen record the sampler, `fntrain generate`, the
samples hook and the GRPO rollout share, and the one default `fntrain generate` and the samples during
training (`--sample.*`) draw text with (`TEXT_DEFAULTS`)."""

from __future__ import annotations

from dataclasses import dataclass

from fntrain.config import require_float, require_int, require_int_list

__all__ = ["SampleSettings", "TEXT_DEFAULTS", "eos_ids"]


@dataclass(frozen=True)
class SampleSettings:
    """How to draw the new tokens of one sequence."""

    max_new_tokens: int = 256
    """Tokens to generate at most (fewer when an EOS id comes first)."""
    temperature: float = 1.0
    """Softmax temperature (0: greedy, the most likely token every step)."""
    top_k: int | None = None
    """Draw only among the k most likely tokens (None or 0: no cut)."""
    top_p: float = 1.0
    """Nucleus sampling: draw among the most likely tokens holding this much probability, in (0, 1] (1: no cut)."""
    eos_id: int | tuple[int, ...] | None = None
    """Stop once this token (or any of these, for a model with several EOS ids) is produced: it is kept as
    the sequence's last token; None: never stop early."""

    def validate(self, prefix: str = "sample") -> None:
        """Value rules naming `prefix.field`."""
        require_int(f"{prefix}.max_new_tokens", self.max_new_tokens, min=1)
        require_float(f"{prefix}.temperature", self.temperature, min=0.0)
        if self.top_k is not None:
            require_int(f"{prefix}.top_k", self.top_k, min=0)
        require_float(f"{prefix}.top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{prefix}.top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.eos_id, tuple):
            require_int_list(f"{prefix}.eos_id", self.eos_id, min=0)
            if not self.eos_id:
                raise ValueError(f"{prefix}.eos_id must name at least one id (or be None), got ()")
        elif self.eos_id is not None:
            require_int(f"{prefix}.eos_id", self.eos_id, min=0)


TEXT_DEFAULTS = SampleSettings(temperature=0.8, top_k=None, top_p=1.0)
"""How `fntrain generate` and the samples during training draw text unless told otherwise: softmax
temperature 0.8 over the whole vocabulary (no top-k, no nucleus cut). One default for both, so the same
checkpoint, prompt and seed write the same text through either."""


def eos_ids(settings: SampleSettings) -> frozenset[int]:
    """The ids that end a sequence under `settings` (empty: none does)."""
    if settings.eos_id is None:
        return frozenset()
    return frozenset(settings.eos_id) if isinstance(settings.eos_id, tuple) else frozenset((settings.eos_id,))
