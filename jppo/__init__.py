"""jppo: PPO-family RL fine-tuning of language models in JAX/Flax whose gradients do not depend on batch cuts."""

__version__ = "0.1.0"
