"""memfit: train PyTorch models and batches that do not fit in memory.

Layers, one folder each: ``capture`` (Dynamo/AOTAutograd, marks, graph breaks) → ``analysis``
(sizes, FLOPs, memory simulation) → ``planning`` (what to keep) → ``execution`` (partitioned
graphs, the wrapper module) → ``measurement`` (exact peak memory and time).
"""

from memfit.capture.mark import mark
from memfit.execution.module import CheckpointedModule, checkpoint, plan
from memfit.measurement import Measurement, measure
from memfit.planning.budget import Budget, BudgetError, parse_budget
from memfit.planning.plan import GraphPlan, ParetoPoint, Plan

__all__ = [
    "checkpoint",
    "plan",
    "BudgetError",
    "Budget",
    "parse_budget",
    "ParetoPoint",
    "mark",
    "measure",
    "Measurement",
    "CheckpointedModule",
    "Plan",
    "GraphPlan",
]
__version__ = "0.1.0"
