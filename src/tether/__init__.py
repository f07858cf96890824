"""Tether: asynchronous RL post-training with a staleness budget stated in rollout batches."""

__version__ = "0.1.0"

__all__ = ["__version__"]
