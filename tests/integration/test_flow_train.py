"""`tether train` for the flow family end to end: a real tiny flow model, real worker processes,
real run directories. The seed system's two diffusion arms are reproduced exactly (publications
and per-batch staleness equal `tether plan`'s), a stopped run resumes exactly, and the flow demo
recipe runs (shortened) with its pictures."""

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from safetensors.torch import load_file

from faults.runs import whole_and_resumed
from schedule import rule_violations
from tether.config import load_config
from tether.errors import ConfigError
from tether.loop import Timings, simulate, summarize
from tether.runtime.run import train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
REWARD = Path(__file__).parent / "flow_reward.py"


@pytest.fixture(scope="module")
def flow_model(tmp_path_factory):
    """A small flow model warm-started for a few steps (its images earn some checks, so groups
    have reward variance), built once for the module."""
    path = tmp_path_factory.mktemp("flow") / "model"
    cfg = load_config(None, ["model.family=flow", "data.task=shapes", "flow.init_width=32",
                             "flow.init_depth=1", "warmstart.max_steps=40", "warmstart.target_pass_rate=1.0",
                             "warmstart.eval_every=40", "data.num_eval=16"])
    cfg.family().build_model(cfg, path, None)
    return path


def recipe(model_dir, *extra):
    return load_config(None, [f"model.path={model_dir}", "model.family=flow", "data.task=shapes",
                              "data.num_train=200", "data.num_eval=8", "flow.steps=4", "flow.eval_steps=4",
                              "rollout.batch_size=2", "rollout.group_size=4", "train.lr=1e-3",
                              "eval.interval=0", "checkpoint.interval=0", f"reward.function={REWARD}:reward",
                              *extra])


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.parametrize(("s", "batches", "published"), [(1, 6, [2, 4]), (3, 8, [4])], ids=["U2-S1", "U2-S3"])
def test_flow_runs_reproduce_the_seed_systems_diffusion_arms(flow_model, tmp_path, s, batches, published):
    """U = 2, S = 1, 6 rollouts: publications after 2 and 4; U = 2, S = 3, 8 rollouts: after 4."""
    cfg = recipe(flow_model, "train.updates_per_batch=2", f"async.max_staleness={s}",
                 f"async.max_inflight={s + 1}", f"train.num_batches={batches}")
    summary = train(cfg, tmp_path / "run", progress_plain=True)
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    plan = simulate(cfg.budget(), Timings(commits=tuple(int(m["async/optimizer_updates"]) for m in metrics)))
    assert [m["staleness/updates"] for m in metrics] == [r.staleness_updates for r in plan.trace.records]
    assert summary["syncs_after"] == summarize(plan)["syncs_after"] == published
    assert all(m["async/optimizer_updates"] == 2 for m in metrics)  # every update committed
    # per-step ratios against the engine: exactly 1 where the trained weights sampled the batch
    fresh = [m for m in metrics if m["staleness/updates"] == 0]
    assert fresh and all(m["mismatch/numeric_logprob_abs_diff_max"] < 1e-4 for m in fresh)
    assert max(m["staleness/updates"] for m in metrics) == 2 * s


def test_a_stopped_flow_run_resumes_exactly(flow_model, tmp_path, monkeypatch):
    """With flow.train_steps the learner trains 2 of each trajectory's 4 steps, drawn from the
    batch's seed: the resumed run draws the same ones."""
    cfg = recipe(flow_model, "train.num_batches=5", "checkpoint.interval=5", "async.max_staleness=1",
                 "train.algorithm=grpo", "flow.train_steps=2")
    keys = ("step", "batch_index", "async/behavior_version", "staleness/updates", "reward/mean",
            "loss/policy", "ratio/mean", "loss/kl")

    def trace(run_dir):
        folder = run_dir / "checkpoints" / "step-000005" / "learner" / "model"
        weights = load_file(str(folder / "model.safetensors"))
        return [{k: m.get(k) for k in keys} for m in rows(run_dir / "metrics.jsonl")], weights, \
            rows(run_dir / "samples.jsonl")

    (whole, whole_weights, whole_samples), (resumed, weights, samples) = whole_and_resumed(
        monkeypatch, cfg, tmp_path, trace)
    assert whole[-1]["loss/kl"] > 0  # the grpo preset's KL to the reference ran
    assert resumed == whole
    # samples.jsonl: each image's prompt and reward, the same after the stop and resume
    assert samples == whole_samples and {x["step"] for x in samples} == {1, 2, 3, 4, 5}
    for m in whole:
        rewards = [x["reward"] for x in samples if x["step"] == m["step"]]
        assert sum(rewards) / len(rewards) == pytest.approx(m["reward/mean"])
    assert all(isinstance(x["prompt"], str) and x["prompt"] for x in samples)
    for name, tensor in weights.items():
        assert tensor.equal(whole_weights[name]), name


