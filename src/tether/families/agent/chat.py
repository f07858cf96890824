"""Observations as chat turns (``data.chat_template: true`` with the agent family).

The conversation is rendered with the tokenizer's template to find the text of each new turn, and
only that text is encoded and appended; the model's sampled ids are never re-encoded. Appending is
right only while rendering the conversation so far reproduces, character for character, the text
the episode already holds: the previous prompt, then exactly what the model sampled (special
tokens included), then whatever the template closes an assistant turn with (e.g. ChatML's newline
after ``<|im_end|>``), which is appended before the next observation.

A template that rewrites earlier turns (Qwen3's removal of past reasoning, a Llama-3-style
``| trim``, a system prompt that moves) is not append-only: ``next`` raises ``NotAppendOnly`` with
what differed, and the player starts a new sample instead (``restart``): its context is the
template's rendering of the whole conversation as it renders it now, with the new observation and
the generation prompt, encoded once. The sequence is never silently re-tokenized in place.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tether.errors import RolloutError


class NotAppendOnly(RolloutError):
    """The chat template does not reproduce the episode so far once a new turn is added; the
    conversation goes on from ``ChatTurns.restart``."""


def _first_difference(a: str, b: str) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"at character {i}: the episode holds {a[i:i + 40]!r}, the template renders {b[i:i + 40]!r}"


@dataclass(frozen=True)
class ChatOptions:
    """What a recipe gives the chat template besides the conversation."""

    system: str = ""
    """A system message opening every conversation (``data.system_prompt``); '' = none."""
    tools: Sequence[Mapping[str, Any]] = ()
    """Tool schemas (``tools.tool_schema``), passed as the template's ``tools`` (``env.tools``)."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """More template arguments (``data.chat_template_kwargs``, e.g. ``enable_thinking``)."""

    def render(self, tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        extra = {"tools": list(self.tools)} if self.tools else {}
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt, **extra, **self.kwargs)

    def opening(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []


def as_messages(observation: str | Sequence[Mapping[str, str]], role: str = "user") -> list[dict[str, str]]:
    """An observation as chat messages: text is one message of ``role``; messages stay as given."""
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    return [dict(m) for m in observation]


class ChatTurns:
    """One episode's conversation: ``first`` and ``next`` return the text to encode and append for
    an observation (text, a turn of ``role``, or role-tagged messages), ``restart`` the whole
    context of a new sample when ``next`` cannot append; ``sampled`` records a model turn as it was
    sampled."""

    def __init__(self, tokenizer: Any, role: str = "user", end_ids: Collection[int] = (),
                 options: ChatOptions = ChatOptions()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            from tether.errors import ConfigError

            raise ConfigError("data.chat_template is true but the tokenizer has no chat template; set "
                              "data.chat_template=false (observations are then appended as plain text)")
        self.tokenizer, self.role, self.options = tokenizer, role, options
        self.end_ids = frozenset(end_ids or (tokenizer.eos_token_id,))
        """End-of-turn ids (``tether.decoding.stops``): a final one the template renders itself is
        left out of the turn's content."""
        self.messages: list[dict[str, str]] = []
        self._closing: dict[int, bool] = {}  # end-of-turn id → whether the template closes turns with it
        self.text = ""  # the episode as text: every prompt and model turn so far

    def _render(self, generation_prompt: bool) -> str:
        return self.options.render(self.tokenizer, self.messages, generation_prompt)

    def first(self, observation: str | Sequence[Mapping[str, str]]) -> str:
        self.messages = self.options.opening() + as_messages(observation, self.role)
        self.text = self._render(True)
        return self.text

    def sampled(self, token_ids: list[int]) -> None:
        """The model's turn as sampled, special tokens included. A final end-of-turn token is left
        out of its content when the template closes the turn with that very token (ChatML's
        ``<|im_end|>``, whether or not it is the tokenizer's EOS; a template that also rewrites the
        turn is asked with a probe, ``_closes_turns_with``), so it is not rendered twice;
        another one (a ``<|endoftext|>`` under ChatML) stays in the content, and the template's own
        closing follows it."""
        decode = self.tokenizer.decode
        self.text += decode(token_ids, skip_special_tokens=False)
        if token_ids and token_ids[-1] in self.end_ids:
            self.messages.append({"role": "assistant",
                                  "content": decode(token_ids[:-1], skip_special_tokens=False)})
            if self._render(False).startswith(self.text) or self._closes_turns_with(token_ids[-1]):
                return
            self.messages.pop()
        self.messages.append({"role": "assistant", "content": decode(token_ids, skip_special_tokens=False)})

    def _closes_turns_with(self, token_id: int) -> bool:
        """Whether the template closes an assistant turn with ``token_id``'s text, seen on a probe
        conversation: a template that rewrites the turn itself (``| trim`` on ``ok <|im_end|>``)
        renders the episode differently with the token or without it, and the token is still its
        own closing (``ok<|im_end|>``, not ``ok <|im_end|><|im_end|>``)."""
        if token_id not in self._closing:
            end = self.tokenizer.decode([token_id], skip_special_tokens=False)
            probe = [{"role": self.role, "content": "hello"}, {"role": "assistant", "content": "ok"}]
            try:
                rendered = self.options.render(self.tokenizer, self.options.opening() + probe, False)
            except Exception:  # a template that refuses the probe's roles: only the rendering decides
                rendered = ""
            self._closing[token_id] = f"ok{end}" in rendered
        return self._closing[token_id]

    def next(self, observation: str | Sequence[Mapping[str, str]]) -> str:
        closed = self._render(False)
        if not closed.startswith(self.text):
            raise NotAppendOnly("the chat template does not render the episode so far as it was sampled "
                                f"({_first_difference(self.text, closed)}); it is not append-only")
        tail = closed[len(self.text):]
        added = as_messages(observation, self.role)
        self.messages += added
        opened = self._render(True)
        if not opened.startswith(closed):
            self.messages = self.messages[:len(self.messages) - len(added)]
            raise NotAppendOnly("adding a turn changes how the chat template renders the earlier ones "
                                f"({_first_difference(closed, opened)}); it is not append-only")
        appended = tail + opened[len(closed):]
        self.text += appended
        return appended

    def restart(self, observation: str | Sequence[Mapping[str, str]]) -> str:
        """The context of a new sample, after ``next`` raised ``NotAppendOnly`` for ``observation``:
        every message so far as the template renders it now (earlier turns as it rewrites them),
        ``observation`` as a new turn, and the generation prompt. The episode's text starts over
        from it."""
        self.messages += as_messages(observation, self.role)
        self.text = self._render(True)
        return self.text
