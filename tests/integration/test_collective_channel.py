"""The collective weight channel (rollout.weight_sync=collective): a run trains batch for batch as
with the shared-memory channel; a worker that dies mid-broadcast or never joins is named with the
version, and nothing hangs or outlives the pool; a corrupted bucket fails the checksum; an engine
that does not declare the channel is refused when the recipe is read."""

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from test_train import recipe, rows  # noqa: E402

from configs import config, pool_settings  # noqa: E402
from procs import children, wait_gone  # noqa: E402
from tether.config import load_config  # noqa: E402
from tether.errors import ConfigError, RolloutError  # noqa: E402
from tether.rollout.channel import ChannelError, Layout  # noqa: E402
from tether.rollout.collective import CollectivePublisher, CollectiveReceiver, WeightSyncError  # noqa: E402
from tether.runtime.run import train  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
KEYS = ("step", "batch_index", "async/behavior_version", "async/train_version", "staleness/updates",
        "reward/mean", "loss/policy")
BASE = ["async.max_staleness=1", "async.max_inflight=2",  # one worker: batches complete in order
        "rollout.on_worker_loss=stop"]  # the group is formed once: a lost worker is not replaced


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(300, 7, generator=g), "b": torch.randn(5, generator=g).half(),
            "c": torch.randint(-9, 9, (1000,), generator=g)}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """The same recipe trained through shared memory and through the collective channel."""
    out = {}
    for sync in ("shm", "collective"):
        run_dir = tmp_path_factory.mktemp(sync) / "run"
        train(load_config(None, recipe(tiny_model_dir, *BASE, f"rollout.weight_sync={sync}")), run_dir,
              progress_plain=True)
        out[sync] = run_dir
    return out