def test_the_flow_demo_recipe_runs_shortened_with_pictures(flow_model, tmp_path, caplog):
    cfg = load_config(ROOT / "recipes" / "flow-demo.yaml",
                      [f"model.path={flow_model}", "train.num_batches=4", "eval.interval=2",
                       "checkpoint.interval=4", "data.num_eval=16"])
    summary = train(cfg, tmp_path / "run", progress_plain=True)
    # the module's model was built otherwise than the recipe would build it: said, not ignored
    said = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert f"warmstart.max_steps: built with 40, the recipe says {cfg.warmstart.max_steps}" in said
    assert "flow.init_width: built with 32" in said
    assert summary["trained_batches"] == 4
    evals = rows(tmp_path / "run" / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert all(0 <= e["eval/reward_mean"] <= 1 and e["eval/examples"] == 16 for e in evals)
    pictures = sorted(p.name for p in (tmp_path / "run" / "samples").glob("*.png"))
    assert pictures == ["step_000000.png", "step_000002.png", "step_000004.png"]
    from PIL import Image

    assert Image.open(tmp_path / "run" / "samples" / "step_000004.png").size[0] > 64
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    assert all(m["throughput/gen_images_per_s"] > 0 and 0 <= m["reward/mean"] <= 1 for m in metrics)
    assert (tmp_path / "run" / "samples" / "prompts.txt").read_text().count("\n") == 16
    # tether report lays the grids out and writes the study; tether eval reads the last checkpoint
    from tether.cli.eval_cmd import evaluate_model
    from tether.runtime.report import write_report

    plots = {p.name for p in write_report(tmp_path / "run")}
    assert {"samples.png", "study.png", "study.json", "reward.png"} <= plots
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000004" / "learner" / "model"
    again, _ = evaluate_model(cfg, checkpoint, samples=1)
    assert again["eval/reward_mean"] == evals[-1]["eval/reward_mean"]  # the same images, from fixed noise


def test_eval_seed_measures_runs_of_different_seeds_on_one_held_out_set(flow_model):
    """The same weights, evaluated as runs of run.seed 0 and 1 would: different prompts' noises
    unless eval.seed fixes them, then the same figures to the last digit."""
    from tether.cli.eval_cmd import evaluate_model

    def measured(*overrides):
        return evaluate_model(recipe(flow_model, "data.num_eval=16", *overrides), flow_model, samples=2)[0]

    first, second, fixed = measured(), measured("run.seed=1"), measured("run.seed=1", "eval.seed=0")
    assert fixed == first
    assert (second["eval/reward_mean"], second["eval/sampled_reward_mean"]) != (
        first["eval/reward_mean"], first["eval/sampled_reward_mean"])


@pytest.mark.parametrize("rule", [[], ["flow.sde_type=cps", "flow.noise_level=0.8"],
                                  ["flow.sde_window_slide=1"]], ids=["sde", "cps", "slide"])
def test_a_flow_run_with_an_sde_window_trains_the_windows_steps(flow_model, tmp_path, rule):
    """flow.sde_window=2 of 4 steps, within the first 3: each batch's window drawn by its seed (a
    resume and every rank draw the same), or sliding one step a batch (flow.sde_window_slide), the
    learner's log-probs of the window's steps equal the engine's where the trained weights sampled
    them, and the weights move; under Flow-GRPO's SDE and under CPS (flow.sde_type), whose rule the
    batches carry to the learner."""
    from tether.families.flow.policy import FlowSampling

    cfg = recipe(flow_model, "train.num_batches=4", "async.max_staleness=1", "flow.sde_window=2",
                 "flow.sde_window_range=3", "eval.interval=4", "eval.num_samples=2", "checkpoint.interval=4",
                 *rule)
    summary = train(cfg, tmp_path / "run", progress_plain=True)
    assert summary["trained_batches"] == 4
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    sampling = FlowSampling(steps=4, window=2, window_range=3)
    drawn = [sampling.window_steps(cfg.run.seed * 1_000_003 + m["batch_index"]).start for m in metrics]
    if cfg.flow.sde_window_slide:  # batches 0, 1, 2, 3 at starts 0, 1, then back to 0
        sliding = FlowSampling(steps=4, window=2, window_range=3, window_slide=1)
        drawn = [sliding.window_steps(0, m["batch_index"]).start for m in metrics]
        assert sorted(drawn) == [0, 0, 1, 1]
    assert [m["flow/window_start"] for m in metrics] == drawn and set(drawn) <= {0, 1}
    fresh = [m for m in metrics if m["staleness/updates"] == 0]
    assert fresh and all(m["mismatch/numeric_logprob_abs_diff_max"] < 1e-4 for m in fresh)
    assert any(m["loss/policy"] != 0 for m in metrics)
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "step-000004" / "learner" / "model" /
                            "model.safetensors"))
    start = load_file(str(flow_model / "model.safetensors"))
    assert any(not trained[name].equal(start[name]) for name in start)
    evals = rows(tmp_path / "run" / "eval.jsonl")
    assert all(0 <= e["eval/sampled_reward_mean"] <= 1 for e in evals)


