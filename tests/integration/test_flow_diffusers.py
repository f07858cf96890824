"""A diffusers SD3-class pipeline behind the flow family: a tiny Stable Diffusion 3 pipeline built
locally from configs (transformer, VAE, two CLIP text encoders, SD3's scheduler; nothing
downloaded), sampled by Tether's SDE, trained through `tether train` with a pixel reward on
prompts from a file, with and without classifier-free guidance."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

import torch
from safetensors.torch import load_file

from faults.runs import whole_and_resumed
from tether.config import load_config
from tether.errors import ConfigError, DataError
from tether.loop import Timings, simulate
from tether.runtime.run import train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REWARD = Path(__file__).parent / "flow_reward.py"
PROMPTS = ["a red square", "a blue sky", "green grass at noon", "a yellow sun", "a black cat", "white snow",
           "an orange", "a purple flower", "a grey road", "a brown dog"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from tether.families.flow.tiny_sd3 import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipeline", seed=0)


def test_the_built_pipeline_does_not_depend_on_the_installed_libraries_initialisation(pipeline, tmp_path,
                                                                                   monkeypatch):
    """The text encoders' weights are drawn by Tether (CLIP's formulas, a generator of its own), not
    by transformers, whose order of drawing differs between versions: the same seed builds the same
    pipeline when the library initialises the encoders otherwise. Under the fixture's build the
    library drew them; here it draws something else, and nothing built changes."""
    from transformers import CLIPTextModelWithProjection

    from tether.families.flow.tiny_sd3 import build_tiny_sd3

    own_init = CLIPTextModelWithProjection.__init__

    def other_library(self, config):  # another version's initialisation: other numbers, more draws
        own_init(self, config)
        with torch.no_grad():
            for param in self.parameters():
                param.normal_(0, 0.5)

    monkeypatch.setattr(CLIPTextModelWithProjection, "__init__", other_library)
    again = build_tiny_sd3(tmp_path / "pipeline", seed=0)
    for part in ("text_encoder", "text_encoder_2", "transformer", "vae"):
        [want] = sorted((pipeline / part).glob("*.safetensors"))
        [have] = sorted((again / part).glob("*.safetensors"))
        want, have = load_file(want), load_file(have)
        assert want.keys() == have.keys()
        assert all(torch.equal(want[k], have[k]) for k in want), part
    one = load_file(next((pipeline / "text_encoder").glob("*.safetensors")))
    two = load_file(next((pipeline / "text_encoder_2").glob("*.safetensors")))
    token = "text_model.embeddings.token_embedding.weight"
    assert not torch.equal(one[token], two[token])  # two encoders, two draws
    assert abs(one[token].std().item() - 0.02) < 0.002  # CLIP's N(0, 0.02²), not the library's stand-in
    other = build_tiny_sd3(tmp_path / "seed1", seed=1)
    assert not torch.equal(one[token], load_file(next((other / "text_encoder").glob("*.safetensors")))[token])


def test_loading_a_pipeline_prints_no_note_about_its_image_processors(pipeline):
    """transformers notes, once a process, that an SD3 pipeline's image processors fall back to
    PIL where torchvision is not installed; the flow family calls no image processor, so neither a
    run's workers nor its driver print it (where torchvision is installed there is no note)."""
    code = ("from tether.families.flow.pipeline import DiffusersFlow\n"
            f"DiffusersFlow.from_pretrained({str(pipeline)!r})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "torchvision" not in done.stderr + done.stdout


def test_a_word_tokenizer_holds_each_word_of_the_task_whole_and_other_text_in_characters(tmp_path):
    """flow.init_tokens=words: BPE merges under which each of the shapes task's words is one token,
    every prompt four tokens between CLIP's start and end; text of other words keeps its characters
    and decodes back; words that share pieces ("le" in left and circles) all end whole."""
    from transformers import CLIPTokenizer

    from tether.families.flow import scenes
    from tether.families.flow.tiny_sd3 import ALPHABET, _tokenizer, build_tiny_sd3

    tok = _tokenizer(tmp_path / "words", 8, scenes.WORDS[1:])
    for scene in scenes.all_scenes():
        ids = tok(scene.prompt, padding="max_length", max_length=8).input_ids
        assert tok.convert_ids_to_tokens(ids) == [
            "<|startoftext|>", *(w + "</w>" for w in scene.prompt.split()), *["<|endoftext|>"] * 3]
    ids = tok("squared circ lefty").input_ids
    assert len(ids) > 5 and tok.decode(ids, skip_special_tokens=True) == "squared circ lefty"
    shared = ["le", "left", "circle", "circles", "el", "ele", "elect", "lectern", "a", "aaaa", "abab", "ba"]
    tok = _tokenizer(tmp_path / "shared", 8, shared)
    for word in shared:
        tokens = tok.convert_ids_to_tokens(tok(word).input_ids)
        assert tokens == ["<|startoftext|>", word + "</w>", "<|endoftext|>"]
    plain = build_tiny_sd3(tmp_path / "plain", image_size=16)
    worded = build_tiny_sd3(tmp_path / "worded", image_size=16, max_prompt_tokens=8, words=scenes.WORDS[1:])
    size = {p: json.loads((p / "text_encoder" / "config.json").read_text())["vocab_size"]
            for p in (plain, worded)}
    assert size[plain] == 2 + 2 * len(ALPHABET) < size[worded]
    assert size[worded] == len(CLIPTokenizer.from_pretrained(worded / "tokenizer").get_vocab())


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n\n")  # a blank line is not a prompt
    return path


def recipe(pipeline, prompts, *extra):
    return load_config(None, [f"model.path={pipeline}", "model.family=flow", "data.task=",
                              f"data.dataset={prompts}", "data.num_eval=4", "data.max_prompt_tokens=32",
                              "flow.steps=4", "flow.eval_steps=4", "rollout.batch_size=2",
                              "rollout.group_size=4", "train.lr=1e-3", "eval.interval=0",
                              "checkpoint.interval=0", f"reward.function={REWARD}:reward", *extra])


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.parametrize("guidance", [1.0, 4.5], ids=["no-cfg", "cfg-4.5"])
def test_engine_and_learner_step_logprobs_agree_for_a_diffusers_pipeline(pipeline, guidance):
    """The engine samples with the whole pipeline (text encoders, scheduler sigmas, guidance);
    the learner, which loads the transformer alone, recomputes every step's log-prob from the
    conditioning carried with the batch: mean |Δ| ≤ 1e-5 in float32."""
    from tether.families.flow import conditioning
    from tether.families.flow.learn import FlowPolicy, to_flow_batch
    from tether.families.flow.model import load_flow_model
    from tether.families.flow.policy import FlowSampling
    from tether.families.flow.rollout import FlowBatch, FlowEngine

    torch.set_num_threads(1)
    model = load_flow_model(pipeline)
    sigmas = model.times(4, 0.0)
    sampling = FlowSampling(steps=4, noise_level=0.7, guidance_scale=guidance,
                            schedule=tuple(float(t) for t in sigmas))
    engine = FlowEngine(model, sampling, negative_prompt="")
    cond = model.encode_prompts(PROMPTS[:3])
    per_sample = conditioning.rows(cond, torch.arange(3).repeat_interleave(2))
    out = engine.generate(per_sample, seed=7)
    latents, logps, versions = out.latents, out.logprobs, out.versions
    assert latents.shape == (6, 5, 4, 16, 16) and versions == [0] * 4
    negative = engine.negative
    batch = FlowBatch(positions=[0, 1, 2], prompts=PROMPTS[:3], cond=conditioning.as_numpy(cond),
                      latents=latents.numpy(), logprobs=logps.numpy(), versions=[versions] * 6,
                      rewards=[0.0] * 6, times=sigmas.numpy(), noise_level=0.7, group_size=2,
                      negative=None if negative is None else conditioning.as_numpy(negative),
                      guidance_scale=guidance)
    batch.check()
    policy = FlowPolicy()
    learner_model, _ = policy.load(pipeline)
    assert learner_model.pipe is None  # no text encoder or VAE in the learner
    assert {n.split(".")[0] for n, _ in learner_model.named_parameters()} == {"transformer"}
    tb = to_flow_batch(batch)
    with torch.no_grad():
        learner_logp = policy.forward(learner_model, tb)[0]
    diff = (learner_logp - tb.behavior_logp).abs()
    assert diff.mean() <= 1e-5, diff.mean()
    if guidance != 1.0:  # the guided policy is what was sampled: the unguided one is another
        import dataclasses

        with torch.no_grad():
            unguided = policy.forward(learner_model, dataclasses.replace(tb, guidance_scale=1.0))[0]
        assert (unguided - tb.behavior_logp).abs().mean() > 1e-3


def test_the_trajectory_times_are_the_schedulers_shifted_sigmas(pipeline):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from tether.families.flow.model import load_flow_model

    model = load_flow_model(pipeline, whole=False)
    for shift in (0.0, 1.0, 3.0):
        scheduler = FlowMatchEulerDiscreteScheduler(shift=shift or 3.0)  # the pipeline's is shift 3
        scheduler.set_timesteps(6)
        assert torch.equal(model.times(6, shift), scheduler.sigmas.float())
    assert not torch.equal(model.times(6, 1.0), model.times(6, 3.0))


def test_a_pipeline_trains_through_tether_train_with_guidance_on_prompts_from_a_file(pipeline, prompts,
                                                                                      tmp_path):
    """Per-batch staleness follows `tether plan`; prompts come from a .txt file; guidance is
    recorded with every batch; the checkpoint is the transformer and the base's identity; `tether
    eval` on it gives the run's last held-out reward; `tether report` lays out its pictures."""
    cfg = recipe(pipeline, prompts, "train.num_batches=4", "async.max_staleness=1", "async.max_inflight=2",
                 "train.updates_per_batch=2", "flow.guidance_scale=3.0", "eval.interval=2",
                 "checkpoint.interval=4")
    summary = train(cfg, tmp_path / "run", progress_plain=True)
    assert summary["trained_batches"] == 4
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    plan = simulate(cfg.budget(), Timings(commits=tuple(int(m["async/optimizer_updates"]) for m in metrics)))
    assert [m["staleness/updates"] for m in metrics] == [r.staleness_updates for r in plan.trace.records]
    fresh = [m for m in metrics if m["staleness/updates"] == 0]
    assert fresh and all(m["mismatch/numeric_logprob_abs_diff_max"] < 1e-4 for m in fresh)
    assert all(m["time/decode"] > 0 for m in metrics)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000004" / "learner" / "model"
    record = json.loads((checkpoint / "config.json").read_text())
    assert record["backbone"] == "diffusers" and record["base"] == str(Path(pipeline).resolve())
    assert not (checkpoint / "vae").exists() and (checkpoint / "transformer").is_dir()
    evals = rows(tmp_path / "run" / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4] and evals[-1]["eval/examples"] == 4

    from tether.cli.eval_cmd import evaluate_model
    from tether.runtime.report import write_report

    again, _ = evaluate_model(cfg, checkpoint, samples=1)
    assert again["eval/reward_mean"] == pytest.approx(evals[-1]["eval/reward_mean"], abs=1e-6)
    from PIL import Image

    assert Image.open(tmp_path / "run" / "samples" / "step_000004.png").size[0] >= 64
    plots = {p.name for p in write_report(tmp_path / "run")}
    assert {"samples.png", "reward.png"} <= plots


def test_a_stopped_pipeline_run_resumes_exactly(pipeline, prompts, tmp_path, monkeypatch):
    cfg = recipe(pipeline, prompts, "train.num_batches=4", "checkpoint.interval=4", "async.max_staleness=1",
                 "train.kl_coef=0.01", "flow.train_steps=2", "flow.train_step_choice=first")
    keys = ("step", "batch_index", "async/behavior_version", "staleness/updates", "reward/mean",
            "loss/policy", "loss/kl")

    def trace(run_dir):
        folder = run_dir / "checkpoints" / "step-000004" / "learner" / "model" / "transformer"
        weights = load_file(str(next(folder.glob("*.safetensors"))))
        return [{k: m.get(k) for k in keys} for m in rows(run_dir / "metrics.jsonl")], weights

    (whole, whole_weights), (resumed, weights) = whole_and_resumed(monkeypatch, cfg, tmp_path, trace)
    assert whole[-1]["loss/kl"] > 0  # the reference transformer, a second copy of the base's
    assert resumed == whole
    for name, tensor in weights.items():
        assert tensor.equal(whole_weights[name]), name


def test_a_checkpoint_refuses_a_base_pipeline_that_changed_or_is_gone(pipeline, tmp_path):
    from tether.families.flow.model import load_flow_model

    base = tmp_path / "base"
    shutil.copytree(pipeline, base)
    model = load_flow_model(base, whole=False)
    model.save_pretrained(tmp_path / "checkpoint")
    again = load_flow_model(tmp_path / "checkpoint")
    for name, p in model.named_parameters():
        assert torch.equal(p, dict(again.named_parameters())[name])
    config = json.loads((base / "vae" / "config.json").read_text())
    (base / "vae" / "config.json").write_text(json.dumps({**config, "scaling_factor": 1.0}))
    with pytest.raises(ConfigError, match="fingerprint"):
        load_flow_model(tmp_path / "checkpoint")
    shutil.rmtree(base)
    with pytest.raises(ConfigError, match="is gone"):
        load_flow_model(tmp_path / "checkpoint")


@pytest.mark.parametrize(("override", "says"), [
    ("data.prompt_column=text", "has no column 'text'"),
])
def test_bad_pipeline_settings_are_refused_clearly(pipeline, prompts, tmp_path, override, says):
    with pytest.raises((ConfigError, DataError), match=says):
        cfg = recipe(pipeline, prompts, "train.num_batches=1", override)
        train(cfg, tmp_path / "run", progress_plain=True)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(("override", "says"), [
    ("flow.resolution=33", "flow.resolution=33 is not a multiple of 2, the factor by which .* multiple of 2"),
    # 4 steps at the scheduler's shift 3 (flow.shift: 0 takes it): the last step's r is 1.5
    ("flow.noise_level=1.9", r"flow.shift=0 \(the model's own, 3\) and flow.steps=4: .* ≤ 1.63"),
])
def test_pipeline_settings_its_configs_rule_out_are_refused_when_the_recipe_is_read(pipeline, prompts,
                                                                                   override, says):
    """What depends on the pipeline's own configs (its VAE's factor, its scheduler's shift) is
    read from them with the recipe, before any process or diffusers loads anything."""
    with pytest.raises(ConfigError, match=says):
        recipe(pipeline, prompts, override)
    recipe(pipeline, prompts, "flow.resolution=32", "flow.noise_level=1.6")


def test_resolution_is_refused_for_the_built_in_model(tmp_path):
    with pytest.raises(ConfigError, match="built-in model, whose size is fixed"):
        load_config(None, ["model.family=flow", "data.task=shapes", f"model.path={tmp_path / 'm'}",
                           "flow.resolution=32"])


@pytest.mark.parametrize("keys", [["flow.init_tokens=words"],
                                  ["flow.init_vae_steps=20", "flow.init_vae_reward=0.5"]])
def test_the_sd3_builds_keys_are_refused_for_the_built_in_model(tmp_path, keys):
    """flow.init_tokens and the VAE's keys shape the tiny SD3 pipeline alone: with the built-in
    DiT (flow.init_backbone=dit) they would do nothing, so the recipe is refused, naming each;
    with flow.init_backbone=sd3 they are read."""
    base = ["model.family=flow", "data.task=shapes", f"model.path={tmp_path / 'm'}"]
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*base, *keys])
    assert all(key in str(refused.value) for key in keys) and "flow.init_backbone=sd3" in str(refused.value)
    cfg = load_config(None, [*base, *keys, "flow.init_backbone=sd3", "data.max_prompt_tokens=32"])
    assert cfg.flow.init_backbone == "sd3"


