"""Credit assignment for agents on a real tiny model: DAPO's dynamic sampling on episode returns,
failed episodes scored or masked (``env.on_failure``), and ``env.credit=turn`` through
``tether train`` on a built-in task, logging turn returns."""

import json
from pathlib import Path

import pytest
from cli_run import tether

pytest.importorskip("torch")
import torch

from tether.config.config import load_config
from tether.families.agent.episode import FAILURES
from tether.rollout.dynamic import informative
from tether.vocabulary import DynamicSampling, Example, SamplingParams, WorkItem

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
ENVS = Path(__file__).with_name("credit_envs.py")
B, G = 4, 4


def config(model_dir, env: str, *extra: str):
    return load_config(None, ["model.family=agent", "data.task=kv_lookup", f"model.path={model_dir}",
                              f"env.env_class={ENVS}:{env}", "env.max_turns=3", "env.max_turn_tokens=4",
                              "rollout.max_new_tokens=4", f"rollout.group_size={G}", *extra])


def sampler_for(cfg):
    from tether.families.agent.sampler import AgentSampler

    return AgentSampler(cfg, str(cfg.model.path), cfg.env.turn_stop, device=torch.device("cpu"), threads=1,
                        seed=0)


def item(dynamic=None):
    """Tasks 0..3 (answers 0..3: 1 and 3 odd), and with dynamic sampling an extra slice of 8."""
    extra = [(-1 - p, Example(prompt=f"extra {p}", answer=str(p))) for p in range(8)]
    return WorkItem(batch_index=0, version=0, examples=[(i, Example(f"task {i}", str(i))) for i in range(B)],
                    group_size=G, params=SamplingParams(max_new_tokens=4, temperature=1.0), seed=3,
                    dynamic=dynamic, extra_examples=extra if dynamic else [])


def groups(batch):
    return [batch.rewards[i * G:(i + 1) * G] for i in range(batch.num_groups)]


def test_dynamic_sampling_keeps_only_groups_whose_episode_returns_vary(tiny_model_dir):
    cfg = config(tiny_model_dir, "OddTasksVary", "rollout.dynamic_sampling=true")
    sampler = sampler_for(cfg)
    try:
        plain = sampler.generate(item())
        batch = sampler.generate(item(DynamicSampling(max_draws=3)))
    finally:
        sampler.close()
    assert not informative(groups(plain)[0]) and not informative(groups(plain)[2])  # even tasks: 0 always
    batch.check()
    assert batch.num_groups == B and all(informative(g) for g in groups(batch))
    assert any(p < 0 for p in batch.positions)  # topped up from the batch's own extra slice
    answers = [p if p >= 0 else -1 - p for p in batch.positions]  # task i and extra p answer i and p
    assert all(a % 2 == 1 for a in answers), answers  # only odd tasks' returns vary
    m = batch.metrics
    assert m["rollout/prompts_drawn"] > B and m["rollout/filtered_groups"] >= 2
    assert m["rollout/short_groups"] == 0
    assert m["agent/turns_mean"] == 1.0


@pytest.mark.parametrize("mode", ["score", "mask"])
def test_failed_episodes_are_scored_or_masked_out_of_loss_and_advantages(tiny_model_dir, mode):
    cfg = config(tiny_model_dir, "FailsOnOddActions", "env.max_failed_frac=1", "env.failure_reward=-1",
                 f"env.on_failure={mode}")
    sampler = sampler_for(cfg)
    try:
        batch = sampler.generate(item())
    finally:
        sampler.close()
    failed = [s in FAILURES for s in batch.statuses]
    assert 0 < sum(failed) < len(failed), batch.statuses  # some broke, some returned 1
    policy = cfg.family().policy(cfg)
    policy.pad_id = sampler.tokenizer.pad_token_id
    tb = policy.batch(batch)
    rows_failed = torch.as_tensor([failed[e] for e in batch.episode_of])
    if mode == "score":
        assert batch.metrics["agent/masked_failures"] == 0
        assert tb.turn is None and tb.rewards[rows_failed].eq(-1).all()  # trained at env.failure_reward
        assert tb.mask[rows_failed].sum() > 0
        return
    from tether.train.advantages import group_advantages, turn_advantages

    assert batch.metrics["agent/masked_failures"] == sum(failed)
    assert tb.mask[rows_failed].sum() == 0 and tb.mask[~rows_failed].sum() > 0  # out of the loss
    adv = turn_advantages(tb, std_norm=False)
    assert adv.values[rows_failed].abs().sum() == 0
    # the survivors all returned 1: against a baseline of survivors only, nothing to learn; scored,
    # the failures' −1 would have given the survivors a positive advantage
    assert adv.values[~rows_failed].abs().sum() == 0
    scored = group_advantages(tb.rewards, G, std_norm=False)
    assert scored.values[~rows_failed].gt(0).any()


