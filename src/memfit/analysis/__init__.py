"""Analysis: facts about a joint graph (sizes, storages, FLOPs) and memory simulation."""