def test_build_keys_set_for_a_pipeline_tether_did_not_build_are_named_in_a_warning(pipeline, prompts,
                                                                                 tmp_path, caplog):
    """The flow.init_* keys shape a pipeline Tether builds. A user's own pipeline (no warmstart.json)
    is used as it is, so each of them a recipe sets away from its default is named in a warning
    when the run prepares its model; a pipeline Tether built is compared with its build instead."""
    import logging

    from tether.data.prepare import ensure_model

    caplog.set_level(logging.WARNING, logger="tether")
    keys = ["flow.init_backbone=sd3", "flow.init_width=128", "flow.init_cond_dropout=0.2"]
    assert ensure_model(recipe(pipeline, prompts, *keys)) == pipeline
    (said,) = [r.getMessage() for r in caplog.records if "did not build" in r.getMessage()]
    assert f"model.path {pipeline} is a model Tether did not build" in said
    assert ", ".join(keys) in said and "drop them" in said
    caplog.clear()
    ensure_model(recipe(pipeline, prompts, "flow.init_width=96"))  # the default: nothing set, nothing said
    assert not [r for r in caplog.records if "did not build" in r.getMessage()]
    built = tmp_path / "built"
    shutil.copytree(pipeline, built)
    (built / "warmstart.json").write_text(json.dumps({"settings": {"backbone": "sd3", "init_width": 128}}))
    ensure_model(recipe(built, prompts, *keys))
    assert not [r for r in caplog.records if "did not build" in r.getMessage()]


