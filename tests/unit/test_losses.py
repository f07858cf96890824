"""Losses, aggregation, KL and advantages on small hand-computed tensors."""

import math

import pytest

torch = pytest.importorskip("torch")

from tether import registry  # noqa: E402
from tether.errors import ConfigError, LossError, PluginError  # noqa: E402
from tether.train.advantages import group_advantages, overlong_penalty  # noqa: E402
from tether.train.losses import CheckedLoss, LossInputs, LossSettings, aggregate, loss_for  # noqa: E402

get_loss = registry.losses.get


def kl_penalty(logp, ref, estimator):
    return registry.kl_estimators.get(estimator)(logp, ref)


def flat(t):
    return [v for row in t.tolist() for v in row]


def inputs(ratios, adv, mask=None, logp=None):
    r = torch.tensor(ratios, dtype=torch.float64)
    lp = torch.zeros_like(r) if logp is None else torch.tensor(logp, dtype=torch.float64)
    lp = lp.clone().requires_grad_(True)
    anchor = lp.detach() - torch.log(r)  # so that exp(logp − anchor) = r
    m = torch.ones_like(r) if mask is None else torch.tensor(mask, dtype=torch.float64)
    return LossInputs(lp, anchor, torch.tensor(adv, dtype=torch.float64), m)


def test_registry_lists_valid_names_and_refuses_duplicates():
    assert registry.losses.names() == ["ppo_clip", "gspo", "cispo"]
    with pytest.raises(ConfigError, match=r"unknown loss 'ppo' for train.loss; valid: ppo_clip, gspo, cispo"):
        get_loss("ppo")
    with pytest.raises(PluginError, match="a loss named 'ppo_clip' is already registered"):
        registry.register_loss("ppo_clip")(lambda x, s: (x.logp, {}))


def test_a_registered_loss_is_a_valid_train_loss_until_it_is_removed():
    from tether.config import load_config

    with pytest.raises(ConfigError, match=r"train\.loss must be one of 'ppo_clip', 'gspo', 'cispo', got"):
        load_config(None, ["train.loss=mine"])
    registry.register_loss("mine")(lambda x, s: (-x.advantages[:, None] * x.logp, {}))
    try:
        assert load_config(None, ["train.loss=mine"]).train.loss == "mine"
        x = inputs([[1.0, 1.0]], [2.0])
        loss, _ = get_loss("mine")(x, LossSettings())
        assert loss.tolist() == [[-0.0, -0.0]]
    finally:
        registry.losses.unregister("mine")


def reinforce(x, s):
    return -x.advantages[:, None] * x.logp, {"mine/adv": x.advantages.mean(), "mine/n": 3}


@pytest.mark.parametrize(("loss", "says"), [
    (lambda x, s: (reinforce(x, s)[0].mean(), {}),
     r"returned a tensor of shape \(\) as its losses; it must return one loss per column of x\.logp, "
     r"shape \(2, 2\) .*unreduced.*not its mean"),
    (lambda x, s: reinforce(x, s)[0].sum(dim=1), r"returned Tensor; it must return a pair"),
    (lambda x, s: (reinforce(x, s)[0].detach(), {}), r"returned losses without a gradient \(detached"),
    (lambda x, s: (reinforce(x, s)[0], {"mine/note": "high"}),
     r"returned metric 'mine/note' = 'high'; each metric must be a name \(str\) and a number"),
    (lambda x, s: (reinforce(x, s)[0], {"mine/all": x.logp.detach()}),
     r"returned metric 'mine/all' = tensor"),
    (lambda x, s: (reinforce(x, s)[0], [1.0]), r"returned list as its metrics; return a dict"),
    (lambda x, s: (reinforce(x, s)[0] * float("nan"), {}),
     r"returned non-finite losses: NaN or infinite in 4 of its 4 values \(1 outside the loss mask.*\)\. "
     r"A plug-in's loss must be finite everywhere"),
    (lambda x, s: (reinforce(x, s)[0] / x.mask, {}),  # 1/0 outside the mask: NaN × 0 is NaN in the aggregate
     r"returned non-finite losses: NaN or infinite in 1 of its 4 values \(1 outside the loss mask, which "
     r"poison the aggregate"),
])
def test_a_plugin_loss_is_checked_and_refused_naming_it_and_what_to_change(loss, says):
    """A plug-in's loss is held to the contract Tether's own keep: the shape of x.logp, a gradient,
    numeric metrics (first call), finite values (every call: a plug-in's NaN stops the run)."""
    registry.register_loss("checked")(loss)
    try:
        checked = loss_for("checked")
        who = r"train\.loss=checked \(a plug-in's loss, .*test_losses\.py:\d+\) "
        with pytest.raises(LossError, match=who + says):
            checked(inputs([[1.0, 1.0], [1.0, 1.0]], [1.0, -1.0], mask=[[1, 1], [1, 0]]), LossSettings())
    finally:
        registry.losses.unregister("checked")


