"""memfit: train PyTorch models and batches that do not fit in memory.

Layers, one folder each: ``capture`` (Dynamo/AOTAutograd, marks, graph breaks, the rewrites that
precede planning) → ``analysis`` (sizes, FLOPs, op scratch, memory simulation) → ``planning`` (a
``Decision`` per forward value; the plan as plain data) → ``execution`` (graphs built from the
plan, memfit applied to a model in place) → ``measurement`` (exact peak memory and time).
Private torch APIs are reached only through ``memfit._compat``.
"""

from memfit import nn
from memfit.analysis.devices import Device
from memfit.analysis.step_memory import StepMemory, step_memory
from memfit.capture.mark import mark
from memfit.execution.largest_batch import BatchProbe, LargestBatch, largest_batch
from memfit.execution.module import CheckpointedModule, Checkpointing, checkpoint, plan, remove
from memfit.execution.offload import OffloadError
from memfit.execution.options import Attention, Executor, LossHead, OffloadTarget, Options
from memfit.execution.step import Step, step
from memfit.fitting import FitReport, fit
from memfit.measurement import Measurement, measure
from memfit.planning.budget import Budget, BudgetError, parse_budget
from memfit.planning.decision import Decision
from memfit.planning.plan import FrontierPoint, GraphPlan, Plan, RegionPlan
from memfit.planning.policy import Policy, parse_policy

__all__ = [
    "Options",
    "Executor",
    "Attention",
    "LossHead",
    "OffloadTarget",
    "OffloadError",
    "checkpoint",
    "remove",
    "step",
    "Step",
    "plan",
    "largest_batch",
    "LargestBatch",
    "BatchProbe",
    "nn",
    "BudgetError",
    "Budget",
    "parse_budget",
    "Policy",
    "parse_policy",
    "Decision",
    "FrontierPoint",
    "mark",
    "measure",
    "Measurement",
    "CheckpointedModule",
    "Checkpointing",
    "Plan",
    "GraphPlan",
    "RegionPlan",
    "Device",
    "fit",
    "FitReport",
    "StepMemory",
    "step_memory",
]
#: The release this tree is (CHANGELOG.md's latest); pyproject.toml reads it from here.
__version__ = "0.2.0"

# attn_implementation="memfit" whatever the import order; see memfit.nn.huggingface
nn.huggingface.register_when_imported()
