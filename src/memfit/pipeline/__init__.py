"""memfit.pipeline: pipelines under every torch schedule, stages balanced for time and memory.

``plan(model, example_inputs, ranks=K, options=PipelineOptions(...))`` cuts a model's captured
forward into stages over K ranks (exact search for the predicted step, every rank within the
per-device budget, its stages planned together by memfit's planner; ``schedule="auto"``
compares every schedule, stages per rank and micro-batch count); ``Pipeline`` takes the same
arguments and runs this rank's stages with ``torch.distributed.pipelining``; ``launch`` runs a
function in K local processes and ends them all, naming the rank, when one fails;
``PipelineOptions`` holds every knob of both, each documented where it is declared;
``PipelineSchedule`` names the schedules, as torch names them (``"gpipe"``, ``"1f1b"``,
and, with several stages per rank, ``"interleaved_1f1b"``, ``"looped_bfs"``,
``"interleaved_zero_bubble"``, ``"zbv_zero_bubble"``, ``"dualpipev"``). ``balance_intervals``
is the pure search the planner cuts with; ``balance_pipeline``, the same for additive costs.
"""

from memfit.pipeline.balancing import balance_pipeline as balance_pipeline
from memfit.pipeline.balancing import pipeline_step_time as pipeline_step_time
from memfit.pipeline.intervals import CapacityError as CapacityError
from memfit.pipeline.intervals import balance_intervals as balance_intervals
from memfit.pipeline.launch import RankError as RankError
from memfit.pipeline.launch import launch as launch
from memfit.pipeline.pipeline_options import PipelineOptions as PipelineOptions
from memfit.pipeline.plan_pipeline import plan as plan
from memfit.pipeline.runtime import Pipeline as Pipeline
from memfit.pipeline.schedule import PipelineSchedule as PipelineSchedule
from memfit.pipeline.stages import PipelinePlan as PipelinePlan
from memfit.pipeline.stages import StagePlan as StagePlan

__all__ = [
    "CapacityError",
    "Pipeline",
    "PipelineOptions",
    "PipelinePlan",
    "PipelineSchedule",
    "RankError",
    "StagePlan",
    "balance_intervals",
    "balance_pipeline",
    "launch",
    "pipeline_step_time",
    "plan",
]
