"""Execution: apply a plan (partitioned graphs, the torch.compile backend, the model's forward)."""
