"""`EvaluateConfig`: when and how much the evaluation hook (`fntrain.hooks.evaluate`) evaluates."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fntrain.config import require_bool, require_int

__all__ = ["EvaluateConfig"]


@dataclass(frozen=True)
class EvaluateConfig:
    """When and how much to evaluate on the validation split."""

    eval_every: int = 0
    """Evaluate every N optimizer steps (0: not by steps)."""
    eval_epochs: int = 0
    """Evaluate after every N-th epoch (0: not by epochs)."""
    at_end: bool = False
    """Also evaluate after the run's last step."""
    max_batches: int = 0
    """Micro-batches per rank and evaluation (0: the whole validation split)."""
    micro_batch_size: int = 0
    """Sequences per evaluation forward (0: the training micro-batch size)."""
    with_validation: bool = False
    """With a validation split and eval_every, eval_epochs and at_end all off: evaluate at the end and every tenth of the run (`resolved`); set those to choose, or this false to never evaluate."""

    def validate(self, prefix: str = "evaluate") -> None:
        require_int(f"{prefix}.eval_every", self.eval_every, min=0)
        require_int(f"{prefix}.eval_epochs", self.eval_epochs, min=0)
        require_bool(f"{prefix}.at_end", self.at_end)
        require_int(f"{prefix}.max_batches", self.max_batches, min=0)
        require_int(f"{prefix}.micro_batch_size", self.micro_batch_size, min=0)
        require_bool(f"{prefix}.with_validation", self.with_validation)

    @property
    def enabled(self) -> bool:
        """A cadence is set (with_validation alone does not count: it applies only to a validation split)."""
        return bool(self.eval_every or self.eval_epochs or self.at_end)

    def resolved(self, has_validation: bool, train_iters: int) -> EvaluateConfig:
        """The cadence a run uses: this one, or with `with_validation`, a validation split and no cadence
        set, every max(1, train_iters // 10) steps and at the end [issue 27]."""
        if self.enabled or not (self.with_validation and has_validation):
            return self
        return dataclasses.replace(self, eval_every=max(1, train_iters // 10), at_end=True)

    def describe(self) -> str:
        """When evaluation runs, in words (for the log line at the start of a run)."""
        when = [f"every {self.eval_every} steps"] if self.eval_every else []
        when += [f"every {self.eval_epochs} epochs"] if self.eval_epochs else []
        when += ["at the end"] if self.at_end else []
        return " and ".join(when) or "never"
