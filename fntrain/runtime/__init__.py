"""Process runtime: device, distributed init/teardown, mesh, parallelize (data, tensor, pipeline), seeding."""

from fntrain.runtime.groups import pipeline_group
from fntrain.runtime.materialize import build_seeded_model
from fntrain.runtime.parallel import ParallelConfig, parallelize
from fntrain.runtime.pipeline import PipelineSplit
from fntrain.runtime.runtime import Runtime
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from fntrain.runtime.tensor_parallel import tensor_parallel_plan

__all__ = [
    "Runtime", "RuntimeConfig", "setup_runtime", "ParallelConfig", "parallelize", "build_seeded_model",
    "pipeline_group", "PipelineSplit", "tensor_parallel_plan",
]  # fmt: skip
