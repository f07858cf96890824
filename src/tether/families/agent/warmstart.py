"""The agent family's warm start: supervised fine-tuning on the task's scripted transcripts with the
same mask RL uses (loss on the model's turns only, never on observations) and cut into the same
samples (where the chat template rewrites the conversation), until held-out greedy episode success
reaches ``warmstart.target_pass_rate``. ``env.script_quality`` says how good a player the
transcripts show."""

from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tether.errors import ConfigError
from tether.families.agent.tasks import AgentTask
from tether.train.supervised import WarmstartResult, warmstart_loop, write_record
from tether.vocabulary import Progress, SamplingParams


def encode_transcript(tokenizer, segments, *, chat: bool = False, options=None, end_ids=()
                      ) -> list[tuple[list[int], list[int]]]:
    """The training sequences of a scripted transcript, each (ids, labels): every segment encoded
    on its own, as the player encodes observations (with ``chat``, each observation, text or
    messages, as the chat turn the player would append, with the recipe's ``ChatOptions`` (system
    prompt, tool schemas) and the end-of-turn ids the player uses); labels are the ids on the
    model's segments and −100 elsewhere. One sequence, or, as the player starts a new sample where
    the chat template does not reproduce the conversation so far, one more from each such point,
    whose context is the template's rendering of the whole conversation (earlier model turns
    unlabelled there)."""
    from tether.families.agent.chat import ChatOptions, ChatTurns, NotAppendOnly
    from tether.families.agent.env import plain_text

    turns = ChatTurns(tokenizer, end_ids=end_ids, options=options or ChatOptions()) if chat else None
    sequences: list[tuple[list[int], list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    for text, by_model in segments:
        if turns is not None and not by_model:
            try:
                text = turns.next(text) if turns.messages else turns.first(text)
            except NotAppendOnly:
                sequences.append((ids, labels))
                ids, labels = [], []
                text = turns.restart(text)
        elif not by_model:
            text = plain_text(text)
        piece = list(tokenizer(text, add_special_tokens=False).input_ids)
        if turns is not None and by_model:
            turns.sampled(piece)
        ids += piece
        labels += piece if by_model else [-100] * len(piece)
    return [*sequences, (ids, labels)]


def transcript_batch(encoded, pad_id: int):
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (seq, lab) in enumerate(encoded):
        ids[i, : len(seq)] = torch.as_tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, : len(lab)] = torch.as_tensor(lab)
    return ids, mask, labels


def run_agent_warmstart(
    cfg: Any, model_dir: Path, out: Path, on_progress: Progress | None = None
) -> WarmstartResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tether import registry
    from tether.families.agent.evaluate import eval_engine, play_tasks

    task = registry.tasks.get(cfg.data.task) if cfg.data.task else None
    if not isinstance(task, AgentTask) or task.script is None:
        raise ConfigError(
            "the agent family's warm start needs scripted transcripts: data.task must be a "
            "built-in agent task (kv_lookup, guess_number, tool_calc); with your own environment, point "
            "model.path at a model you trained and set model.create_if_missing=false"
        )
    s = cfg.warmstart
    torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.run.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = cfg.family().data(cfg, model_dir)
    rng = random.Random(cfg.run.seed)
    quality = cfg.env.script_quality
    from tether.decoding.stops import generation_eos_ids
    from tether.families.agent.sampler import chat_options, turn_ends_of

    options = chat_options(cfg) if cfg.data.chat_template else None
    end_ids = turn_ends_of(cfg, tokenizer, generation_eos_ids(model_dir)).end_ids
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)

    def loss_at(step: int) -> torch.Tensor:
        chosen = rng.sample(data.train, min(s.batch_size, len(data.train)))
        encoded = [sequence for ex in chosen
                   for sequence in encode_transcript(tokenizer, task.script(ex, rng, quality),
                                                     chat=cfg.data.chat_template, options=options,
                                                     end_ids=end_ids)]
        ids, mask, labels = transcript_batch(encoded, tokenizer.pad_token_id)
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    greedy = SamplingParams(
        max_new_tokens=cfg.env.max_turn_tokens or cfg.rollout.max_new_tokens, temperature=0.0
    )

    def evaluate() -> dict[str, float]:
        was = model.training
        model.eval()
        episodes = play_tasks(eval_engine(model, tokenizer, cfg), tokenizer, cfg, data.eval, greedy,
                              seed=cfg.run.seed)
        model.train(was)
        return {"pass_at_1": sum(ep.succeeded for ep in episodes) / len(episodes)}

    result = warmstart_loop(
        model, optimizer, loss_at, evaluate, s, data=data.description, on_progress=on_progress
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_record(out, result, {**asdict(s), "seed": cfg.run.seed, "script_quality": quality})
    return result
