"""The agent family's episodes on vLLM: each turn a token-id prompt of the episode so far, the
engine's log-probs equal to the learner's on model tokens, and nothing on observation tokens."""

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from tether.config import load_config  # noqa: E402
from tether.families.agent.policy import AgentPolicy  # noqa: E402
from tether.families.agent.sampler import AgentSampler  # noqa: E402
from tether.vocabulary import SamplingParams, WorkItem  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_vllm_plays_multi_turn_episodes_the_learner_scores_alike(demo_model):
    from tether.data.tasks import get_task

    cfg = load_config(
        None,
        [
            "model.family=agent",
            "data.task=kv_lookup",
            f"model.path={demo_model}",
            "rollout.engine=vllm",
            "env.max_turns=3",
            "env.max_turn_tokens=6",
            "rollout.max_new_tokens=6",
            "rollout.group_size=4",
        ],
    )
    sampler = AgentSampler(cfg, str(demo_model), "\n", device=torch.device("cpu"), threads=1, seed=0)
    examples = list(enumerate(get_task("kv_lookup").examples("train", 2, seed=0)))
    try:
        batch = sampler.generate(
            WorkItem(
                batch_index=0,
                version=0,
                examples=examples,
                group_size=4,
                params=SamplingParams(max_new_tokens=6, temperature=1.0),
                seed=3,
            )
        )
    finally:
        sampler.close()
        sampler.engine.close()
    batch.check()
    assert max(batch.turns) >= 1 and batch.metrics["agent/env_tokens_mean"] > 0
    policy = AgentPolicy(1.0)
    model, _ = policy.load(demo_model)
    train = policy.batch(batch)
    with torch.no_grad():
        logp, _, _ = policy.forward(model.eval(), train)
    on = train.mask.bool()
    assert int(on.sum()) == sum(sum(m) for m in batch.model)
    assert (logp[on] - train.behavior_logp[on]).abs().mean() <= 1e-5
