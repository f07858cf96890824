"""LoRA adapters (train.lora_rank): the learner trains and publishes adapters only (through PEFT),
the KL reference is the base with the adapters off, the built-in engine merges each published
version into its base weights; checkpoints hold the adapters and the base's identity."""

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from test_learner import PROMPTS, sampled_batch  # noqa: E402

from configs import config  # noqa: E402
from tether.config import load_config  # noqa: E402
from tether.errors import ConfigError  # noqa: E402
from tether.families.text.batch import to_train_batch, token_logprobs  # noqa: E402
from tether.modeling import load_causal_lm  # noqa: E402
from tether.rollout.engines.torch.engine import TorchEngine  # noqa: E402
from tether.train.learner import TorchLearner  # noqa: E402
from tether.vocabulary import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
LORA = dict(lora_rank=4, lora_alpha=8.0)
ADAPTERS = "adapter.safetensors"
VARIED = Path(__file__).parent / "varied_reward.py"


def test_the_lora_gradient_is_the_full_gradient_projected_through_the_adapters(tiny_model_dir):
    """At B = 0 an adapter W₀ + s·B·A has ∂L/∂B = s·(∂L/∂W)·Aᵀ and ∂L/∂A = 0, with ∂L/∂W the
    full-weight learner's gradient of the same loss on the same batch: the adapters' forward and
    backward, checked against the full model's independently."""
    batch, _ = sampled_batch(tiny_model_dir)
    common = dict(lr=1e-3, updates_per_batch=1, grad_clip=0, loss="ppo_clip", aggregation="token_mean")
    full = TorchLearner(tiny_model_dir, config(**common))
    adapted = TorchLearner(tiny_model_dir, config(**common, **LORA))
    params = dict(adapted.model.named_parameters())
    suffix = ".lora_A.default.weight"
    layers = [n[: -len(suffix)] for n in params if n.endswith(suffix)]
    assert len(layers) == 14  # all-linear: q, k, v, o, gate, up, down in each of 2 layers
    a_before = {layer: params[layer + suffix].detach().clone() for layer in layers}
    assert full.train(batch, train_version=0).committed_updates == 1
    assert adapted.train(batch, train_version=0).committed_updates == 1
    full_grads = {n: p.grad for n, p in full.model.named_parameters()}
    scale = 8.0 / 4
    for layer in layers:
        assert params[layer + suffix].grad.abs().max() == 0
        expected = scale * full_grads[f"{layer}.weight"] @ a_before[layer].T
        grad_b = params[f"{layer}.lora_B.default.weight"].grad
        assert torch.allclose(grad_b, expected, rtol=1e-4, atol=1e-7), layer
    assert not any(p.requires_grad for n, p in adapted.model.named_parameters() if ".lora_" not in n)


