"""train.world_size=2: two FSDP2 ranks (gloo, spawned processes) make the single-process update.

The same real rollout batches are trained by one process and by two ranks; the parameters must
agree after several updates (the test that catches a loss normalised per rank instead of over the
whole mini-batch), and so must the metrics the loop logs.

At lr 5e-5: AdamW's first steps move every weight by about ±lr whatever its gradient's size, so a
gradient that is zero in exact arithmetic (GRPO's advantages cancel within a group) and rounding
noise in float32 turns into a full step whose sign is chance. At lr 3e-3 that noise floor is a
relative difference of about 1e-4 between two *single-process* runs that only split their
mini-batches differently; at 1e-4 about 5e-6, and less at 5e-5. Where the floor lies depends on
the CPU's kernels too: on an AMD EPYC (no AVX-512) two ranks differ from one process by up to
2.2e-5 at 5e-5, where the machine the cases were first run on stayed under 1e-5. A loss
normalised per rank (each rank dividing by its own counts) fails every case here: by 1e-4 to
1.5e-3 in the parameters, or, where it only scales the loss (which AdamW does not see), in the
logged loss. So the ranks must reach ``RANKS_TOLERANCE``, 5e-5: above the rounding floor on both
machines, half the smallest failure.
"""

import os
import shutil
import signal

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_learner import sampled_batch  # noqa: E402

from configs import config  # noqa: E402
from procs import wait_gone  # noqa: E402
from tether.errors import ConfigError, LearnerError, LearnerLostError  # noqa: E402
from tether.rollout.channel import ChannelError, WeightChannel  # noqa: E402
from tether.train.learner import TorchLearner  # noqa: E402
from tether.train.ranks import ProcessRanks, RankGroup  # noqa: E402

RANKS_TOLERANCE = 5e-5
"""The largest relative parameter difference allowed between two ranks and one process."""

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
METRICS = ("loss/policy", "loss/total", "train/grad_norm", "ratio/mean", "ratio/max", "ratio/clip_frac_high",
           "ratio/is_weight_mean", "ratio/masked_frac", "mismatch/k3", "mismatch/logprob_abs_diff_max",
           "train/entropy")


def batches(model_dir):
    """Three real rollout batches (4 prompts × 4 samples), sampled with different seeds."""
    out = []
    for seed in range(3):
        batch, _ = sampled_batch(model_dir, seed=seed)
        out.append(batch)
    return out


def ranks(cfg, model_dir):
    """``cfg``'s learner as ``train.world_size`` rank processes (no held-out evaluation)."""
    return RankGroup(ProcessRanks(cfg, model_dir, None))


def trained(learner, rollout_batches):
    results = [learner.train(b, train_version=2 * i) for i, b in enumerate(rollout_batches)]
    return dict(learner.export_weights()), results  # gathered now: ranks' exports are lazy


@pytest.mark.parametrize("case", [
    {"aggregation": "token_mean", "updates_per_batch": 2},
    {"aggregation": "seq_mean_token_mean", "updates_per_batch": 2},
    {"aggregation": "seq_mean_token_sum", "updates_per_batch": 1},
    {"aggregation": "seq_mean_token_sum_norm", "updates_per_batch": 2, "kl_coef": 0.05},
    {"aggregation": "token_mean", "updates_per_batch": 1,
     "overrides": ("correction.tis=token", "correction.tis_cap=1.5", "correction.mask=sequence",
                   "correction.mask_low=0.7", "correction.mask_high=1.3")},
    {"aggregation": "token_mean", "updates_per_batch": 2, "shared_prefix": True,
     "overrides": ("metrics.attribution=true", "async.max_staleness=2")},
    {"aggregation": "seq_mean_token_mean", "updates_per_batch": 2, "kl_coef": 0.05, "shared_prefix": True},
    # packed by tokens: a group costs its prompt once plus 4 × 6 completion tokens (28, 29, 32, 33),
    # so rank 0 (groups 0, 1) packs 2 micro-batches and rank 1 (groups 2, 3, each cut in two) 3:
    # rank 0 runs a stand-in for the third
    {"aggregation": "seq_mean_token_sum_norm", "updates_per_batch": 1, "kl_coef": 0.05, "shared_prefix": True,
     "max_tokens_per_micro_batch": 30, "overrides": ("data.max_prompt_tokens=9", "rollout.max_new_tokens=6")},
], ids=["token_mean", "seq_mean_token_mean", "seq_mean_token_sum-inline", "dr_grpo-kl", "tis-mask-inline",
        "attribution", "shared-prefix-kl", "token-budget"])
