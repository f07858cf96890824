"""Batched sampling with a KV cache, returning the log-probability of what was sampled.

Prompts of different lengths are left-padded into one batch; position ids follow the attention
mask so padding does not shift positions. Each step runs one forward pass over the newest token
of every sequence, so per-token Python work is a handful of tensor operations for the whole batch;
on the native decoder (``FastDecoder.decode_run``) sampling runs inside its decode calls, from
the same uniforms, and without in-flight updates the whole loop does.

Log-prob semantics: ``logprobs[t]`` is log μ(token_t), where μ is the distribution actually
sampled from — softmax(logits / temperature) after top-k and top-p truncation and renormalisation.
Without truncation that equals the trainer's log-softmax of the same logits at the same
temperature; with truncation it does not, and the importance ratio then measures the truncation
too. Greedy decoding returns log-probs at temperature 1.

Weights may change mid-generation (``async.inflight_update``): ``sample`` asks ``poll`` before
every decode step whether new weights were put in place, and stamps each token with the version
whose forward produced its logits. Then ``keep`` continues with the KV cache of the prefix as
computed by the old weights; ``recompute`` first runs the whole prefix (prompt and tokens so far)
again under the new weights; ``abort`` drops every unfinished sequence and samples it again from
its prompt under the new weights (its discarded tokens are counted as wasted).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache as _memo

import torch

from tether.control.inflight import KEEP, InflightMode
from tether.decoding.stops import StopStrings
from tether.errors import ConfigError
from tether.vocabulary import SamplingParams


@dataclass(frozen=True)
class Completions:
    """One completion per input prompt, stop token included when it stopped."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    """``stop`` (a stop token was sampled) or ``length`` (``max_new_tokens`` reached)."""
    versions: list[list[int]] = field(default_factory=list)
    """The policy version of each token: the weights whose forward gave its logits."""
    wasted_tokens: int = 0
    """Tokens sampled and then dropped by ``abort``."""
    switches: int = 0
    """Weight changes seen while sampling."""


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu"):
    """(B, P) token ids and attention mask, prompts right-aligned."""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
    width = max(len(p) for p in prompts)
    # one tensor from padded Python lists: a slice assignment per prompt cost ~8 µs each
    rows = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    ids = torch.tensor(rows, dtype=torch.long, device=device)  # (B, P)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long,
                        device=device)  # (B, P)
    return ids, mask


@_memo
def _cache_kwarg(model_type: type) -> str:
    """The name a model's forward takes its KV cache by (``cache`` from transformers 5.x)."""
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_of(out) -> object:
    return out.cache if hasattr(out, "cache") else out.past_key_values


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p set to -inf. ``logits``: (B, V), already / T."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches p (always keep the first)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def categorical(logp: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of (B, V) log-probabilities, by the Gumbel-max trick: the argmax of
    log p + G with G = −log(−log U), U uniform, is distributed as p (the exponential race vLLM's
    sampler also uses). One uniform per logit and an argmax cost about a third of
    ``torch.multinomial``, whose exponential draws dominate a small model's sampling step.
    Rows with −inf entries (truncation) never pick them."""
    u = torch.rand(logp.shape, generator=generator, device=logp.device)
    return (logp - u.log_().neg_().log_()).argmax(dim=-1)


def stop_ids_for(tokenizer, stop_text: str) -> list[int]:
    """Token ids that end an answer: EOS, plus ``stop_text`` when it is a single token."""
    ids = [tokenizer.eos_token_id]
    if stop_text:
        stop = tokenizer(stop_text, add_special_tokens=False).input_ids
        if len(stop) == 1:
            ids.append(stop[0])
    return ids


class _TransformersStepper:
    """Prefill/decode through the model's own forward and its KV cache (any causal LM)."""

    path = "transformers"
    """How it decodes (``TorchEngine.decoder_path``)."""
    samples_natively = False
    """It has no ``decode_run`` (``FastDecoder``'s native path samples inside its decode calls)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache_kw = _cache_kwarg(type(model))

    def invalidate(self) -> None:
        """Nothing to do: the model's own forward always reads its current weights."""

    def reload(self) -> None:
        """Weights changed mid-generation: nothing to do (see ``invalidate``)."""

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
                repeats: int = 1) -> torch.Tensor:
        ids, mask = ids.repeat_interleave(repeats, 0), mask.repeat_interleave(repeats, 0)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        self.cache = _cache_of(out)
        self.mask = mask
        self.next_pos = positions[:, -1:] + 1  # (B, 1)
        return out.logits[:, -1, :].float()

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        ones = torch.ones((tokens.shape[0], 1), dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=-1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=self.next_pos,
                         use_cache=True, **{self.cache_kw: self.cache})
        self.cache = _cache_of(out)
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1, :].float()


