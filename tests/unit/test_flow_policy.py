"""The flow family's pieces without a run: the shapes task's pixel verifier, the policy's step
log-probabilities (engine against learner), the closed-form KL, the model directory."""

import dataclasses
import math
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tether.families.flow import scenes  # noqa: E402
from tether.families.flow.learn import FlowPolicy, to_flow_batch  # noqa: E402
from tether.families.flow.model import FlowModel, FlowModelConfig, is_flow_model  # noqa: E402
from tether.families.flow.policy import FlowSampling, gaussian_kl, step_log_density  # noqa: E402
from tether.families.flow.rollout import FlowBatch, FlowEngine  # noqa: E402
from tether.families.flow.task import SHAPES, held_out, split_scenes  # noqa: E402


def small_model(seed=0):
    torch.manual_seed(seed)
    model = FlowModel(FlowModelConfig(vocab=scenes.WORDS, width=32, depth=2, patch=4))
    with torch.no_grad():  # adaLN-Zero starts at v = 0; give every path a nonzero weight
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_a_drawn_image_passes_and_each_wrong_word_fails_exactly_its_check():
    rng = random.Random(0)
    for scene in scenes.all_scenes():
        image = scenes.render(scene, rng)
        assert scenes.checks(scene, image) == dict.fromkeys(scenes.CHECKS, True)
        others = {
            "colour": scenes.Scene(scene.count, next(c for c in scenes.COLOURS if c != scene.colour),
                                   scene.shape, scene.position),
            "count": scenes.Scene(3 - scene.count, scene.colour, scene.shape, scene.position),
            "shape": scenes.Scene(scene.count, scene.colour,
                                  "circle" if scene.shape == "square" else "square", scene.position),
            "position": scenes.Scene(scene.count, scene.colour, scene.shape,
                                     {"left": "right", "right": "left", "top": "bottom",
                                      "bottom": "top"}[scene.position]),
        }
        for attribute, wrong in others.items():
            got = scenes.checks(wrong, image)
            assert not got[attribute] and sum(got.values()) == 4, (scene.prompt, attribute, got)
    blank = torch.full((3, 16, 16), -1.0)
    assert scenes.score(scenes.Scene(1, "red", "square", "left"), scenes.to_pixels(blank)) == 0.0


def drawn(prompt: str, seed: int = 0):
    return scenes.render(scenes.Scene.parse(prompt), random.Random(seed))


@pytest.mark.parametrize(("case", "fails"), [
    ("mid-grey background", {"background"}),
    ("grey fill", set(scenes.CHECKS)),
    ("uniform dim noise", {"background"}),
    ("two 2x2 dots", set(scenes.CHECKS)),
    ("white for yellow", {"colour"}),
    ("stray specks", {"background"}),
])
def test_the_verifier_refuses_what_a_pixel_audit_found_it_rewarding(case, fails):
    """Each of these earned the full reward from a four-check verifier; now each fails exactly the
    checks it should, and never passes."""
    rng = np.random.default_rng(0)
    scene = scenes.Scene.parse("two yellow squares left")
    image = drawn(scene.prompt)
    if case == "mid-grey background":
        image = np.where(image.max(-1, keepdims=True) == 0, np.uint8(100), image)
    elif case == "grey fill":
        image = np.full_like(image, 140)
    elif case == "uniform dim noise":
        noise = rng.integers(0, 110, image.shape, dtype=np.uint8)
        image = np.where(image.max(-1, keepdims=True) == 0, noise, image)
    elif case == "two 2x2 dots":
        image = np.zeros_like(image)
        image[2:4, 2:4] = image[10:12, 3:5] = scenes.COLOURS["yellow"]
    elif case == "white for yellow":
        image = np.where(image.max(-1, keepdims=True) > 0, np.uint8(255), image)
    elif case == "stray specks":
        image = image.copy()
        image[1, 14] = image[14, 14] = image[8, 12] = scenes.COLOURS["yellow"]
    got = scenes.checks(scene, image)
    assert {k for k, ok in got.items() if not ok} == fails, got
    assert scenes.score(scene, image) < 1.0


