"""`tether plan` for episodes: a batch takes the engine's time plus one environment wait per turn,
and the keys that say so are the agent family's."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "agent-demo.yaml"


def plan(*overrides):
    out = subprocess.run([sys.executable, "-m", "tether.cli.main", "plan", RECIPE, "train.num_batches=30",
                          *overrides, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return out


def test_turns_and_environment_time_add_one_wait_per_turn_to_a_batch():
    episodes = plan("plan.gen_time=0.1", "plan.turns=3", "plan.env_time=0.5")
    assert episodes.returncode == 0, episodes.stderr
    flat = plan("plan.gen_time=1.6")
    slow = json.loads(episodes.stdout)
    assert slow["batches"] == json.loads(flat.stdout)["batches"]
    assert slow["batches"] != json.loads(plan("plan.gen_time=0.1").stdout)["batches"]


def test_the_episode_keys_are_refused_for_another_family():
    out = subprocess.run([sys.executable, "-m", "tether.cli.main", "plan", ROOT / "recipes" / "demo.yaml",
                          "plan.turns=3"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "plan.turns=3.0 is read only with model.family=agent" in out.stderr
