"""Rollout worker processes behind the RolloutPool protocol: real processes, real tiny model."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from configs import pool_settings  # noqa: E402
from procs import children, describe, running, wait_gone  # noqa: E402
from tether.data.stream import PromptStream  # noqa: E402
from tether.data.tasks import get_task  # noqa: E402
from tether.errors import RolloutError  # noqa: E402
from tether.modeling import load_causal_lm, unique_parameters  # noqa: E402
from tether.rollout.backends.local.pool import ProcessPool  # noqa: E402
from tether.vocabulary import GenerationRequest  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
STREAM = PromptStream(get_task("arithmetic").examples("train", 300, seed=0), batch_size=3)


def make_pool(model_dir, *overrides):
    model, _ = load_causal_lm(model_dir)
    settings = pool_settings(model_dir, "rollout.group_size=2", "rollout.max_new_tokens=6", *overrides)
    return ProcessPool(settings, STREAM.batch, unique_parameters(model)), model


def collect(pool, n, timeout=60):
    got = []
    while len(got) < n:
        got += pool.wait(timeout)
    return got


def reward_file(tmp_path, body):
    path = tmp_path / "reward.py"
    path.write_text(textwrap.dedent(body))
    return f"{path}:reward"


def test_whole_batches_in_completion_order_and_weight_updates(tiny_model_dir):
    pool, model = make_pool(tiny_model_dir, "rollout.num_workers=2")
    with pool:
        pids = pool.pids
        assert len(pids) == 2 and all(running(p) for p in pids)
        for i in range(4):
            pool.launch(GenerationRequest(index=i, version=0))
        batches = collect(pool, 4)
        assert sorted(b.index for b in batches) == [0, 1, 2, 3]
        for b in batches:
            scored = b.payload
            assert (b.num_groups, b.group_size, b.behavior_version) == (3, 2, 0)
            assert scored.positions == [pos for pos, _ in STREAM.batch(b.index)]
            assert len(scored.rewards) == 6 and all(0.0 <= r <= 1.0 for r in scored.rewards)
            assert all(v == 0 for vs in scored.versions for v in vs)
            for key in ("reward/mean", "reward/std", "response/length_mean", "time/generate"):
                assert key in b.metrics
        first = {b.index: b.payload.completion_ids for b in batches}
        # same batch index, same weights: the same tokens (seeded by run seed and batch index)
        pool.launch(GenerationRequest(index=0, version=0))
        assert collect(pool, 1)[0].payload.completion_ids == first[0]
        # publish new weights: what is sampled changes, and every token carries the new version
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        metrics = pool.publish(unique_parameters(model), 7)
        assert {"sync/publish_s", "sync/load_s", "sync/bytes", "sync/gbps"} <= set(metrics)
        pool.launch(GenerationRequest(index=0, version=7))
        after = collect(pool, 1)[0]
        assert after.behavior_version == 7
        assert all(v == 7 for vs in after.payload.versions for v in vs)
        assert after.payload.completion_ids != first[0]
        # what a stop's checkpoint keeps: a copy of exactly the weights the workers hold now
        held = pool.published_weights()
        assert all(torch.equal(held[k], v) for k, v in unique_parameters(model).items())
        with pytest.raises(RolloutError, match="stamped version 0 but the workers hold 7"):
            pool.launch(GenerationRequest(index=1, version=0))
    assert wait_gone(pids) == []


def test_reward_exception_names_worker_batch_cause_and_traceback(tiny_model_dir, tmp_path):
    spec = reward_file(tmp_path, """
        def reward(prompt, completion, answer, fields):
            raise ValueError("bad reward for " + prompt)
    """)
    pool, _ = make_pool(tiny_model_dir, f"reward.function={spec}")
    with pool:
        pool.launch(GenerationRequest(index=4, version=0))
        with pytest.raises(RolloutError) as info:
            collect(pool, 1)
    err = info.value
    assert err.worker == "rollout-0" and err.batch_index == 4
    assert "ValueError: bad reward for" in str(err)
    assert "in reward" in err.remote_traceback and "reward.py" in err.remote_traceback


def test_reward_errors_scored_zero_and_counted_when_asked(tiny_model_dir, tmp_path):
    spec = reward_file(tmp_path, """
        def reward(prompt, completion, answer, fields):
            return float("nan")
    """)
    pool, _ = make_pool(tiny_model_dir, f"reward.function={spec}", "reward.on_error=zero")
    with pool:
        pool.launch(GenerationRequest(index=0, version=0))
        batch = collect(pool, 1)[0]
    assert batch.metrics["reward/errors"] == 6
    assert batch.payload.rewards == [0.0] * 6


def test_non_finite_reward_fails_the_batch_by_default(tiny_model_dir, tmp_path):
    spec = reward_file(tmp_path, """
        def reward(prompt, completion, answer, fields):
            return float("inf")
    """)
    pool, _ = make_pool(tiny_model_dir, f"reward.function={spec}")
    with pool, pytest.raises(RolloutError, match="must return a finite number"):
        pool.launch(GenerationRequest(index=0, version=0))
        collect(pool, 1)


SLOW_REWARD = """
    import time
    def reward(prompt, completion, answer, fields):
        time.sleep(30)
        return 0.0