def test_the_held_out_prompts_are_a_balanced_quarter_never_in_training():
    train, held = split_scenes("train"), split_scenes("eval")
    assert len(held) == 16 and len(train) == 48
    for attribute in ("count", "colour", "shape", "position"):
        values = {getattr(s, attribute) for s in held}
        assert len(values) == len({getattr(s, attribute) for s in scenes.all_scenes()})
    prompts = {e.prompt for e in SHAPES.examples("train", 500, seed=3)}
    assert prompts and not prompts & {s.prompt for s in held}
    assert all(held_out(scenes.Scene.parse(e.prompt)) for e in SHAPES.examples("eval", 40, seed=3))


def test_engine_and_learner_step_logprobs_agree_at_the_same_weights():
    """The engine's log-probs as it samples, and the learner's recomputed from the recorded
    trajectories in one batched forward: mean |Δ| ≤ 1e-5 in float32 (Issue 17)."""
    torch.set_num_threads(1)
    model = small_model()
    sampling = FlowSampling(steps=6, noise_level=0.7)
    engine = FlowEngine(FlowModel(model.config), sampling)
    engine.load_weights(dict(model.named_parameters()), version=3)
    words = torch.tensor([scenes.encode(s.prompt) for s in scenes.all_scenes()[:8]])
    out = engine.generate({"words": words.repeat_interleave(4, 0)}, seed=11)
    latents, logps, versions = out.latents, out.logprobs, out.versions
    assert versions == [3] * 6 and latents.shape == (32, 7, 3, 16, 16)
    again = engine.generate({"words": words.repeat_interleave(4, 0)}, seed=11)
    assert torch.equal(again.latents, latents) and torch.equal(again.logprobs, logps)  # seeded
    batch = FlowBatch(positions=list(range(8)), prompts=["p"] * 8, cond={"words": words.numpy()},
                      latents=latents.numpy(), logprobs=logps.numpy(), versions=[versions] * 32,
                      rewards=[0.0] * 32, times=sampling.times().numpy(), noise_level=0.7, group_size=4)
    batch.check()
    tb = to_flow_batch(batch)
    learner_logp, entropy, _ = FlowPolicy().forward(model, tb, with_entropy=True)
    diff = (learner_logp.detach() - tb.behavior_logp).abs()
    assert diff.mean() <= 1e-5, diff.mean()
    # a wrong noise level (the schedule the learner assumes) is caught by the same comparison
    wrong = FlowPolicy().forward(model, to_flow_batch(FlowBatch(**{**batch.__dict__, "noise_level": 0.5})))[0]
    assert (wrong.detach() - tb.behavior_logp).abs().mean() > 1e-2
    # the entropy is the Gaussian's per coordinate, the same for every sample of a step
    assert torch.allclose(entropy, entropy[:1].expand_as(entropy))
    # flow.train_steps: 2 of the 6 steps of each trajectory, the learner's forward over those only,
    # each equal to the engine's log-prob of that very step
    batch.seed = 5
    sub = to_flow_batch(batch, train_steps=2)
    assert sub.steps.shape == (32, 2) and sub.behavior_logp.shape == (32, 2)
    assert torch.equal(sub.behavior_logp, tb.behavior_logp.gather(1, sub.steps))
    sub_logp, sub_entropy, _ = FlowPolicy(2).forward(model, sub, with_entropy=True)
    assert (sub_logp.detach() - learner_logp.detach().gather(1, sub.steps)).abs().max() <= 1e-5
    assert (sub_logp.detach() - sub.behavior_logp).abs().mean() <= 1e-5
    assert torch.allclose(sub_entropy, entropy.gather(1, sub.steps))


