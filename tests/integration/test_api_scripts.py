"""docs/api.md's examples, run as the scripts they are (examples/api/*.py: no `__main__` guard, a
run directory given as a string), and a script that registers its own reward and names itself in
run.plugins, on Ray: what a script hands to ``tether.train`` reaches every worker process."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
SHORT = ["train.num_batches=2", "eval.interval=0", "checkpoint.interval=0"]


def run_script(script, cwd, *overrides):
    out = subprocess.run([sys.executable, str(script), *overrides], cwd=cwd, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def recorded(run_dir):
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


def trained(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("example", "run_name", "key", "value"), [
    ("reward_function.py", "api-reward", ("reward", "function"), "reward_function.py:partial_credit"),
    ("environment.py", "api-environment", ("env", "env_class"), "environment.py:Echo"),
    ("loss.py", "api-loss", ("train", "loss"), "clipped_reinforce"),
])
def test_the_api_examples_train(tiny_model_dir, tmp_path, example, run_name, key, value):
    script = ROOT / "examples" / "api" / example
    saves = ["checkpoint.interval=2"] if example == "loss.py" else []  # resumed below
    out = run_script(script, tmp_path, f"model.path={tiny_model_dir}", *SHORT, *saves)
    run_dir = tmp_path / "runs" / run_name  # run_dir="runs/..." (a str), relative to where it ran
    assert "trained 2 batches" in out.stdout and len(trained(run_dir)) == 2
    section, name = key
    assert recorded(run_dir)[section][name].endswith(value)
    if example == "loss.py":  # the script registered its loss: the run's plug-ins name the script,
        assert recorded(run_dir)["run"]["plugins"] == [str(script)]
        # so `tether train --resume` finds it (importing the script ends at its tether.train call)
        resumed = subprocess.run([sys.executable, "-m", "tether.cli.main", "train", "--resume", str(run_dir),
                                  "train.num_batches=3", "--plain", "--no-report"], cwd=tmp_path,
                                 capture_output=True, text=True, timeout=240)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert len(trained(run_dir)) == 3


SELF_NAMED = textwrap.dedent("""
    import sys

    import tether

    @tether.register_reward("length_score")
    def length_score(prompt, completion, answer, fields):
        return len(completion.strip()) / 10

    recipe = {"run": {"plugins": [__file__]}, "data": {"task": "reverse"},
              "reward": {"function": "length_score"},
              "rollout": {"batch_size": 2, "group_size": 2, "max_new_tokens": 4, "backend": "ray"}}
    summary = tether.train(recipe, sys.argv[1:], run_dir=sys.argv[0] + ".run")
    print("trained", summary["trained_batches"])
""")


@pytest.mark.timeout(400)
def test_a_script_that_registers_its_reward_and_names_itself_trains_on_ray(tiny_model_dir, tmp_path):
    pytest.importorskip("ray")
    script = tmp_path / "self_named.py"
    script.write_text(SELF_NAMED)
    out = run_script(script, tmp_path, f"model.path={tiny_model_dir}", *SHORT)
    assert "trained 2" in out.stdout
    run_dir = Path(f"{script}.run")
    assert len(trained(run_dir)) == 2
    assert recorded(run_dir)["run"]["plugins"] == [str(script)]