"""


def test_killed_worker_is_reported_with_its_batch_and_signal(tiny_model_dir, tmp_path):
    pool, _ = make_pool(tiny_model_dir, f"reward.function={reward_file(tmp_path, SLOW_REWARD)}",
                        "rollout.on_worker_loss=stop")
    with pool:
        pid = pool.pids[0]
        pool.launch(GenerationRequest(index=2, version=0))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RolloutError) as info:
            collect(pool, 1, timeout=30)
    assert "died from signal SIGKILL" in str(info.value)
    assert info.value.worker == "rollout-0" and info.value.batch_index == 2
    assert wait_gone([pid]) == []


def test_a_generation_past_the_wait_timeout_fails_naming_worker_and_batch(tiny_model_dir, tmp_path):
    pool, _ = make_pool(tiny_model_dir, f"reward.function={reward_file(tmp_path, SLOW_REWARD)}")
    with pool:
        pids = pool.pids
        pool.launch(GenerationRequest(index=5, version=0))
        with pytest.raises(RolloutError) as info:
            pool.wait(0.5)
    assert "within async.wait_timeout_s=0.5s" in str(info.value)
    assert info.value.batch_index == 5 and info.value.worker == "rollout-0"
    assert wait_gone(pids) == []  # close() terminated the worker stuck in the reward


def test_prompt_longer_than_the_context_is_a_clear_error(tiny_model_dir):
    model, _ = load_causal_lm(tiny_model_dir)
    settings = pool_settings(tiny_model_dir, "rollout.group_size=2", "rollout.max_new_tokens=300")
    with ProcessPool(settings, STREAM.batch, unique_parameters(model)) as pool:
        pool.launch(GenerationRequest(index=0, version=0))
        with pytest.raises(RolloutError, match="exceeds the model's context of 256"):
            collect(pool, 1)


def test_a_worker_that_cannot_start_fails_the_pool_and_leaves_nothing(tmp_path, tiny_model_dir):
    model, _ = load_causal_lm(tiny_model_dir)
    reward = tmp_path / "gone.py"  # there when the recipe is loaded, gone when the worker starts
    reward.write_text("def reward(prompt, completion, answer, fields):\n    return 1.0\n")
    settings = pool_settings(tiny_model_dir, f"reward.function={reward}:reward")
    reward.unlink()
    with pytest.raises(RolloutError, match="failed to start") as info:
        ProcessPool(settings, STREAM.batch, unique_parameters(model))
    assert "does not exist" in str(info.value)


@pytest.mark.parametrize("exit_path", ["exception", "keyboard_interrupt"])
def test_no_process_outlives_an_error_inside_the_pool(tiny_model_dir, exit_path):
    pool, _ = make_pool(tiny_model_dir, "rollout.num_workers=2")
    pids = pool.pids
    error = RuntimeError("boom") if exit_path == "exception" else KeyboardInterrupt()
    with pytest.raises(type(error)), pool:
        pool.launch(GenerationRequest(index=0, version=0))
        raise error
    assert wait_gone(pids) == []


def test_workers_exit_when_the_driver_process_is_killed(tiny_model_dir, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        from test_pool import make_pool
        if __name__ == "__main__":
            from multiprocessing import forkserver
            pool, _ = make_pool({str(tiny_model_dir)!r}, "rollout.num_workers=2")
            print(" ".join(map(str, pool.pids)), flush=True)
            print(forkserver._forkserver._forkserver_address, flush=True)
            time.sleep(120)
    """))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        server_socket = Path(driver.stdout.readline().strip())
        assert len(pids) == 2 and all(running(p) for p in pids)
        assert server_socket.parent.name.startswith("pymp-") and server_socket.exists()
        pids = sorted(set(pids) | set(children(driver.pid)))  # the forkserver too
        driver.kill()
        driver.wait(10)
        left = wait_gone(pids, timeout=5)  # at once, through the lifeline, not after a batch
        assert left == [], describe(left)
        # the killed driver could not remove its multiprocessing folder; the server did
        assert not server_socket.parent.exists()
    finally:
        if driver.poll() is None:
            driver.kill()


def test_a_stop_while_the_pool_publishes_its_first_weights_unlinks_the_channel(tiny_model_dir, monkeypatch):
    """The stop signal's ``StopRequested`` raised inside the first publication (before any worker
    starts): the pool's clean-up unlinks the block it made."""
    from tether.errors import StopRequested
    from tether.rollout.channel import WeightChannel

    made = []
    real = WeightChannel.for_tensors.__func__

    def for_tensors(cls, tensors):
        made.append(real(cls, tensors))
        return made[-1]

    def publish(self, tensors, version):
        raise StopRequested("SIGINT")

    monkeypatch.setattr(WeightChannel, "for_tensors", classmethod(for_tensors))
    monkeypatch.setattr(WeightChannel, "publish", publish)
    with pytest.raises(StopRequested):
        make_pool(tiny_model_dir, "rollout.num_workers=1")
    assert len(made) == 1 and not os.path.exists(f"/dev/shm/{made[0].name}")
