"""Process runtime: device, distributed init/teardown, mesh, parallelize, seeding."""

from fntrain.runtime.runtime import Runtime

__all__ = ["Runtime"]