def test_tethers_own_losses_are_not_wrapped_and_a_good_plugin_loss_passes_through():
    assert loss_for("ppo_clip") is registry.losses.get("ppo_clip")
    checked = CheckedLoss("reinforce", reinforce)
    x = inputs([[1.0, 1.0]], [2.0])
    loss, metrics = checked(x, LossSettings())
    assert loss.requires_grad and loss.tolist() == [[-0.0, -0.0]] and metrics["mine/n"] == 3
    with torch.no_grad():  # the ranks' whole-batch figures: no gradient there, and none asked for
        checked(x, LossSettings())
    x = inputs([[1.0, 1.0]], [float("nan")])  # finiteness is checked at every call, not only the first
    with pytest.raises(LossError, match="non-finite losses"):
        checked(x, LossSettings())


def test_the_clip_fraction_against_the_behaviour_policy_whatever_the_anchor():
    """π_θ/μ = 1.5, 0.5, 1.1, 0.7 (the third masked out) against ε = 0.2: 1.5 and 0.5 are outside,
    0.7 is not masked and outside too → 3 of 3; the proximal anchor's ratio does not enter."""
    from tether.train.losses import behavior_outside

    logp = torch.log(torch.tensor([[1.5, 0.5], [1.1, 0.7]]))
    mask = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    mu = torch.zeros(2, 2)
    assert float(behavior_outside(logp, mu, mask, LossSettings(0.2, 0.2))) == 1.0
    # in [0.6, 1.6]: 1.5 and 0.7; outside: 0.5
    assert float(behavior_outside(logp, mu, mask, LossSettings(0.4, 0.6))) == pytest.approx(1 / 3)
    assert behavior_outside(logp, mu, torch.zeros(2, 2), LossSettings()) is None


def test_ppo_clip_hand_computed():
    x = inputs([[1.5, 0.5], [1.1, 0.7]], [1.0, -1.0])
    loss, m = get_loss("ppo_clip")(x, LossSettings(0.2, 0.2))
    # A=+1: r=1.5 → max(−1.5, −1.2) = −1.2 (clipped high); r=0.5 → max(−0.5, −0.8) = −0.5
    # A=−1: r=1.1 → max(1.1, 1.1) = 1.1;                 r=0.7 → max(0.7, 0.8) = 0.8 (clipped low)
    assert flat(loss) == pytest.approx([-1.2, -0.5, 1.1, 0.8])
    assert float(m["ratio/clip_frac_high"]) == 0.25 and float(m["ratio/clip_frac_low"]) == 0.25
    # outside the range whatever the advantage (the reference's count): r = 0.5 too, which does not bind
    assert float(m["ratio/outside_clip_frac"]) == 0.75
    aggregate(loss, x.mask, "token_mean").backward()
    # clipped tokens get no gradient; the others −A·r / 4 tokens
    assert flat(x.logp.grad) == pytest.approx([0.0, -0.5 / 4, 1.1 / 4, 0.0])


def test_clip_higher_and_dual_clip():
    x = inputs([[1.5, 5.0]], [1.0])
    loss, _ = get_loss("ppo_clip")(x, LossSettings(0.2, 0.28))
    assert loss.tolist()[0][0] == pytest.approx(-1.28)  # DAPO: upper clip at 1 + 0.28
    y = inputs([[5.0, 1.0]], [-1.0])
    plain, _ = get_loss("ppo_clip")(y, LossSettings(0.2, 0.2))
    dual, m = get_loss("ppo_clip")(y, LossSettings(0.2, 0.2, dual_clip=3.0))
    # A=−1, r=5: PPO's loss is 5 (unbounded as r grows); the dual clip bounds it at 3·|A| = 3
    assert plain.tolist()[0][0] == pytest.approx(5.0)
    assert dual.tolist()[0] == pytest.approx([3.0, 1.0])
    assert float(m["ratio/dual_clip_frac"]) == 0.5


