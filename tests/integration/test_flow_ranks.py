"""The flow family with learner ranks: two FSDP2 ranks make the single process's update on the
same real trajectories (the closed-form KL included), to 1e-5 in every parameter."""

import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from learners import solo_and_ranks, worst_relative  # noqa: E402
from tether.config import load_config  # noqa: E402
from tether.families.flow import scenes  # noqa: E402
from tether.families.flow.model import FlowModel, FlowModelConfig  # noqa: E402
from tether.families.flow.policy import FlowSampling  # noqa: E402
from tether.families.flow.rollout import FlowBatch, FlowEngine  # noqa: E402
from tether.vocabulary import RolloutBatch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
STEPS = 4
REWARD = Path(__file__).parent / "flow_reward.py"  # varies within every group, whatever the model


@pytest.fixture(scope="module")
def flow_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = FlowModel(FlowModelConfig(vocab=scenes.WORDS, width=32, depth=2, patch=4))
    with torch.no_grad():  # adaLN-Zero starts at v = 0; give every path a nonzero weight
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("flow") / "model"
    model.save_pretrained(path)
    return path, model


def rollout_batches(model):
    """Two real batches of 4 prompts × 4 trajectories, with rewards that vary within groups."""
    sampling = FlowSampling(steps=STEPS, noise_level=0.7)
    engine = FlowEngine(FlowModel(model.config), sampling)
    engine.load_weights(dict(model.named_parameters()), version=0)
    rng = random.Random(0)
    out = []
    for index in range(2):
        prompts = [s.prompt for s in scenes.all_scenes()[4 * index:4 * index + 4]]
        words = torch.tensor([scenes.encode(p) for p in prompts])
        sampled = engine.generate({"words": words.repeat_interleave(4, 0)}, seed=index)
        latents, logps, versions = sampled.latents, sampled.logprobs, sampled.versions
        payload = FlowBatch(positions=list(range(4)), prompts=prompts, cond={"words": words.numpy()},
                            latents=latents.numpy(), logprobs=logps.numpy(), versions=[versions] * 16,
                            rewards=[rng.random() for _ in range(16)], times=sampling.times().numpy(),
                            noise_level=0.7, group_size=4, seed=index)
        out.append(RolloutBatch(index=index, behavior_version=0, num_groups=4, group_size=4, payload=payload))
    return out


def config(path, *extra):
    return load_config(None, ["model.family=flow", "data.task=shapes", f"model.path={path}",
                              f"flow.steps={STEPS}", "train.lr=5e-5", "train.kl_coef=0.04",
                              "train.updates_per_batch=2", *extra])


@pytest.mark.parametrize("train_steps", [0, 2])
def test_two_ranks_make_the_single_process_flow_update(flow_dir, train_steps):
    path, model = flow_dir
    batches = rollout_batches(model)
    # a narrow clip, so that the second update's steps leave it against μ: a figure to agree on
    narrow = (f"flow.train_steps={train_steps}", "train.clip_low=1e-4", "train.clip_high=1e-4")
    (solo_weights, solo_results), (weights, results) = solo_and_ranks(
        path, config(path, *narrow), config(path, *narrow, "train.world_size=2"), batches)
    worst = worst_relative(weights, solo_weights)
    assert worst <= 1e-5, worst
    for a, b in zip(solo_results, results, strict=True):
        assert a.committed_updates == b.committed_updates == 2
        for key in ("loss/policy", "loss/kl", "train/grad_norm", "ratio/mean", "ratio/outside_clip_frac",
                    "ratio/behavior_outside_clip_frac"):
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-7), key
    assert solo_results[-1].metrics["loss/kl"] > 0  # the KL term was there to agree on


def test_the_flow_learner_in_a_ray_actor_trains_the_rows_it_trains_in_the_driver(flow_dir, tmp_path):
    import json
    import subprocess
    import sys

    pytest.importorskip("ray")
    path, _ = flow_dir
    common = ["model.family=flow", "data.task=shapes", f"model.path={path}", f"flow.steps={STEPS}",
              "flow.eval_steps=4", "data.num_train=200", "data.num_eval=16", "rollout.batch_size=2",
              "rollout.group_size=4", "train.num_batches=3", "eval.interval=0", "checkpoint.interval=0",
              f"reward.function={REWARD}:reward"]

    def rows(run, *extra):
        command = [sys.executable, "-m", "tether.cli.main", "train", *common, *extra, "--run-dir", str(run),
                   "--plain", "--no-report"]
        out = subprocess.run(command, capture_output=True, text=True, timeout=240,
                             cwd=Path(__file__).resolve().parents[2])
        assert out.returncode == 0, out.stderr[-3000:]
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    keys = ("batch_index", "async/behavior_version", "staleness/updates", "reward/mean", "loss/policy")
    local = rows(tmp_path / "local")
    actor = rows(tmp_path / "actor", "rollout.backend=ray", "ray.local_cpus=2", "ray.learner=actor")
    assert [{k: m[k] for k in keys} for m in actor] == [{k: m[k] for k in keys} for m in local]


@pytest.mark.parametrize("backbone", ["built-in", "diffusers"])
def test_flow_learner_ranks_write_checkpoints_that_load_and_resume(flow_dir, tmp_path, monkeypatch, backbone):
    """Two ranks gather the weights whole and rank 0 writes the family's own model folder (the
    DiT's, or a pipeline's transformer with its base named), which loads as the model and from
    which a stopped run resumes to the same weights."""
    from faults.runs import stop_and_resume
    from tether.families.flow.learn import FlowPolicy
    from tether.runtime.run import train

    if backbone == "diffusers":
        pytest.importorskip("diffusers")
        from tether.families.flow.tiny_sd3 import build_tiny_sd3

        path = build_tiny_sd3(tmp_path / "pipeline")
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("".join(f"prompt number {i}\n" for i in range(12)))
        data = ["data.task=", f"data.dataset={prompts}", "data.num_eval=4", "data.max_prompt_tokens=32",
                f"reward.function={REWARD}:reward"]
    else:
        path, data = flow_dir[0], ["data.task=shapes", "data.num_train=200", "data.num_eval=16",
                                   f"reward.function={REWARD}:reward"]
    common = ["model.family=flow", f"model.path={path}", f"flow.steps={STEPS}", "flow.eval_steps=4",
              "rollout.batch_size=2", "rollout.group_size=4", "train.num_batches=4", "eval.interval=0",
              "checkpoint.interval=2", "async.max_staleness=1", "train.world_size=2", *data]
    cfg = load_config(None, common)
    train(cfg, tmp_path / "whole", progress_plain=True)
    policy = FlowPolicy()
    final = policy.read_weights(tmp_path / "whole" / "checkpoints" / "step-000004" / "learner" / "model")
    model, _ = policy.load(tmp_path / "whole" / "checkpoints" / "step-000004" / "learner" / "model")
    assert set(final) == set(model.state_dict())  # a pipeline's: SD3's position table too (a buffer)
    for name, p in model.named_parameters():
        assert torch.equal(p, final[name]), name
    # resumed at one rank from the two ranks' checkpoint of step 2: the same last weights
    stopped = tmp_path / "stopped"
    stop_and_resume(monkeypatch, cfg, stopped, after=2)
    again = policy.read_weights(stopped / "checkpoints" / "step-000004" / "learner" / "model")
    for name, tensor in final.items():
        assert torch.allclose(again[name], tensor, rtol=1e-5, atol=1e-6), name