def test_the_adapted_model_is_pefts_own_model(tiny_model_dir):
    """The learner's adapted model and PEFT's get_peft_model with the same adapter values give the
    same log-probs: the learner's LoRA is PEFT's."""
    from peft import LoraConfig, get_peft_model

    batch, tok = sampled_batch(tiny_model_dir)
    learner = TorchLearner(tiny_model_dir, config(lr=3e-3, **LORA))
    learner.train(batch, train_version=0)  # B moves off zero
    reference = get_peft_model(load_causal_lm(tiny_model_dir)[0],
                               LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear"))
    theirs = dict(reference.named_parameters())
    for name, tensor in learner.export_weights().items():
        with torch.no_grad():
            theirs[f"base_model.model.{name}"].copy_(tensor)
    tb = to_train_batch(batch.payload, tok.pad_token_id)
    with torch.no_grad():
        mine, _ = token_logprobs(learner.model, tb, 1.0)
        peft_logp, _ = token_logprobs(reference, tb, 1.0)
    assert (mine - peft_logp).abs().max() <= 1e-5
    assert any(t.abs().max() > 0 for n, t in learner.export_weights().items() if "lora_B" in n)


@pytest.mark.parametrize("decoder", ["native", "python"])
def test_the_engine_samples_at_the_adapters_the_learner_trained(tiny_model_dir, decoder):
    """Published adapters merged into the engine's base weights: its log-probs equal the learner's
    at the same adapters (mean ≤ 1e-5, float32), the native decoder included; only the adapters are
    published."""
    batch, tok = sampled_batch(tiny_model_dir)
    learner = TorchLearner(tiny_model_dir, config(lr=3e-3, **LORA))
    for _ in range(2):
        learner.train(batch, train_version=0)
    published = learner.export_weights()
    model, _ = load_causal_lm(tiny_model_dir)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    sent = sum(t.numel() * t.element_size() for t in published.values())
    assert all(".lora_" in name for name in published)
    assert sent == sum(p.numel() * 4 for n, p in learner.model.named_parameters() if p.requires_grad)
    assert sent < whole / 4
    engine = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id], decoder=decoder)
    engine.use_adapter(8.0 / 4)
    engine.bind(published, version=2)  # merged in, never bound: the base weights stay the engine's
    prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    params = SamplingParams(max_new_tokens=6)
    groups = engine.generate(prompt_ids, samples_per_prompt=4, params=params, seed=3)
    assert engine.decoder_path == decoder
    from tether.families.text.payload import ScoredBatch

    flat = [c for g in groups for c in g]
    scored = ScoredBatch(positions=list(range(4)), prompt_ids=prompt_ids,
                         completion_ids=[c.token_ids for c in flat], logprobs=[c.logprobs for c in flat],
                         versions=[c.versions for c in flat],
                         rewards=[0.0] * 16, finish_reasons=[c.finish_reason for c in flat],
                         completions=[""] * 16, group_size=4)
    tb = to_train_batch(scored, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(learner.model, tb, 1.0)
    diff = ((logp - tb.behavior_logp).abs() * tb.mask).sum() / tb.mask.sum()
    assert diff <= 1e-5, diff
    # the learner's own adapted model decoded as its held-out evaluation does (the decoders read
    # each LoRA layer's adapted weight): the same samples and log-probs as the merged engine
    own = TorchEngine(learner.model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id], decoder=decoder)
    mine = [c for g in own.generate(prompt_ids, samples_per_prompt=4, params=params, seed=3) for c in g]
    assert [c.token_ids for c in mine] == [c.token_ids for c in flat]
    worst = max(abs(a - b) for x, y in zip(mine, flat, strict=True) for a, b in zip(x.logprobs, y.logprobs,
                                                                                    strict=True))
    assert worst <= 1e-4, worst
    learner.model.train()
    # a second version merges onto the base again, not onto the first merge
    again = {n: t.clone() for n, t in published.items()}
    engine.load_weights(again, version=3)
    groups2 = engine.generate(prompt_ids, samples_per_prompt=4, params=params, seed=3)
    assert [c.token_ids for g in groups2 for c in g] == [c.token_ids for c in flat]


def test_adapters_as_low_rank_terms_sample_what_merged_adapters_sample(tiny_model_dir):
    """rollout.lora_apply=terms: the engine's model gets the LoRA layers and each version is
    copied into them (nothing merged); the model's own forward samples the same tokens as the
    merged engine, with the learner's log-probs."""
    batch, tok = sampled_batch(tiny_model_dir)
    learner = TorchLearner(tiny_model_dir, config(lr=3e-3, **LORA))
    for _ in range(2):
        learner.train(batch, train_version=0)
    published = learner.export_weights()
    prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    params = SamplingParams(max_new_tokens=6)
    samples = {}
    for how in ("merge", "terms"):
        model, _ = load_causal_lm(tiny_model_dir)
        engine = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])
        engine.use_adapter(8.0 / 4, config(**LORA).train if how == "terms" else None)
        engine.load_weights(published, version=2)
        samples[how] = [c for g in engine.generate(prompt_ids, samples_per_prompt=4, params=params, seed=3)
                        for c in g]
        assert engine.decoder_path == ("transformers" if how == "terms" else "native")
        if how == "terms":
            base, _ = load_causal_lm(tiny_model_dir)
            base_weights = dict(base.named_parameters())
            for name, p in model.named_parameters():  # the base weights never moved
                plain = name.replace(".base_layer", "")
                if plain in base_weights:
                    assert torch.equal(p, base_weights[plain]), name
    assert [c.token_ids for c in samples["terms"]] == [c.token_ids for c in samples["merge"]]
    worst = max(abs(a - b) for x, y in zip(samples["terms"], samples["merge"], strict=True)
                for a, b in zip(x.logprobs, y.logprobs, strict=True))
    assert worst <= 1e-5, worst