def test_turn_credit_trains_a_built_in_task_and_logs_turn_returns(kv_lookup_model, tmp_path):
    # a model that sometimes plays kv_lookup right (calling the tool takes two turns, guessing one):
    # the tiny one warm-started briefly on its scripts, as test_own_env.py does
    model = kv_lookup_model
    run = tmp_path / "run"
    tether("train", "model.family=agent", f"model.path={model}", "data.task=kv_lookup", "data.num_train=300",
           "data.num_eval=16", "env.max_turns=3", "env.max_turn_tokens=6", "rollout.max_new_tokens=6",
           "env.credit=turn", "env.gamma=0.9", "train.num_batches=3", "rollout.batch_size=2",
           "rollout.group_size=4", "train.lr=1e-3", "eval.interval=0", "--run-dir", run, "--plain",
           "--no-report")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    episodes = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    for m in metrics:
        assert 1 <= m["credit/turns_max"] <= 3
        mine = [e for e in episodes if e["step"] == m["step"]]
        # R_0 of an episode is Σ_k γ^k r_k: its mean over the model tokens of first turns lies within
        # the episodes' discounted returns
        r0 = [sum(0.9 ** k * r for k, r in enumerate(e["step_rewards"])) for e in mine]
        assert min(r0) - 1e-6 <= m["credit/first_turn_return_mean"] <= max(r0) + 1e-6
        assert "credit/turn_return_mean" in m
    assert max(e["turns"] for e in episodes) > 1  # several turns, each credited on its own
    # (a run that commits no update fails `tether train`: the turn advantages moved the weights)


@pytest.mark.timeout(300)
def test_two_learner_ranks_train_turn_credit_as_one_process_does(tiny_model_dir):
    """One advantage per column travels through mini-batches and ranks as one per row does."""
    from dataclasses import replace

    from learners import solo_and_ranks, worst_relative
    from tether.vocabulary import RolloutBatch

    extra = ("env.max_failed_frac=1", "env.failure_reward=-1", "env.credit=turn", "env.gamma=0.5")
    sampler = sampler_for(config(tiny_model_dir, "FailsOnOddActions", *extra))
    try:
        played = [sampler.generate(replace(item(), seed=s, batch_index=s)) for s in (1, 2)]
    finally:
        sampler.close()
    assert max(max(b.turns) for b in played) == 2  # two turns credited apart
    batches = [RolloutBatch(index=s, behavior_version=0, num_groups=b.num_groups, group_size=G, payload=b)
               for s, b in zip((1, 2), played, strict=True)]
    base = (*extra, "train.lr=5e-5", "train.updates_per_batch=2")
    solo_cfg = config(tiny_model_dir, "FailsOnOddActions", *base)
    ranks_cfg = config(tiny_model_dir, "FailsOnOddActions", *base, "train.world_size=2")
    (solo, results), (ranked, _) = solo_and_ranks(tiny_model_dir, solo_cfg, ranks_cfg, batches)
    assert sum(r.committed_updates for r in results) > 0 and results[0].metrics["credit/turns_max"] == 2
    assert worst_relative(ranked, solo) <= 1e-5
