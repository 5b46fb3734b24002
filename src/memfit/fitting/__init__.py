"""Planning for hardware that is not here: will a training step fit on a device, and how far.

``memfit.fit(model, *inputs, device="h100-80gb", policies=..., optimizer="adamw")`` plans the
step's activations under each policy (``memfit.plan``; on a model built under
``torch.device("meta")``, for the device's type without allocating), adds what the step holds
besides them (``memfit.analysis.step_memory``: weights, gradients, optimizer state and step
temporaries), compares the whole peak with the device's memory (``memfit.Device``), searches
the largest batch and sequence length that fit in a few plans (``size_search``), and estimates the
step's time from the device's FLOP/s and bandwidth (``step_time``). ``memfit fit`` is its
command line.

Modules: ``step_plan`` (the one call of ``memfit.plan``, and inputs at another size),
``size_search`` (the largest size that fits, pure), ``step_time`` (the roofline estimate),
``device_fit`` (``fit``: the whole step's peak on a named device, the rows of policies and
batches, the report).
"""

from memfit.fitting.device_fit import DEFAULT_POLICIES, FitReport, FitRow, StepPeak, fit
from memfit.fitting.size_search import SizeSearch, largest_fitting
from memfit.fitting.step_plan import plan_step

__all__ = [
    "fit",
    "FitReport",
    "FitRow",
    "StepPeak",
    "DEFAULT_POLICIES",
    "SizeSearch",
    "largest_fitting",
    "plan_step",
]
