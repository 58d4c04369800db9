"""fntrain: a functional, stateless training-step library.

Setup is pure builders returning frozen dataclasses; the loop is `train(state, step_fn, hooks, ...)`,
threading an explicit `TrainState` through a step function and hook functions.

`import fntrain` stays light: it imports neither torch, tyro, tqdm nor matplotlib.
"""

from fntrain.loop import Event, Hook, StepInfo, StopTraining, train
from fntrain.state import RunPlan, TrainState, make_run_plan

__version__ = "0.1.0"

__all__ = ["TrainState", "RunPlan", "make_run_plan", "train", "Event", "Hook", "StepInfo", "StopTraining"]
