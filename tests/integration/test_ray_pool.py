"""The Ray backend: rollout actors behind the same RolloutPool protocol, on a local Ray instance."""

import contextlib
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("ray")

from configs import pool_settings  # noqa: E402
from procs import running, wait_gone  # noqa: E402
from tether.data.stream import PromptStream  # noqa: E402
from tether.data.tasks import get_task  # noqa: E402
from tether.errors import ConfigError, RolloutError  # noqa: E402
from tether.modeling import load_causal_lm, unique_parameters  # noqa: E402
from tether.rollout.backends.ray.cluster import RayOptions  # noqa: E402
from tether.rollout.backends.ray.pool import RayPool  # noqa: E402
from tether.vocabulary import GenerationRequest  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
STREAM = PromptStream(get_task("arithmetic").examples("train", 300, seed=0), batch_size=3)


def slow_reward(tmp_path, seconds_for_batch0):
    """A reward that sleeps on batch 0's prompts, so later batches finish first."""
    prompts = [ex.prompt for _, ex in STREAM.batch(0)]
    path = tmp_path / "slow_reward.py"
    path.write_text(textwrap.dedent(f"""
        import time
        SLOW = {prompts!r}
        def reward(prompt, completion, answer, fields):
            if prompt in SLOW:
                time.sleep({seconds_for_batch0})
            return 0.0
    """))
    return f"{path}:reward"


def make_pool(model_dir, run_dir, *overrides):
    model, _ = load_causal_lm(model_dir)
    settings = pool_settings(model_dir, "rollout.group_size=2", "rollout.max_new_tokens=6", *overrides)
    return RayPool(settings, STREAM.batch, unique_parameters(model), options=RayOptions(local_cpus=2),
                   run_dir=run_dir), model


def ray_processes(temp_dir: str) -> list[int]:
    """Pids of processes whose command line mentions the Ray instance's temp dir."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if temp_dir in cmd and running(int(entry)):
                out.append(int(entry))
    return out


def collect(pool, n, timeout=60):
    got = []
    while len(got) < n:
        got += pool.wait(timeout)
    return got


def test_two_actors_are_both_used_in_completion_order_and_weights_update(tiny_model_dir, tmp_path):
    pool, model = make_pool(tiny_model_dir, tmp_path / "run", "rollout.num_workers=2",
                            f"reward.function={slow_reward(tmp_path, 0.5)}")
    with pool:
        assert len(pool.pids) == 2 and all(running(p) for p in pool.pids)
        for i in range(4):
            pool.launch(GenerationRequest(index=i, version=0))
        batches = collect(pool, 4)
        order = [b.index for b in batches]
        # batch 0 is slow: batch 1 (on the other actor) completes first, and so do the batches
        # dispatched to that actor after it; batch 0 is not held back for launch order
        assert sorted(order) == [0, 1, 2, 3] and order[0] == 1 and order.index(0) > 0
        assert sum(pool.served.values()) == 4 and min(pool.served.values()) >= 1, pool.served  # both used
        for b in batches:
            assert (b.num_groups, b.group_size, b.behavior_version) == (3, 2, 0)
            assert b.payload.positions == [pos for pos, _ in STREAM.batch(b.index)]
        first = {b.index: b.payload.completion_ids for b in batches}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        metrics = pool.publish(unique_parameters(model), 5)
        assert {"sync/publish_s", "sync/load_s", "sync/bytes", "sync/gbps", "sync/put_s"} <= set(metrics)
        pool.launch(GenerationRequest(index=2, version=5))
        after = collect(pool, 1)[0]
        assert after.behavior_version == 5 and all(v == 5 for vs in after.payload.versions for v in vs)
        assert after.payload.completion_ids != first[2]
        # what a stop's checkpoint keeps: a copy of exactly the weights the actors hold now
        held = pool.published_weights()
        assert held.keys() == unique_parameters(model).keys()
        assert all(torch.equal(held[k], v) for k, v in unique_parameters(model).items())


def test_same_seed_same_tokens_as_the_local_backend(tiny_model_dir, tmp_path):
    from tether.rollout.backends.local.pool import ProcessPool

    model, _ = load_causal_lm(tiny_model_dir)
    settings = pool_settings(tiny_model_dir, "rollout.group_size=2", "rollout.max_new_tokens=6")
    with ProcessPool(settings, STREAM.batch, unique_parameters(model)) as local:
        local.launch(GenerationRequest(index=3, version=0))
        expected = collect(local, 1)[0].payload
    with RayPool(settings, STREAM.batch, unique_parameters(model), options=RayOptions(local_cpus=2),
                 run_dir=tmp_path / "run") as pool:
        pool.launch(GenerationRequest(index=3, version=0))
        got = collect(pool, 1)[0].payload
    assert got.completion_ids == expected.completion_ids
    flat = [x for lp in got.logprobs for x in lp]
    assert flat == pytest.approx([x for lp in expected.logprobs for x in lp], abs=1e-6)
    assert got.rewards == expected.rewards


@pytest.mark.parametrize("mode", ["recompute", "abort"])
def test_actors_switch_weights_mid_generation_and_stamp_every_token(tiny_model_dir, tmp_path, mode):
    """Without draining, an actor verifies each newer snapshot while it generates and binds it at
    its next decode step: under recompute every token's log-prob is its stamped version's own
    teacher-forced one; under abort every sequence is one version's and the waste is counted."""
    from test_inflight_update import check_abort, check_recompute_stamps, publish_until_a_switch

    model, _ = load_causal_lm(tiny_model_dir)
    settings = pool_settings(tiny_model_dir, "rollout.group_size=8", "rollout.max_new_tokens=40",
                             f"async.inflight_update={mode}", stop_text="")
    with RayPool(settings, STREAM.batch, unique_parameters(model), options=RayOptions(local_cpus=2),
                 run_dir=tmp_path / "run") as pool:
        pids = list(pool.pids)
        batch, launched, weights = publish_until_a_switch(pool, model, mode,
                                                          every_s=0.05 if mode == "abort" else None)
    assert wait_gone(pids) == []
    if mode == "recompute":
        check_recompute_stamps(tiny_model_dir, batch, weights)
    else:
        check_abort(batch, every_row_restarted=False, launched=launched)  # a row may end first


