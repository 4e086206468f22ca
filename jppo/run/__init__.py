"""The training run, RL and SFT, on one lifecycle: its state, models and inputs, the collect and learn phases,
checkpoints."""
