"""Measure the tensor memory and time of a call: memory is measured, never guessed."""

from memfit.measurement.measure import Measurement, measure

__all__ = ["Measurement", "measure"]
