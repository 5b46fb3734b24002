"""Execution: apply a plan (partitioned graphs, the torch.compile backend, the wrapper)."""