def test_flow_same_latent_reaches_the_rollout_worker(flow_model):
    """flow.same_latent from the recipe to the worker's sampler: each prompt's group starts from
    one initial noise (its first recorded latent, without a window), and the batches differ."""
    import torch

    from tether.families.flow.rollout import FlowSampler
    from tether.families.flow.task import SHAPES
    from tether.vocabulary import SamplingParams, WorkItem

    examples = list(enumerate(SHAPES.examples("train", 2, seed=0)))
    starts = {}
    for same in (True, False):
        cfg = recipe(flow_model, f"flow.same_latent={str(same).lower()}")
        sampler = FlowSampler(cfg, str(flow_model), device=torch.device("cpu"))
        item = WorkItem(batch_index=0, version=0, examples=examples, group_size=4,
                        params=SamplingParams(max_new_tokens=1), seed=3)
        starts[same] = torch.from_numpy(sampler.generate(item).latents[:, 0]).flatten(1)
    shared, own = starts[True], starts[False]
    assert torch.equal(shared[:4], shared[:1].expand(4, -1))
    assert torch.equal(shared[4:], shared[4:5].expand(4, -1))
    assert not torch.equal(shared[0], shared[4])
    assert torch.cdist(own[:4], own[:4]).triu(1)[0, 1:].min() > 0.1


@pytest.mark.parametrize(("override", "says"), [
    ("rollout.temperature=0.5", "rollout.temperature"),
    ("rollout.dynamic_sampling=true", "dynamic sampling, which model.family=flow does not have"),
    ("reward.function=exact_match", "scores text"),
    ("flow.train_steps=5", "exceeds the flow.steps=4"),
    ("flow.sde_window=5", "flow.sde_window=5 exceeds the flow.steps=4"),
])
def test_language_model_keys_are_refused_for_flow(flow_model, tmp_path, override, says):
    with pytest.raises(ConfigError, match=says):
        cfg = recipe(flow_model, override)
        train(cfg, tmp_path / "run", progress_plain=True)


def test_flow_on_ray_rollout_actors_trains_batch_for_batch_like_local(flow_model, tmp_path):
    """The same FlowSampler in a Ray actor, weights through the object store: the same batches,
    versions, rewards and losses as local worker processes."""
    pytest.importorskip("ray")
    keys = ("step", "batch_index", "async/behavior_version", "staleness/updates", "reward/mean",
            "loss/policy")
    base = ("train.num_batches=4", "async.max_staleness=1")
    train(recipe(flow_model, *base), tmp_path / "local", progress_plain=True)
    train(recipe(flow_model, *base, "rollout.backend=ray", "ray.local_cpus=2"), tmp_path / "ray",
          progress_plain=True)
    local = [{k: m[k] for k in keys} for m in rows(tmp_path / "local" / "metrics.jsonl")]
    on_ray = [{k: m[k] for k in keys} for m in rows(tmp_path / "ray" / "metrics.jsonl")]
    assert local == on_ray  # the learner in a Ray actor too: tests/integration/test_flow_ranks.py