def test_a_bfloat16_engine_trains_a_float32_learner_with_the_mismatch_measured(pipeline, prompts, tmp_path):
    """flow.dtype=bfloat16: the engine's pipeline in bf16 (published float32 weights cast on the
    way in, never bound), its SDE step and log-probs in float32; the learner float32. The
    precision mismatch is what the mismatch metrics show, and it is small."""
    cfg = recipe(pipeline, prompts, "train.num_batches=2", "flow.dtype=bfloat16", "async.max_staleness=0")
    train(cfg, tmp_path / "run", progress_plain=True)
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    numeric = [m["mismatch/numeric_logprob_abs_diff_max"] for m in metrics]
    assert all(1e-5 < d < 1e-2 for d in numeric), numeric  # float32 agrees to ~1e-7


def test_bfloat16_is_refused_for_the_built_in_model(tmp_path):
    with pytest.raises(ConfigError, match=r"flow\.dtype=bfloat16 is for a diffusers pipeline"):
        load_config(None, ["model.family=flow", "data.task=shapes", f"model.path={tmp_path / 'm'}",
                           "flow.dtype=bfloat16"])


def test_a_pipeline_on_ray_actors_trains_batch_for_batch_like_local(pipeline, prompts, tmp_path):
    """Rollout workers and the learner as Ray actors, the guided batches (conditioning, negative
    prompt and all) through the object store: the same rows as local processes."""
    pytest.importorskip("ray")
    keys = ("step", "batch_index", "async/behavior_version", "staleness/updates", "reward/mean",
            "loss/policy")
    base = ("train.num_batches=3", "async.max_staleness=1", "flow.guidance_scale=2.0")
    train(recipe(pipeline, prompts, *base), tmp_path / "local", progress_plain=True)
    train(recipe(pipeline, prompts, *base, "rollout.backend=ray", "ray.local_cpus=2", "ray.learner=actor"),
          tmp_path / "ray", progress_plain=True)
    local = [{k: m[k] for k in keys} for m in rows(tmp_path / "local" / "metrics.jsonl")]
    on_ray = [{k: m[k] for k in keys} for m in rows(tmp_path / "ray" / "metrics.jsonl")]
    assert local == on_ray


