"""Client execution: the generic worker, the operation registries, the common training operations."""