def test_two_ranks_make_the_single_process_update(tiny_model_dir, case):
    rollout_batches = batches(tiny_model_dir)
    # the model's own forward on both sides, so only the split across ranks differs; the last two
    # cases run the shared-prompt forward on both (under FSDP2: as FSDP forward methods)
    keys = {"shared_prefix": False, **case}
    overrides = keys.pop("overrides", ())
    solo_weights, solo = trained(TorchLearner(tiny_model_dir, config(*overrides, lr=5e-5, **keys)),
                                 rollout_batches)
    sharded = ranks(config(*overrides, lr=5e-5, world_size=2, **keys), tiny_model_dir)
    try:
        pids = list(sharded.pids)
        weights, two = trained(sharded, rollout_batches)
    finally:
        sharded.close()
    assert wait_gone(pids) == []
    assert set(weights) == set(solo_weights)
    worst = 0.0
    for name, ref in solo_weights.items():
        rel = ((weights[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()
        worst = max(worst, rel)
    print(f"\nworld size 2 vs 1, {case['aggregation']}: max relative parameter difference {worst:.1e}")
    assert worst <= RANKS_TOLERANCE
    for a, b in zip(solo, two, strict=True):
        assert a.committed_updates == b.committed_updates == case["updates_per_batch"]
        for key in METRICS:
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-6), key
    if "metrics.attribution=true" in overrides:
        # batches trained at versions 0, 2, 4 from tokens of version 0: the ranks' kept shards
        # give the split one process's whole copies give
        keys = [k for k in solo[-1].metrics if k.startswith("attribution/") and k != "attribution/memory_mb"]
        assert solo[-1].metrics["attribution/staleness_logratio_abs_mean"] > 0
        for a, b in zip(solo, two, strict=True):
            for key in keys:
                assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-6), key
            assert b.metrics["attribution/memory_mb"] < a.metrics["attribution/memory_mb"]  # shards only


def test_a_plugin_that_fails_only_in_the_rank_processes_is_their_failure_to_start_named(
        tiny_model_dir, tmp_path, monkeypatch):
    """A recipe's plug-in is imported again in every rank process; one that exits there (but not in
    the driver) is each rank's failure to start, with what it raised — not a silent exit, and not
    a rank that 'exited with status 0' after reporting it."""
    plugin = tmp_path / "not_in_ranks.py"
    plugin.write_text("import os\nimport sys\n\nif os.environ['DRIVER_PID'] != str(os.getpid()):\n"
                      "    sys.exit(5)\n")
    monkeypatch.setenv("DRIVER_PID", str(os.getpid()))
    says = rf"learner rank \d failed while starting: PluginError: run\.plugins: {plugin} failed to import: "
    with pytest.raises(LearnerError, match=says + "SystemExit: 5 at ") as info:
        ranks(config(f"run.plugins=[{plugin}]", world_size=2), tiny_model_dir)
    assert "Original traceback" not in str(info.value)  # the message says it all


def test_ranks_write_their_rows_into_the_channel_and_a_killed_rank_fails_naming_it(tiny_model_dir):
    """A publication with ranks: every rank writes its own rows of each weight into the shared
    block, which then holds exactly what gathering them whole gives. Weights exported before an
    update are refused after it. A rank killed between calls fails the next one naming it; a
    publication it could not finish leaves the block marked incomplete (no worker takes it), and
    no rank is left."""
    rollout_batches = batches(tiny_model_dir)
    sharded = ranks(config(lr=3e-3, world_size=2), tiny_model_dir)
    pids = list(sharded.pids)
    by_ranks = gathered = None
    try:
        sharded.train(rollout_batches[0], train_version=0)
        exported = sharded.export_weights()
        whole = {name: t.clone() for name, t in exported.items()}
        gathered, by_ranks = WeightChannel.for_tensors(whole), WeightChannel.for_tensors(whole)
        gathered.publish(whole, 1)
        by_ranks.publish(exported, 1)
        by_ranks.verify(1)
        for name, t in gathered.views().items():
            assert torch.equal(by_ranks.views()[name], t), name
        assert any(torch.count_nonzero(t) for t in by_ranks.views().values())
        sharded.train(rollout_batches[1], train_version=1)
        with pytest.raises(LearnerError, match="exported before the learner last changed them"):
            by_ranks.publish(exported, 2)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(LearnerLostError, match=r"learner rank 1 \(pid \d+\) died from signal SIGKILL"):
            by_ranks.publish(sharded.export_weights(), 2)
        with pytest.raises(ChannelError, match="incomplete"):
            by_ranks.verify(2)
    finally:
        sharded.close()
        for channel in (gathered, by_ranks):
            if channel is not None:
                channel.close()
    assert wait_gone(pids) == []


def test_a_run_with_two_ranks_follows_the_plan_and_resumes_at_any_world_size(tiny_model_dir, tmp_path):
    from test_train import assert_follows_plan, recipe, rows

    from tether.config import load_config
    from tether.runtime.run import train

    keys = ("step", "batch_index", "async/behavior_version", "staleness/updates", "reward/mean",
            "loss/policy")
    two = ["train.world_size=2"]
    whole = load_config(None, recipe(tiny_model_dir, *two))
    summary = train(whole, tmp_path / "whole", progress_plain=True)
    metrics, _plan = assert_follows_plan(whole, tmp_path / "whole", summary)
    assert [e["step"] for e in rows(tmp_path / "whole" / "eval.jsonl")] == [0, 3, 6]
    # stopped after 3 batches, resumed at two ranks: row for row the same run
    parts, single = tmp_path / "parts", tmp_path / "single"
    train(load_config(None, recipe(tiny_model_dir, *two, "train.num_batches=3")), parts, progress_plain=True)
    shutil.copytree(parts, single)  # the same stopped run, for one process to continue below
    train(load_config(parts / "config.yaml", ["train.num_batches=6"]), parts, resume=True,
          progress_plain=True)
    assert [{k: m[k] for k in keys} for m in rows(parts / "metrics.jsonl")] == [
        {k: m[k] for k in keys} for m in metrics]
    # one process continues from a two-rank checkpoint (the format is the same at any world size)
    done = train(load_config(single / "config.yaml", ["train.num_batches=6", "train.world_size=1"]), single,
                 resume=True, progress_plain=True)
    assert done["trained_batches"] == 6
    for a, b in zip(rows(single / "metrics.jsonl")[3:], metrics[3:], strict=True):
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], rel=1e-3, abs=1e-5)