def test_lora_dropout_drops_the_adapters_inputs_in_the_learner_only(tiny_model_dir):
    """train.lora_dropout: two learner forwards of the same batch differ (the model's own forward
    runs: the shared-prompt one cannot drop), the engine with the same adapters as terms does not;
    at 0 the learner's forwards are equal."""
    from tether.families.text.batch import to_train_batch

    batch, tok = sampled_batch(tiny_model_dir)
    tb = to_train_batch(batch.payload, tok.pad_token_id)
    for rate in (0.0, 0.5):
        learner = TorchLearner(tiny_model_dir, config(lr=3e-3, lora_dropout=rate, **LORA))
        learner.train(batch, train_version=0)  # B off zero, so the adapters' inputs matter
        assert (learner.forward is None) == (rate > 0)
        first, _ = token_logprobs(learner.model, tb, 1.0)
        second, _ = token_logprobs(learner.model, tb, 1.0)
        assert torch.equal(first, second) == (rate == 0), rate
    model, _ = load_causal_lm(tiny_model_dir)
    engine = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])
    engine.use_adapter(2.0, config(lora_dropout=0.5, **LORA).train)
    engine.load_weights(learner.export_weights(), version=1)
    prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    runs = [engine.generate(prompt_ids, samples_per_prompt=2, params=SamplingParams(max_new_tokens=6), seed=1)
            for _ in range(2)]
    assert [[c.logprobs for c in g] for g in runs[0]] == [[c.logprobs for c in g] for g in runs[1]]


def recipe(model_dir, *extra):
    return load_config(None, [f"model.path={model_dir}", "data.task=arithmetic", "rollout.batch_size=4",
                              "rollout.group_size=4", "rollout.max_new_tokens=8", "train.lr=3e-3",
                              "eval.interval=0", "checkpoint.interval=0", "train.lora_rank=4",
                              "train.lora_alpha=8", f"reward.function={VARIED}:reward", *extra])


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_a_lora_run_trains_publishes_adapters_and_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from faults.runs import stop_and_resume
    from tether.runtime.run import train

    cfg = recipe(tiny_model_dir, "train.num_batches=4", "checkpoint.interval=4", "async.max_staleness=1",
                 "train.kl_coef=0.05")
    train(cfg, tmp_path / "whole", progress_plain=True)
    metrics = rows(tmp_path / "whole" / "metrics.jsonl")
    assert metrics[-1]["loss/kl"] > 0  # the base, adapters off, as the reference
    fresh = [m for m in metrics if m["staleness/updates"] == 0]
    assert all(m["mismatch/numeric_logprob_abs_diff_max"] < 1e-4 for m in fresh)
    folder = tmp_path / "whole" / "checkpoints" / "step-000004" / "learner" / "model"
    assert not (folder / "model.safetensors").exists()
    adapters = load_file(str(folder / "adapter.safetensors"))
    assert adapters and all(".lora_" in n for n in adapters)
    record = json.loads((folder / "adapter.json").read_text())
    assert record["rank"] == 4 and record["base"] == str(Path(tiny_model_dir).resolve())
    stopped = tmp_path / "stopped"
    stop_and_resume(monkeypatch, cfg, stopped, after=2)
    keys = ("step", "async/behavior_version", "staleness/updates", "reward/mean", "loss/policy", "loss/kl")
    assert [{k: m[k] for k in keys} for m in rows(stopped / "metrics.jsonl")] == [{k: m[k] for k in keys}
                                                                                   for m in metrics]
    again = load_file(str(stopped / "checkpoints" / "step-000004" / "learner" / "model" / ADAPTERS))
    for name, tensor in adapters.items():
        assert torch.equal(again[name], tensor), name


