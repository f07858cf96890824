"""The agent family through ``tether train``: a tiny model built and warm-started on scripted
transcripts, episodes under the staleness budget in every in-flight mode, the schedule ``tether
plan`` predicts, an exact resume, and ``tether eval`` / ``tether report`` on the run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
KEYS = (
    "step",
    "batch_index",
    "async/behavior_version",
    "staleness/updates",
    "reward/mean",
    "loss/policy",
    "agent/turns_mean",
    "agent/model_tokens_mean",
)


def tether(*args, check=True):
    out = subprocess.run(
        [sys.executable, "-m", "tether.cli.main", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent")
    path = tmp / "agent.yaml"
    path.write_text(
        "\n".join(
            [
                "model:",
                "  family: agent",
                f"  path: {tmp / 'model'}",
                "  create_if_missing: true",
                "  init_size: tiny",
                "data:",
                "  task: kv_lookup",
                "  num_train: 300",
                "  num_eval: 16",
                "env:",
                "  max_turns: 3",
                "  max_turn_tokens: 6",
                "  script_quality: 0.5",
                "warmstart:",
                "  max_steps: 30",
                "  eval_every: 30",
                "  target_pass_rate: 1.0",
                "  batch_size: 16",
                "rollout:",
                "  batch_size: 2",
                "  group_size: 4",
                "  max_new_tokens: 6",
                "async:",
                "  max_staleness: 1",
                "  max_inflight: 2",
                "train:",
                "  num_batches: 8",
                "  lr: 1.0e-3",
                "eval:",
                "  interval: 4",
                "checkpoint:",
                "  interval: 4",
            ]
        )
        + "\n"
    )
    return path


@pytest.fixture(scope="module")
def whole(recipe, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "whole"
    out = tether("train", recipe, "--run-dir", run, "--plain")
    assert "held-out episode success" in out.stderr
    return run


def test_agent_episodes_train_follow_the_plan_resume_exactly_and_evaluate(recipe, whole, tmp_path):
    metrics = rows(whole / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9))
    for m in metrics:
        assert m["staleness/updates"] <= 1
        assert m["agent/turns_mean"] >= 1 and m["agent/env_tokens_mean"] > 0
        assert m["agent/timeouts"] == 0 and m["agent/env_errors"] == 0
    evals = rows(whole / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 4, 8] and "eval/return_mean" in evals[-1]

    commits = ",".join(str(int(m["async/optimizer_updates"])) for m in metrics)
    plan = json.loads(tether("plan", recipe, f"plan.commits=[{commits}]", "--json").stdout)
    assert [m["staleness/updates"] for m in metrics] == [b["staleness_updates"] for b in plan["batches"]]

    # episodes.jsonl: every episode of every batch, its transcript, per-step rewards and return
    episodes = rows(whole / "episodes.jsonl")
    assert [(e["step"], e["group"], e["episode"]) for e in episodes] == [
        (step, b, g) for step in range(1, 9) for b in range(2) for g in range(4)]
    for e in episodes:
        assert e["status"] in ("done", "max_turns") and e["error"] == "" and e["rewrites"] == 0
        assert e["return"] == pytest.approx(sum(e["step_rewards"])) and len(e["step_rewards"]) == e["turns"]
        assert len(e["transcript"]) == 2 * e["turns"] + 1 and e["transcript"][0].startswith("key ")
        assert e["model_tokens"] > 0 and e["versions"][1] <= e["step"] - 1
    by_step = {m["step"]: m for m in metrics}
    for step in range(1, 9):
        returns = [e["return"] for e in episodes if e["step"] == step]
        assert sum(returns) / len(returns) == pytest.approx(by_step[step]["reward/mean"])

    parts = tmp_path / "parts"
    tether("train", recipe, "train.num_batches=4", "--run-dir", parts, "--plain", "--no-report")
    with (parts / "episodes.jsonl").open("a") as f:  # as if a crash had come after a fifth batch
        f.write(json.dumps({**episodes[-1], "step": 5}) + "\n")
    tether("train", "--resume", parts, "train.num_batches=8", "--plain", "--no-report")
    assert [{k: m[k] for k in KEYS} for m in rows(parts / "metrics.jsonl")] == [
        {k: m[k] for k in KEYS} for m in metrics
    ]
    assert rows(parts / "episodes.jsonl") == episodes  # trimmed to the checkpoint, then the same

    scored = json.loads(tether("eval", whole, "--json").stdout)
    assert scored["eval/pass_at_1"] == evals[-1]["eval/pass_at_1"]
    assert (whole / "plots" / "episodes.png").is_file() and (whole / "plots" / "reward.png").is_file()


@pytest.mark.parametrize("mode", ["keep", "recompute", "abort"])
def test_in_flight_updates_keep_every_episode_within_the_budget(recipe, tmp_path, mode):
    run = tmp_path / mode
    tether(
        "train",
        recipe,
        f"async.inflight_update={mode}",
        "async.max_staleness=2",
        "async.max_inflight=3",
        "train.num_batches=6",
        "eval.interval=0",
        "checkpoint.interval=0",
        "--run-dir",
        run,
        "--plain",
        "--no-report",
    )
    metrics = rows(run / "metrics.jsonl")
    assert len(metrics) == 6
    assert all(m["staleness/updates"] <= 2 for m in metrics)
    assert all("rollout/weight_switches" in m for m in metrics)
    if mode == "keep":
        assert "staleness/multi_version_seq_frac" in metrics[0]


def short_run(recipe, run, *overrides):
    """Four batches of the recipe with ``overrides``, no evaluation, checkpoint or report."""
    tether("train", recipe, *overrides, "train.num_batches=4", "eval.interval=0", "checkpoint.interval=0",
           "--run-dir", run, "--plain", "--no-report")
    return rows(run / "metrics.jsonl")


def test_on_ray_with_the_learner_in_an_actor_the_same_episodes_train_the_same(recipe, whole, tmp_path):
    ray = short_run(recipe, tmp_path / "ray", "rollout.backend=ray", "ray.local_cpus=2", "ray.learner=actor")
    local = rows(whole / "metrics.jsonl")[:4]
    assert [{k: m[k] for k in KEYS} for m in ray] == [{k: m[k] for k in KEYS} for m in local]


def test_two_learner_ranks_train_episodes_as_one_does(recipe, whole, tmp_path):
    one, two = rows(whole / "metrics.jsonl")[:4], short_run(recipe, tmp_path / "ranks", "train.world_size=2")
    trained = [(a, b) for a, b in zip(one, two, strict=True) if a["loss/policy"] is not None]
    assert trained  # some batch had something to learn from
    for a, b in zip(one, two, strict=True):
        for key in ("reward/mean", "agent/model_tokens_mean"):
            assert a[key] == b[key]
    for a, b in trained:
        assert b["loss/policy"] == pytest.approx(a["loss/policy"], rel=1e-5, abs=1e-7)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)


def test_episodes_train_lora_adapters_with_the_engine_at_the_learners_adapters(recipe, tmp_path):
    """LoRA through the agent family: the engine merges each published version of the adapters
    and the model's turns score as the learner scores them; only the adapters are checkpointed."""
    from safetensors.torch import load_file

    run = tmp_path / "lora"
    tether("train", recipe, "train.lora_rank=4", "train.lora_alpha=8", "train.lr=3e-3", "train.num_batches=4",
           "eval.interval=0", "checkpoint.interval=4", "--run-dir", run, "--plain", "--no-report")
    metrics = rows(run / "metrics.jsonl")
    fresh = [m for m in metrics if (m["mismatch/numeric_token_frac"] or 0) > 0]
    assert fresh and all(m["mismatch/numeric_logprob_abs_diff_max"] < 1e-4 for m in fresh)
    folder = run / "checkpoints" / "step-000004" / "learner" / "model"
    adapters = load_file(str(folder / "adapter.safetensors"))
    assert adapters and all(".lora_" in n for n in adapters)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_draining_at_turn_boundaries_publishes_between_turns_within_the_budget(recipe, tmp_path, backend):
    """drain with env.switch_at=turn against a slow tool: publications land between turns of
    episodes still going (episodes span versions, each turn on one), wait only for the turns in
    flight, and every batch stays within the budget; on Ray actors too."""
    envs = Path(__file__).with_name("envs.py")
    slow = Path(__file__).with_name("slow_learner.py")
    ray = ["rollout.backend=ray", "ray.local_cpus=2"] if backend == "ray" else []
    run = tmp_path / backend
    # batches run one after another on the one worker, so the update of batch k is published while
    # batch k + 1 is played: mid-episode only if it lands after that batch's first turn is sampled
    # and before its last. An update of this model takes about 0.05 s, less than a loaded machine
    # may take to start the next batch on a Ray actor (then every switch came before a first turn),
    # so the learner takes 0.6 s (slow_grpo), as a real one takes its time, and a tool's 1 s steps
    # leave the publication about 1.4 s more before the batch's last turn
    tether("train", recipe, "async.inflight_update=drain", "env.switch_at=turn",
           f"env.env_class={envs}:SlowEcho", "env.kwargs={step_s: 1.0}", "async.max_staleness=1",
           "async.max_inflight=2", "train.num_batches=8", "eval.interval=0", "checkpoint.interval=0",
           f"run.plugins=[{slow}]", "train.advantage=slow_grpo",
           *ray, "--run-dir", run, "--plain", "--no-report")
    metrics = rows(run / "metrics.jsonl")
    assert len(metrics) == 8 and all(m["staleness/updates"] <= 1 for m in metrics)
    assert all(m["rollout/weight_switches"] == m["rollout/turn_boundary_switches"] for m in metrics)
    assert sum(m["rollout/turn_boundary_switches"] for m in metrics) > 0
    timeline = [{k: round(m[k], 3) for k in ("time/generate", "time/train", "rollout/turn_boundary_switches",
                                             "staleness/multi_version_seq_frac") if k in m} for m in metrics]
    assert any(m["staleness/multi_version_seq_frac"] > 0 for m in metrics), timeline
    waits = [m["sync/turn_wait_s"] for m in metrics if "sync/turn_wait_s" in m]
    assert waits and max(waits) < 0.9  # a turn and a poll, never a tool's 1 s step or a 3 s episode
