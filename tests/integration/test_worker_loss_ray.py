"""Losing a rollout actor (`rollout.on_worker_loss` with rollout.backend=ray): an actor killed with
`ray.kill`, its process SIGKILLed in a whole run, and its node removed from a Ray cluster of three
nodes; each time it is held inside its reward (a gate file), so it dies while generating a batch."""

import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
ray = pytest.importorskip("ray")

from test_train import rows  # noqa: E402
from test_worker_loss import (  # noqa: E402
    SAMPLES_PER_BATCH,
    Gate,
    assert_staleness_follows_the_launches,
    kill_twice_past_the_cap,
    resume_three_more,
    start,
    wait_rows,
)

from configs import pool_settings  # noqa: E402
from procs import wait_gone  # noqa: E402
from tether.data.stream import PromptStream  # noqa: E402
from tether.data.tasks import get_task  # noqa: E402
from tether.modeling import load_causal_lm, unique_parameters  # noqa: E402
from tether.rollout.backends.ray.cluster import RayOptions  # noqa: E402
from tether.rollout.backends.ray.pool import RayPool  # noqa: E402
from tether.vocabulary import GenerationRequest  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
STREAM = PromptStream(get_task("arithmetic").examples("train", 300, seed=0), batch_size=2)
RAY = ("rollout.backend=ray", "ray.local_cpus=2")


def settings(model_dir, gate):
    return pool_settings(model_dir, "rollout.group_size=2", "rollout.max_new_tokens=4",
                         f"reward.function={gate.reward}:reward", startup_timeout_s=120)


def hold(gate, timeout=60):
    """Close the gate and wait until an actor is held inside its reward; its pid."""
    gate.close()
    deadline = time.monotonic() + timeout
    while not gate.held.exists():
        assert time.monotonic() < deadline, "no actor reached the reward"
        time.sleep(0.05)
    return int(gate.held.read_text())


def until_lost(pool, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert pool.wait(timeout) == []  # the held batch never completes
        losses = pool.lost()
        if losses:
            return losses
    raise AssertionError("no loss reported")


def regenerate(pool, loss, version):
    """Launch the lost batch again, as the driver does, and collect it."""
    assert pool.inflight == 0
    pool.launch(GenerationRequest(index=loss.batch_index, version=version))
    (batch,) = pool.wait(120)
    assert batch.index == loss.batch_index and batch.behavior_version == version
    return batch


@pytest.mark.timeout(240)
def test_an_actor_killed_with_ray_kill_is_replaced_holding_the_published_version(tiny_model_dir, tmp_path):
    gate = Gate(tmp_path)
    model, _ = load_causal_lm(tiny_model_dir)
    weights = unique_parameters(model)
    with RayPool(settings(tiny_model_dir, gate), STREAM.batch, weights, options=RayOptions(local_cpus=2),
                 run_dir=tmp_path / "run") as pool:
        pool.publish(weights, 1)
        (old,) = pool.pids
        pool.launch(GenerationRequest(index=4, version=1))
        assert hold(gate) == old
        (name,) = [n for n in ray.util.list_named_actors() if n.startswith("tether-rollout-0-")]
        ray.kill(ray.get_actor(name), no_restart=True)
        gate.gate.unlink()
        (loss,) = until_lost(pool)
        assert (loss.worker, loss.batch_index, loss.restarts) == ("rollout-0", 4, 1)
        assert "died while generating batch 4" in loss.cause and pool.restarts == 1
        (new,) = pool.pids
        assert new != old
        regenerate(pool, loss, 1)  # the replacement loaded version 1, the one published
        pool.publish(weights, 2)  # and takes the next publication like any actor
        pool.launch(GenerationRequest(index=5, version=2))
        (batch,) = pool.wait(120)
        assert batch.behavior_version == 2
    assert wait_gone([old, new]) == []


def test_a_run_replaces_a_sigkilled_actor_then_stops_past_the_cap_and_resumes(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    first, second, family, proc, err = kill_twice_past_the_cap(tiny_model_dir, run_dir, Gate(tmp_path), *RAY,
                                                               timeout=180)
    assert second != first
    assert proc.returncode == 2, err[-3000:]
    assert ("Ray actor (pid " in err and "1 worker(s) already replaced in this run, the most "
            "rollout.max_worker_restarts=1 allows: raise rollout.max_worker_restarts" in err), err[-3000:]
    assert wait_gone(family, timeout=30) == []
    metrics = rows(run_dir / "metrics.jsonl")
    restarts = [m["rollout/worker_restarts"] for m in metrics]
    assert restarts[0] == 0 and restarts[-1] == 1  # the first loss replaced, the run went on
    (lost,) = [e for e in rows(run_dir / "events.jsonl") if e["kind"] == "worker_lost"]
    assert f"pid {first}" in lost["cause"]
    total, resume = resume_three_more(run_dir, timeout=240)
    assert resume.returncode == 0, resume.stderr[-3000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert sorted(m["batch_index"] for m in metrics) == list(range(total))
    assert all(0 <= m["staleness/updates"] <= 1 for m in metrics)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(300)
def test_a_run_goes_on_when_its_rollout_actors_node_is_removed(tiny_model_dir, tmp_path):
    """A whole run on a three-node cluster (a head with no CPUs, two nodes of one): the node running
    the rollout actor is removed mid-batch; the run replaces the actor on the other node and trains
    every batch once."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        gate, run_dir = Gate(tmp_path, after=3 * SAMPLES_PER_BATCH), tmp_path / "run"
        gate.close()  # from the start: the worker holds on batch 3 however fast the run goes
        proc = start(tiny_model_dir, run_dir, gate, "rollout.backend=ray", f"ray.address={cluster.address}",
                     "train.num_batches=10", "checkpoint.interval=0")
        try:
            wait_rows(run_dir, proc, 3, timeout=180)
            held = hold(gate)
            raylets = {node.all_processes["raylet"][0].process.pid: node for node in nodes}
            assert _parent(held) in raylets, "the held actor is not a worker of either node"
            cluster.remove_node(raylets[_parent(held)], allow_graceful=False)
            assert wait_gone([held], timeout=60) == []  # gone with its node, its batch unfinished
            gate.gate.unlink()
            _out, err = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err[-3000:]
    finally:
        cluster.shutdown()
    metrics = assert_staleness_follows_the_launches(run_dir)
    assert sorted(m["batch_index"] for m in metrics) == list(range(10))
    assert metrics[-1]["rollout/worker_restarts"] == 1
    (lost,) = [e for e in rows(run_dir / "events.jsonl") if e["kind"] == "worker_lost"]
    assert lost["worker"] == "rollout-0" and "died while generating batch" in lost["cause"]