def test_the_trained_steps_are_drawn_per_trajectory_from_the_batch_seed():
    from tether.families.flow.learn import trained_steps

    drawn = trained_steps(500, 8, 3, seed=7)
    assert drawn.shape == (500, 3) and torch.equal(drawn, trained_steps(500, 8, 3, seed=7))
    assert not torch.equal(drawn, trained_steps(500, 8, 3, seed=8))
    assert (drawn[:, 1:] > drawn[:, :-1]).all()  # sorted, no step twice
    assert len({tuple(r) for r in drawn.tolist()}) > 40  # per trajectory, not one draw for the batch
    counts = torch.bincount(drawn.flatten(), minlength=8).float()
    assert counts.min() > 0.8 * counts.mean()  # every step trained about equally often
    assert torch.equal(trained_steps(4, 8, 0, seed=1), torch.arange(8).expand(4, -1))
    assert torch.equal(trained_steps(4, 8, 8, seed=1), torch.arange(8).expand(4, -1))


def test_step_density_and_closed_form_kl_match_torch_distributions():
    torch.manual_seed(0)
    mean, other = torch.randn(5, 3, 4, 4), torch.randn(5, 3, 4, 4)
    x, std = torch.randn(5, 3, 4, 4), 0.37
    exact = torch.distributions.Normal(mean, std).log_prob(x).flatten(1).mean(1)
    assert torch.allclose(step_log_density(x, mean, std), exact, atol=1e-5)
    kl = gaussian_kl(mean[:, None], other[:, None], torch.tensor([std]))[:, 0]
    exact_kl = torch.distributions.kl_divergence(torch.distributions.Normal(mean, std),
                                                 torch.distributions.Normal(other, std)).flatten(1).mean(1)
    assert torch.allclose(kl, exact_kl, atol=1e-5)


def test_a_flow_model_directory_round_trips(tmp_path):
    model = small_model()
    model.save_pretrained(tmp_path / "m")
    assert is_flow_model(tmp_path / "m")
    loaded = FlowModel.from_pretrained(tmp_path / "m")
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_the_learners_kl_term_is_the_closed_form_of_the_two_step_gaussians():
    torch.set_num_threads(1)
    model, ref = small_model(0), small_model(1)
    sampling = FlowSampling(steps=4, noise_level=0.7)
    words = torch.tensor([scenes.encode(s.prompt) for s in scenes.all_scenes()[:3]])
    engine = FlowEngine(FlowModel(model.config), sampling)
    engine.load_weights(dict(model.named_parameters()), version=0)
    out = engine.generate({"words": words}, seed=2)
    latents, logps, versions = out.latents, out.logprobs, out.versions
    tb = to_flow_batch(FlowBatch(positions=[0, 1, 2], prompts=["p"] * 3, cond={"words": words.numpy()},
                                 latents=latents.numpy(), logprobs=logps.numpy(), versions=[versions] * 3,
                                 rewards=[0.0] * 3, times=sampling.times().numpy(), noise_level=0.7,
                                 group_size=1))
    policy = FlowPolicy()
    own, theirs = policy.forward(model, tb)[2], policy.forward(ref, tb)[2]
    kl = policy.kl(own, theirs, "k3")
    from tether.families.flow.policy import step_means

    means, stds = step_means(model, tb.latents, tb.sample_cond(), tb.times, 0.7)
    ref_means, _ = step_means(ref, tb.latents, tb.sample_cond(), tb.times, 0.7)
    for j in range(4):
        std = stds[:, j].view(-1, 1, 1, 1)
        exact = torch.distributions.kl_divergence(torch.distributions.Normal(means[:, j], std),
                                                  torch.distributions.Normal(ref_means[:, j], std))
        assert torch.allclose(kl[:, j], exact.flatten(1).mean(1), rtol=1e-4, atol=1e-6)
    assert (kl > 0).all() and policy.kl(own, own, "k3").abs().max() == 0


@pytest.mark.parametrize(("n", "chosen"), [(1, [0]), (2, [0, 1]), (3, [0, 1, 2]), (4, [0, 1, 2, 3]),
                                           (5, [0, 1, 2, 3, 4]), (9, [0, 2, 4, 6, 8]),
                                           (19, [0, 4, 9, 14, 18])])
