"""``episodes.jsonl``: what each episode of a run was, one JSON line an episode, written as its
batch trains (every ``metrics.record_every``-th trained batch).

A line holds the step it trained at, its rollout batch and task position, its group and place in
it, how it ended (and the failure's message), its return and the reward of every step, its turns,
how many times its history was rewritten, its model tokens, the oldest and newest policy version
of those tokens, and its transcript: observation, action, observation, … as text, the final
observation included. On resume, lines after the checkpoint are dropped and written again.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tether.families.agent.payload import EpisodeBatch
from tether.loop.observe import BatchRecord, Recorder

NAME = "episodes.jsonl"


def episode_lines(batch: EpisodeBatch) -> list[dict]:
    """One record per episode of ``batch``, in group order."""
    samples = Counter(batch.episode_of)
    model_tokens = [0] * len(batch.rewards)
    versions: list[list[int]] = [[] for _ in batch.rewards]
    for e, flags, vs in zip(batch.episode_of, batch.model, batch.versions, strict=True):
        model_tokens[e] += sum(flags)
        versions[e] += [v for v, m in zip(vs, flags, strict=True) if m]
    g = batch.group_size
    return [
        {"position": batch.positions[e // g], "group": e // g, "episode": e % g, "status": batch.statuses[e],
         "error": batch.errors[e], "return": batch.rewards[e], "step_rewards": batch.step_rewards[e],
         "turns": batch.turns[e], "rewrites": samples[e] - 1, "model_tokens": model_tokens[e],
         "versions": [min(versions[e]), max(versions[e])] if versions[e] else [],
         "transcript": batch.transcripts[e]}
        for e in range(len(batch.rewards))
    ]


def episode_recorder(run_dir: Path, every: int) -> Recorder:
    def lines(record: BatchRecord) -> list[dict]:
        return episode_lines(record.payload) if isinstance(record.payload, EpisodeBatch) else []

    return Recorder(Path(run_dir) / NAME, every, lines)
