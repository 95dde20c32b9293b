"""Every touch of Flower's engine beyond its public API: the in-process grid, the simulation's message sweep,
waiting for nodes, describing node data, fault injection."""
