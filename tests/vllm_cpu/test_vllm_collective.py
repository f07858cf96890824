"""vLLM takes weights through the collective channel (rollout.weight_sync=collective): the rollout
worker that holds vLLM's engine core receives each broadcast version, verifies it, and loads it
through vLLM's worker extension; the run trains batch for batch as through shared memory."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))

from runs import rows

from tether.config import load_config
from tether.runtime.run import train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "demo.yaml"
REWARD = ROOT / "tests" / "integration" / "varied_reward.py"  # varies within groups: every batch trains
KEYS = ("step", "batch_index", "async/behavior_version", "async/train_version", "staleness/updates",
        "reward/mean", "loss/policy")


def test_vllm_trains_batch_for_batch_through_the_collective_group_as_through_shared_memory(demo_model,
                                                                                           tmp_path):
    out = {}
    for sync in ("shm", "collective"):
        cfg = load_config(DEMO, [f"model.path={demo_model}", f"reward.function={REWARD}:reward",
                                 "rollout.engine=vllm", "train.num_batches=4", "data.num_eval=8",
                                 "eval.interval=0", "checkpoint.interval=0", f"rollout.weight_sync={sync}",
                                 "rollout.on_worker_loss=stop"])
        train(cfg, tmp_path / sync, progress_plain=True)
        out[sync] = rows(tmp_path / sync / "metrics.jsonl")
    shm, collective = ([{k: m[k] for k in KEYS} for m in out[s]] for s in ("shm", "collective"))
    assert shm == collective
    published = [m for m in out["collective"] if "sync/bytes" in m]
    assert published and all(m["sync/buckets"] >= 1 for m in published)
