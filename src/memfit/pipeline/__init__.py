"""memfit.pipeline: GPipe-style pipelines, stages balanced for time and memory.

``balance``, ``balance_pipeline`` and ``balance_intervals`` are the pure, exact stage searches;
``launch`` runs a function in K local processes and ends them all, naming the rank, when one
fails.
"""

from memfit.pipeline.balancing import balance as balance
from memfit.pipeline.balancing import balance_pipeline as balance_pipeline
from memfit.pipeline.balancing import pipeline_step_time as pipeline_step_time
from memfit.pipeline.balancing import stage_sums as stage_sums
from memfit.pipeline.intervals import CapacityError as CapacityError
from memfit.pipeline.intervals import balance_intervals as balance_intervals
from memfit.pipeline.launch import RankError as RankError
from memfit.pipeline.launch import launch as launch

__all__ = [
    "CapacityError",
    "RankError",
    "balance",
    "balance_intervals",
    "balance_pipeline",
    "launch",
    "pipeline_step_time",
    "stage_sums",
]