def transformers_stepper(model: torch.nn.Module):
    """Prefill and decode through ``model``'s own forward, whatever its family."""
    return _TransformersStepper(model)


def stepper_for(model: torch.nn.Module, decoder: str = "auto"):
    """The lean decoder when the model's family supports it (``decoder``: ``auto``, ``native``
    or ``python``, how it runs: ``FastDecoder``), else the transformers forward."""
    from tether.decoding.fast_decoder import FastDecoder, supports

    return FastDecoder(model, decoder=decoder) if supports(model) else _TransformersStepper(model)


@torch.inference_mode()
def sample(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    stop_ids: Sequence[int],
    pad_id: int,
    generator: torch.Generator | None = None,
    stepper=None,
    samples_per_prompt: int = 1,
    version: int = 0,
    poll: Callable[[], int | None] | None = None,
    inflight: InflightMode = KEEP,
    stop_strings: StopStrings | None = None,
) -> Completions:
    """Sample ``samples_per_prompt`` completions per prompt, prompt-major (prompt 0's samples
    first); each prompt's prefill runs once for its whole group.

    ``stepper`` (from ``stepper_for``) can be reused across calls; after the model's weights
    change, call its ``invalidate()`` (the lean decoder keeps transposed copies of them).
    ``version`` is the weights' version now; ``poll``, asked before each decode step, returns a
    newer version once it has put newer weights in place (else None), and ``inflight`` (keep,
    recompute, abort: ``tether.control.inflight``) says what happens to the sequences then (module
    docstring). ``stop_strings`` also ends a row at the token that completes one of its strings
    (its decoded tail is searched after every step, so the loop is never run natively whole).
    """
    if not inflight.switches:
        raise ConfigError(f"async.inflight_update={inflight.name} does not switch weights mid-generation")
    stepper = stepper if stepper is not None else stepper_for(model)
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    batch = ids.shape[0] * samples_per_prompt
    stop = torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)
    logits = stepper.prefill(ids, mask, params.max_new_tokens, samples_per_prompt)  # (B·n, V)
    vocab = logits.shape[-1]
    step_versions: list[int] = []  # the version of each step's logits
    switches = 0
    # the native decoder draws untruncated samples itself, inside its decode calls (one a step,
    # or the whole loop when nothing polls for new weights), from the uniforms this loop would
    # have drawn: the same stream, and no torch sampler operations a step
    fuse = not params.truncates

    tokens = torch.empty((batch, params.max_new_tokens), dtype=torch.long, device=device)  # (B, N)
    logps = torch.empty((batch, params.max_new_tokens), dtype=torch.float32, device=device)  # (B, N)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.full((batch,), params.max_new_tokens, dtype=torch.long, device=device)
    steps = 0
    for t in range(params.max_new_tokens):
        if logits is not None:  # else decode_run wrote this step's tokens, log-probs and stops
            if params.greedy:
                dist = torch.log_softmax(logits, dim=-1)
                tok = dist.argmax(dim=-1)
            else:
                scaled = logits if params.temperature == 1.0 else logits / params.temperature
                dist = torch.log_softmax(truncate_logits(scaled, params.top_k, params.top_p), dim=-1)
                tok = categorical(dist, generator)
            tokens[:, t] = tok
            logps[:, t] = dist.gather(-1, tok[:, None]).squeeze(-1)
        tok = tokens[:, t]
        step_versions.append(version)
        steps = t + 1
        if len(stop) or stop_strings is not None:
            hit = torch.isin(tok, stop) & ~done
            if stop_strings is not None:
                hit |= _completes_string(stop_strings, tokens, t, done)
            lengths = torch.where(hit, torch.full_like(lengths, t + 1), lengths)
            done |= hit
            if bool(done.all()):
                break
        if t + 1 == params.max_new_tokens:
            break
        newer = poll() if poll is not None else None
        if newer is None:
            if fuse and stepper.samples_natively:
                if poll is None and stop_strings is None:  # nothing changes the weights or ends a row
                    # by its text now: the rest in native calls
                    steps = _run_natively(stepper, params, generator, tokens, logps, t, vocab, stop, done,
                                          lengths)
                    step_versions += [version] * (steps - len(step_versions))
                    break
                u = None if params.greedy else torch.rand((1, batch, vocab), generator=generator,
                                                          device=device)
                stepper.decode_run(1, tokens, logps, t, params.temperature, u, stop, done, lengths)
                logits = None
            else:
                logits = stepper.decode(tok)
            continue
        version, switches = newer, switches + 1
        stepper.reload()
        if inflight.restarts:
            return _resample_unfinished(
                model, prompts, params, tokens[:, :steps], logps[:, :steps], lengths, done, step_versions,
                switches, stop_ids=stop_ids, pad_id=pad_id, generator=generator, stepper=stepper,
                samples_per_prompt=samples_per_prompt, version=version, poll=poll, inflight=inflight,
                stop_strings=stop_strings)
        if inflight.recomputes_prefix:  # the whole prefix again, under the new weights
            prefix = torch.cat([ids.repeat_interleave(samples_per_prompt, 0), tokens[:, :steps]], dim=1)
            prefix_mask = torch.cat([mask.repeat_interleave(samples_per_prompt, 0),
                                     torch.ones_like(tokens[:, :steps], dtype=mask.dtype)], dim=1)
            logits = stepper.prefill(prefix, prefix_mask, params.max_new_tokens - steps)
        else:  # keep: the prefix's KV cache stays as the old weights computed it
            logits = stepper.decode(tok)
    return _completions(tokens[:, :steps], logps[:, :steps], lengths, done, step_versions, switches)


