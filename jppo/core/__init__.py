"""Layer 1, the bottom: the batch type, masked reductions, metric pairs, errors, paths. Imports nothing from
jppo outside ``core``."""