def test_lora_on_a_pipelines_transformer_trains_resumes_and_evaluates(pipeline, prompts, tmp_path,
                                                                       monkeypatch):
    """LoRA on the attention projections Flow-GRPO's reference adapts in SD3: the adapters alone
    published and merged by the engine (its step log-probs equal the learner's on fresh batches),
    the KL reference the transformer with them off, an exact resume, `tether eval` of the adapter
    checkpoint giving the run's last held-out reward."""
    from faults.runs import stop_and_resume

    targets = "[to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out]"
    cfg = recipe(pipeline, prompts, "train.num_batches=4", "checkpoint.interval=4", "async.max_staleness=1",
                 "train.lora_rank=4", "train.lora_alpha=8", f"train.lora_targets={targets}",
                 "train.kl_coef=0.01", "eval.interval=4", "flow.guidance_scale=2.0")
    train(cfg, tmp_path / "whole", progress_plain=True)
    metrics = rows(tmp_path / "whole" / "metrics.jsonl")
    assert metrics[-1]["loss/kl"] > 0
    fresh = [m for m in metrics if m["staleness/updates"] == 0]
    assert fresh and all(m["mismatch/numeric_logprob_abs_diff_max"] < 1e-4 for m in fresh)
    folder = tmp_path / "whole" / "checkpoints" / "step-000004" / "learner" / "model"
    adapters = load_file(str(folder / "adapter.safetensors"))
    assert adapters and all(".lora_" in n and n.startswith("transformer.") for n in adapters)
    assert any(t.abs().max() > 0 for n, t in adapters.items() if "lora_B" in n)
    from tether.cli.eval_cmd import evaluate_model

    again, _ = evaluate_model(cfg, folder, samples=1)
    last = rows(tmp_path / "whole" / "eval.jsonl")[-1]
    assert again["eval/reward_mean"] == pytest.approx(last["eval/reward_mean"], abs=1e-6)
    stopped = tmp_path / "stopped"
    stop_and_resume(monkeypatch, cfg, stopped, after=2)
    resumed = load_file(str(stopped / "checkpoints" / "step-000004" / "learner" / "model" /
                            "adapter.safetensors"))
    for name, tensor in adapters.items():
        assert torch.equal(resumed[name], tensor), name


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA device")])])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rollout_worker_samples_the_pipeline_on_its_device_as_the_cpu_learner_scores_it(
        pipeline, prompts, device, dtype):
    """The flow sampler of a rollout worker on ``device`` (a Ray actor with a GPU runs this), in the
    engine dtype of flow.dtype; the float32 learner on the CPU recomputes every step's log-prob. In
    float32 they agree to numerics; bfloat16 shows as a small measured mismatch
    (scripts/device_check.sh runs the CUDA cases)."""
    from tether.families.flow.learn import FlowPolicy, to_flow_batch
    from tether.families.flow.rollout import FlowSampler
    from tether.vocabulary import Example, SamplingParams, WorkItem

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    cfg = recipe(pipeline, prompts, f"flow.dtype={dtype}", "flow.guidance_scale=4.5")
    sampler = FlowSampler(cfg, str(pipeline), device=torch.device(device))
    item = WorkItem(batch_index=0, version=0, examples=[(i, Example(prompt=p, answer="")) for i, p in
                                                        enumerate(PROMPTS[:3])],
                    group_size=2, params=SamplingParams(max_new_tokens=1), seed=5)
    batch = sampler.generate(item)
    batch.check()
    policy = FlowPolicy()
    learner_model, _ = policy.load(pipeline)
    tb = to_flow_batch(batch)
    with torch.no_grad():
        diff = (policy.forward(learner_model, tb)[0] - tb.behavior_logp).abs().mean().item()
    print(f"\n{device} {dtype}: engine against the float32 CPU learner, mean |Δ log-prob| {diff:.2e}")
    bound = {("cpu", "float32"): 1e-5, ("cuda", "float32"): 1e-4}.get((device, dtype), 1e-2)
    assert diff <= bound


