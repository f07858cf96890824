"""Observations as chat turns: only the new turn's text is encoded and appended, the model's ids
are never re-encoded, and where a template rewrites earlier turns (drops past reasoning, trims) the
episode goes on in a new sample rendered whole by the template, each sample what the engine saw."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from envs import Echo, Summarises

pytest.importorskip("torch")

from tether.decoding.sampling import stop_ids_for
from tether.families.agent.chat import ChatTurns, NotAppendOnly
from tether.families.agent.env import factory
from tether.families.agent.envthreads import EnvThreads
from tether.families.agent.episode import Limits
from tether.families.agent.episodes import Player
from tether.modeling import load_causal_lm
from tether.rollout.engines.torch.engine import TorchEngine
from tether.vocabulary import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# renders every assistant turn but the last empty: what templates that strip earlier reasoning do
FORGETFUL = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-style thinking: the generation prompt opens the reasoning, and an assistant turn before the
# last user turn keeps only what follows its </think> (nothing, when it never closed its reasoning)
THINKING = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] != 'assistant' %}{{ m['content'] }}"
    "{% elif loop.index0 > ns.last %}<think>\n{{ m['content'] }}"
    "{% elif '</think>' in m['content'] %}{{ m['content'].split('</think>')[-1].lstrip() }}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
# Llama-3-style: every turn's content trimmed of surrounding whitespace
TRIM = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ENVS = Path(__file__).with_name("envs.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chat_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with ChatML's two special tokens, <|im_end|> its EOS, and a ChatML template."""
    model, tokenizer = load_causal_lm(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHATML
    model.resize_token_embeddings(len(tokenizer))
    path = tmp_path_factory.mktemp("chat") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def play(path, template=None, episodes=4, env=Echo, max_episode_tokens=256):
    model, tokenizer = load_causal_lm(path)
    if template is not None:
        tokenizer.chat_template = template
    engine = TorchEngine(model, pad_id=tokenizer.pad_token_id, stop_ids=stop_ids_for(tokenizer, ""))
    threads = EnvThreads(2)
    limits = Limits(4, 6, max_episode_tokens, 10, 60)
    player = Player(engine, tokenizer, factory(env, {}), limits, threads, chat=True)
    try:
        return tokenizer, player.play([({}, 0)] * episodes, SamplingParams(max_new_tokens=6), seed=1)
    finally:
        threads.close()


def test_each_observation_appends_only_its_own_turn_and_the_model_ids_stay_as_sampled(chat_model):
    tokenizer, episodes = play(chat_model)
    for ep in episodes:
        assert ep.status == "done" and ep.turns == 3
        assert ep.rewrites == ep.template_rewrites == 0  # an append-only template: one sample
        text = tokenizer.decode(ep.ids, skip_special_tokens=False)
        assert text == ep.chat.text  # the sequence is the episode's text, token for token
        runs, start = [], None  # the runs of model tokens: one per turn
        for j, m in enumerate([*ep.model, 0]):
            if m and start is None:
                start = j
            elif not m and start is not None:
                runs.append((start, j))
                start = None
        assert len(runs) == 3
        # up to the last turn, the sequence is exactly the template's rendering of the conversation
        before_last = tokenizer.decode(ep.ids[: runs[-1][0]], skip_special_tokens=False)
        assert before_last == tokenizer.apply_chat_template(
            ep.chat.messages[:-1], tokenize=False, add_generation_prompt=True
        )
        assert text.startswith("<|im_start|>user\ngo \n<|im_end|>\n<|im_start|>assistant\n")
        for (_, b), (next_a, _) in zip(runs, [*runs[1:], (len(ep.ids), None)], strict=True):
            after = tokenizer.decode(ep.ids[b:next_a], skip_special_tokens=False)
            ended = tokenizer.decode(ep.ids[b - 1 : b], skip_special_tokens=False) == "<|im_end|>"
            if next_a < len(ep.ids):
                assert after.startswith(
                    "\n<|im_start|>user\no" if ended else "<|im_end|>\n<|im_start|>user\no"
                )


def test_a_rewritten_history_opens_a_new_conversation_rendered_by_the_template(chat_model):
    tokenizer, episodes = play(chat_model, env=Summarises)
    for ep in episodes:
        assert ep.status == "done" and ep.rewrites == 1
        first, second = ep.samples()
        assert tokenizer.decode(first.ids, skip_special_tokens=False).startswith("<|im_start|>user\ngo \n")
        text = tokenizer.decode(second.ids, skip_special_tokens=False)
        assert text == ep.chat.text  # the new conversation is the second sample, token for token
        assert text.startswith("<|im_start|>user\nsummary: ")
        opening = tokenizer.apply_chat_template(ep.chat.messages[:1], tokenize=False,
                                                add_generation_prompt=True)
        assert tokenizer.decode(second.ids[: second.model.index(1)], skip_special_tokens=False) == opening


def with_template(model_dir, template, tmp_path_factory, *, spaces: bool = False):
    """A copy of ``model_dir`` whose tokenizer carries ``template``; with ``spaces``, one whose model
    samples a space about one token in five (rather than one in ninety), so turns often begin or end
    with one: every embedding gets +0.1 in dimension 0, so the last hidden state is positive there,
    and the space's 1.5 more, so its logit rises with it (the embeddings are tied)."""
    import torch

    path = tmp_path_factory.mktemp("templated") / "model"
    shutil.copytree(model_dir, path)
    model, tokenizer = load_causal_lm(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    if spaces:
        assert model.config.tie_word_embeddings
        with torch.no_grad():
            weight = model.get_input_embeddings().weight
            weight[:, 0] += 0.1
            weight[tokenizer(" ", add_special_tokens=False).input_ids, 0] += 1.5
        model.save_pretrained(path)
    return path


def sampler_for(model_dir, env=f"{ENVS}:Echo", *extra):
    import torch

    from tether.config.config import load_config
    from tether.families.agent.sampler import AgentSampler

    cfg = load_config(None, ["model.family=agent", "data.task=kv_lookup", f"model.path={model_dir}",
                             f"env.env_class={env}", "data.chat_template=true", "env.max_turns=4",
                             "env.max_turn_tokens=6", "rollout.max_new_tokens=6", "rollout.group_size=4",
                             *extra])
    return AgentSampler(cfg, str(model_dir), cfg.env.turn_stop, device=torch.device("cpu"), threads=1, seed=0)


def work_item():
    from tether.vocabulary import Example, WorkItem

    return WorkItem(batch_index=0, version=0, examples=[(i, Example(f"task {i}", str(i))) for i in range(2)],
                    group_size=4, params=SamplingParams(max_new_tokens=6, temperature=1.0), seed=5)


@pytest.fixture(scope="module")
def thinking_model(chat_model, tmp_path_factory):
    return with_template(chat_model, THINKING, tmp_path_factory)


@pytest.fixture(scope="module", params=["THINKING", "TRIM"])
def rewriting(request, chat_model, tmp_path_factory):
    """(template name, the model, its tokenizer, a batch of 2 tasks × 4 Echo episodes, and what the
    engine was asked and sampled, turn by turn), under a template that rewrites earlier turns."""
    path = (request.getfixturevalue("thinking_model") if request.param == "THINKING"
            else with_template(chat_model, TRIM, tmp_path_factory, spaces=True))
    sampler = sampler_for(path)
    calls = []
    generate = sampler.engine.generate

    def recording(prompts, **kw):
        out = generate(prompts, **kw)
        calls.append(([list(p) for p in prompts], [list(c.token_ids) for (c,) in out]))
        return out

    sampler.engine.generate = recording
    try:
        yield request.param, path, sampler.tokenizer, sampler.generate(work_item()), calls
    finally:
        sampler.close()


def turn_starts(flags):
    return [j for j in range(len(flags)) if flags[j] and (j == 0 or not flags[j - 1])]


def test_where_the_template_rewrites_earlier_turns_a_new_sample_starts_from_its_whole_rendering(rewriting):
    name, _, tokenizer, batch, calls = rewriting
    batch.check()
    assert set(batch.statuses) == {"done"} and batch.turns == [3] * 8
    completions: dict[tuple, list[list[int]]] = {}  # prompt ids → what the engine sampled from them
    for prompts, sampled in calls:
        for p, c in zip(prompts, sampled, strict=True):
            completions.setdefault(tuple(p), []).append(c)
    before = [0] * 8  # turns of each episode in its earlier samples
    for ids, flags, e in zip(batch.ids, batch.model, batch.episode_of, strict=True):
        transcript = batch.transcripts[e]
        starts = turn_starts(flags)
        # the sample opens with the template's rendering of the conversation so far (past reasoning
        # dropped, turns trimmed), encoded once
        k = before[e]
        messages = [{"role": ("user", "assistant")[i % 2], "content": t}
                    for i, t in enumerate(transcript[: 2 * k + 1])]
        opening = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ids[: starts[0]] == list(tokenizer(opening, add_special_tokens=False).input_ids)
        # each turn is exactly what the engine sampled when given exactly the ids before it
        for a, b in zip(starts, [*starts[1:], len(ids)], strict=True):
            turn = ids[a:a + flags[a:b].count(1)]
            assert turn in completions[tuple(ids[:a])]
        assert ids[starts[-1]:] in completions[tuple(ids[: starts[-1]])]  # it ends with its last turn
        assert "<|im_end|><|im_end|>" not in tokenizer.decode(ids, skip_special_tokens=False)
        before[e] += len(starts)
    assert before == batch.turns
    samples = [batch.episode_of.count(e) for e in range(8)]
    assert samples == [1 + r for r in batch.template_rewrites]
    if name == "THINKING":  # every observation after a turn drops that turn's reasoning: one sample a turn
        assert samples == [3] * 8
    else:  # trimming rewrites the turns that begin or end in whitespace, and only those
        actions = [t[1:5:2] for t in batch.transcripts]
        assert batch.template_rewrites == [sum(a != a.strip() for a in acts) for acts in actions]
        assert 0 < sum(batch.template_rewrites) < 16
    assert batch.metrics["agent/template_rewrites"] == batch.metrics["agent/rewrites"] == sum(samples) - 8
    lines = batch.sample_lines()
    assert [line["template_rewrites"] for line in lines] == [line["rewrites"] for line in lines] == \
        batch.template_rewrites


def test_the_learner_scores_each_sample_of_a_rewritten_episode_as_the_engine_did(rewriting):
    from episodes import scored
    from tether.families.agent.policy import AgentPolicy

    _, path, _, batch, _ = rewriting
    policy = AgentPolicy(1.0)
    train, logp = scored(policy, policy.load(path)[0], batch)
    on = train.mask.bool()
    assert int(on.sum()) == sum(sum(m) for m in batch.model) and len(batch.ids) > 8
    for row in range(len(batch.ids)):
        assert (logp[row][on[row]] - train.behavior_logp[row][on[row]]).abs().mean() <= 1e-5
    # per-turn credit finds each turn in the sample that holds it: the turns go on across samples
    from tether.families.agent.policy import turn_columns

    turn, _ = turn_columns(batch, train.mask, credit="turn", gamma=1.0, mask_failures=True)
    before = [0] * 8
    for row, e in enumerate(batch.episode_of):
        n = len(turn_starts(batch.model[row]))
        assert sorted(set(turn[row][on[row]].tolist())) == list(range(before[e], before[e] + n))
        before[e] += n
    assert before == batch.turns


def test_a_masked_failure_leaves_the_loss_with_every_sample_the_template_started(thinking_model):
    import torch

    from tether.families.agent.episode import FAILURES

    # two steps; on task 1 the second raises: its episodes fail in their second sample
    sampler = sampler_for(thinking_model, f"{ENVS}:FailsLateOnOddTasks", "env.max_failed_frac=1",
                          "env.on_failure=mask")
    try:
        batch = sampler.generate(work_item())
    finally:
        sampler.close()
    failed = [status in FAILURES for status in batch.statuses]
    assert failed == [False] * 4 + [True] * 4 and batch.template_rewrites == [1] * 8
    policy = sampler.cfg.family().policy(sampler.cfg)
    policy.pad_id = sampler.tokenizer.pad_token_id
    train = policy.batch(batch)
    rows_failed = torch.as_tensor([failed[e] for e in batch.episode_of])
    assert train.mask[rows_failed].sum() == 0 and train.mask[~rows_failed].sum() > 0
    assert batch.metrics["agent/masked_failures"] == sum(failed)


@pytest.mark.timeout(300)
def test_tether_train_trains_turn_credit_across_a_thinking_templates_samples(thinking_model, tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "tether.cli.main", "train", "model.family=agent",
         f"model.path={thinking_model}", "data.task=kv_lookup", "data.num_train=50", "data.num_eval=8",
         "data.chat_template=true", f"env.env_class={ENVS}:OddEcho", "env.max_turns=4",
         "env.max_turn_tokens=6", "rollout.max_new_tokens=6",
         "env.credit=turn", "train.num_batches=2", "rollout.batch_size=2", "rollout.group_size=4",
         "eval.interval=0", "--run-dir", run, "--plain", "--no-report"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]  # a run that commits no update fails
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["agent/template_rewrites"] for m in metrics] == [16.0, 16.0]  # two per episode of 3 turns
    episodes = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 16
    assert {(e["turns"], e["rewrites"], e["template_rewrites"]) for e in episodes} == {(3, 2, 2)}
    assert all(m["credit/turns_max"] == 3 for m in metrics)


def test_a_rendering_of_the_whole_conversation_over_the_token_budget_ends_the_episode(chat_model):
    # the first prompt and a turn (at most 6 tokens) fit in 45; the thinking template's rendering
    # of the conversation after the first observation does not
    tokenizer, episodes = play(chat_model, THINKING, max_episode_tokens=45)
    for ep in episodes:
        assert ep.status == "token_budget" and ep.turns == 1
        assert len(ep.samples()) == 1 and ep.rewrites == ep.template_rewrites == 0
        assert len(ep.transcript) == 3  # the observation that did not fit is kept in the transcript
        messages = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(ep.transcript)]
        first, whole = (len(tokenizer(tokenizer.apply_chat_template(messages[:n], tokenize=False,
                                                                    add_generation_prompt=True),
                                      add_special_tokens=False).input_ids) for n in (1, 3))
        assert first + 6 < 45 <= whole


