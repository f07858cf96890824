"""Where a sampled turn ends, defined once for every engine: the end-of-turn token ids and the stop
strings.

A turn ends at the first sampled token that is an end-of-turn id, or at the first token whose text
completes a stop string (the token is part of the turn either way). The ids are

- the tokenizer's EOS;
- the end-of-turn token of its chat template, when the template uses one the vocabulary holds as a
  single token (ChatML ``<|im_end|>``, Gemma ``<end_of_turn>``, Llama-3 ``<|eot_id|>``, Phi-3
  ``<|end|>``), so a ChatML template over a tokenizer whose EOS is another token still ends a turn
  at ``<|im_end|>``;
- the model's generation config's ``eos_token_id`` (an id or a list; ``config.json``'s when there is
  no ``generation_config.json``): vLLM stops at those whatever it is asked, so the built-in engine
  must too for both to end the same turns.

A stop string that is one token of the vocabulary is matched as that id (no decoding a step); a
longer one as text: the built-in engine decodes each row's tail as it samples
(``tether.decoding.sampling``), vLLM through its ``stop`` parameter. A stop string the tokenizer
cannot encode and decode back unchanged is refused, naming the key it came from.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.errors import ConfigError

CHAT_END_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")
"""End-of-turn tokens of the common chat templates: ChatML, Gemma, Llama-3, Phi-3."""


@dataclass(frozen=True)
class TurnEnds:
    """What ends a sampled turn: an end-of-turn id, a stop string of one token (as its id), or the
    token that completes a longer stop string."""

    end_ids: tuple[int, ...]
    """End-of-turn tokens: the turn's text (the action, a chat message) leaves a final one out."""
    stop_ids: tuple[int, ...] = ()
    """Stop strings that are one token each: part of the turn's text."""
    strings: tuple[str, ...] = ()
    """Stop strings of several tokens, matched on the decoded text; part of the turn's text."""

    @property
    def ids(self) -> list[int]:
        """Every id that ends a turn, as the engines take them."""
        return list(dict.fromkeys((*self.end_ids, *self.stop_ids)))


def as_ids(value: int | Sequence[int] | None) -> list[int]:
    """An ``eos_token_id`` setting (an id, a list of them, or none) as a list."""
    return [] if value is None else [int(value)] if isinstance(value, int) else [int(v) for v in value]


def generation_eos_ids(model_path: str | Path | None) -> list[int]:
    """``eos_token_id`` of the model's generation config, else of its config.json, as vLLM reads
    it; [] without a model directory. (A loaded model: ``as_ids(model.generation_config.eos_token_id)``.)"""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name if model_path is not None else None
        if path is not None and path.is_file():
            ids = as_ids(json.loads(path.read_text()).get("eos_token_id"))
            if ids:
                return ids
    return []


def single_token(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when the vocabulary holds it as one token, else None."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return ids[0] if len(ids) == 1 else None


def end_of_turn_ids(tokenizer: Any, generation_eos: Iterable[int] = ()) -> tuple[int, ...]:
    """The ids that end a turn (module docstring), the tokenizer's EOS first, no repeats;
    ``generation_eos``: the model's generation config's (``generation_eos_ids``)."""
    ids: list[int] = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    template = tokenizer.chat_template  # None without one
    if isinstance(template, str):
        for token in CHAT_END_TOKENS:
            tid = single_token(tokenizer, token) if token in template else None
            if tid is not None:
                ids.append(tid)
    ids += generation_eos
    return tuple(dict.fromkeys(ids))


def turn_ends(tokenizer: Any, stops: str | Iterable[str], *, generation_eos: Iterable[int] = (),
              key: str = "env.turn_stop") -> TurnEnds:
    """The end-of-turn ids and ``stops`` (one string or several; '' = none) resolved against the
    tokenizer; a stop string it cannot express is refused naming ``key``."""
    ids: list[int] = []
    strings: list[str] = []
    for stop in [stops] if isinstance(stops, str) else list(stops):
        if not stop:
            continue
        encoded = tokenizer(stop, add_special_tokens=False).input_ids
        back = tokenizer.decode(encoded, skip_special_tokens=False)
        if back != stop:
            raise ConfigError(f"{key}={stop!r} cannot be expressed by the model's tokenizer: it encodes to "
                              f"{len(encoded)} token(s) that decode to {back!r}; choose a stop string made "
                              "of text the tokenizer knows")
        if len(encoded) == 1:
            ids.append(encoded[0])
        else:
            strings.append(stop)
    return TurnEnds(end_of_turn_ids(tokenizer, generation_eos), tuple(dict.fromkeys(ids)),
                    tuple(dict.fromkeys(strings)))


class StopStrings:
    """Finds, as a row is sampled, the token that completes a stop string: the row's decoded tail
    is searched after each token. The tail is long enough to hold the longest string (every token
    decodes to at least a character, a few spare for tokens that decode to nothing alone). A row
    never held a stop string before the token just sampled (it would have ended there), so a
    string in the tail was completed by that token."""

    def __init__(self, tokenizer: Any, strings: Sequence[str]) -> None:
        self.tokenizer, self.strings = tokenizer, tuple(strings)
        self.window = max(len(s) for s in self.strings) + 4

    def completes(self, row: Sequence[int]) -> bool:
        """Whether the last token of ``row`` (a turn's ids so far) completes a stop string."""
        tail = self.tokenizer.decode(list(row[-self.window:]), skip_special_tokens=False)
        return any(s in tail for s in self.strings)
