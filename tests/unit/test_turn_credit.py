"""Credit per turn (``env.credit=turn``, ``env.gamma``) and masked failures (``env.on_failure=mask``):
turn returns and advantages against hand computations on a constructed episode batch, and the
losses taking one advantage per column."""

import re

import pytest

torch = pytest.importorskip("torch")

from tether.config.config import load_config  # noqa: E402
from tether.errors import ConfigError  # noqa: E402
from tether.families.agent.payload import EpisodeBatch  # noqa: E402
from tether.families.agent.policy import to_train_batch  # noqa: E402
from tether.train.advantages import turn_advantages, turn_returns  # noqa: E402
from tether.train.losses import LossInputs, LossSettings, cispo, ppo_clip  # noqa: E402


def test_turn_returns_discount_later_rewards():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 1.0, 9.0]])
    present = torch.tensor([[True, True, True], [True, True, False]])  # episode 1: two turns
    # γ = 0.5: episode 0: R2 = 1, R1 = 0.5·1, R0 = 0.25; episode 1: R1 = 1, R0 = 0.5 + 0.5·1 (9 is no turn)
    assert turn_returns(rewards, present, 0.5).tolist() == [[0.25, 0.5, 1.0], [1.0, 1.0, 0.0]]
    # γ = 1: R0 is the episode's return
    assert turn_returns(rewards, present, 1.0)[:, 0].tolist() == [1.0, 1.5]


def batch(statuses=("done", "done", "done")):
    """One group of three episodes (obs tokens 5, 6, 8; model tokens 7, 9), γ-independent rewards:
    ep0: [5 6][7 7][8][9]      turns of 2 and 1 tokens, step rewards [0, 1]
    ep1: [5 6][7]              one turn, step reward [1]
    ep2: [5 6][7] | [8][9 9]   its history rewritten after turn 0: two samples, step rewards [0, 0]
    """
    return EpisodeBatch(
        positions=[0],
        ids=[[5, 6, 7, 7, 8, 9], [5, 6, 7], [5, 6, 7], [8, 9, 9]],
        model=[[0, 0, 1, 1, 0, 1], [0, 0, 1], [0, 0, 1], [0, 1, 1]],
        logprobs=[[0.0] * 6, [0.0] * 3, [0.0] * 3, [0.0] * 3],
        versions=[[-1, -1, 0, 0, -1, 0], [-1, -1, 0], [-1, -1, 0], [-1, 0, 0]],
        episode_of=[0, 1, 2, 2],
        rewards=[1.0, 1.0 if statuses[1] == "done" else -1.0, 0.0],
        statuses=list(statuses), turns=[2, 1, 2], transcripts=[[], [], []], group_size=3,
        step_rewards=[[0.0, 1.0], [1.0] if statuses[1] == "done" else [], [0.0, 0.0]],
        errors=["", "" if statuses[1] == "done" else "boom", ""],
        turn_tokens=[[2, 1], [1], [1, 2]],
    )


def test_turn_columns_follow_the_turns_across_samples():
    tb = to_train_batch(batch(), pad_id=0, credit="turn", gamma=0.5)
    # column j − 1 holds token j: ep0's model tokens 2, 3 (turn 0) and 5 (turn 1)
    assert tb.turn[0].tolist() == [-1, 0, 0, -1, 1]
    assert tb.turn[1].tolist()[:2] == [-1, 0]
    assert tb.turn[2].tolist()[:2] == [-1, 0]
    assert tb.turn[3].tolist()[:2] == [1, 1]  # ep2's second sample: turn 1
    # R: ep0 [0 + 0.5·1, 1] = [0.5, 1]; ep1 [1]; ep2 [0, 0]
    assert tb.turn_return[0].tolist() == [0.0, 0.5, 0.5, 0.0, 1.0]
    assert tb.turn_return[1, 1].item() == 1.0


def test_turn_advantages_compare_each_turn_with_the_same_turn_of_the_group():
    tb = to_train_batch(batch(), pad_id=0, credit="turn", gamma=0.5)
    adv = turn_advantages(tb, std_norm=False)
    # turn 0: R = [0.5, 1, 0], mean 0.5 → [0, 0.5, −0.5]; turn 1: ep0 and ep2, R = [1, 0] → [0.5, −0.5]
    assert adv.values.shape == tb.mask.shape
    assert adv.values[0].tolist() == [0.0, 0.0, 0.0, 0.0, 0.5]
    assert adv.values[1, 1].item() == 0.5
    assert adv.values[2, 1].item() == -0.5 and adv.values[3, :2].tolist() == [-0.5, -0.5]
    # GRPO: turn 0's std is sqrt((0 + 0.25 + 0.25) / 3) = 0.40825 → ep1 0.5 / 0.40825 = 1.2247
    grpo = turn_advantages(tb)
    assert grpo.values[1, 1].item() == pytest.approx(1.2247, abs=1e-4)
    assert grpo.values[0, 4].item() == pytest.approx(1.0, abs=1e-4)  # turn 1: [1, 0] → ±1
    assert grpo.frac_zero_std == 0.0


