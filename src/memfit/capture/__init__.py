"""Capture: get graphs out of a model (Dynamo + AOTAutograd), marks, graph-break reports."""
