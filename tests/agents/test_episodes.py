"""Playing episodes on a real tiny model: exact tokens in and out, log-probs the learner agrees
with, no loss on environment tokens, environment calls off the generation path, and every kind
of environment failure an outcome of its episode."""

import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch

from episodes import later_turns, learner_with, publish_at_poll, scored
from tether.config.config import load_config
from tether.errors import RolloutError
from tether.vocabulary import Example, SamplingParams, WorkItem

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ENVS = Path(__file__).with_name("envs.py")


def loaded_envs():
    """envs.py as ``env.env_class`` loads it (its module state is what the environments see)."""
    from tether.pyload import load_python_object

    return sys.modules[load_python_object(f"{ENVS}:Echo", what="env.env_class").__module__]


def config(model_dir, env: str, *extra: str):
    return load_config(
        None,
        [
            "model.family=agent",
            "data.task=kv_lookup",
            f"model.path={model_dir}",
            f"env.env_class={ENVS}:{env}",
            "env.max_turns=4",
            "env.max_turn_tokens=5",
            "rollout.max_new_tokens=5",
            "env.step_timeout_s=2",
            "rollout.group_size=4",
            *extra,
        ],
    )


def sampler_for(cfg):
    from tether.families.agent.sampler import AgentSampler

    return AgentSampler(
        cfg, str(cfg.model.path), cfg.env.turn_stop, device=torch.device("cpu"), threads=1, seed=0
    )


def item(n_tasks: int, group_size: int = 4) -> WorkItem:
    examples = [(i, Example(prompt=f"task {i}", answer=str(i))) for i in range(n_tasks)]
    return WorkItem(
        batch_index=0,
        version=0,
        examples=examples,
        group_size=group_size,
        params=SamplingParams(max_new_tokens=5, temperature=1.0),
        seed=11,
    )


@pytest.fixture(scope="module")
def echo(tiny_model_dir):
    sampler = sampler_for(config(tiny_model_dir, "Echo"))
    calls = []
    generate = sampler.engine.generate

    def recording(prompts, **kw):  # what the engine was asked and what it sampled, turn by turn
        out = generate(prompts, **kw)
        calls.append(([list(p) for p in prompts], [c for (c,) in out]))
        return out

    sampler.engine.generate = recording
    batch = sampler.generate(item(2))
    yield sampler, batch, calls
    sampler.close()


def test_an_episode_is_the_engines_sampled_ids_and_each_observation_encoded_once(echo):
    sampler, batch, calls = echo
    batch.check()
    encode = sampler.player.encode
    sampled = {}  # prompt ids of a turn → the completions the engine returned for them
    for prompts, completions in calls:
        for p, c in zip(prompts, completions, strict=True):
            sampled.setdefault(tuple(p), []).append(c.token_ids)
    for ids, model, transcript in zip(batch.ids, batch.model, batch.transcripts, strict=True):
        expected, flags = [], []
        observations = transcript[0::2]
        for k, obs in enumerate(observations[:-1]):  # the last observation ends the episode
            expected += encode(obs)
            flags += [0] * len(encode(obs))
            # each turn is what the engine sampled when given exactly the ids so far
            turn = [t for t in sampled[tuple(expected)] if ids[len(expected) : len(expected) + len(t)] == t]
            assert turn, f"no engine completion of this episode's turn {k + 1}"
            expected += turn[0]
            flags += [1] * len(turn[0])
            # the action: the turn as sampled, special tokens included, less a final end-of-turn token
            action = turn[0][:-1] if turn[0][-1] == sampler.tokenizer.eos_token_id else turn[0]
            assert sampler.tokenizer.decode(action, skip_special_tokens=False) == transcript[2 * k + 1]
        assert ids == expected
        assert model == flags
    assert batch.turns == [3] * 8 and batch.rewards == [0.75] * 8
    assert set(batch.statuses) == {"done"}


