"""Planning: which forward values to keep for backward; the plan as plain data."""
