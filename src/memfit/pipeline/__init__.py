"""memfit.pipeline: GPipe-style pipelines, stages balanced for time and memory.

``balance`` (pure: contiguous stage sizes from per-layer costs) is the core the planner and the
runtime build on.
"""

__all__: list[str] = []