def test_a_collective_run_trains_batch_for_batch_like_shared_memory(runs):
    shm, coll = (rows(runs[s] / "metrics.jsonl") for s in ("shm", "collective"))
    assert [{k: m[k] for k in KEYS} for m in shm] == [{k: m[k] for k in KEYS} for m in coll]
    assert all(m["sync/buckets"] >= 1 for m in coll if "sync/bytes" in m)  # it did broadcast
    assert not any("sync/buckets" in m for m in shm)
    a, b = (load_file(str(runs[s] / "checkpoints/step-000006/learner/model/model.safetensors"))
            for s in ("shm", "collective"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_two_learner_ranks_publish_through_the_group_like_shared_memory(tiny_model_dir, tmp_path):
    """With FSDP2 ranks the whole weights are gathered on rank 0 and broadcast from the driver; the
    ranks write their own rows into the shared-memory block instead. The run is the same."""
    out = {}
    for sync in ("shm", "collective"):
        train(load_config(None, recipe(tiny_model_dir, *BASE, "train.world_size=2", "eval.interval=0",
                                       f"rollout.weight_sync={sync}")), tmp_path / sync, progress_plain=True)
        out[sync] = rows(tmp_path / sync / "metrics.jsonl")
    shm, coll = ([{k: m[k] for k in KEYS} for m in out[s]] for s in ("shm", "collective"))
    assert shm == coll
    assert all(m["sync/buckets"] >= 1 for m in out["collective"] if "sync/bytes" in m)


def test_ray_actors_take_weights_through_the_collective_group_batch_for_batch(runs, tiny_model_dir, tmp_path):
    pytest.importorskip("ray")
    run_dir = tmp_path / "ray"
    train(load_config(None, recipe(tiny_model_dir, *BASE, "rollout.weight_sync=collective",
                                   "rollout.backend=ray", "ray.local_cpus=2")), run_dir, progress_plain=True)
    shm, coll = rows(runs["shm"] / "metrics.jsonl"), rows(run_dir / "metrics.jsonl")
    assert [{k: m[k] for k in KEYS} for m in shm] == [{k: m[k] for k in KEYS} for m in coll]
    assert all(m["sync/buckets"] >= 1 for m in coll if "sync/bytes" in m)
    assert not any("sync/put_s" in m for m in coll)  # nothing went through the object store


# -- the channel alone, between this process and real worker processes ---------------------------

def _receive(address, rank, layout, versions, exit_after_header, results):
    receiver = CollectiveReceiver(address, rank, layout)
    for v in versions:
        if exit_after_header:
            info = torch.zeros(8, dtype=torch.int64)
            receiver._broadcast(info)
            os._exit(3)  # dies mid-broadcast: after the header, before the buckets
        receiver.receive(v)
        results.put((rank, v, {k: t.clone() for k, t in receiver.views().items()}))


def _start(ctx, publisher, rank, versions, results, *, exit_after_header=False):
    p = ctx.Process(target=_receive, args=(publisher.address, rank, publisher.layout, versions,
                                           exit_after_header, results), daemon=True)
    p.start()
    return p


def test_round_trip_through_processes_in_small_buckets():
    ctx, tensors = mp.get_context("spawn"), _tensors()
    publisher = CollectivePublisher(Layout.of(tensors), ["rollout-0", "rollout-1"], timeout_s=60,
                                    bucket_bytes=1000)
    results = ctx.Queue()
    procs = [_start(ctx, publisher, r, [4, 5], results) for r in (1, 2)]
    publisher.join()
    for v in (4, 5):
        metrics = publisher.publish({k: t + v for k, t in tensors.items()}, v)
        assert metrics["sync/buckets"] == -(-publisher.layout.data_bytes // 1000)
    got = [results.get(timeout=60) for _ in range(4)]
    for _rank, v, views in got:
        assert all(torch.equal(views[k], tensors[k] + v) for k in tensors)
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]


def test_a_worker_dying_mid_broadcast_is_named_with_the_version():
    ctx, tensors = mp.get_context("spawn"), _tensors()
    procs: list = []
    publisher = CollectivePublisher(
        Layout.of(tensors), ["rollout-0", "rollout-1"], timeout_s=30, bucket_bytes=512,
        gone=lambda: [f"rollout-{i}" for i, p in enumerate(procs) if (p.join(2) or not p.is_alive())])
    results = ctx.Queue()
    procs += [_start(ctx, publisher, 1, [7], results), _start(ctx, publisher, 2, [7], results,
                                                              exit_after_header=True)]
    publisher.join()
    with pytest.raises(WeightSyncError, match=r"version 7 failed: worker rollout-1 is gone"):
        publisher.publish(tensors, 7)
    for p in procs:
        p.kill()
        p.join(10)


def test_a_worker_that_never_joins_is_named():
    ctx, tensors = mp.get_context("spawn"), _tensors()
    publisher = CollectivePublisher(Layout.of(tensors), ["rollout-0", "rollout-1"], timeout_s=3)
    results = ctx.Queue()
    proc = _start(ctx, publisher, 1, [0], results)  # rank 2 never starts
    for _ in range(600):  # rank 1 is at the door (its interpreter's start is not what is timed)
        if publisher.store.check(["joined/1"]):
            break
        time.sleep(0.1)
    with pytest.raises(WeightSyncError, match=r"^worker rollout-1 did not join .*_timeout_s=3s"):
        publisher.join()
    proc.join(30)  # its own join times out as well, and it exits
    assert not proc.is_alive()


def test_a_port_in_use_is_named_with_the_key_to_change():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        named = rf"(?s)cannot listen on 127.0.0.1:{port} .*; set rollout.weight_sync_port to a free port"
        with pytest.raises(WeightSyncError, match=named):
            CollectivePublisher(Layout.of(_tensors()), ["rollout-0"], timeout_s=3, port=port)


def test_a_corrupted_bucket_fails_the_checksum():
    tensors = _tensors()
    publisher = CollectivePublisher(Layout.of(tensors), ["rollout-0"], timeout_s=30, bucket_bytes=1024)
    got: dict = {}

    def receive():
        receiver = CollectiveReceiver(publisher.address, 1, publisher.layout)
        for v in (1, 2):
            try:
                receiver.receive(v)
                got[v] = "ok"
            except ChannelError as exc:
                got[v] = str(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    publisher.join()
    publisher.publish(tensors, 1)
    sent = []

    def corrupting(t):  # flips one byte of the third bucket on the wire, after the checksum was taken
        sent.append(t)
        if len(sent) == 4:
            t = t.clone()
            t[5] ^= 1
        CollectivePublisher._send(publisher, t)

    publisher._send = corrupting
    publisher.publish(tensors, 2)
    thread.join(30)
    assert got[1] == "ok"
    assert "weights for version 2 fail their checksum" in got[2]


# -- a pool of worker processes -------------------------------------------------------------------

def test_a_killed_worker_stops_the_next_publication_naming_it_and_leaves_nothing(tiny_model_dir):
    from tether.modeling import load_causal_lm, unique_parameters
    from tether.rollout.backends.local.pool import ProcessPool

    settings = pool_settings(tiny_model_dir, "rollout.weight_sync=collective", "rollout.on_worker_loss=stop",
                             "rollout.num_workers=2", "rollout.weight_sync_timeout_s=20",
                             startup_timeout_s=60)
    weights = unique_parameters(load_causal_lm(tiny_model_dir)[0])
    pool = ProcessPool(settings, lambda i: [], weights)
    try:
        pids = pool.pids
        pool.publish(weights, 1)  # every worker verified and loaded version 1
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises((RolloutError, WeightSyncError), match=r"rollout-1"):
            pool.publish(weights, 2)
    finally:
        pool.close()
    assert wait_gone(pids, timeout=20) == []
    assert [p for p in children(os.getpid()) if p in pids] == []


def test_a_killed_ray_actor_stops_the_next_broadcast_naming_it(tiny_model_dir, tmp_path):
    pytest.importorskip("ray")
    from tether.modeling import load_causal_lm, unique_parameters
    from tether.rollout.backends.ray.cluster import RayOptions
    from tether.rollout.backends.ray.pool import RayPool

    settings = pool_settings(tiny_model_dir, "rollout.weight_sync=collective", "rollout.on_worker_loss=stop",
                             "rollout.num_workers=2", "rollout.weight_sync_timeout_s=20",
                             startup_timeout_s=120)
    weights = unique_parameters(load_causal_lm(tiny_model_dir)[0])
    pool = RayPool(settings, lambda i: [], weights, options=RayOptions(local_cpus=2),
                   run_dir=tmp_path / "run")
    try:
        pids = pool.pids
        pool.publish(weights, 1)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WeightSyncError, match=r"version 2 failed: worker rollout-1 is gone"):
            pool.publish(weights, 2)
    finally:
        pool.close()
    assert wait_gone(pids, timeout=20) == []


# -- refusals when the recipe is read -------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.backend=ray", "ray.learner=actor"], r"ray\.learner=actor keeps the weights in the learner's"),
    (["async.inflight_update=keep"], r"between batches only .* async\.inflight_update=keep"),
    (["rollout.on_worker_loss=replace"], r"a lost worker cannot be replaced into it"),
])
def test_collective_is_refused_where_it_cannot_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config("rollout.weight_sync=collective", "rollout.on_worker_loss=stop", *overrides)