def test_a_template_that_drops_past_reasoning_restarts_from_its_rendering_of_the_whole(chat_model):
    _, tokenizer = load_causal_lm(chat_model)
    tokenizer.chat_template = THINKING
    turns = ChatTurns(tokenizer)
    assert turns.first("q") == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n"
    turns.sampled(tokenizer("plan</think>ans 1<|im_end|>", add_special_tokens=False).input_ids)
    with pytest.raises(NotAppendOnly, match="adding a turn changes how the chat template renders"):
        turns.next("o1")
    whole = ("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nans 1<|im_end|>\n"
             "<|im_start|>user\no1<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert turns.restart("o1") == whole == turns.text
    turns.sampled(tokenizer("more</think>ans 2<|im_end|>", add_special_tokens=False).input_ids)
    with pytest.raises(NotAppendOnly):
        turns.next("o2")
    assert turns.restart("o2").startswith(whole.removesuffix("<think>\n") + "ans 2<|im_end|>\n")


def test_a_template_that_trims_turns_restarts_without_doubling_the_end_of_turn(chat_model):
    _, tokenizer = load_causal_lm(chat_model)
    tokenizer.chat_template = TRIM
    turns = ChatTurns(tokenizer)
    turns.first("q")
    turns.sampled(tokenizer("ans <|im_end|>", add_special_tokens=False).input_ids)
    with pytest.raises(NotAppendOnly, match="does not render the episode so far"):
        turns.next("o1")
    assert turns.restart("o1") == ("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nans<|im_end|>\n"
                                   "<|im_start|>user\no1<|im_end|>\n<|im_start|>assistant\n")


def test_a_tokenizer_without_a_template_is_refused(tiny_model_dir):
    _, tokenizer = load_causal_lm(tiny_model_dir)
    from tether.errors import ConfigError

    with pytest.raises(ConfigError, match="no chat template"):
        ChatTurns(tokenizer)


def test_the_warm_start_encodes_transcripts_as_the_player_appends_them(chat_model):
    from tether.families.agent.warmstart import encode_transcript

    _, tokenizer = load_causal_lm(chat_model)
    [(ids, labels)] = encode_transcript(
        tokenizer,
        [("key b", False), ("get b<|im_end|>", True), ("b=7", False), ("ans 7<|im_end|>", True)],
        chat=True,
    )
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text == (
        "<|im_start|>user\nkey b<|im_end|>\n<|im_start|>assistant\nget b<|im_end|>\n<|im_start|>user\n"
        "b=7<|im_end|>\n<|im_start|>assistant\nans 7<|im_end|>"
    )
    trained = tokenizer.decode(
        [i for i, lab in zip(ids, labels, strict=True) if lab != -100], skip_special_tokens=False
    )
    assert trained == "get b<|im_end|>ans 7<|im_end|>"
    assert Path(chat_model).is_dir()


def test_the_warm_start_splits_a_transcript_where_the_template_rewrites_it_as_the_player_does(chat_model):
    from tether.families.agent.warmstart import encode_transcript

    _, tokenizer = load_causal_lm(chat_model)
    tokenizer.chat_template = THINKING
    sequences = encode_transcript(
        tokenizer,
        [("key b", False), ("b?</think>get b<|im_end|>", True), ("b=7", False), ("ans 7<|im_end|>", True)],
        chat=True,
    )
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    trained = [decode([i for i, lab in zip(ids, labels, strict=True) if lab != -100])
               for ids, labels in sequences]
    assert [decode(ids) for ids, _ in sequences] == [
        "<|im_start|>user\nkey b<|im_end|>\n<|im_start|>assistant\n<think>\nb?</think>get b<|im_end|>",
        "<|im_start|>user\nkey b<|im_end|>\n<|im_start|>assistant\nget b<|im_end|>\n<|im_start|>user\n"
        "b=7<|im_end|>\n<|im_start|>assistant\n<think>\nans 7<|im_end|>",
    ]
    assert trained == ["b?</think>get b<|im_end|>", "ans 7<|im_end|>"]  # each model turn once