def test_gspo_clips_whole_sequences_on_the_geometric_mean_ratio():
    # seq 0: log r = [0.1, 0.3] → s = exp(0.2) = 1.2214 > 1.2 → every token −A·1.2 = −1.2 (clipped)
    # seq 1: log r = [0.0, 0.1] but only token 0 counts → s = exp(0) = 1; A = −1 → loss 1
    x = inputs([[math.exp(0.1), math.exp(0.3)], [1.0, math.exp(0.1)]], [1.0, -1.0],
               mask=[[1, 1], [1, 0]])
    loss, m = get_loss("gspo")(x, LossSettings(0.2, 0.2))
    assert loss[0].tolist() == pytest.approx([-1.2, -1.2])
    assert loss[1, 0].item() == pytest.approx(1.0)
    assert float(m["ratio/clip_frac_high"]) == 0.5
    aggregate(loss, x.mask, "seq_mean_token_mean").backward()
    # clipped sequence: no gradient; seq 1 token 0: −A·s / (1 token) / (2 sequences) = 0.5
    assert flat(x.logp.grad) == pytest.approx([0.0, 0.0, 0.5, 0.0])


def test_cispo_weights_the_log_prob_with_a_clipped_stopped_ratio():
    # r = [2.0, 0.5], A = 1, ε_low = 1 (no lower bound), ε_high = 0.28 → weights [1.28, 0.5]
    x = inputs([[2.0, 0.5]], [1.0], logp=[[-1.0, -2.0]])
    loss, m = get_loss("cispo")(x, LossSettings(1.0, 0.28))
    # ℓ = −w·A·log π: [−1.28·(−1.0), −0.5·(−2.0)] = [1.28, 1.0]
    assert loss.tolist()[0] == pytest.approx([1.28, 1.0])
    loss.sum().backward()
    assert x.logp.grad.tolist()[0] == pytest.approx([-1.28, -0.5])  # −w·A: the weight is detached
    assert float(m["ratio/clip_frac_high"]) == 0.5 and float(m["ratio/clip_frac_low"]) == 0.0