def test_a_resume_against_another_base_is_refused_naming_both(tiny_model_dir, tmp_path):
    from tether.runtime.run import train

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    cfg = recipe(base, "train.num_batches=2", "checkpoint.interval=2")
    train(cfg, tmp_path / "run", progress_plain=True)
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config_file = other / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "rms_norm_eps": 1e-5}))
    moved = load_config(tmp_path / "run" / "config.yaml", [f"model.path={other}", "train.num_batches=3"])
    kept = {name: (tmp_path / "run" / name).read_bytes() for name in ("config.yaml", "starts.jsonl")}
    with pytest.raises(ConfigError, match=f"trained on the base model {base.resolve()}.*this run's base is "
                                          f"{other.resolve()}"):  # past the check of the recipe's paths
        train(moved, tmp_path / "run", resume=True, force=True, progress_plain=True)
    # the forced resume that failed left the run as it was: its config, and no start recorded
    assert {name: (tmp_path / "run" / name).read_bytes() for name in kept} == kept
    shutil.copy2(config_file, base / "config.json")  # the same path, another model in it
    again = load_config(tmp_path / "run" / "config.yaml", [f"model.path={base}", "train.num_batches=3"])
    with pytest.raises(ConfigError, match=r"sha256:\w+\); this run's base is .*base \(fingerprint sha256:"):
        train(again, tmp_path / "run", resume=True, force=True, progress_plain=True)


@pytest.mark.parametrize(("overrides", "says"), [
    (["train.lora_alpha=32"], "train.lora_alpha=32.0 has no effect with train.lora_rank=0"),
    (["rollout.lora_apply=terms"], "rollout.lora_apply=terms has no effect with train.lora_rank=0"),
    (["train.lora_dropout=0.1"], "train.lora_dropout=0.1 has no effect with train.lora_rank=0"),
    (["train.lora_rank=4", "rollout.lora_apply=terms", "rollout.engine=vllm"],
     "rollout.lora_apply=terms is read only with rollout.engine=torch"),
    (["train.lora_rank=4", "train.world_size=2", "rollout.batch_size=4", "checkpoint.sharded=true"],
     "holds the adapters alone"),
    (["train.lora_rank=4", "train.lora_targets=[]"], "train.lora_targets is empty"),
    (["train.lora_rank=4", "train.lora_alpha=0"], r"train.lora_alpha=0.0: .*every gradient is 0; set a "),
])
def test_lora_settings_that_cannot_work_are_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, overrides)


def test_targets_the_model_does_not_have_are_refused_with_its_layer_names(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"the model's linear layers are named .*q_proj") as refused:
        TorchLearner(tiny_model_dir, config(lora_rank=4, lora_targets="[attn_c]"))
    assert "lm_head" not in str(refused.value)  # named only where adapters can go


@pytest.mark.parametrize(("overrides", "says"), [
    (["train.lora_targets=[embed_tokens]"], "adapts model.embed_tokens, a layer of type Embedding, not a"),
    (["train.lora_targets=[q_proj,lm_head]"], "adapts lm_head, the model's output head"),
    (["train.lora_rank=48"], r"train.lora_rank=48 is above the size of model.layers.0.self_attn.k_proj "
                             r"\(64 → 32\).*set train.lora_rank to 32 or less"),
])
def test_targets_the_engines_cannot_merge_are_refused_before_a_run_starts(tiny_model_dir, tmp_path, overrides,
                                                                          says):
    """Adapters the built-in engine cannot merge (an embedding's, the output head's, whose weight
    is the embeddings' in this model) or a rank above a targeted layer's smaller side: refused while
    the run is prepared (the model's skeleton, no weights read), before its directory or any
    process exists, naming the layers adapters can go on; the learner refuses them too."""
    from tether.runtime.run import train

    cfg = recipe(tiny_model_dir, *overrides)
    with pytest.raises(ConfigError, match=says) as refused:
        train(cfg, tmp_path / "run", progress_plain=True)
    if "lora_targets" in overrides[0]:
        assert "linear layers, named ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', " \
               "'v_proj'], or [all-linear]" in str(refused.value)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=says):
        TorchLearner(tiny_model_dir, cfg)


