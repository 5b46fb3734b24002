"""Former home of the op-scratch measurement, now :mod:`memfit.analysis.op_scratch`.

Kept only so that ``benchmarks/planning_time.py`` (outside this change) still imports; delete it
once that script imports ``measure_op_scratch`` from ``memfit.analysis.op_scratch``.
"""

from memfit.analysis.op_scratch import measure_op_scratch as measure_workspace

__all__ = ["measure_workspace"]
