"""fntrain: a functional, stateless training-step library.

Setup is pure builders returning frozen dataclasses; the loop is `train(state, step_fn, hooks, ...)`,
threading an explicit `TrainState` through a step function and hook functions.

`import fntrain` stays light: it imports neither torch, tyro, tqdm nor matplotlib.
"""

import os

# OpenMP threads that spin while they wait turn a CPU shared with one other busy process into a ~10x
# slower step; waiting passively keeps it within ~2x and costs nothing measurable on free cores
# (bench/RESULTS.md, "Contention"). libgomp reads this once, when torch loads it, so it is set here,
# before fntrain imports torch; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fntrain.loop import Event, Hook, StepInfo, StopTraining, train  # noqa: E402
from fntrain.state import RunPlan, TrainState, make_run_plan  # noqa: E402

__version__ = "0.1.0"

__all__ = ["TrainState", "RunPlan", "make_run_plan", "train", "Event", "Hook", "StepInfo", "StopTraining"]