def test_two_ranks_beside_ray_rollout_actors_follow_the_plan(tiny_model_dir, tmp_path):
    pytest.importorskip("ray")
    from test_train import assert_follows_plan, recipe

    from tether.config import load_config
    from tether.runtime.run import train

    cfg = load_config(None, recipe(tiny_model_dir, "train.world_size=2", "rollout.backend=ray",
                                   "ray.local_cpus=2", "eval.interval=0", "checkpoint.interval=0"))
    summary = train(cfg, tmp_path / "run", progress_plain=True)
    assert_follows_plan(cfg, tmp_path / "run", summary)


def test_sharded_checkpoints_resume_exactly_continue_at_one_process_and_evaluate(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    from test_train import ROOT, recipe, rows

    from tether.config import load_config
    from tether.runtime.run import train

    two = ["train.world_size=2", "checkpoint.sharded=true"]
    whole = tmp_path / "whole"
    train(load_config(None, recipe(tiny_model_dir, *two)), whole, progress_plain=True)
    ckpt = sorted((whole / "checkpoints").iterdir())[-1] / "learner"
    shards = sorted(p.name for p in (ckpt / "sharded").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own
    assert not (ckpt / "model" / "model.safetensors").exists()  # no process held the whole state
    parts, single = tmp_path / "parts", tmp_path / "single"
    train(load_config(None, recipe(tiny_model_dir, *two, "train.num_batches=3")), parts, progress_plain=True)
    shutil.copytree(parts, single)  # the same stopped run, for one process to continue below
    train(load_config(parts / "config.yaml", ["train.num_batches=6"]), parts, resume=True,
          progress_plain=True)
    keys = ("batch_index", "staleness/updates", "reward/mean", "loss/policy")
    assert [{k: m[k] for k in keys} for m in rows(parts / "metrics.jsonl")] == [
        {k: m[k] for k in keys} for m in rows(whole / "metrics.jsonl")]
    done = train(load_config(single / "config.yaml", ["train.num_batches=6", "train.world_size=1",
                                                      "checkpoint.sharded=false"]),
                 single, resume=True, progress_plain=True)
    assert done["trained_batches"] == 6
    # `tether eval` reads the shards whole, in one process, and scores what the run scored
    out = subprocess.run([sys.executable, "-m", "tether.cli.main", "eval", str(whole)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    last = rows(whole / "eval.jsonl")[-1]["eval/pass_at_1"]
    assert f"{last:.1%}" in out.stdout, out.stdout


def test_ranks_as_ray_actors_train_batch_for_batch_like_local_ranks(tiny_model_dir, tmp_path, caplog):
    """One actor per rank, all in one placement group, giving the rows local ranks give."""
    pytest.importorskip("ray")
    import logging
    import re

    caplog.set_level(logging.INFO, logger="tether")
    from test_train import recipe, rows

    from tether.config import load_config
    from tether.runtime.run import train

    keys = ("batch_index", "async/behavior_version", "staleness/updates", "reward/mean", "loss/policy")
    two = ["train.world_size=2", "rollout.backend=ray", "ray.local_cpus=3"]
    train(load_config(None, recipe(tiny_model_dir, *two)), tmp_path / "local", progress_plain=True)
    actors = tmp_path / "actors"
    train(load_config(None, recipe(tiny_model_dir, *two, "ray.learner=actor")), actors, progress_plain=True)
    local = rows(tmp_path / "local" / "metrics.jsonl")
    assert [{k: m[k] for k in keys} for m in rows(actors / "metrics.jsonl")] == [
        {k: m[k] for k in keys} for m in local]
    assert [e["eval/pass_at_1"] for e in rows(actors / "eval.jsonl")] == [
        e["eval/pass_at_1"] for e in rows(tmp_path / "local" / "eval.jsonl")]
    assert sorted((actors / "checkpoints").iterdir())  # written by the rank actors
    placed = [r.getMessage() for r in caplog.records if "learner rank actors ready" in r.getMessage()]
    one_group = r"in placement group\(s\) \['[0-9a-f]{8,}'\] \(PACK\)"
    assert len(placed) == 1 and re.search(one_group, placed[0]), placed


def test_learner_ranks_that_cannot_be_placed_are_refused_before_any_starts(tiny_model_dir, tmp_path):
    """Two ranks of 2 CPUs each do not fit a 3-CPU Ray instance: refused at once, saying what to
    change, instead of one rank waiting forever for the other."""
    pytest.importorskip("ray")
    from test_train import recipe

    from tether.config import load_config
    from tether.runtime.run import train

    cfg = load_config(None, recipe(tiny_model_dir, "train.world_size=2", "train.threads=2",
                                   "rollout.backend=ray", "ray.local_cpus=3", "ray.learner=actor"))
    with pytest.raises(ConfigError, match=r"learner ranks of \{'CPU': 2.0\} each cannot be placed \(PACK\) "
                                          r"on this Ray cluster: it has room for 1"):
        train(cfg, tmp_path / "run", progress_plain=True)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())


def test_a_learner_actor_and_rollout_actors_that_cannot_fit_together_are_refused_before_either_starts(
        tiny_model_dir, tmp_path, caplog):
    """One learner actor (1 CPU) and two rollout actors (1 CPU each) on a 2-CPU instance: refused
    at once, before the learner's actor starts (it used to start, and the refusal came 28 s later
    from the rollout pool)."""
    pytest.importorskip("ray")
    import logging

    from test_train import recipe

    from tether.config import load_config
    from tether.runtime.run import train

    caplog.set_level(logging.INFO, logger="tether")
    cfg = load_config(None, recipe(tiny_model_dir, "rollout.backend=ray", "ray.local_cpus=2",
                                   "ray.learner=actor", "rollout.num_workers=2"))
    with pytest.raises(ConfigError, match=r"2 rollout actor\(s\) × ray.cpus_per_worker=1 CPUs plus 1 for "
                                          r"the learner's actors do not fit the Ray cluster's nodes "
                                          r"\(CPUs per node: 2\)"):
        train(cfg, tmp_path / "run", progress_plain=True)
    assert not [r for r in caplog.records if "learner actor ready" in r.getMessage()]


def test_a_non_finite_gradient_on_one_rank_skips_the_update_on_every_rank(tiny_model_dir):
    """One token of the last group — rank 1's share of the second mini-batch — gets an engine
    log-prob so low that its ratio π/μ overflows: only rank 1's loss is infinite, yet the
    gradient norm is the global one, so both ranks skip that update and commit the first."""
    import dataclasses

    batch = batches(tiny_model_dir)[0]
    scored = batch.payload
    row = len(scored.rewards) - 1  # the last sample of the last group: reward 0, advantage < 0
    logprobs = [list(lp) for lp in scored.logprobs]
    logprobs[row][0] = -1e30
    poisoned = dataclasses.replace(batch, payload=dataclasses.replace(scored, logprobs=logprobs))
    keys = dict(lr=1e-3, updates_per_batch=2, anchor="behavior", shared_prefix=False)
    solo = TorchLearner(tiny_model_dir, config("correction.tis=none", **keys)).train(poisoned,
                                                                                     train_version=0)
    sharded = ranks(config("correction.tis=none", world_size=2, **keys), tiny_model_dir)
    try:
        two = sharded.train(poisoned, train_version=0)
        after = dict(sharded.export_weights())  # gathered now, before the weights change again
        again = sharded.train(batch, train_version=1)  # every rank still agrees on the clock
    finally:
        sharded.close()
    assert (solo.committed_updates, two.committed_updates) == (1, 1)
    assert two.metrics["train/skipped_nonfinite_grad"] == 1.0
    assert all(torch.isfinite(t).all() for t in after.values())
    assert again.committed_updates == 2


def _most_of_ranks(rank: int, init_file: str, out) -> None:
    import torch.distributed as dist

    from tether.train.collective import Ranks

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = Ranks()
        out.put((rank, group.most(100.5 * (1 + rank)), group.most(3 - rank)))
    finally:
        dist.destroy_process_group()


def test_the_largest_value_over_ranks_keeps_its_type(tmp_path):
    """``most`` (micro-batch counts, each rank's peak memory) is the largest over the ranks, an
    int staying an int: every rank reports rank 1's memory, and rank 0's count."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_most_of_ranks, args=(r, str(tmp_path / "init"), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        answers = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert answers == [(0, 201.0, 3), (1, 201.0, 3)]
    assert all(type(count) is int for _, _, count in answers)


def test_two_ranks_keep_the_single_process_ema_and_any_world_size_resumes_it(tiny_model_dir, tmp_path):
    """train.ema_decay on FSDP2 ranks: each rank averages its own shards; the checkpoint's EMA folder,
    gathered whole, equals one process's, and one process resumes the ranks' average exactly."""
    from safetensors.torch import load_file

    rollout_batches = batches(tiny_model_dir)
    keys = {"shared_prefix": False, "lr": 5e-5, "ema_decay": 0.9, "ema_every": 1, "updates_per_batch": 2}
    solo = TorchLearner(tiny_model_dir, config(**keys))
    trained(solo, rollout_batches)
    solo.save(tmp_path / "solo")
    sharded = ranks(config(world_size=2, **keys), tiny_model_dir)
    try:
        pids = list(sharded.pids)
        trained(sharded, rollout_batches)
        sharded.save(str(tmp_path / "two"))
    finally:
        sharded.close()
    assert wait_gone(pids) == []
    def read(folder):
        return load_file(str(folder / "model.safetensors"))

    one, two = read(tmp_path / "solo" / "ema"), read(tmp_path / "two" / "ema")
    worst = max(((two[n] - w).abs().max() / w.abs().max().clamp(min=1e-12)).item() for n, w in one.items())
    assert set(one) == set(two) and worst <= RANKS_TOLERANCE, worst
    moved = max((one[n] - w).abs().max().item() for n, w in read(tmp_path / "solo" / "model").items())
    assert moved > 0  # the average is not the trained weights
    resumed = TorchLearner(tiny_model_dir, config(**keys))
    resumed.load(tmp_path / "two")
    for name, value in resumed.ema.values.items():
        assert torch.equal(value, two[name].to(value.dtype)), name