def _completes_string(stop_strings: StopStrings, tokens: torch.Tensor, t: int, done: torch.Tensor
                      ) -> torch.Tensor:
    """(B,) rows not done whose token ``t`` completes a stop string (their tails decoded)."""
    tails = tokens[:, max(0, t + 1 - stop_strings.window):t + 1].tolist()
    return torch.tensor([not finished and stop_strings.completes(tail)
                         for tail, finished in zip(tails, done.tolist(), strict=True)], device=tokens.device)


_UNIFORMS_AT_ONCE = 1 << 21  # floats of uniforms _run_natively draws in one call (8 MB)


def _run_natively(stepper, params: SamplingParams, generator: torch.Generator | None, tokens: torch.Tensor,
                  logps: torch.Tensor, t: int, vocab: int, stop: torch.Tensor, done: torch.Tensor,
                  lengths: torch.Tensor) -> int:
    """The sampling loop from column ``t`` (sampled, its stop ids seen) to the end, in native
    calls (``FastDecoder.decode_run``): each takes the uniforms of as many steps as fit in
    ``_UNIFORMS_AT_ONCE`` floats, drawn in one ``torch.rand`` — the numbers the per-step loop
    would draw, in the same order, so the same tokens. Returns the columns now filled."""
    batch, n = tokens.shape
    col = t
    while col + 1 < n:
        k = min(n - 1 - col, max(1, _UNIFORMS_AT_ONCE // (batch * vocab)))
        u = None if params.greedy else torch.rand((k, batch, vocab), generator=generator,
                                                  device=tokens.device)
        ran = stepper.decode_run(k, tokens, logps, col, params.temperature, u, stop, done, lengths)
        col += ran
        if ran < k or (len(stop) and bool(done.all())):
            break
    return col + 1


def _completions(tokens: torch.Tensor, logps: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor,
                 step_versions: list[int], switches: int, wasted: int = 0) -> Completions:
    """Each row cut at its length: (B, steps) tokens and log-probs, per-step versions."""
    lens = lengths.tolist()
    return Completions(
        tokens=[row[:n] for row, n in zip(tokens.tolist(), lens, strict=True)],
        logprobs=[row[:n] for row, n in zip(logps.tolist(), lens, strict=True)],
        finish_reasons=["stop" if f else "length" for f in done.tolist()],
        versions=[step_versions[:n] for n in lens],
        wasted_tokens=wasted, switches=switches,
    )


def _resample_unfinished(model, prompts, params, tokens, logps, lengths, done, step_versions, switches, *,
                         samples_per_prompt: int, **again) -> Completions:
    """``abort``: keep the finished rows; sample every unfinished one again from its prompt,
    under the weights just put in place (further switches are handled the same way)."""
    out = _completions(tokens, logps, lengths, done, step_versions, switches)
    redo = [r for r, finished in enumerate(done.tolist()) if not finished]
    wasted = tokens.shape[1] * len(redo)
    fresh = sample(model, [prompts[r // samples_per_prompt] for r in redo], params, samples_per_prompt=1,
                   **again)
    for k, r in enumerate(redo):
        out.tokens[r], out.logprobs[r] = fresh.tokens[k], fresh.logprobs[k]
        out.finish_reasons[r], out.versions[r] = fresh.finish_reasons[k], fresh.versions[k]
    return dataclasses.replace(out, wasted_tokens=wasted + fresh.wasted_tokens,
                               switches=switches + fresh.switches)