def test_the_report_shows_the_first_and_the_last_evaluation_whatever_their_number(n, chosen):
    from tether.families.flow.evaluate import evenly_spaced

    assert evenly_spaced(n, 5) == chosen


def test_first_k_trains_the_same_leading_steps_of_every_trajectory_as_the_reference():
    from tether.families.flow.learn import trained_steps

    # Flow-GRPO's timestep_fraction 0.99 at T = 8: int(7.92) = 7 steps, 0 … 6, in order
    first = trained_steps(5, 8, int(8 * 0.99), seed=3, choice="first")
    assert torch.equal(first, torch.arange(7).expand(5, -1))
    assert torch.equal(trained_steps(5, 8, 0, seed=3, choice="first"), torch.arange(8).expand(5, -1))


def test_kl_in_the_references_units_is_the_exact_one_times_each_steps_dt():
    """flow.kl_units: reference = ‖Δμ‖²/(2σ_t²), Flow-GRPO's code (its issue #78: Δt dropped);
    exact = ‖Δμ‖²/(2σ_t²|dt|). On a shifted schedule |dt| differs per step, and so does the ratio."""
    torch.set_num_threads(1)
    model, ref = small_model(0), small_model(1)
    sampling = FlowSampling(steps=4, noise_level=0.7)
    engine = FlowEngine(FlowModel(model.config), sampling)
    engine.load_weights(dict(model.named_parameters()), version=0)
    words = torch.tensor([scenes.encode(s.prompt) for s in scenes.all_scenes()[:2]])
    out = engine.generate({"words": words.repeat_interleave(2, 0)}, seed=3)
    latents, logps, versions = out.latents, out.logprobs, out.versions
    times = torch.tensor([1.0, 0.9, 0.6, 0.25, 0.0])  # uneven steps
    batch = FlowBatch(positions=[0, 1], prompts=["p"] * 2, cond={"words": words.numpy()},
                      latents=latents.numpy(), logprobs=logps.numpy(), versions=[versions] * 4,
                      rewards=[0.0] * 4, times=times.numpy(),
                      noise_level=0.7, group_size=2)
    tb = to_flow_batch(batch)
    kl = {}
    for units in ("exact", "reference"):
        policy = FlowPolicy(kl_units=units)
        with torch.no_grad():
            _, _, basis = policy.forward(model, tb)
            _, _, ref_basis = policy.forward(ref, tb)
        kl[units] = policy.kl(basis, ref_basis, "k1")
    dt = (times[:-1] - times[1:]).abs()
    assert torch.allclose(kl["reference"], kl["exact"] * dt, rtol=1e-4)
    # the reference's own expression, step by step: mean over coordinates of Δμ², over 2σ_t²
    from tether.families.flow.policy import step_means

    with torch.no_grad():
        means, stds = step_means(model, tb.latents, tb.sample_cond(), tb.times, 0.7)
        ref_means, _ = step_means(ref, tb.latents, tb.sample_cond(), tb.times, 0.7)
    sigma_t = stds / dt.sqrt()
    by_hand = (means - ref_means).flatten(2).pow(2).mean(-1) / (2 * sigma_t ** 2)
    assert torch.allclose(kl["reference"], by_hand, rtol=1e-4)