def test_the_learner_scores_model_tokens_as_the_engine_did_and_nothing_else(echo, tiny_model_dir):
    from tether.families.agent.policy import AgentPolicy

    _, batch, _ = echo
    policy = AgentPolicy(1.0)
    train, logp = scored(policy, policy.load(tiny_model_dir)[0], batch)
    on = train.mask.bool()
    assert int(on.sum()) == sum(sum(m) for m in batch.model)
    assert (logp[on] - train.behavior_logp[on]).abs().mean() <= 1e-5
    assert (train.behavior_versions[~on] == -1).all() and (train.behavior_logp[~on] == 0).all()


def loss_gradient_on_targets(model, train):
    """d(−Σ mask·log π) / d(logits) per column, summed over the vocabulary's absolute values."""
    logits = model(input_ids=train.input_ids, attention_mask=train.attention_mask).logits[:, :-1]
    logits.retain_grad()
    logp = torch.log_softmax(logits.float(), -1).gather(-1, train.targets[..., None]).squeeze(-1)
    (-(logp * train.mask).sum()).backward()
    return logits.grad.abs().sum(-1)


def assert_no_loss_on_environment_tokens(model, train, model_flags):
    grad = loss_gradient_on_targets(model, train)
    for i, flags in enumerate(model_flags):
        for j in range(1, len(flags)):
            if flags[j]:
                assert grad[i, j - 1] > 0, f"episode {i}: model token {j} gets no loss"
            else:
                assert grad[i, j - 1] == 0, f"episode {i}: environment token {j} gets a loss"


def test_environment_tokens_get_no_loss_and_the_check_catches_a_mask_that_covers_one(echo, tiny_model_dir):
    from tether.families.agent.policy import AgentPolicy

    _, batch, _ = echo
    policy = AgentPolicy(1.0)
    model, _ = policy.load(tiny_model_dir)
    train = policy.batch(batch)
    assert_no_loss_on_environment_tokens(model, train, batch.model)
    # the mutation: one observation token of episode 0 put under the loss
    first_turn = batch.model[0].index(1)
    j = next(j for j in range(first_turn, len(batch.model[0])) if not batch.model[0][j])
    mask = train.mask.clone()
    mask[0, j - 1] = 1.0
    mutated = type(train)(**{**train.__dict__, "mask": mask})
    model.zero_grad()
    with pytest.raises(AssertionError, match="environment token"):
        assert_no_loss_on_environment_tokens(model, mutated, batch.model)


def test_environment_steps_run_side_by_side(tiny_model_dir):
    """Eight steps that each return only when eight run at once: they finish because the
    environment threads run them together, not one after another."""

    sampler = sampler_for(config(tiny_model_dir, "Rendezvous", "env.workers=8", "env.step_timeout_s=60"))
    module = loaded_envs()
    module.BARRIER = threading.Barrier(8)
    try:
        batch = sampler.generate(item(2))
    finally:
        sampler.close()
    assert batch.statuses == ["done"] * 8 and batch.rewards == [1.0] * 8