def test_a_pipelines_sde_window_records_and_trains_its_steps_alone(pipeline, prompts):
    """flow.sde_window on a diffusers pipeline (guided, the scheduler's shifted sigmas): the batch
    holds the window's K steps at their sigmas, and the transformer-only learner's log-probs of
    them equal the engine's."""
    from tether.families.flow.learn import FlowPolicy, to_flow_batch
    from tether.families.flow.rollout import FlowSampler
    from tether.vocabulary import Example, SamplingParams, WorkItem

    torch.set_num_threads(1)
    cfg = recipe(pipeline, prompts, "flow.guidance_scale=4.5", "flow.sde_window=2", "flow.sde_window_range=3")
    sampler = FlowSampler(cfg, str(pipeline), device=torch.device("cpu"))
    item = WorkItem(batch_index=0, version=0, examples=[(i, Example(prompt=p, answer="")) for i, p in
                                                        enumerate(PROMPTS[:3])],
                    group_size=2, params=SamplingParams(max_new_tokens=1), seed=5)
    batch = sampler.generate(item)
    batch.check()
    start = sampler.sampling.window_steps(5).start
    assert start == 1  # seed 5: an ODE step before the window and one after it
    assert batch.first_step == start and batch.latents.shape[1] == 3 and batch.logprobs.shape == (6, 2)
    assert torch.equal(torch.as_tensor(batch.times), sampler.sampling.times()[start:start + 3])
    policy = FlowPolicy()
    learner_model, _ = policy.load(pipeline)
    tb = to_flow_batch(batch)
    with torch.no_grad():
        diff = (policy.forward(learner_model, tb)[0] - tb.behavior_logp).abs().max().item()
    assert diff <= 1e-5


