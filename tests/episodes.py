"""What the agent tests on either engine (built-in, vLLM) share: the learner's view of the turns
after each episode's first."""

import torch

from tether.control.inflight import inflight_mode


def later_turns(policy, model, batch):
    """(learner log-probs, engine log-probs, versions) of the model tokens of every turn but each
    episode's first (each episode here has exactly three turns), with ``model`` as the learner's
    weights."""
    train = policy.batch(batch)
    with torch.no_grad():
        logp, _, _ = policy.forward(model.eval(), train)
    later = torch.zeros_like(train.mask, dtype=torch.bool)
    for i, flags in enumerate(batch.model):
        starts = [j for j in range(1, len(flags)) if flags[j] and not flags[j - 1]]
        assert len(starts) == 3, f"episode {i} has {len(starts)} turns"
        later[i, starts[1] - 1:len(flags) - 1] = True
    later &= train.mask.bool()
    return logp[later], train.behavior_logp[later], train.behavior_versions[later]


def scored(policy, model, batch):
    """(training tensors, the learner's log-probs (n, L − 1)) of an episode batch under ``model``."""
    train = policy.batch(batch)
    with torch.no_grad():
        logp, _, _ = policy.forward(model.eval(), train)
    return train, logp


def publish_at_poll(engine, mode, n, seed):
    """Have ``engine`` (watching in ``mode``) take other weights as version 1 at its ``n``-th poll;
    returns those weights and the poll counter."""
    gen = torch.Generator().manual_seed(seed)
    weights = {name: p.detach() + 0.05 * torch.randn(p.shape, generator=gen)
               for name, p in engine.model.named_parameters()}
    calls = {"n": 0}

    def poll():
        calls["n"] += 1
        if calls["n"] == n and engine.version == 0:
            engine.bind(weights, 1)
            return 1
        return None

    engine.watch(poll, inflight_mode(mode))
    return weights, calls


def learner_with(policy, model_dir, weights):
    """The learner's model from ``model_dir`` with ``weights`` (name → tensor) copied in."""
    model, _ = policy.load(model_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    return model