def test_a_killed_actor_names_itself_and_its_batch_and_nothing_is_left_running(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    pool, _ = make_pool(tiny_model_dir, run_dir, f"reward.function={slow_reward(tmp_path, 3.0)}",
                        "rollout.on_worker_loss=stop")
    temp_dir = os.path.realpath(run_dir / "ray")
    try:
        assert ray_processes(temp_dir), "the local Ray instance should run under the run directory"
        (pid,) = pool.pids
        pool.launch(GenerationRequest(index=0, version=0))
        time.sleep(1.5)  # scoring batch 0 takes 3 s per sample
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RolloutError) as info:
            collect(pool, 1, timeout=60)
        text = str(info.value)
        assert info.value.worker == "rollout-0" and info.value.batch_index == 0, text
        assert "died while generating batch 0" in text
    finally:
        pool.close()
    assert wait_gone([pid]) == []
    assert wait_gone(ray_processes(temp_dir), timeout=20) == []
    # the run directory's path is too long for Ray's sockets: the instance ran under /tmp, and its
    # logs are now in the run's own `ray` folder, with nothing left under /tmp
    assert temp_dir.startswith("/tmp/tether-ray-") and not os.path.exists(temp_dir)
    home = run_dir / "ray"
    assert home.is_dir() and not home.is_symlink()
    assert list(home.glob("session_*/logs/raylet.out")), sorted(p.name for p in home.rglob("*"))


def test_publish_to_a_dead_actor_and_missing_resources_are_clear_errors(tiny_model_dir, tmp_path):
    model, _ = load_causal_lm(tiny_model_dir)
    settings = pool_settings(tiny_model_dir, "rollout.group_size=2", "rollout.max_new_tokens=6",
                             "rollout.on_worker_loss=stop", startup_timeout_s=120)
    with pytest.raises(ConfigError, match="do not fit the Ray cluster's nodes"):
        RayPool(settings, STREAM.batch, unique_parameters(model),
                options=RayOptions(local_cpus=2, cpus_per_worker=4), run_dir=tmp_path / "a")
    import ray

    assert not ray.is_initialized()  # the failed pool shut down the instance it started
    with pytest.raises(ConfigError, match=r"ray.gpus_per_worker=1 GPUs do not fit .*GPUs per node: 0"):
        RayPool(settings, STREAM.batch, unique_parameters(model),
                options=RayOptions(local_cpus=2, gpus_per_worker=1), run_dir=tmp_path / "g")
    with pytest.raises(ConfigError, match="GPUs plus 1 for the learner's actors do not fit"):
        RayPool(settings, STREAM.batch, unique_parameters(model),
                options=RayOptions(local_cpus=2, gpus_per_worker=0.5, reserved_gpus=1),
                run_dir=tmp_path / "h")
    assert not ray.is_initialized()
    with RayPool(settings, STREAM.batch, unique_parameters(model), options=RayOptions(local_cpus=2),
                 run_dir=tmp_path / "b") as pool:
        os.kill(pool.pids[0], signal.SIGKILL)
        with pytest.raises(RolloutError, match="rollout-0") as info:
            pool.publish(unique_parameters(model), 1)
        assert "died while loading version 1" in str(info.value)


def test_an_existing_ray_instance_is_used_and_left_running(tiny_model_dir, tmp_path):
    import ray

    temp_dir = f"/tmp/tether-test-ray-{os.getpid()}"
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, configure_logging=False)
    try:
        pool, _ = make_pool(tiny_model_dir, None)
        with pool:
            assert not pool.session.started  # it joined the caller's instance
            pool.launch(GenerationRequest(index=0, version=0))
            assert collect(pool, 1)[0].index == 0
        assert ray.is_initialized() and ray_processes(temp_dir)  # left running for its owner
        assert wait_gone(pool.pids) == []  # but the pool's own actors are gone
    finally:
        ray.shutdown()


def test_connects_to_a_cluster_by_address_and_leaves_it_running(tiny_model_dir, tmp_path):
    import shutil
    import subprocess
    import sys

    import ray

    temp_dir = f"/tmp/tether-test-head-{os.getpid()}"
    port = 6400 + os.getpid() % 500
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", f"--temp-dir={temp_dir}",
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, env=env,
                   capture_output=True, timeout=120)
    head = ray_processes(temp_dir)
    try:
        model, _ = load_causal_lm(tiny_model_dir)
        settings = pool_settings(tiny_model_dir, "rollout.group_size=2", "rollout.max_new_tokens=6")
        with RayPool(settings, STREAM.batch, unique_parameters(model),
                     options=RayOptions(address=f"127.0.0.1:{port}")) as pool:
            assert pool.session.connected and not pool.session.started
            pool.launch(GenerationRequest(index=1, version=0))
            assert collect(pool, 1)[0].index == 1
        assert not ray.is_initialized()  # disconnected
        assert head and all(running(p) for p in head)  # the cluster itself still runs
    finally:
        for pid in ray_processes(temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        wait_gone(ray_processes(temp_dir), timeout=20)
        for pid in ray_processes(temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