def _edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _remove_weights(folder):
    for f in folder.glob("*.safetensors"):
        f.unlink()


BROKEN = {  # how a pipeline folder is broken → what the refusal names
    "no-vae": (lambda p: shutil.rmtree(p / "vae"), r"vae/ is missing"),
    "no-text-encoder": (lambda p: shutil.rmtree(p / "text_encoder_2"), r"text_encoder_2/ is missing"),
    "no-tokenizer-config": (lambda p: (p / "tokenizer" / "tokenizer_config.json").unlink(),
                            r"tokenizer/tokenizer_config.json is missing"),
    "no-weights": (lambda p: _remove_weights(p / "transformer"), r"transformer/ holds no weights"),
    "vae-config-not-json": (lambda p: (p / "vae" / "config.json").write_text('{"block_out_channels": [8,'),
                            r"vae/config.json cannot be read as JSON"),
    "vae-blocks": (lambda p: _edit_json(p / "vae" / "config.json", block_out_channels="8,16"),
                   r"block_out_channels is '8,16'"),
    "vae-latents": (lambda p: _edit_json(p / "vae" / "config.json", latent_channels=16),
                    r"the VAE's latents have 16 channels .* the transformer takes 4"),
    "t5-without-encoder": (lambda p: _edit_json(p / "model_index.json",
                                                tokenizer_3=["transformers", "T5TokenizerFast"]),
                           r"model_index.json names no text_encoder_3"),
    "scheduler": (lambda p: _edit_json(p / "model_index.json",
                                       scheduler=["diffusers", "EulerDiscreteScheduler"]),
                  r"the scheduler is EulerDiscreteScheduler"),
    "unet-pipeline": (lambda p: _edit_json(p / "model_index.json", _class_name="StableDiffusionPipeline"),
                      r"names the pipeline class 'StableDiffusionPipeline'; the flow family trains "
                      r"StableDiffusion3Pipeline"),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_pipeline_folder_that_is_not_whole_is_refused_when_the_recipe_is_read(pipeline, prompts, tmp_path,
                                                                               broken):
    """Read from model_index.json and the parts' configs before diffusers loads anything (so before
    any process starts): an unsupported class, a part missing, without its config or weights, or a
    setting Tether reads that makes no sense, each named in one ConfigError."""
    from tether.families.flow.model import load_flow_model

    copy = tmp_path / "pipeline"
    shutil.copytree(pipeline, copy)
    breaks, says = BROKEN[broken]
    breaks(copy)
    with pytest.raises(ConfigError, match=says):
        recipe(copy, prompts)
    with pytest.raises(ConfigError, match=says):  # and where a checkpoint's base or the API loads it
        load_flow_model(copy, whole=False)


def test_a_vae_config_that_does_not_fit_its_weights_is_refused_clearly(pipeline, tmp_path):
    """What only loading finds (a config whose sizes are not its weights') is one ConfigError
    naming the folder, not diffusers' hundred lines of size mismatches."""
    from tether.families.flow.model import load_flow_model

    copy = tmp_path / "pipeline"
    shutil.copytree(pipeline, copy)
    _edit_json(copy / "vae" / "config.json", block_out_channels=[8, 16, 32],
               down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3)
    with pytest.raises(ConfigError, match=r"diffusers cannot load .*VAE.* \(RuntimeError: .*size mismatch"):
        load_flow_model(copy)


@pytest.mark.parametrize(("settings", "codes"), [
    (("flow.guidance_scale=0",), ["unconditional"]),
    (("flow.guidance_scale=0.5",), ["guidance_below_one"]),
    (("flow.negative_prompt=blurry",), ["unused_negative_prompt"]),
    (("flow.guidance_scale=4.5", "flow.negative_prompt=blurry"), []),
    (("flow.guidance_scale=1",), []),
])
def test_guidance_that_has_no_effect_is_noted_once_at_start(pipeline, prompts, tmp_path, caplog, settings,
                                                             codes):
    """Guidance 0 (the unconditional branch alone: the prompts do nothing) and a negative prompt
    without guidance run, but say so when the run starts (here one refused for its non-empty run
    directory right after, so nothing trains)."""
    import logging

    cfg = recipe(pipeline, prompts, *settings)
    assert [n.code for n in cfg.family().notes(cfg)] == codes
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "something").write_text("")
    caplog.set_level(logging.WARNING, logger="tether")
    with pytest.raises(ConfigError, match="not empty"):
        train(cfg, tmp_path / "run", progress_plain=True)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("note [")]
    assert [s.split("]")[0].removeprefix("note [") for s in said if "oversubscribed" not in s] == codes