def test_under_cps_engine_and_learner_agree_and_both_kl_units_are_the_exact_kl():
    """flow.sde_type: cps through the whole path: the engine samples a window of CPS steps, the
    batch carries the rule, the learner's log-probs of the recorded steps equal the engine's, a
    learner assuming Flow-GRPO's SDE does not; the reference divides CPS's KL by the step's own
    variance (its std_dev_t), so both flow.kl_units give the exact KL."""
    torch.set_num_threads(1)
    model, ref = small_model(0), small_model(1)
    sampling = FlowSampling(steps=6, noise_level=0.8, sde_type="cps", window=2, window_range=4)
    engine = FlowEngine(FlowModel(model.config), sampling)
    engine.load_weights(dict(model.named_parameters()), version=0)
    words = torch.tensor([scenes.encode(s.prompt) for s in scenes.all_scenes()[:4]])
    out = engine.generate({"words": words.repeat_interleave(4, 0)}, seed=7)
    k, first = out.logprobs.shape[1], out.first_step
    assert k == 2 and out.latents.shape[1] == 3
    times = sampling.times()[first:first + k + 1]
    batch = FlowBatch(positions=list(range(4)), prompts=["p"] * 4, cond={"words": words.numpy()},
                      latents=out.latents.numpy(), logprobs=out.logprobs.numpy(),
                      versions=[out.versions] * 16,
                      rewards=[0.0] * 16, times=times.numpy(), noise_level=0.8, group_size=4,
                      first_step=first, sde_type="cps")
    tb = to_flow_batch(batch)
    assert tb.sde_type == "cps"
    logp = FlowPolicy().forward(model, tb)[0].detach()
    assert (logp - tb.behavior_logp).abs().mean() <= 1e-5
    as_sde = FlowPolicy().forward(model, to_flow_batch(FlowBatch(**{**batch.__dict__, "sde_type": "sde"})))[0]
    assert (as_sde.detach() - tb.behavior_logp).abs().mean() > 1e-2
    kl = {}
    for units in ("exact", "reference"):
        policy = FlowPolicy(kl_units=units)
        with torch.no_grad():
            kl[units] = policy.kl(policy.forward(model, tb)[2], policy.forward(ref, tb)[2], "k1")
    assert torch.equal(kl["exact"], kl["reference"]) and kl["exact"].min() > 0
    from tether.families.flow.policy import step_means

    with torch.no_grad():
        means, stds = step_means(model, tb.latents, tb.sample_cond(), tb.times, 0.8, tb.steps, sde_type="cps")
        ref_means, _ = step_means(ref, tb.latents, tb.sample_cond(), tb.times, 0.8, tb.steps, sde_type="cps")
    s = times[1:].double()
    assert torch.allclose(stds[0].double(), s * math.sin(0.4 * math.pi), rtol=1e-6)
    by_hand = (means - ref_means).flatten(2).pow(2).mean(-1) / (2 * stds ** 2)
    assert torch.allclose(kl["exact"], by_hand, rtol=1e-4)


@pytest.mark.parametrize("first", [0, 2], ids=["window-at-the-start", "window-after-ode-steps"])
def test_same_latent_starts_a_group_from_one_noise_and_its_sde_steps_still_differ(first):
    """flow.same_latent (Flow-GRPO's sample.same_latent): each prompt's group of G trajectories
    starts from one initial noise, new for every group; they part at the window's first SDE step,
    and the learner's log-probs of the recorded steps are the engine's, as without it. Behind ODE
    steps the group reaches the window at one point, computed once a group."""
    torch.set_num_threads(1)
    model = small_model()
    sampling = FlowSampling(steps=6, noise_level=0.7, window=2, window_range=first + 2, same_latent=True)
    seed = next(seed for seed in range(100) if sampling.window_steps(seed).start == first)
    engine = FlowEngine(FlowModel(model.config), sampling)
    engine.load_weights(dict(model.named_parameters()), version=0)
    words = torch.tensor([scenes.encode(s.prompt) for s in scenes.all_scenes()[:3]])
    cond = {"words": words.repeat_interleave(4, 0)}
    forward, seen = engine.model.forward, []
    engine.model.forward = lambda x, *rest: seen.append(len(x)) or forward(x, *rest)
    out = engine.generate(cond, seed=seed, group=4)
    assert seen == [3] * first + [12] * (6 - first)  # the ODE steps before the window once a group
    start, after = out.latents[:, 0].flatten(1), out.latents[:, 1].flatten(1)
    for g in range(3):
        rows = slice(4 * g, 4 * g + 4)
        assert torch.equal(start[rows], start[4 * g].expand(4, -1))  # one point for the group
        assert torch.cdist(after[rows], after[rows]).triu(1)[0, 1:].min() > 0.1  # the SDE parts them
    assert not torch.equal(start[0], start[4]) and not torch.equal(start[4], start[8])  # a noise a group
    independent = FlowEngine(FlowModel(model.config), dataclasses.replace(sampling, same_latent=False))
    independent.load_weights(dict(model.named_parameters()), version=0)
    own = independent.generate(cond, seed=seed, group=4).latents[:, 0].flatten(1)
    assert torch.cdist(own[:4], own[:4]).triu(1)[0, 1:].min() > 0.1  # without it, a noise an image
    k = out.logprobs.shape[1]
    batch = FlowBatch(positions=list(range(3)), prompts=["p"] * 3, cond={"words": words.numpy()},
                      latents=out.latents.numpy(), logprobs=out.logprobs.numpy(),
                      versions=[out.versions] * 12, rewards=[0.0] * 12,
                      times=sampling.times()[first:first + k + 1].numpy(), noise_level=0.7, group_size=4,
                      first_step=first)
    tb = to_flow_batch(batch)
    assert (FlowPolicy().forward(model, tb)[0].detach() - tb.behavior_logp).abs().mean() <= 1e-5


