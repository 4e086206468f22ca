"""A training run: its state, models and inputs, the collect and learn phases, checkpoints."""