@pytest.mark.parametrize(
    ("env", "status", "says"),
    [
        ("Hangs", "timeout", "step ran past its timeout"),
        ("SlowSetUp", "timeout", "reset ran past its timeout"),
        ("ResetRaises", "error", "reset raised RuntimeError: no sandbox today"),
        ("WrongTypes", "error", "step returned int 42"),
        ("HugeReward", "error", "environment HugeReward: step returned a reward of 100000"),
        ("NoInfo", "error", "step returned info of type NoneType; expected a mapping"),
        ("DoneAsText", "error", "step returned done='false'; expected True or False"),
        ("RewardsPile", "error", "environment RewardsPile: step rewards add up to 1.2e+06 after 2 steps"),
        ("Exits", "error", "step raised SystemExit: the tool quit"),
        ("Interrupts", "error", "step raised KeyboardInterrupt: the tool quit"),
    ],
)
def test_a_failing_environment_ends_only_its_episode_with_a_counted_status(tiny_model_dir, env, status, says):
    sampler = sampler_for(config(tiny_model_dir, env, "env.max_failed_frac=1", "env.failure_reward=-1"))
    t0 = time.monotonic()
    try:
        batch = sampler.generate(item(1))
    finally:
        sampler.close()
    assert time.monotonic() - t0 < 60  # the hung calls were abandoned, not waited for
    assert batch.statuses == [status] * 4
    assert batch.rewards == [-1.0] * 4  # env.failure_reward, and the group is kept whole
    player_errors = {ep_error for ep_error in _errors(sampler)}
    assert any(says in e for e in player_errors), player_errors
    if env == "ResetRaises":  # an environment whose reset failed is closed all the same
        module = loaded_envs()
        assert module.CLOSED.count("ResetRaises") >= 4
    key = "agent/timeouts" if status == "timeout" else "agent/env_errors"
    assert batch.metrics[key] == 4.0
    if status == "timeout":
        assert batch.metrics["agent/abandoned_calls"] == 4.0
        hung = [t for t in threading.enumerate() if t.name == "tether-env" and t.is_alive()]
        assert hung and all(t.daemon for t in hung)  # they cannot keep the worker process alive


def _errors(sampler):
    return sampler.player.last_errors


@pytest.mark.parametrize("env", ["HugeObservation", "HugeLastObservation"])
def test_a_huge_observation_is_refused_cheaply_and_recorded_only_in_part(tiny_model_dir, env):
    """A 10-million-character observation: one that does not fit ends its episode as token_budget
    without the whole text being encoded (a char tokenizer takes ~40 s for it); the last one is
    not encoded at all. The transcript, and so episodes.jsonl, keeps its beginning and says how
    much it left out."""
    import json

    sampler = sampler_for(config(tiny_model_dir, env))
    t0 = time.monotonic()
    try:
        batch = sampler.generate(item(1))
    finally:
        sampler.close()
    assert time.monotonic() - t0 < 30
    assert batch.statuses == ["token_budget" if env == "HugeObservation" else "done"] * 4
    for transcript in batch.transcripts:
        assert transcript[-1].startswith("x" * 4096)
        assert transcript[-1].endswith(f"[... {10_000_000 - 4096:,} more characters left out]")
    assert len(json.dumps(batch.sample_lines())) < 40_000


@pytest.fixture
def python_sigint():
    """SIGINT handled by Python's own handler for the test, as in a terminal: a suite launched
    detached (``setsid nohup``) starts with SIGINT ignored, and a Ctrl-C would then never reach
    the play these tests stop with one."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("python_sigint")
def test_an_environment_raising_a_base_exception_inline_fails_its_episode_but_a_ctrl_c_stops(tiny_model_dir):
    """env.workers=0 runs calls in the generating thread: SystemExit from the environment fails
    its episode; a KeyboardInterrupt there may be a real Ctrl-C (the main thread, Python's own
    SIGINT handler), so it stops the play, unless SIGINT is not Python's (a rollout worker ignores
    it): then it is the environment's."""
    import signal

    sampler = sampler_for(config(tiny_model_dir, "Exits", "env.workers=0", "env.max_failed_frac=1"))
    try:
        batch = sampler.generate(item(1))
    finally:
        sampler.close()
    assert batch.statuses == ["error"] * 4 and "SystemExit: the tool quit" in _errors(sampler)[0]
    sampler = sampler_for(config(tiny_model_dir, "Interrupts", "env.workers=0", "env.max_failed_frac=1"))
    try:
        with pytest.raises(KeyboardInterrupt, match="the tool quit"):
            sampler.generate(item(1))
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            batch = sampler.generate(item(1))
        finally:
            signal.signal(signal.SIGINT, previous)
    finally:
        sampler.close()
    assert batch.statuses == ["error"] * 4 and "KeyboardInterrupt: the tool quit" in _errors(sampler)[0]


