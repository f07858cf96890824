"""Every architecture a user brings: at the same weights, the learner's log-probabilities of the
sampled tokens are the engine's, on each decoder path the architecture has.

Models are built locally (``tests/architectures.py``): GPT-2, Llama, Qwen2, Qwen3, Mistral, Phi-3
and Gemma-2, each with a character tokenizer and a byte-level BPE one. GPT-2's config turns
dropout on, as the released models' do: the learner trains in train mode, so unless every policy
forward runs without dropout its log-probs are another random sub-network's and the same-weight
mismatch is ~0.3 instead of ~1e-7.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from architectures import ARCHITECTURES, build  # noqa: E402
from configs import config  # noqa: E402
from learners import sampled_batch_of  # noqa: E402
from tether.data.tasks import get_task  # noqa: E402
from tether.decoding import native  # noqa: E402
from tether.decoding.fast_decoder import supports  # noqa: E402
from tether.modeling import load_causal_lm  # noqa: E402
from tether.rollout.engines.torch.engine import TorchEngine  # noqa: E402
from tether.train.learner import TorchLearner  # noqa: E402
from tether.vocabulary import RolloutBatch  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
EXAMPLES = get_task("arithmetic").examples("train", 300, seed=0)
TEXTS = [e.prompt + e.answer for e in EXAMPLES]
G = 4


def engine_batch(engine, tokenizer) -> RolloutBatch:
    """Four prompts × G samples from ``engine``; half of each group rewarded, so every group has
    something to learn from."""
    prompts = [tokenizer(e.prompt, add_special_tokens=False).input_ids for e in EXAMPLES[:4]]
    params = config("rollout.max_new_tokens=6").sampling()
    return sampled_batch_of(engine, prompts, params, G)


def decoders(model) -> list[str]:
    """The decode paths the built-in engine has for ``model``: its own forward, or the lean
    decoder's Python path and its native one (where the library builds here)."""
    if not supports(model):
        return ["auto"]
    return ["python", "native"] if native.library("auto") is not None else ["python"]


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_learner_scores_what_the_engine_sampled_on_every_architecture(tmp_path, arch, tokenizer):
    path = build(tmp_path / f"{arch}-{tokenizer}", arch, tokenizer, TEXTS)
    model, tok = load_causal_lm(path)
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    for decoder in decoders(model):
        engine = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id], decoder=decoder)
        batch = engine_batch(engine, tok)
        assert sum(len(t) for t in batch.payload.completion_ids) > 0
        expected_path = {"auto": "transformers"}.get(decoder, decoder)
        assert engine.decoder_path == expected_path
        learner = TorchLearner(path, config(f"model.path={path}", "rollout.max_new_tokens=6", lr=1e-3,
                                            shared_prefix=False))
        metrics = learner.train(batch, train_version=0).metrics
        assert metrics["mismatch/numeric_token_frac"] == 1.0
        diff = metrics["mismatch/numeric_logprob_abs_diff_max"]
        print(f"\n{arch} ({tokenizer}, {expected_path}): max |log π − log μ| at the same weights {diff:.1e}")
        assert diff <= 1e-5, (arch, tokenizer, decoder, diff)


def test_a_dropout_config_is_reported_once_and_trained_without(tmp_path, caplog):
    import logging

    path = build(tmp_path / "gpt2", "gpt2", "char", TEXTS)
    caplog.set_level(logging.WARNING, logger="tether")
    learner = TorchLearner(path, config(f"model.path={path}"))
    said = [r.getMessage() for r in caplog.records if "turns dropout on" in r.getMessage()]
    assert len(said) == 1 and "resid_pdrop=0.1" in said[0] and "attn_pdrop=0.1" in said[0]
    assert learner.model.training
    assert all(m.p == 0 for m in learner.model.modules() if isinstance(m, torch.nn.Dropout))
    assert all(getattr(learner.model.config, k) == 0 for k in ("resid_pdrop", "attn_pdrop", "embd_pdrop"))
