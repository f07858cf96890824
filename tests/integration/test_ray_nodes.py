"""Several Ray nodes on this machine (``ray.cluster_utils.Cluster``): each a raylet with its own
object store, so what the learner's node puts is pulled over the network by the others.

One cluster for the module: a head node offering the custom resource ``trainer`` and three CPUs
(room for every actor of a run, where Ray would pack them without the keys), and two nodes
offering ``sampler`` and one CPU; an 80 MB object store each. ``ray.learner_resources`` and
``ray.worker_resources`` put the learner's actor on the head and a rollout actor on each of the
others; the weights then cross object stores at every publication, and the run still follows the
control rules' schedule. Two learner ranks placed on two nodes by the same keys make the
single-process update over gloo (TCP between the nodes' worker processes). A resource the cluster
cannot give is refused before any actor starts, with every node's resources in the message.
"""

import logging
import os
import re
import shutil
import tempfile

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("ray")

from test_sharded_learner import METRICS, batches, trained
from test_train import assert_follows_plan, recipe

from configs import config
from tether.config import load_config
from tether.errors import ConfigError
from tether.runtime.run import train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
STORE = {"object_store_memory": 80 * 2**20}


@pytest.fixture(scope="module")
def cluster():
    """Three Ray nodes: the head offers 3 CPUs and {trainer: 1}, the other two 1 CPU and
    {sampler: 1}. Ray's files (sockets, logs, its address file) go under a short directory."""
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="tether-nodes-", dir="/tmp")
    env = {"RAY_TMPDIR": temp, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    nodes = None
    try:
        head = {**STORE, "num_cpus": 3, "resources": {"trainer": 1}, "include_dashboard": False}
        nodes = Cluster(initialize_head=True, head_node_args=head)
        for _ in range(2):
            nodes.add_node(**STORE, num_cpus=1, resources={"sampler": 1})
        nodes.wait_for_nodes()
        yield nodes
    finally:
        if nodes is not None:
            nodes.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(temp, ignore_errors=True)


def node_ids(cluster) -> tuple[str, set[str]]:
    """The head's node id and the two sampler nodes' (8 hex digits, as the run logs them)."""
    return cluster.head_node.node_id[:8], {n.node_id[:8] for n in cluster.worker_nodes}


def on_cluster(cluster, model_dir, *extra):
    return recipe(model_dir, "rollout.backend=ray", f"ray.address={cluster.address}", "ray.learner=actor",
                  *extra)


def test_learner_and_rollout_actors_run_on_the_nodes_their_resources_name(cluster, tiny_model_dir, tmp_path,
                                                                         caplog):
    """The learner's actor on the head ({trainer: 1}), one rollout actor on each sampler node: every
    version the actors sample with was put into the head's object store by the learner and pulled
    (and its checksum verified) on another node; per-batch staleness is `tether plan`'s."""
    caplog.set_level(logging.INFO, logger="tether")
    cfg = load_config(None, on_cluster(cluster, tiny_model_dir, "ray.learner_resources={trainer: 1}",
                                       "ray.worker_resources={sampler: 1}", "rollout.num_workers=2",
                                       "async.max_staleness=1", "async.max_inflight=2", "eval.interval=0"))
    run_dir = tmp_path / "run"
    summary = train(cfg, run_dir, progress_plain=True)
    metrics, _plan = assert_follows_plan(cfg, run_dir, summary)
    assert summary["trained_batches"] == 6
    head, samplers = node_ids(cluster)
    logged = [r.getMessage() for r in caplog.records]
    learner = [m for m in logged if m.startswith("ray: learner actor ready")]
    workers = [m for m in logged if re.match(r"ray: 2 rollout actor\(s\) ready on node\(s\)", m)]
    assert len(learner) == 1 and learner[0].endswith(f"on node {head}"), learner
    assert len(workers) == 1, logged
    placed = re.search(r"on node\(s\) ([0-9a-f]{8}), ([0-9a-f]{8});", workers[0]).groups()
    assert set(placed) == samplers and head not in placed  # one per sampler node, none beside the learner
    # versions published by the learner after training reached the actors on the other nodes
    assert max(m["async/behavior_version"] for m in metrics) > 0
    assert [m for m in metrics if "sync/load_s" in m]  # the actors' loads (checksums verified) timed


def test_the_collective_channel_reaches_actors_on_other_nodes(cluster, tiny_model_dir, tmp_path, caplog):
    """rollout.weight_sync=collective with the learner in the driver (on the head's host) and a
    rollout actor on each sampler node: every version is broadcast to them over gloo (TCP), each
    verifies it, and the run follows the control rules' schedule."""
    caplog.set_level(logging.INFO, logger="tether")
    cfg = load_config(None, on_cluster(cluster, tiny_model_dir, "ray.learner=driver",
                                       "ray.worker_resources={sampler: 1}", "rollout.num_workers=2",
                                       "rollout.weight_sync=collective", "rollout.on_worker_loss=stop",
                                       "async.max_staleness=1", "async.max_inflight=2", "eval.interval=0"))
    run_dir = tmp_path / "run"
    summary = train(cfg, run_dir, progress_plain=True)
    metrics, _plan = assert_follows_plan(cfg, run_dir, summary)
    _head, samplers = node_ids(cluster)
    workers = [r.getMessage() for r in caplog.records
               if re.match(r"ray: 2 rollout actor\(s\) ready on node\(s\)", r.getMessage())]
    placed = re.search(r"on node\(s\) ([0-9a-f]{8}), ([0-9a-f]{8});", workers[0]).groups()
    assert set(placed) == samplers
    broadcasts = [m for m in metrics if "sync/buckets" in m]
    assert broadcasts and all(m["sync/buckets"] >= 1 for m in broadcasts)
    assert max(m["async/behavior_version"] for m in metrics) > 0


def test_learner_ranks_on_two_nodes_make_the_single_process_update(cluster, tiny_model_dir):
    """train.world_size=2 with ray.learner_resources={sampler: 1}: one rank actor on each sampler
    node (a node offers one), meeting over gloo on TCP; the same rollout batches trained by them and
    by one process give the same parameters (≤ 1e-5 relative, float32 rounding) and metrics."""
    import ray

    from tether.train.learner import TorchLearner
    from tether.train.ranks import RankGroup
    from tether.train.ray_ranks import ActorRanks

    rollout_batches = batches(tiny_model_dir)
    keys = {"lr": 5e-5, "shared_prefix": False, "aggregation": "token_mean", "updates_per_batch": 2}
    solo_weights, solo = trained(TorchLearner(tiny_model_dir, config(**keys)), rollout_batches)
    cfg = config("rollout.backend=ray", "ray.learner=actor", "ray.learner_resources={sampler: 1}",
                 world_size=2, **keys)
    ray.init(address=cluster.address, include_dashboard=False, configure_logging=False)
    try:
        transport = ActorRanks(ray, cfg, str(tiny_model_dir), None)
        group = RankGroup(transport)
        try:
            nodes = [n[:8] for n in transport.nodes]
            weights, two = trained(group, rollout_batches)
        finally:
            group.close()
    finally:
        ray.shutdown()
    _head, samplers = node_ids(cluster)
    assert len(set(nodes)) == 2 and set(nodes) == samplers, nodes
    worst = 0.0
    for name, ref in solo_weights.items():
        worst = max(worst, ((weights[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item())
    print(f"\nranks on two Ray nodes vs one process: max relative parameter difference {worst:.1e}")
    assert worst <= 1e-5
    for a, b in zip(solo, two, strict=True):
        assert a.committed_updates == b.committed_updates == 2
        for key in METRICS:
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize(("keys", "message"), [
    (["ray.worker_resources={gpu_node: 1}"],
     r"ray.worker_resources asks each rollout actor for 1 of the resource 'gpu_node', and no node of the "
     r"Ray cluster has it; start nodes that offer it \(`ray start --address=<head>:6379 "
     r"--resources='\{\"gpu_node\": 1\}'`\) or change ray.worker_resources"),
    (["ray.learner_resources={trainer: 2}"],
     r"ray.learner_resources asks each learner actor for 2 of the resource 'trainer', and no node has "
     r"more than 1"),
    (["ray.worker_resources={sampler: 1}", "ray.cpus_per_worker=2"],
     r"no node of the Ray cluster holds a whole rollout actor \(CPU 2, sampler 1: ray.worker_resources"),
    (["ray.worker_resources={sampler: 1}", "rollout.num_workers=3"],
     r"3 rollout actor\(s\) × ray.worker_resources\['sampler'\]=1 need 3 of 'sampler', and the Ray "
     r"cluster has 2"),
], ids=["unknown", "more-than-a-node", "not-on-one-node", "more-than-the-cluster"])
def test_resources_the_cluster_cannot_give_are_refused_before_any_actor_starts(
        cluster, tiny_model_dir, tmp_path, caplog, keys, message):
    caplog.set_level(logging.INFO, logger="tether")
    cfg = load_config(None, on_cluster(cluster, tiny_model_dir, *keys))
    with pytest.raises(ConfigError, match=message) as info:
        train(cfg, tmp_path / "run", progress_plain=True)
    head, samplers = node_ids(cluster)
    text = str(info.value)
    assert f"node {head} (" in text and "CPU 3, trainer 1" in text, text  # every node's resources
    assert all(f"node {s} (" in text for s in samplers) and text.count("CPU 1, sampler 1") == 2, text
    assert not [r for r in caplog.records if "ready" in r.getMessage()]  # neither learner nor rollout actor