def test_a_checkpoint_holds_its_whole_transformer_and_tether_eval_names_the_file_it_read(
        pipeline, prompts, tmp_path, capfd):
    """A checkpoint's transformer/ holds SD3's fixed position table beside the trained parameters,
    so loading it (as `tether eval` does) initialises nothing anew and diffusers has nothing to
    warn of; `tether eval` names the held-out file it read (data.eval_dataset) as such."""
    from tether.cli.main import main
    from tether.families.flow.model import load_flow_model

    model = load_flow_model(pipeline, whole=False)
    model.save_pretrained(tmp_path / "checkpoint")
    saved = load_file(str(tmp_path / "checkpoint" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert "pos_embed.pos_embed" in saved
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("a pink cloud\na green leaf\n")
    capfd.readouterr()
    rc = main(["eval", f"model.path={pipeline}", "model.family=flow", "data.task=", f"data.dataset={prompts}",
               f"data.eval_dataset={held_out}", "data.num_eval=2", "data.max_prompt_tokens=32",
               "flow.eval_steps=2", "flow.steps=2", f"reward.function={REWARD}:reward",
               "--model", str(tmp_path / "checkpoint"), "--samples", "1"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert f"on 2 held-out examples of dataset {prompts} (held out: {held_out})" in out
    assert "newly initialized" not in out + err and "pos_embed" not in out + err


def test_an_sd3_pipeline_the_recipe_builds_has_a_trained_vae_and_trains_on_shapes(tmp_path, caplog):
    """flow.init_backbone=sd3: model.create_if_missing builds a tiny SD3 pipeline, trains its VAE on
    drawn scenes (it reconstructs them far better than the random one; latents normalised to zero
    mean and unit variance, SD3's convention), warm-starts its transformer with guidance's empty
    prompt, and the run trains it with CFG on the shapes prompts; a recipe asking for another build
    is told the keys it differs in."""
    import random

    from tether.data.prepare import built_otherwise
    from tether.families.flow import scenes
    from tether.families.flow.sd3_warmstart import VAE_WIDTH, latents_of
    from tether.families.flow.tiny_sd3 import build_tiny_sd3

    model = tmp_path / "sd3-shapes"
    keys = [f"model.path={model}", "model.create_if_missing=true", "model.family=flow", "data.task=shapes",
            "flow.init_backbone=sd3", "flow.init_width=32", "flow.init_depth=1", "flow.init_vae_steps=60",
            "warmstart.max_steps=4", "warmstart.eval_every=4", "data.num_eval=8", "data.max_prompt_tokens=32",
            "flow.guidance_scale=4.5", "flow.steps=4", "flow.eval_steps=4", "rollout.batch_size=2",
            "rollout.group_size=4", "train.num_batches=2", "eval.interval=2", "checkpoint.interval=0",
            f"reward.function={REWARD}:reward"]  # varies within groups after four warm-start steps
    summary = train(load_config(None, keys), tmp_path / "run", progress_plain=True)
    assert summary["trained_batches"] == 2
    record = json.loads((model / "warmstart.json").read_text())["settings"]
    assert (record["backbone"], record["vae_steps"], record["cond_dropout"]) == ("sd3", 60, 0.1)
    # 60 steps cannot reconstruct the scenes to the verifier's full reward: it trains them all, the
    # record says how far it got, and the build says what that costs
    assert record["vae_steps_taken"] == 60 and record["vae_reward"] < record["vae_reward_target"] == 1.0
    assert any("flow.init_vae_steps=60" in r.getMessage() and "no image this pipeline decodes can score more"
               in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(model / "vae")
    assert (vae.config.shift_factor, vae.config.scaling_factor) == pytest.approx(
        (record["latent_shift"], record["latent_scale"]))
    build_tiny_sd3(tmp_path / "random", image_size=scenes.SIZE, vae_width=VAE_WIDTH)
    untrained = AutoencoderKL.from_pretrained(tmp_path / "random" / "vae")
    rng = random.Random(5)
    images = torch.stack([scenes.from_pixels(scenes.render(s, rng)) for s in scenes.all_scenes()[:64]])
    with torch.no_grad():
        errors = [float((v.decode(v.encode(images).latent_dist.mean).sample - images).abs().mean())
                  for v in (vae, untrained)]
    assert errors[0] < 0.5 * errors[1], errors
    z = latents_of(vae, images)
    assert abs(float(z.mean())) < 0.5 and 0.5 < float(z.std()) < 2.0
    other = load_config(None, [*keys, "flow.init_vae_steps=61"])
    assert built_otherwise(other, model) == ["flow.init_vae_steps: built with 60, the recipe says 61"]
    other = load_config(None, [*keys, "flow.init_vae_reward=0.9"])
    assert built_otherwise(other, model) == ["flow.init_vae_reward: built with 1.0, the recipe says 0.9"]
    other = load_config(None, [*keys, "flow.init_tokens=words"])
    assert built_otherwise(other, model) == ["flow.init_tokens: built with characters, the recipe says words"]


@pytest.mark.parametrize(("tokens", "length", "need"), [("characters", 23, 24), ("words", 5, 6)])
def test_a_prompt_length_that_would_cut_the_tasks_prompts_is_refused_before_anything_is_built(
        tmp_path, tokens, length, need):
    """The shapes task's longest prompt is 24 tokens a character and 6 a word (CLIP's start and end
    included): a data.max_prompt_tokens below that would have the built text encoders read cut
    prompts, so the build refuses it, naming the length to set, and writes no model."""
    model = tmp_path / "sd3"
    keys = [f"model.path={model}", "model.create_if_missing=true", "model.family=flow", "data.task=shapes",
            "flow.init_backbone=sd3", f"flow.init_tokens={tokens}", f"data.max_prompt_tokens={length}",
            "flow.init_width=32", "flow.init_depth=1", "flow.guidance_scale=4.5", "train.num_batches=1"]
    with pytest.raises(ConfigError, match=f"data.max_prompt_tokens={length} .* at least {need}") as refused:
        train(load_config(None, keys), tmp_path / "run", progress_plain=True)
    assert ("(or flow.init_tokens=words" in str(refused.value)) == (tokens == "characters")
    assert not model.exists() and not any(p.name.startswith(".sd3") for p in tmp_path.iterdir())


def test_the_vae_trains_until_its_reconstructions_reach_the_target(monkeypatch):
    """The VAE's training stops at the first check that reaches flow.init_vae_reward, and runs to
    its most steps where none does (the check at the last step too)."""
    from diffusers import AutoencoderKL

    from tether.families.flow import scenes, sd3_warmstart
    from tether.families.flow.sd3_warmstart import VAE_WIDTH, check_scenes, reconstruction_reward, train_vae

    monkeypatch.setattr(sd3_warmstart, "VAE_CHECK_EVERY", 2)
    drawn, images = check_scenes(seed=0, n=16)
    assert {s.prompt for s in drawn} <= {s.prompt for s in scenes.all_scenes()} and len(set(drawn)) == 16

    def tiny_vae():
        torch.manual_seed(0)
        return AutoencoderKL(block_out_channels=(VAE_WIDTH // 2, VAE_WIDTH), in_channels=3, out_channels=3,
                             latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8)

    def run(checks, steps):
        calls = iter(checks)
        return train_vae(tiny_vae(), images, steps=steps, generator=torch.Generator().manual_seed(0),
                         batch_size=4, check=lambda: next(calls), target=0.95)

    assert run([0.2, 0.6, 0.97, 0.1], steps=20)[1:] == (6, 0.97)  # stops at the third check
    assert run([0.2, 0.6, 0.9], steps=5)[1:] == (5, 0.9)  # checks at 2, 4 and the last step, 5
    assert reconstruction_reward(tiny_vae(), drawn, images) < 0.3  # a random VAE's blur earns little
    assert reconstruction_reward(_Identity(), drawn, images) == 1.0  # the drawn scenes themselves: full


class _Identity(torch.nn.Module):
    """A VAE whose reconstruction is its input, for reconstruction_reward's upper end."""

    class _Dist:
        def __init__(self, x):
            self.mean = x

    class _Out:
        def __init__(self, x):
            self.latent_dist = _Identity._Dist(x)
            self.sample = x

    def encode(self, x):
        return self._Out(x)

    def decode(self, z):
        return self._Out(z)