def test_an_adapter_checkpoint_evaluates_and_exports_merged_and_as_peft(tiny_model_dir, tmp_path):
    """The run's held-out evaluation (the learner's adapted model) equals `tether eval` of its
    adapter checkpoint (the base with the adapters merged), and the exported merged folder, which
    transformers loads, scores the same; the PEFT export loads with PeftModel on the base and
    computes what the merged model does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tether.cli.eval_cmd import evaluate_model
    from tether.cli.export_cmd import export
    from tether.runtime.run import train

    cfg = recipe(tiny_model_dir, "train.num_batches=3", "checkpoint.interval=3", "eval.interval=3",
                 "data.num_eval=16", "eval.num_samples=1")
    train(cfg, tmp_path / "run", progress_plain=True)
    last = rows(tmp_path / "run" / "eval.jsonl")[-1]
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000003" / "learner" / "model"
    again, _ = evaluate_model(cfg, checkpoint, samples=1)
    assert again["eval/pass_at_1"] == last["eval/pass_at_1"]
    assert again["eval/greedy_reward_mean"] == pytest.approx(last["eval/greedy_reward_mean"], abs=1e-9)
    merged = export(tmp_path / "run", tmp_path / "merged", merge=True)
    assert (merged / "config.json").is_file() and not (merged / "adapter.json").exists()
    scored, _ = evaluate_model(cfg, merged, samples=1)
    assert scored["eval/greedy_reward_mean"] == pytest.approx(last["eval/greedy_reward_mean"], abs=1e-9)
    adapters = export(tmp_path / "run", tmp_path / "peft")
    model = AutoModelForCausalLM.from_pretrained(merged)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapters)
    ids = torch.tensor([[5, 9, 12, 7, 3]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, peft(input_ids=ids).logits, atol=1e-5)
    with pytest.raises(ConfigError, match="not empty"):
        export(tmp_path / "run", tmp_path / "merged", merge=True)


@pytest.fixture(scope="module")
def adapter_run(tiny_model_dir, tmp_path_factory):
    """(config, base, run directory) of a LoRA run of two batches, a checkpoint after each, on a
    copy of the tiny model of its own (a test may change that copy's weights, and puts them back)."""
    from tether.runtime.run import train

    root = tmp_path_factory.mktemp("adapter_run")
    base = root / "base"
    shutil.copytree(tiny_model_dir, base)
    cfg = recipe(base, "train.num_batches=2", "checkpoint.interval=1", "data.num_eval=8",
                 "eval.num_samples=1")
    train(cfg, root / "run", progress_plain=True)
    return cfg, base, root / "run"


def test_a_base_whose_weights_changed_at_the_same_size_is_refused(adapter_run, tmp_path):
    """The base's weights replaced by others of the same size (every file's name, size and JSON as
    they were): a resume, `tether eval` and `tether export --merge` of the run's adapters refuse
    them, naming the fingerprint of the contents recorded and the one found; nothing is exported."""
    from safetensors.torch import load_file, save_file

    from tether.cli.eval_cmd import evaluate_model
    from tether.cli.export_cmd import export
    from tether.runtime.run import train

    cfg, base, run = adapter_run
    weights = base / "model.safetensors"
    kept = weights.read_bytes()
    others = {n: t + 0.5 for n, t in load_file(str(weights)).items()}
    save_file(others, str(weights), metadata={"format": "pt"})
    assert weights.stat().st_size == len(kept) and weights.read_bytes() != kept
    checkpoint = run / "checkpoints" / "step-000002" / "learner" / "model"
    changed = r"with fingerprint sha256:\w+; that folder now has sha256:\w+ \(its files, or their contents"
    resumed = r"\(fingerprint sha256:\w+\); this run's base is .*base \(fingerprint sha256:\w+\); that"
    try:
        with pytest.raises(ConfigError, match=resumed):
            train(load_config(run / "config.yaml", ["train.num_batches=3"]), run, resume=True,
                  progress_plain=True)
        with pytest.raises(ConfigError, match=changed):
            evaluate_model(cfg, checkpoint, samples=1)
        with pytest.raises(ConfigError, match=changed):
            export(run, tmp_path / "merged", merge=True)
        assert not list(tmp_path.iterdir())
    finally:
        weights.write_bytes(kept)
    assert (export(run, tmp_path / "merged", merge=True) / "config.json").is_file()


def test_a_checkpoint_that_recorded_its_bases_sizes_alone_still_resumes(adapter_run, tmp_path, caplog):
    """Checkpoints written before fingerprints hashed the weights recorded every file's size and
    the JSON files: a resume compares the base with what they recorded (saying it checks no more),
    and its next checkpoint records the contents; a base whose recorded sizes or JSON differ is
    still refused."""
    from tether.filehash import sha256_of
    from tether.modeling import check_base, sizes_fingerprint
    from tether.runtime.run import train

    _, base, run = adapter_run
    old = tmp_path / "run"
    shutil.copytree(run, old)
    folder = old / "checkpoints" / "step-000002" / "learner" / "model"
    record = json.loads((folder / "adapter.json").read_text())
    assert record["base_fingerprint"].startswith("sha256:")
    (folder / "adapter.json").write_text(json.dumps({**record, "base_fingerprint": sizes_fingerprint(base)}))
    manifest_file = folder.parents[1] / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["learner/model/adapter.json"] = {"bytes": (folder / "adapter.json").stat().st_size,
                                              "sha256": sha256_of(folder / "adapter.json")}
    manifest_file.write_text(json.dumps(manifest))
    train(load_config(old / "config.yaml", ["train.num_batches=3"]), old, resume=True, progress_plain=True)
    assert "a fingerprint of its files' sizes alone" in caplog.text
    newest = old / "checkpoints" / "step-000003" / "learner" / "model"
    again = json.loads((newest / "adapter.json").read_text())
    assert again["base_fingerprint"] == record["base_fingerprint"]
    other = tmp_path / "other"
    shutil.copytree(base, other)
    (other / "config.json").write_text((other / "config.json").read_text().replace("}", ', "x": 1}', 1))
    with pytest.raises(ConfigError, match="that folder now has"):
        check_base(folder, other, sizes_fingerprint(base), what="adapters of the base model")


@pytest.mark.parametrize("where", ["a file", "under a file", "/proc", "/sys"])
def test_export_refuses_an_out_it_cannot_write_and_leaves_nothing(adapter_run, tmp_path, capsys, where):
    from tether.cli.main import main

    _, _, run = adapter_run
    (tmp_path / "file").write_text("kept\n")
    out, says = {"a file": (tmp_path / "file", "exists and is not a folder"),
                 "under a file": (tmp_path / "file" / "sub" / "out", "which is a file, not a folder"),
                 "/proc": (Path("/proc/tether-export-test"), "cannot make a folder at --out"),
                 "/sys": (Path("/sys/tether-export-test"), "cannot make a folder at --out")}[where]
    before = sorted(p.name for p in run.parent.iterdir())
    for merge in ([], ["--merge"]):
        assert main(["export", str(run), "--out", str(out), *merge]) == 2
        err = capsys.readouterr().err
        assert f"tether export: error: --out {out}" in err or f"--out {out} (" in err, err
        assert says in err and "Traceback" not in err
    assert (tmp_path / "file").read_text() == "kept\n" and [p.name for p in tmp_path.iterdir()] == ["file"]
    assert sorted(p.name for p in run.parent.iterdir()) == before
    assert out == tmp_path / "file" or not out.exists()


def test_export_of_a_damaged_checkpoint_it_names_is_refused_saying_what_is_wrong(adapter_run, tmp_path,
                                                                                 capsys):
    """--checkpoint is verified against its manifest as the newest good one is: a damaged one is
    refused, naming the file that is wrong and the checkpoints to export instead."""
    from tether.cli.main import main

    _, _, run = adapter_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    adapters = copy / "checkpoints" / "step-000001" / "learner" / "model" / ADAPTERS
    damaged = bytearray(adapters.read_bytes())
    damaged[-1] ^= 0xFF
    adapters.write_bytes(bytes(damaged))
    out = tmp_path / "out"
    assert main(["export", str(copy), "--out", str(out), "--checkpoint", "step-000001"]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint step-000001 is damaged" in err and f"{ADAPTERS} does not match its checksum" in err
    assert "export another (step-000002)" in err and not out.exists()
    assert main(["export", str(copy), "--out", str(out), "--checkpoint", "step-000002"]) == 0
    assert (out / "adapter_model.safetensors").is_file()


def test_lora_on_ray_actors_trains_the_rows_it_trains_locally(tiny_model_dir, tmp_path):
    """Adapters through Ray's object store to rollout actors that merge them, the learner in an
    actor too: the same rows as local processes."""
    pytest.importorskip("ray")
    from tether.runtime.run import train

    keys = ("step", "async/behavior_version", "staleness/updates", "reward/mean", "loss/policy")
    base = ("train.num_batches=3", "async.max_staleness=1", "train.kl_coef=0.05")
    train(recipe(tiny_model_dir, *base), tmp_path / "local", progress_plain=True)
    train(recipe(tiny_model_dir, *base, "rollout.backend=ray", "ray.local_cpus=2", "ray.learner=actor"),
          tmp_path / "ray", progress_plain=True)
    local = [{k: m[k] for k in keys} for m in rows(tmp_path / "local" / "metrics.jsonl")]
    assert local == [{k: m[k] for k in keys} for m in rows(tmp_path / "ray" / "metrics.jsonl")]


def test_adapters_published_mid_generation_stamp_each_token_with_its_version(tiny_model_dir):
    """In-flight updates (recompute) with adapters: versions of the adapters published while a
    batch generates are merged between decode steps, and every token's log-prob is the one of the
    adapters its stamp names (teacher-forced through the learner's adapted model)."""
    import time

    from test_pool import STREAM

    from configs import pool_settings
    from tether.rollout.backends.local.pool import ProcessPool
    from tether.train import lora as adapters_of
    from tether.vocabulary import GenerationRequest

    settings = pool_settings(tiny_model_dir, "rollout.group_size=8", "rollout.max_new_tokens=40",
                             "async.inflight_update=recompute", "train.lora_rank=4", "train.lora_alpha=8",
                             stop_text="")
    learner = TorchLearner(tiny_model_dir, config(**LORA))
    model = learner.model.eval()
    gen = torch.Generator().manual_seed(0)
    versions = {0: {k: v.clone() for k, v in adapters_of.adapters(model).items()}}
    with ProcessPool(settings, STREAM.batch, versions[0]) as pool:
        batch = None
        for index in range(1, 6):
            launched = max(versions)
            pool.launch(GenerationRequest(index=index, version=launched))
            got = []
            while not got:
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if ".lora_" in name:
                            p.add_(0.05 * torch.randn(p.shape, generator=gen))
                versions[max(versions) + 1] = {k: v.clone() for k, v in adapters_of.adapters(model).items()}
                pool.publish(versions[max(versions)], max(versions))
                time.sleep(0.003)
                got = pool.reap()
            if got[0].metrics["rollout/weight_switches"] >= 1:
                batch = got[0]
                break
    assert batch is not None, "no publication reached the worker mid-generation"
    scored = batch.payload
    assert any(len(set(vs)) > 1 for vs in scored.versions)
    params = dict(model.named_parameters())
    for g, prompt in enumerate(scored.prompt_ids):
        for j in range(scored.group_size):
            row = g * scored.group_size + j
            toks, lps, vs = scored.completion_ids[row], scored.logprobs[row], scored.versions[row]
            for v in set(vs):
                with torch.no_grad():
                    for name, t in versions[v].items():
                        params[name].copy_(t)
                    logits = model(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1: -1].float()
                expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks)[:, None]).squeeze(-1)
                at = [k for k, x in enumerate(vs) if x == v]
                assert torch.allclose(torch.tensor(lps)[at], expected[at], atol=1e-4), (row, v)