def test_a_channel_the_backend_does_not_deliver_is_refused():
    with pytest.raises(ConfigError, match=r"backend=local delivers weights through shm or collective"):
        config("rollout.weight_sync=object_store")
    with pytest.raises(ConfigError, match=r"backend=ray delivers weights through object_store or collective"):
        config("rollout.weight_sync=shm", "rollout.backend=ray")
    chosen = config("rollout.weight_sync=collective", "rollout.on_worker_loss=stop")
    assert chosen.rollout.weight_sync == "collective"


# -- on CUDA (scripts/device_check.sh; skipped without CUDA) -----------------------------------------

def _receive_on_cuda(address, layout, device, results):
    receiver = CollectiveReceiver(address, 1, layout, device=device)
    receiver.receive(3)
    results.put({k: t.cpu() for k, t in receiver.views().items()})


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_broadcast_of_cuda_tensors_arrives_whole(backend):
    """NCCL between two CUDA devices (the receiver on the second GPU where there is one, else on the
    same one, which NCCL may refuse: then skipped, saying so); gloo carrying CUDA tensors."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    ctx, tensors = mp.get_context("spawn"), {k: t.cuda() for k, t in _tensors().items()}
    there = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    publisher = CollectivePublisher(Layout.of(tensors), ["rollout-0"], timeout_s=60, device="cuda:0",
                                    nccl=backend == "nccl", bucket_bytes=4096)
    results = ctx.Queue()
    proc = ctx.Process(target=_receive_on_cuda, args=(publisher.address, publisher.layout, there, results),
                       daemon=True)
    proc.start()
    try:
        publisher.join()
        publisher.publish(tensors, 3)
        got = results.get(timeout=60)
    except WeightSyncError as exc:
        if backend == "nccl" and there == "cuda:0" and "uplicate" in str(exc.__cause__):
            pytest.skip(f"NCCL refuses two ranks on one GPU here: {exc}")
        raise
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert all(torch.equal(got[k], tensors[k].cpu()) for k in tensors)


def test_the_channel_benchmark_runs():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "benchmarks/channel_compare.py", "--size", "tiny", "--repeats", "1",
                          "--only", "shm,collective", "--json"], cwd=root, capture_output=True, text=True,
                         timeout=240, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["collective"]["buckets"] == 1 and figures["shm"]["wall_s"] > 0