def test_the_flow_grpo_preset_trains_the_references_recipe_on_the_built_in_model(flow_model, tmp_path):
    """train.algorithm: flow_grpo as the reference runs it: LoRA adapters, two updates a batch with
    the ratio against the engine's log-probs (so its clip fraction is the one against μ), the first
    int(0.99·T) steps; the recipe's own lr wins."""
    cfg = recipe(flow_model, "train.algorithm=flow_grpo", "train.num_batches=3", "checkpoint.interval=3")
    assert (cfg.train.lora_rank, cfg.train.anchor, cfg.train.lr) == (32, "behavior", 1e-3)
    assert (cfg.flow.train_steps, cfg.flow.train_step_choice) == (3, "first")  # int(0.99 · 4)
    train(cfg, tmp_path / "run", progress_plain=True)
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == 3
    for m in metrics:
        assert m["async/optimizer_updates"] + m["train/skipped_updates"] == 2
        assert m["ratio/behavior_outside_clip_frac"] == pytest.approx(m["ratio/outside_clip_frac"])
    assert sum(m["async/optimizer_updates"] for m in metrics) > 0
    saved = tmp_path / "run" / "checkpoints" / "step-000003" / "learner" / "model"
    adapter = json.loads((saved / "adapter.json").read_text())  # the adapters alone (docs/lora.md)
    assert adapter["rank"] == 32 and adapter["alpha"] == 64.0, adapter


@pytest.mark.parametrize("mode", ["keep", "recompute", "abort"])
def test_weights_taken_up_between_denoising_steps_stay_within_the_budget(flow_model, tmp_path, mode):
    """async.inflight_update keep / recompute / abort: publications land while trajectories are
    being denoised (long trajectories, a cheap learner: 2 trained steps of 24), every step carries
    the version that took it, no batch trains above the budget, hard boundaries still drain, only
    abort throws steps away (then no trajectory spans two versions), metrics.attribution splits each
    step's log-ratio with nothing left over, and recompute runs as keep (the run says so: there is no
    cache to recompute)."""
    cfg = recipe(flow_model, "async.max_staleness=2", "async.max_inflight=2", f"async.inflight_update={mode}",
                 "flow.steps=24", "flow.train_steps=2", "train.num_batches=10", "eval.interval=5",
                 "checkpoint.interval=5", "flow.eval_steps=4", "train.algorithm=grpo",
                 "metrics.attribution=true")
    assert ("recompute_is_keep" in [n.code for n in cfg.family().notes(cfg)]) == (mode == "recompute")
    summary = train(cfg, tmp_path / "run", progress_plain=True)
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == 10 and summary["trained_batches"] == 10
    for m in metrics:
        assert 0 <= m["staleness/updates"] <= 2  # the budget, from each batch's oldest step
        assert m["staleness/token_min_updates"] <= m["staleness/token_mean_updates"] <= m["staleness/updates"]
        # the split of each step's log-ratio: no cache, so even under keep every step is exactly
        # its version's (numerics alone, nothing of an older version's work)
        assert m["attribution/token_frac"] == 1.0 and m["attribution/residual_abs_max"] < 1e-5
        assert m["attribution/numeric_logratio_abs_max"] < 1e-5
        if m["staleness/token_min_updates"] > 0:
            assert m["attribution/staleness_logratio_abs_mean"] > 0
        if mode == "abort":
            assert m["staleness/multi_version_seq_frac"] == 0
            assert (m["rollout/wasted_steps"] > 0) == (m["rollout/weight_switches"] > 0)
        else:
            assert m["rollout/wasted_steps"] == 0
            assert (m["staleness/multi_version_seq_frac"] > 0) <= (m["rollout/weight_switches"] > 0)
    events = rows(tmp_path / "run" / "events.jsonl")
    published = [e for e in events if e["kind"] == "sync" and e["published"]]
    assert any(not e["drained"] for e in published)  # published with trajectories being denoised
    assert all(e["drained"] for e in published if {"eval", "save"} & set(e["reasons"]))
    # every launch, consumption and publication the run recorded is what the rules allow in the
    # state the events before it leave (the launch bound by the oldest version still generating)
    assert rule_violations(cfg.budget(), events) == []
    assert any(e["kind"] == "launch" for e in events[events.index(published[0]):])
    first = next(i for i, e in enumerate(events) if e["kind"] == "launch")  # and the replay can fail:
    extra = [*events[:first + 1], {**events[first], "batch": 99}, *events[first + 1:]]  # a launch too many
    assert any("launch" in v for v in rule_violations(cfg.budget(), extra))
    unpublished = [e for e in events if e is not published[0]]
    assert any("no publication" in v or "version" in v for v in rule_violations(cfg.budget(), unpublished))
    print(f"\n{mode}: {sum(m['rollout/weight_switches'] for m in metrics):.0f} switches mid-trajectory over "
          f"{len(metrics)} batches")