def test_two_learner_ranks_make_the_single_process_lora_update(tiny_model_dir, tmp_path, monkeypatch):
    """FSDP2 over a model with adapters: two ranks train the same adapters as one process on the
    same batches (1e-5), publish them alone, and write a checkpoint a run resumes from."""
    from learners import solo_and_ranks, worst_relative

    batches = [sampled_batch(tiny_model_dir, seed=s)[0] for s in range(2)]
    overrides = ("train.lora_rank=4", "train.lora_alpha=8", "train.lr=3e-3", "train.kl_coef=0.05",
                 "train.updates_per_batch=2", "rollout.batch_size=4", "rollout.group_size=4")
    (solo_weights, solo_results), (weights, results) = solo_and_ranks(
        tiny_model_dir, config(*overrides), config(*overrides, "train.world_size=2"), batches)
    assert set(weights) == set(solo_weights) and all(".lora_" in n for n in weights)
    worst = worst_relative(weights, solo_weights)
    # B starts at zero, and Adam divides each element's step by its gradient's own size: an
    # element whose gradient is near zero turns the ranks' summation-order rounding into a step
    # of lr, so after four updates the adapters agree to 1e-4 where whole weights agree to 1e-5
    assert worst <= 1e-4, worst
    for a, b in zip(solo_results, results, strict=True):
        for key in ("loss/policy", "loss/kl", "train/grad_norm"):
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-7), key
    assert solo_results[-1].metrics["loss/kl"] > 0


