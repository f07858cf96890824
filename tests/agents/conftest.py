"""Fixtures of the agent tests: a model that sometimes plays kv_lookup right, built once."""

import pytest
from cli_run import tether


@pytest.fixture(scope="session")
def kv_lookup_model(tiny_model_dir, tmp_path_factory):
    """The tiny model warm-started briefly on kv_lookup's scripts (half of them call the tool), so
    it sometimes answers right: something for RL to learn from."""
    model = tmp_path_factory.mktemp("kv_lookup") / "model"
    tether("warmstart", "model.family=agent", "data.task=kv_lookup", "data.num_train=300", "data.num_eval=16",
           "env.script_quality=0.5", "warmstart.max_steps=30", "warmstart.eval_every=30",
           "warmstart.batch_size=16", "warmstart.target_pass_rate=1", "--model", tiny_model_dir,
           "--out", model)
    return model
