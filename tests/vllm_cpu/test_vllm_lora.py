"""LoRA on vLLM's CPU build: each published version of the adapters served through vLLM's LoRA
requests. Its log-probs are the learner's at the same adapters, and `tether train` with LoRA on
vLLM follows `tether plan` with only the adapters published."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))

from test_vllm_train import DEMO, check_against_plan, short  # noqa: E402

from tether.config import load_config  # noqa: E402
from tether.runtime.run import train  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
PROMPTS = ["12+3=", "45+6=", "7+80=", "33+21="]


def test_vllm_samples_at_the_adapters_the_learner_trained(demo_model):
    from tether.families.text.batch import to_train_batch, token_logprobs
    from tether.families.text.payload import ScoredBatch
    from tether.modeling import load_tokenizer
    from tether.rollout.engines.vllm.engine import VLLMEngine
    from tether.train.learner import TorchLearner
    from tether.vocabulary import RolloutBatch, SamplingParams

    tok = load_tokenizer(demo_model)
    cfg = load_config(None, [f"model.path={demo_model}", "train.lora_rank=8", "train.lora_alpha=16",
                             "train.lr=3e-3", "rollout.engine=vllm"])
    learner = TorchLearner(demo_model, cfg)
    engine = VLLMEngine(str(demo_model), stop_ids=[tok.eos_token_id], lora_rank=8)
    try:
        engine.use_adapter(2.0)
        prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
        params = SamplingParams(max_new_tokens=6)
        for version in range(3):  # the adapters of version v sample batch v; the learner trains on it
            engine.load_weights(learner.export_weights(), version)
            flat = [c for g in engine.generate(prompts, samples_per_prompt=4, params=params, seed=version)
                    for c in g]
            scored = ScoredBatch(positions=list(range(4)), prompt_ids=prompts,
                                 completion_ids=[c.token_ids for c in flat],
                                 logprobs=[c.logprobs for c in flat], versions=[c.versions for c in flat],
                                 rewards=[float(i % 2) for i in range(16)],
                                 finish_reasons=[c.finish_reason for c in flat], completions=[""] * 16,
                                 group_size=4)
            tb = to_train_batch(scored, tok.pad_token_id)
            with torch.no_grad():
                logp, _ = token_logprobs(learner.model, tb, 1.0)
            diff = ((logp - tb.behavior_logp).abs() * tb.mask).sum() / tb.mask.sum()
            assert diff <= 1e-5, (version, diff)
            learner.train(RolloutBatch(index=version, behavior_version=version, num_groups=4, group_size=4,
                                       payload=scored), train_version=version)
        trained = learner.export_weights()
        assert any(t.abs().max() > 0 for n, t in trained.items() if "lora_B" in n)
    finally:
        engine.close()


def test_lora_on_vllm_through_tether_train_follows_plan_and_its_merged_export_serves(demo_model, tmp_path):
    """The run follows `tether plan`; its adapters exported merged into the base load in vLLM as a
    plain model, which samples what vLLM serving the adapters samples, with the same log-probs."""
    from tether.cli.export_cmd import export
    from tether.modeling import load_tokenizer
    from tether.rollout.engines.vllm.engine import VLLMEngine
    from tether.train import lora
    from tether.vocabulary import SamplingParams

    cfg = load_config(DEMO, short(demo_model, "train.lora_rank=8", "train.lora_alpha=16", "train.lr=2e-3",
                                  "train.kl_coef=0.01", "checkpoint.interval=6"))
    summary = train(cfg, tmp_path / "run", progress_plain=True)
    check_against_plan(cfg, tmp_path / "run", summary)
    merged = export(tmp_path / "run", tmp_path / "merged", merge=True)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000006" / "learner" / "model"
    from safetensors.torch import load_file

    adapters = load_file(str(checkpoint / lora.ADAPTER_FILE))
    tok = load_tokenizer(demo_model)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    params = SamplingParams(max_new_tokens=6)
    samples = []
    for path, rank in ((merged, 0), (demo_model, 8)):
        engine = VLLMEngine(str(path), stop_ids=[tok.eos_token_id], lora_rank=rank)
        try:
            if rank:
                engine.use_adapter(2.0)
                engine.load_weights(adapters, 6)
            samples.append([c for g in engine.generate(prompts, samples_per_prompt=4, params=params, seed=5)
                            for c in g])
        finally:
            engine.close()
    plain, served = samples
    assert [c.token_ids for c in plain] == [c.token_ids for c in served]
    worst = max(abs(a - b) for x, y in zip(plain, served, strict=True)
                for a, b in zip(x.logprobs, y.logprobs, strict=True))
    assert worst <= 1e-4, worst
