"""memfit.pipeline: GPipe-style pipelines, stages balanced for time and memory.

``balance`` (pure: contiguous stage sizes from per-layer costs, exact, with an optional
per-stage memory capacity) is the core the planner and the runtime build on;
``balance_pipeline`` minimises the predicted GPipe step time with transfer costs at the cuts.
"""

from memfit.pipeline.balancing import balance as balance
from memfit.pipeline.balancing import balance_pipeline as balance_pipeline
from memfit.pipeline.balancing import pipeline_step_time as pipeline_step_time
from memfit.pipeline.balancing import stage_sums as stage_sums

__all__ = ["balance", "balance_pipeline", "pipeline_step_time", "stage_sums"]