def test_aggregations():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 3 has no tokens
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(10 / 4)           # (1+2+3+4)/4
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx(3.0)     # mean(2, 4)
    assert aggregate(loss, mask, "seq_mean_token_sum").item() == pytest.approx(5.0)      # mean(6, 4)
    assert aggregate(loss, mask, "seq_mean_token_sum_norm", norm_constant=10).item() == pytest.approx(0.5)
    assert aggregate(loss, mask, "token_mean", total_tokens=8).item() == pytest.approx(10 / 8)
    with pytest.raises(ConfigError, match="valid ones are: token_mean"):
        aggregate(loss, mask, "mean")


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # d = log π_ref − log π = −log 2
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)
    assert kl_penalty(logp, logp, "k3").item() == 0.0
    with pytest.raises(ConfigError, match=r"unknown KL estimator 'k4' .*valid: k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


def test_overlong_penalty_falls_over_the_buffer():
    # L_max = 8, L_c = 4, f = 0.5: up to 4 tokens 0; 5 → −0.5·¼; 6 → −0.5·½; 8 → −0.5
    lengths = torch.tensor([1, 4, 5, 6, 8])
    got = overlong_penalty(lengths, max_len=8, buffer=4, factor=0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5])
    with pytest.raises(ValueError, match=r"must be 1\.\.8 tokens, got 9"):
        overlong_penalty(lengths, max_len=8, buffer=9, factor=1.0)


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(rewards, 4)
    # group 0: mean 0.5, population std 0.5 → ±1; group 1 has zero std → 0
    assert a.values.tolist() == pytest.approx([1, -1, -1, 1, 0, 0, 0, 0], abs=1e-5)
    assert a.frac_zero_std == 0.5 and bool(a.keep.all())
    dropped = group_advantages(rewards, 4, drop_zero_std=True)
    assert dropped.keep.tolist() == [True] * 4 + [False] * 4
    dr = group_advantages(rewards, 4, std_norm=False)  # Dr. GRPO: no std division
    assert dr.values.tolist()[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    batch = group_advantages(rewards, 4, scope="batch")
    # batch std of six 1s and two 0s: sqrt(0.75·0.25) = 0.4330 → 0.5 / 0.4330 = 1.1547
    assert batch.values.tolist()[0] == pytest.approx(1.1547, abs=1e-4)
    with pytest.raises(AssertionError, match="do not split into groups of 3"):
        group_advantages(rewards, 3)


def test_advantages_clamped_as_flow_grpo_does():
    # one success in a group of 8: (1 − 1/8) / sqrt(7/64) = 2.6458; the seven others −0.3780
    rewards = torch.tensor([1.0] + [0.0] * 7)
    free = group_advantages(rewards, 8)
    assert free.values[0] == pytest.approx(2.6458, abs=1e-4) and free.clipped_frac == 0.0
    clamped = group_advantages(rewards, 8, clip=2.0)
    assert clamped.values[0] == pytest.approx(2.0) and clamped.clipped_frac == pytest.approx(1 / 8)
    assert clamped.values[1:].tolist() == pytest.approx(free.values[1:].tolist())


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    # Ahmadian et al. 2024: A_i = r_i − (1/(G−1)) Σ_{j≠i} r_j
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(rewards, 4, estimator="rloo", std_norm=True)  # std_norm is grpo's only
    # sample 0: 1 − (0 + 0 + 0.5)/3 = 0.8333; sample 1: 0 − (1 + 0 + 0.5)/3 = −0.5;
    # sample 3: 0.5 − (1 + 0 + 0)/3 = 0.1667; a zero-variance group: 0
    assert a.values.tolist() == pytest.approx([5 / 6, -0.5, -0.5, 1 / 6, 0, 0, 0, 0], abs=1e-6)
    by_hand = [float(rewards[i] - (rewards[(i // 4) * 4:(i // 4) * 4 + 4].sum() - rewards[i]) / 3)
               for i in range(8)]
    assert a.values.tolist() == pytest.approx(by_hand, abs=1e-6)
    assert a.frac_zero_std == 0.5


def test_reinforce_pp_normalises_over_the_whole_batch_without_a_group_baseline():
    # Hu 2025 (REINFORCE++): A = (r − mean_batch) / std_batch
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(rewards, 4, estimator="reinforce_pp")
    # batch mean 0.75, population std sqrt(0.75 · 0.25) = 0.4330: 1 → 0.5774, 0 → −1.7321
    assert a.values.tolist() == pytest.approx([0.5774, -1.7321, -1.7321, 0.5774] + [0.5774] * 4, abs=1e-4)
    # unlike grpo, a group whose rewards are all equal still gets a (batch-relative) advantage
    assert a.values[4:].abs().min() > 0.5 and a.frac_zero_std == 0.5
    dropped = group_advantages(rewards, 4, estimator="reinforce_pp", drop_zero_std=True)
    assert dropped.keep.tolist() == [True] * 4 + [False] * 4
    with pytest.raises(ConfigError, match="valid: grpo, rloo, reinforce_pp"):
        group_advantages(rewards, 4, estimator="ppo")


def test_reinforce_pp_learns_from_groups_of_one():
    """One sample per prompt: REINFORCE++'s baseline is the batch, so each sample keeps its
    batch-relative advantage, and no group of one counts as having zero variance (the dapo
    preset drops those)."""
    from tether.config import load_config

    cfg = load_config(None, ["train.advantage=reinforce_pp", "rollout.group_size=1"])
    assert cfg.train.drop_zero_std  # the dapo preset's
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    a = group_advantages(rewards, 1, estimator="reinforce_pp", drop_zero_std=True)
    assert a.values.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert a.keep.all() and a.frac_zero_std == 0.0
    with pytest.raises(ConfigError, match=r"rollout\.group_size=1 trains nothing with train\.advantage=rloo"):
        load_config(None, ["train.advantage=rloo", "rollout.group_size=1"])