def test_a_two_rank_lora_run_checkpoints_adapters_and_resumes(tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from faults.runs import stop_and_resume
    from tether.runtime.run import train

    cfg = recipe(tiny_model_dir, "train.num_batches=4", "checkpoint.interval=2", "async.max_staleness=1",
                 "train.world_size=2")
    train(cfg, tmp_path / "whole", progress_plain=True)
    folder = tmp_path / "whole" / "checkpoints" / "step-000004" / "learner" / "model"
    adapters = load_file(str(folder / ADAPTERS))
    assert adapters and all(".lora_" in n for n in adapters) and (folder / "adapter.json").is_file()
    stopped = tmp_path / "stopped"
    stop_and_resume(monkeypatch, cfg, stopped, after=2)
    again = load_file(str(stopped / "checkpoints" / "step-000004" / "learner" / "model" / ADAPTERS))
    for name, tensor in adapters.items():
        assert torch.allclose(again[name], tensor, rtol=1e-5, atol=1e-7), name


def test_a_run_with_adapters_as_low_rank_terms_scores_as_the_learner(tiny_model_dir, tmp_path):
    from tether.runtime.run import train

    cfg = recipe(tiny_model_dir, "train.num_batches=3", "rollout.lora_apply=terms", "async.max_staleness=1")
    train(cfg, tmp_path / "run", progress_plain=True)
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    fresh = [m for m in metrics if m["mismatch/numeric_token_frac"] > 0]
    assert fresh and all(m["mismatch/numeric_logprob_abs_diff_max"] < 1e-4 for m in fresh)
    assert all(m["rollout/native_decoder"] == 0 for m in metrics)  # the model's own forward
