"""Process runtime: device, distributed init/teardown, mesh, parallelize, seeding."""

from fntrain.runtime.parallel import ParallelConfig, parallelize
from fntrain.runtime.runtime import Runtime
from fntrain.runtime.setup import RuntimeConfig, setup_runtime

__all__ = ["Runtime", "RuntimeConfig", "setup_runtime", "ParallelConfig", "parallelize"]