def guided_batch(model, guidance=4.5, steps=4, seed=5):
    """Two prompts × 2 trajectories sampled with guidance away from the empty prompt."""
    sampling = FlowSampling(steps=steps, noise_level=0.7, guidance_scale=guidance)
    engine = FlowEngine(FlowModel(model.config), sampling)
    engine.load_weights(dict(model.named_parameters()), version=0)
    words = torch.tensor([scenes.encode(s.prompt) for s in scenes.all_scenes()[:2]])
    out = engine.generate({"words": words.repeat_interleave(2, 0)}, seed=seed)
    latents, logps, versions = out.latents, out.logprobs, out.versions
    return to_flow_batch(FlowBatch(
        positions=[0, 1], prompts=["p"] * 2, cond={"words": words.numpy()}, latents=latents.numpy(),
        logprobs=logps.numpy(), versions=[versions] * 4, rewards=[0.0] * 4,
        times=sampling.times().numpy(), noise_level=0.7, group_size=2,
        negative={"words": model.encode_prompts([""])["words"].numpy()}, guidance_scale=guidance))


class UnconditionalWithoutGrad(torch.nn.Module):
    """The model with its unconditional half (the first of ``velocity``'s two) run under no_grad:
    the detach built by hand, independent of ``flow.cfg_grad``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, t, cond):
        n = x.shape[0] // 2
        with torch.no_grad():
            uncond = self.model(x[:n], t[:n], {k: v[:n] for k, v in cond.items()})
        return torch.cat([uncond, self.model(x[n:], t[n:], {k: v[n:] for k, v in cond.items()})])


def logp_grads(model, batch, policy):
    model.zero_grad()
    logp = policy.forward(model, batch)[0]
    weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)  # an advantage-weighted sum
    (weights * logp).sum().backward()
    return logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_cfg_grad_conditional_detaches_the_unconditional_branch_as_a_hand_built_detach():
    """flow.cfg_grad: full differentiates both branches of v = v_u + w·(v_c − v_u); conditional is
    v = sg[v_u] + w·(v_c − sg[v_u]) (the reference at ac4c86e): the same log-probs, other gradients."""
    torch.set_num_threads(1)
    model = small_model()
    batch = guided_batch(model)
    full_logp, full = logp_grads(model, batch, FlowPolicy(cfg_grad="full"))
    cond_logp, cond = logp_grads(model, batch, FlowPolicy(cfg_grad="conditional"))
    hand_logp, hand = logp_grads(UnconditionalWithoutGrad(model), batch, FlowPolicy(cfg_grad="full"))
    assert torch.equal(full_logp, cond_logp)
    assert torch.allclose(cond_logp, hand_logp, atol=1e-6)
    assert torch.allclose(cond, hand, rtol=1e-4, atol=1e-7)
    cosine = torch.nn.functional.cosine_similarity(full, cond, dim=0)
    assert cosine < 0.999 and not torch.allclose(full, cond, rtol=1e-2)
    # without guidance there is no unconditional branch: the two are one
    plain = guided_batch(model, guidance=1.0)
    assert torch.equal(logp_grads(model, plain, FlowPolicy(cfg_grad="full"))[1],
                       logp_grads(model, plain, FlowPolicy(cfg_grad="conditional"))[1])


def test_the_warm_start_trains_a_share_of_images_on_the_empty_prompt():
    """flow.init_cond_dropout: each image's words replaced by the empty prompt's (all <pad>, what an
    empty flow.negative_prompt encodes to) at that rate; rate 0 keeps every prompt."""
    from tether.families.flow.warmstart import flow_matching_loss

    torch.set_num_threads(1)
    model = small_model()
    seen = []
    spy = model.forward

    def forward(x, t, cond):
        seen.append(cond.clone())
        return spy(x, t, cond)

    model.forward = forward
    words = torch.tensor([scenes.encode(s.prompt) for s in scenes.all_scenes()[:1]]).repeat(2000, 1)
    images = torch.zeros(2000, 3, 16, 16)
    for rate in (0.0, 0.1):
        flow_matching_loss(model, images, words, torch.Generator().manual_seed(0), cond_dropout=rate)
    kept, dropped = seen
    assert torch.equal(kept, words)
    empty = model.encode_prompts([""])["words"][0]
    is_empty = (dropped == empty).all(1)
    assert ((dropped == words).all(1) | is_empty).all()  # each row whole: its prompt or none
    assert 0.07 < is_empty.float().mean() < 0.13  # 2000 draws at 0.1


@pytest.mark.parametrize(("built", "settings", "codes"), [
    ({"cond_dropout": 0.0}, ["flow.guidance_scale=4.5"], ["untrained_unconditional"]),
    ({"cond_dropout": 0.0}, ["flow.guidance_scale=4.5", "flow.negative_prompt=blurry"],
     ["untrained_unconditional"]),
    ({"cond_dropout": 0.0}, [], []),  # no guidance: the branch never runs
    ({"cond_dropout": 0.1}, ["flow.guidance_scale=4.5"], []),
    ({}, ["flow.guidance_scale=4.5"], []),  # no record of the build: nothing known
    (None, ["flow.guidance_scale=4.5", "model.create_if_missing=true", "flow.init_cond_dropout=0"],
     ["untrained_unconditional"]),
    (None, ["flow.guidance_scale=4.5", "model.create_if_missing=true"], []),  # dropout 0.1 by default
    (None, ["flow.guidance_scale=0.5", "model.create_if_missing=true"], ["guidance_below_one"]),
])
def test_guidance_against_a_branch_the_model_never_learned_is_noted(tmp_path, built, settings, codes):
    """A model built here records its warm start's condition dropout: guiding one built without
    it subtracts the velocity of a prompt it never trained on, and the run says so when it
    starts (as it says that a guidance scale between 0 and 1 holds less of the prompt than none)."""
    import json

    from tether.config import load_config

    model = tmp_path / "model"
    if built is not None:
        model.mkdir()
        (model / "warmstart.json").write_text(json.dumps({"settings": built}))
    cfg = load_config(None, ["model.family=flow", "data.task=shapes", f"model.path={model}", *settings])
    assert [n.code for n in cfg.family().notes(cfg)] == codes


def test_a_folder_that_is_no_model_is_refused_naming_both_kinds_of_model_directory(tmp_path):
    """Neither a pipeline's model_index.json nor a model's config.json: loading it names both, and
    a build is never made over the files a folder already holds."""
    from tether.config import load_config
    from tether.data.prepare import ensure_model
    from tether.errors import ConfigError
    from tether.families.flow.model import load_flow_model

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds neither model_index.json .* nor config.json"):
        load_flow_model(tmp_path)
    cfg = load_config(None, ["model.family=flow", "data.task=shapes", f"model.path={tmp_path}",
                             "model.create_if_missing=true"])
    with pytest.raises(ConfigError, match=r"neither config.json nor model_index.json .* never built over"):
        ensure_model(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