@pytest.mark.usefixtures("python_sigint")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_real_ctrl_c_while_environments_step_stops_the_play(tiny_model_dir, workers):
    sampler = sampler_for(config(tiny_model_dir, "CtrlC", f"env.workers={workers}"))
    loaded_envs().CtrlC.SENT.clear()
    try:
        with pytest.raises(KeyboardInterrupt):
            sampler.generate(item(1))
    finally:
        sampler.close()


def test_an_environment_whose_constructor_needs_arguments_is_refused_when_the_recipe_loads(tiny_model_dir):
    from tether.errors import ConfigError

    with pytest.raises(ConfigError, match=r"environment NeedsArgs cannot be built: .* as NeedsArgs\(\), "
                       r"and its constructor needs 'table', 'difficulty'"):
        config(tiny_model_dir, "NeedsArgs")


def test_malformed_actions_are_shown_to_the_model_and_counted(tiny_model_dir):
    sampler = sampler_for(config(tiny_model_dir, "Malformed"))
    try:
        batch = sampler.generate(item(1))
    finally:
        sampler.close()
    assert batch.statuses == ["max_turns"] * 4 and batch.turns == [4] * 4
    assert batch.metrics["agent/action_errors"] == 16.0
    assert all(t[2::2][:3] == ["bad\n"] * 3 for t in batch.transcripts)


def test_past_the_ceiling_of_failed_episodes_the_batch_stops_the_run_with_the_first_failure(tiny_model_dir):
    sampler = sampler_for(config(tiny_model_dir, "ResetRaises", "env.max_failed_frac=0.5"))
    try:
        with pytest.raises(
            RolloutError, match=r"4 of 4 episodes .* failed .*no sandbox today.*env.max_failed_frac"
        ):
            sampler.generate(item(1))
    finally:
        sampler.close()


@pytest.mark.parametrize("mode", ["keep", "recompute", "abort"])
def test_weights_published_mid_episode_are_stamped_per_token_and_the_episode_is_as_old_as_its_oldest(
    tiny_model_dir, mode
):
    """A publication lands after the second decode step of the first turn: the episode's later
    tokens carry version 1, earlier ones 0 (abort samples the turn again: all of it on 1), and the
    batch is as old as its oldest model token."""
    sampler = sampler_for(config(tiny_model_dir, "Echo", f"async.inflight_update={mode}"))
    weights, _ = publish_at_poll(sampler.engine, mode, 2, seed=0)
    try:
        batch = sampler.generate(item(1))
    finally:
        sampler.close()
    versions = batch.model_versions()
    assert all(v[-1] == 1 for v in versions)  # every later turn samples on the new weights
    assert min(batch.version_shares()) == (1 if mode == "abort" else 0)
    if mode != "abort":
        assert batch.metrics["staleness/multi_version_seq_frac"] > 0
        assert any(v[0] == 0 and v[-1] == 1 for v in versions)
    else:
        assert batch.metrics["rollout/wasted_tokens"] > 0
    assert batch.metrics["rollout/weight_switches"] >= 1
    # turns 2 and 3 start after the switch: prefilled and sampled on version 1 alone, so the
    # learner at version 1 scores them as the engine did
    from tether.families.agent.policy import AgentPolicy

    policy = AgentPolicy(1.0)
    learner, engine_logp, versions = later_turns(policy, learner_with(policy, tiny_model_dir, weights), batch)
    assert (versions == 1).all()
    assert (learner - engine_logp).abs().mean() <= 1e-5


