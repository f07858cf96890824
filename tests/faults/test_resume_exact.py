"""Resume is exact after a stop at any step, not only at checkpoints: a short run stopped after
every one of its steps and resumed trains the same batches at the same versions, publishes after
the same steps, logs the same losses and ends with the same weights as the uninterrupted run."""

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runs import recipe, rows, stop_after
from safetensors.torch import load_file

from tether.config import load_config
from tether.errors import StopRequested
from tether.runtime.run import train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOTAL = 5
KEYS = ("step", "batch_index", "async/behavior_version", "async/train_version", "async/rollout_version",
        "staleness/updates", "reward/mean", "loss/policy", "ratio/mean", "response/length_mean",
        "rollout/prompts_drawn")


SPARSE = Path(__file__).parents[1] / "integration" / "sparse_reward.py"
DYNAMIC = ("rollout.dynamic_sampling=true", "rollout.dynamic_sampling_on_short=partial",
           f"reward.function={SPARSE}:reward")


def config(model_dir, s, u, extra=()):
    return load_config(None, recipe(model_dir, f"train.num_batches={TOTAL}", f"checkpoint.interval={TOTAL}",
                                    f"async.max_staleness={s}", f"async.max_inflight={s + 1}",
                                    f"train.updates_per_batch={u}", *extra))


def stopped_after(k, cfg, run_dir, monkeypatch):
    """Run ``cfg`` into ``run_dir`` and stop it (as Ctrl-C does) after its step ``k``."""
    with monkeypatch.context() as m:
        stop_after(m, k)
        with pytest.raises(StopRequested):
            train(cfg, run_dir, progress_plain=True)


def trace(run_dir):
    metrics = [{k: m.get(k) for k in KEYS} for m in rows(run_dir / "metrics.jsonl")]
    syncs = [e["step"] for e in rows(run_dir / "events.jsonl") if e["kind"] == "sync" and e["published"]]
    weights = load_file(str(run_dir / "checkpoints" / f"step-{TOTAL:06d}" / "learner" / "model" /
                            "model.safetensors"))
    return metrics, syncs, weights, rows(run_dir / "samples.jsonl")


# S = 2 with U = 2 holds both: a budget that lets a batch wait and several updates a batch (each
# alone added half a minute to the suite and nothing S2-U2 does not reach)
@pytest.mark.parametrize(("s", "u", "extra"), [(1, 1, ()), (2, 2, ()), (1, 1, DYNAMIC)],
                         ids=["S1-U1", "S2-U2", "S1-U1-dynamic-sampling"])
def test_a_run_stopped_after_any_step_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch, s, u, extra):
    """With dynamic sampling too: a batch's extra prompts are its own, so they are the same."""
    train(config(tiny_model_dir, s, u, extra), tmp_path / "whole", progress_plain=True)
    whole_metrics, whole_syncs, whole_weights, whole_samples = trace(tmp_path / "whole")
    assert len(whole_metrics) == TOTAL and max(m["staleness/updates"] for m in whole_metrics) == s * u
    # samples.jsonl: every sample of every trained batch, its reward the batch's metrics averaged
    assert [x["step"] for x in whole_samples] == [m["step"] for m in whole_metrics for _ in range(2 * 2)]
    for m in whole_metrics:
        rewards = [x["reward"] for x in whole_samples if x["step"] == m["step"]]
        assert sum(rewards) / len(rewards) == pytest.approx(m["reward/mean"])
    if extra:  # batches really drew beyond their own prompts
        assert max(m["rollout/prompts_drawn"] for m in whole_metrics) > 2
    lagging_stops = 0
    for k in range(1, TOTAL):
        run_dir = tmp_path / f"stop-{k}"
        stopped_after(k, config(tiny_model_dir, s, u, extra), run_dir, monkeypatch)
        state = json.loads((run_dir / "checkpoints" / f"step-{k:06d}" / "state.json").read_text())
        lagging_stops += state["rollout_version"] != state["train_version"]
        train(load_config(run_dir / "config.yaml"), run_dir, resume=True, progress_plain=True)
        metrics, syncs, weights, samples = trace(run_dir)
        assert metrics == whole_metrics, f"stopped after step {k}"
        assert samples == whole_samples, f"stopped after step {k}"  # trimmed to the stop, then the same
        assert syncs == whole_syncs, f"stopped after step {k}"
        assert weights.keys() == whole_weights.keys()
        for name, tensor in weights.items():
            assert tensor.equal(whole_weights[name]), f"stopped after step {k}: {name} differs"
    assert lagging_stops > 0  # some stops fell between two publications: the case that used to diverge


def test_without_draining_a_batch_abandoned_in_flight_is_generated_again_never_staler(
        tiny_model_dir, tmp_path, monkeypatch):
    """``async.inflight_update=keep``: a publication does not wait for the batch in flight, so at a
    stop that batch may have been launched under an older version than the engines hold. A resume
    generates it again under the engines' version (docs/guide.md): never older than its first
    launch, every batch trained once, the budget held."""
    s, extra = 1, ("async.inflight_update=keep",)
    regenerated = 0
    for k in range(1, TOTAL):
        run_dir = tmp_path / f"stop-{k}"
        stopped_after(k, config(tiny_model_dir, s, 1, extra), run_dir, monkeypatch)
        events = rows(run_dir / "events.jsonl")
        first_launch = {}
        for e in events:
            if e["kind"] == "launch":
                first_launch.setdefault(e["batch"], e["version"])
        (abandon,) = [e for e in events if e["kind"] == "abandon"]
        train(load_config(run_dir / "config.yaml"), run_dir, resume=True, progress_plain=True)
        metrics = rows(run_dir / "metrics.jsonl")
        assert sorted(m["batch_index"] for m in metrics) == list(range(TOTAL)), f"stopped after step {k}"
        assert max(m["staleness/batches"] for m in metrics) <= s, f"stopped after step {k}"
        trained_at = {m["batch_index"]: m["async/behavior_version"] for m in metrics}
        for batch in abandon["batches"]:
            assert trained_at[batch] >= first_launch[batch], f"stopped after step {k}: batch {batch}"
            regenerated += trained_at[batch] > first_launch[batch]
    assert regenerated > 0  # some abandoned batch was launched before a publication it missed
