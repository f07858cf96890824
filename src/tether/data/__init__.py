"""Tasks, datasets, rewards, tiny models and warm start."""