def test_with_switch_at_turn_weights_change_only_between_turns(tiny_model_dir):
    """env.switch_at=turn: the publication the engine would take inside the first turn waits for
    the turn to end; every turn is sampled on one version, the later ones on the new weights."""
    sampler = sampler_for(config(tiny_model_dir, "Echo", "async.inflight_update=keep", "env.switch_at=turn"))
    weights, _ = publish_at_poll(sampler.engine, "keep", 0, seed=1)  # bound below instead
    engine, generate = sampler.engine, sampler.engine.generate
    turns, inside = [], []  # engine calls begun and ended; polls made while one was running

    def generating(*args, **kw):
        turns.append("begun")
        try:
            return generate(*args, **kw)
        finally:
            turns.append("ended")

    def polled():  # the publication lands while the first turn is sampled: it is taken at its end
        inside.append(turns[-1:] == ["begun"])
        if turns and engine.version == 0:
            engine.bind(weights, 1)
            return 1
        return None

    engine.generate, engine.poll = generating, polled
    try:
        batch = sampler.generate(item(1))
    finally:
        sampler.close()
    # polls at each boundary (before and after each turn, and while environment calls run), never
    # inside one
    assert len(inside) >= 6 and not any(inside)
    assert batch.metrics["rollout/turn_boundary_switches"] == 1
    for flags, versions in zip(batch.model, batch.versions, strict=True):
        turns, current = [], None
        for m, v in zip(flags, versions, strict=True):
            if m and current is None:
                current = []
            if m:
                current.append(v)
            elif current is not None:
                turns.append(current)
                current = None
        turns += [current] if current else []
        assert [set(t) for t in turns] == [{0}, {1}, {1}]
    from tether.families.agent.policy import AgentPolicy

    policy = AgentPolicy(1.0)
    learner, engine_logp, versions = later_turns(policy, learner_with(policy, tiny_model_dir, weights), batch)
    assert (versions == 1).all() and (learner - engine_logp).abs().mean() <= 1e-5


def test_switch_at_turn_needs_keep(tiny_model_dir):
    from tether.errors import ConfigError

    with pytest.raises(ConfigError, match=r"switch_at=turn .* needs async\.inflight_update=drain or keep"):
        config(tiny_model_dir, "Echo", "async.inflight_update=abort", "env.switch_at=turn")


@pytest.mark.parametrize("env", ["Summarises", "SummarisesByTuple"])
def test_an_environment_that_rewrites_the_history_starts_a_new_sample_of_one_episode(tiny_model_dir, env):
    """The second step replaces the history: each episode is two samples, the second starting
    from the new context encoded once; every sample is what the engine saw and sampled, the
    learner scores it as the engine did, and both carry the episode's return and advantage."""
    from tether.families.agent.policy import AgentPolicy
    from tether.train.advantages import group_advantages

    sampler = sampler_for(config(tiny_model_dir, env))
    prompts_seen = []
    generate = sampler.engine.generate

    def recording(prompts, **kw):
        prompts_seen.extend(tuple(p) for p in prompts)
        return generate(prompts, **kw)

    sampler.engine.generate = recording
    try:
        batch = sampler.generate(item(2))
    finally:
        sampler.close()
    batch.check()
    assert batch.episode_of == [e for e in range(8) for _ in range(2)]
    assert batch.metrics["agent/rewrites"] == 8.0 and batch.turns == [3] * 8
    encode = sampler.player.encode
    for row, (ids, flags) in enumerate(zip(batch.ids, batch.model, strict=True)):
        transcript = batch.transcripts[batch.episode_of[row]]
        opening = transcript[0] if row % 2 == 0 else transcript[4]  # the reset, or the summary
        assert opening.startswith("go" if row % 2 == 0 else "summary:")
        head = encode(opening)
        assert ids[: len(head)] == head and flags[: len(head)] == [0] * len(head)
        # every model turn of the sample was sampled from exactly the ids before it
        starts = [j for j in range(1, len(flags)) if flags[j] and not flags[j - 1]]
        assert len(starts) == (2 if row % 2 == 0 else 1)
        assert all(tuple(ids[:j]) in prompts_seen for j in starts)
    policy = AgentPolicy(1.0)
    train, logp = scored(policy, policy.load(tiny_model_dir)[0], batch)
    on = train.mask.bool()
    assert (logp[on] - train.behavior_logp[on]).abs().mean() <= 1e-5
    assert train.rewards.tolist() == [r for r in batch.rewards for _ in range(2)]
    assert train.episode.tolist() == batch.episode_of
    # advantages are the episodes' (GRPO over the 4 episodes of a task), shared by their samples
    from tether.train.batch_stats import BatchStats
    from tether.train.learner import TorchLearner

    learner = TorchLearner(tiny_model_dir, config(tiny_model_dir, env, "train.updates_per_batch=3"))
    adv, _ = learner._advantages(train, BatchStats())
    assert torch.allclose(adv.values, group_advantages(torch.tensor(batch.rewards), 4).values[train.episode])
    assert len(set(batch.rewards)) > 1
    # three mini-batches of 16 rows cut episodes in two; every update still commits
    result = learner.train(rollout_batch(batch), train_version=0)
    assert result.committed_updates == 3