def test_a_lone_turn_has_no_baseline():
    b = batch()
    b.turn_tokens[0], b.turns[0], b.step_rewards[0] = [1, 1, 1], 3, [0.0, 1.0, 1.0]
    tb = to_train_batch(b, pad_id=0, credit="turn", gamma=1.0)
    assert tb.turn[0].tolist() == [-1, 0, 1, -1, 2]
    adv = turn_advantages(tb, std_norm=False)
    assert adv.values[0, 4].item() == 0.0  # turn 2: ep0 alone


def test_episode_credit_with_masked_failures_leaves_the_failure_out():
    scored = to_train_batch(batch(("done", "error", "done")), pad_id=0)
    assert scored.turn is None  # episode credit, failures scored: today's per-row path
    tb = to_train_batch(batch(("done", "error", "done")), pad_id=0, mask_failures=True)
    assert tb.mask[1].sum().item() == 0 and (tb.turn[1] == -1).all()  # out of the loss and the advantages
    adv = turn_advantages(tb, std_norm=False)
    # the baseline is ep0 and ep2's: returns [1, 0] → [0.5, −0.5], one per row
    assert adv.values.tolist() == [0.5, 0.0, -0.5, -0.5]


def test_turn_credit_scores_a_failure_at_its_last_turn():
    b = batch(("done", "timeout", "done"))
    tb = to_train_batch(b, pad_id=0, credit="turn", gamma=1.0)
    assert tb.turn_return[1, 1].item() == -1.0  # env.failure_reward, its return, at its only turn
    adv = turn_advantages(tb, std_norm=False)
    # turn 0: R = [1, −1, 0] → [1, −1, 0]
    assert [adv.values[0, 1].item(), adv.values[1, 1].item(), adv.values[2, 1].item()] == [1.0, -1.0, 0.0]
    masked = turn_advantages(to_train_batch(b, pad_id=0, credit="turn", gamma=1.0, mask_failures=True),
                             std_norm=False)
    assert masked.values[1].abs().sum().item() == 0.0 and masked.values[0, 1].item() == 0.5


def test_losses_take_one_advantage_per_column():
    logp = torch.zeros(1, 3, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.0]])
    x = LossInputs(logp=logp, anchor_logp=torch.zeros(1, 3), advantages=adv, mask=torch.ones(1, 3))
    loss, _ = ppo_clip(x, LossSettings())
    assert loss.tolist() == [[-1.0, 2.0, 0.0]]  # ratio 1: ℓ_t = −A_t
    loss, _ = cispo(x, LossSettings())
    loss.sum().backward()
    assert logp.grad.tolist() == [[-1.0, 2.0, 0.0]]


def agent(*overrides):
    return load_config(None, ["model.family=agent", "data.task=kv_lookup", *overrides])


def test_credit_keys_load_and_refuse_what_they_cannot_honour():
    cfg = agent("env.credit=turn", "env.gamma=0.9", "env.on_failure=mask")
    assert (cfg.env.credit, cfg.env.gamma, cfg.env.on_failure) == ("turn", 0.9, "mask")
    assert (agent().env.credit, agent().env.gamma, agent().env.on_failure) == ("episode", 1.0, "score")
    for overrides, key in ((["env.gamma=0.5"], "env.gamma"),
                           (["env.credit=turn", "train.loss=gspo"], "train.loss"),
                           (["env.credit=turn", "train.advantage=reinforce_pp"], "train.advantage"),
                           (["env.credit=turn", "train.adv_scope=batch"], "train.adv_scope"),
                           (["env.on_failure=mask", "reward.overlong_buffer=2"], "reward.overlong_buffer")):
        with pytest.raises(ConfigError, match=re.escape(key)):
            agent(*overrides)
    with pytest.raises(ConfigError, match=re.escape("env.credit")):
        agent("env.credit=step")


def test_dynamic_sampling_is_accepted_for_agents():
    assert agent("rollout.dynamic_sampling=true").rollout.dynamic_sampling