def rollout_batch(batch, index=0):
    from tether.vocabulary import RolloutBatch

    return RolloutBatch(index=index, behavior_version=0, num_groups=batch.num_groups,
                        group_size=batch.group_size, payload=batch)


@pytest.mark.timeout(300)
def test_two_learner_ranks_train_rewritten_episodes_as_one_process_does(tiny_model_dir):
    """Ranks split a mini-batch by whole groups of episodes, however many samples each has."""
    from learners import solo_and_ranks, worst_relative

    sampler = sampler_for(config(tiny_model_dir, "Summarises"))
    try:
        batches = [rollout_batch(sampler.generate(replace(item(4), seed=s, batch_index=s)), s)
                   for s in (1, 2)]
    finally:
        sampler.close()
    base = ("train.lr=5e-5", "train.updates_per_batch=2")
    solo_cfg = config(tiny_model_dir, "Summarises", *base)
    ranks_cfg = config(tiny_model_dir, "Summarises", *base, "train.world_size=2")
    (solo, _), (ranked, _) = solo_and_ranks(tiny_model_dir, solo_cfg, ranks_cfg, batches)
    assert worst_relative(ranked, solo) <= 1e-5


def test_a_rewrite_to_an_empty_context_ends_the_episode_with_an_error(tiny_model_dir, tmp_path):
    env = tmp_path / "empty.py"
    env.write_text(
        "from tether.families.agent.env import Step\n"
        "class Empty:\n"
        "    def reset(self, task, seed):\n"
        "        return 'go\\n'\n"
        "    def step(self, action):\n"
        "        return Step('', new_context=True)\n"
    )
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "model.family=agent", "data.task=kv_lookup",
                             f"env.env_class={env}:Empty", "env.max_failed_frac=1", "rollout.group_size=4",
                             "env.max_turn_tokens=5", "rollout.max_new_tokens=5"])
    sampler = sampler_for(cfg)
    try:
        batch = sampler.generate(item(1))
    finally:
        sampler.close()
    assert batch.statuses == ["error"] * 4 and batch.episode_of == [0, 1, 2, 3]
    assert "empty context" in sampler.player.last_errors[0]


def test_tether_eval_prints_the_share_of_failed_episodes_and_the_first(tiny_model_dir, capsys, caplog):
    """An environment that always fails: `tether eval` says so, not just "success 0.0%"."""
    from tether.cli.main import main

    assert main(["eval", "--model", str(tiny_model_dir), "model.family=agent", "data.task=kv_lookup",
                 f"env.env_class={ENVS}:ResetRaises", "data.num_eval=2", "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "success 0.0%" in out and "failed 100.0%" in out, out
    assert out.count("failed 100.0%") == 2  # greedy and sampled
    assert "6 of 6 held-out episodes failed" in caplog.text and "no sandbox today" in caplog.text
