"""A lean decode path for Llama-family models (Llama, Qwen2, Qwen3): same weights, fewer ops.

At the sizes Tether runs on CPU, a transformers forward spends more time in per-module Python
and small ops than in matrix multiplies. This path reads the model's parameters (at the first
prefill, and again at the first prefill after ``invalidate``, which every weight load calls) and
runs each step with:

- a preallocated KV cache, written in place (no concatenation per step), with each prompt's
  prefill run once and shared by its group of samples;
- every weight matrix held transposed, (in, out), so a linear layer is ``x @ Wᵀ``. For sampling
  on CPU these are contiguous copies, a plain row-major right operand that MKL multiplies 15–35%
  faster than ``F.linear``'s transposed one at decode sizes (M = 16–64 rows,
  benchmarks/engine.py); they are rebuilt lazily at the first prefill after a weight load
  (``invalidate``), so a load costs nothing until the next generation, and they double the
  memory of the linear weights. On a GPU (cuBLAS takes either layout at full speed) and for a
  training forward (``refresh(contiguous=False)``, in the autograd graph) they are views, and the
  arithmetic is ``F.linear``'s;
- q, k and v (and gate and up) as one matrix multiply each;
- one RMSNorm and one rotary embedding over q and k together, from a table of the batch's
  positions built at prefill, and an additive key mask built once per batch;
- decode attention as two flat batched matmuls over (batch × kv-heads);
- 2-D activations in decode, so every linear is one GEMM.

Numerics follow the reference implementation op for op in float32; the engine's log-probs match
a teacher-forced transformers forward to ~1e-6 (tested). ``supports(model)`` says whether a model
can use it; anything else falls back to the transformers forward.

On the CPU in float32 the same arithmetic runs by default as native code instead
(``tether.decoding.native``, chosen by ``decoder`` / ``rollout.decoder``): a prefill and each
decode step are one call into a C library, with the weights packed for MKL (no transposed copies
then), and ``decode_run`` samples inside those calls (a step, or the whole loop). This module
keeps the batch state both paths share (KV cache, key mask, rotary table, positions; the native
path's cache holds each slot's key and value side by side, ``k_cache`` and
``v_cache`` being views of it) and the Python path, which runs everywhere else and is the
reference the native one is tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tether.decoding.linear import bias_of, weight_of
from tether.errors import NativeDecoderError

SUPPORTED = ("llama", "qwen2", "qwen3")


def _rope_type(cfg) -> str:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def supports(model: torch.nn.Module) -> bool:
    """True for Llama/Qwen2/Qwen3 causal LMs with default rotary embeddings and no sliding window."""
    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    return (
        cfg is not None and getattr(cfg, "model_type", None) in SUPPORTED
        and inner is not None and hasattr(inner, "rotary_emb") and hasattr(inner, "layers")
        and _rope_type(cfg) == "default"
        and not getattr(cfg, "use_sliding_window", False)
        and not getattr(cfg, "mlp_bias", False)
        and getattr(cfg, "hidden_act", "silu") in ("silu", "gelu")
    )


def _joined_t(parts: list[torch.Tensor], *, contiguous: bool) -> torch.Tensor:
    """The row-stacked ``parts`` (out_i, in), transposed to (in, Σ out_i): one contiguous copy
    written straight in transposed order, or (``contiguous=False``) ``torch.cat(parts).t()``,
    a view of the concatenation that autograd can follow."""
    if not contiguous:
        return (torch.cat(parts) if len(parts) > 1 else parts[0]).t()
    first = parts[0]
    out = first.new_empty(first.shape[1], sum(t.shape[0] for t in parts))
    col = 0
    with torch.no_grad():
        for t in parts:
            out[:, col: col + t.shape[0]].copy_(t.t())
            col += t.shape[0]
    return out


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    # (hidden, H·D + 2·KV·D): q, k and v projections, transposed (read with gradients: the three
    # transposed views, multiplied apart)
    qkv_t: torch.Tensor | tuple[torch.Tensor, ...]
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # (H + KV, D) for Qwen3, else None
    o_t: torch.Tensor  # (H·D, hidden)
    o_bias: torch.Tensor | None
    gate_up_t: torch.Tensor | tuple[torch.Tensor, ...]  # (hidden, 2·I): gate and up, transposed (as qkv_t)
    down_t: torch.Tensor  # (I, hidden)


class FastDecoder:
    """Prefill and single-token decode with an in-place KV cache, for one batch at a time."""

    def __init__(self, model: torch.nn.Module, *, decoder: str = "auto") -> None:
        """``decoder`` (``rollout.decoder``): ``auto`` samples through the native library
        (``tether.decoding.native``) where it builds and the model is float32 on the CPU, else
        through the Python path below; ``native`` requires the library (an error says why it
        cannot run); ``python`` never uses it."""
        if not supports(model):
            raise ValueError(f"model type {getattr(model.config, 'model_type', '?')} is not supported")
        cfg = model.config
        self.model = model
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.act = {"silu": F.silu, "gelu": F.gelu}[getattr(cfg, "hidden_act", "silu")]
        from tether.decoding.native import check_mode

        self.decoder = check_mode(decoder)
        self.layers: list[_Layer] | None = None  # the Python path's weights, read at its first prefill
        self.native_reason: str | None = None  # why this decoder runs the Python path, if it does
        # the native path's packed weights, kept (and re-packed in place) for the decoder's life
        self._packed = None
        self._native = False  # the weights read last were read for the native path
        self._batch = None  # the last batch's native state (``NativeBatch``), made at its prefill
        self._stale = True  # the weights must be read again before the next prefill
        self._buffers: dict[str, torch.Tensor] = {}  # the last batch's caches and scratch, for reuse

    @property
    def path(self) -> str:
        """``native`` or ``python``: how the last batch ran (``native_reason`` says why not)."""
        return "native" if self._batch is not None else "python"

    def invalidate(self) -> None:
        """The weights changed (a load); re-read them at the next prefill."""
        self._stale = True
        self.layers = None  # the Python path's copies, if any: not needed until re-read

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device=None,
               zero: bool = False) -> torch.Tensor:
        """A tensor for this batch, the last batch's when its shape matches: batches of one shape
        (an engine's) reuse their caches instead of faulting fresh memory in every batch. Its
        contents are the last batch's unless ``zero``."""
        device = torch.device(device or "cpu")
        old = self._buffers.get(name)
        if old is None or old.shape != shape or old.dtype != dtype or old.device != device:
            old = self._buffers[name] = torch.empty(shape, dtype=dtype, device=device)
        return old.zero_() if zero else old

    def reload(self) -> None:
        """The weights changed mid-generation: re-read them now (the KV cache stays)."""
        self._read_weights()
        if self._batch is not None:
            self._batch.rebind(self._packed)

    def _read_weights(self) -> None:
        """Read the weights for sampling: packed for the native path when it can run here, else
        the Python path's transposed copies (``refresh``)."""
        from tether.decoding import native

        self._stale = False
        # a bfloat16 learner's held-out evaluation runs under autocast, which only torch ops follow
        autocast = torch.is_autocast_enabled(self.model.model.embed_tokens.weight.device.type)
        lib = None if autocast else native.library(self.decoder)
        self.native_reason = "autocast (train.dtype=bfloat16)" if autocast else (
            "rollout.decoder=python" if lib is None and self.decoder == "python" else (
                "the library could not be built or loaded (see the log)" if lib is None
                else native.unusable(self.model)))
        if self.native_reason is not None and self.decoder == "native" and not autocast:
            raise NativeDecoderError(f"rollout.decoder=native but this model cannot run natively: "
                                     f"{self.native_reason}; use rollout.decoder=auto or python")
        self._native = self.native_reason is None
        if self._native:
            self.layers = None
            self.inv_freq = self.model.model.rotary_emb.inv_freq.float()
            if self._packed is None:
                self._packed = native.NativeModel(lib, self)
            else:
                self._packed.pack(self.model)
        else:
            self._batch = None
            self.refresh()

    def refresh(self, *, detach: bool = True, contiguous: bool = True) -> None:
        """Re-read the parameters now. ``detach=False`` keeps the (transposed, stacked) weights
        in the autograd graph, for a training forward. ``contiguous=False`` makes the transposed
        weights views rather than copies: a training forward's many rows gain nothing from the
        copies' layout, and the copies would cost a transpose of every weight per call."""
        self.read_root(detach=detach, contiguous=contiguous)
        self.layers = [self.read_layer(layer, detach=detach, contiguous=contiguous)
                       for layer in self.model.model.layers]

    def _joiner(self, detach: bool, contiguous: bool):
        """(cut, joined): how parameters are read — detached or not, and stacked-transposed as
        contiguous copies or as views."""
        cut = (lambda t: t.detach()) if detach else (lambda t: t)
        # the copies pay on CPU (MKL); cuBLAS takes a transposed operand at full speed, so on a
        # GPU they would only cost memory
        on_cpu = self.model.model.embed_tokens.weight.device.type == "cpu"

        def joined(*parts: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
            if not detach and len(parts) > 1:
                # with gradients, a stacked copy of the weights would be a tensor autograd keeps
                # for the backward: every layer's, all at once (a whole model's worth on FSDP2
                # ranks, whose own unsharded weights are freed after each layer's forward). Each
                # part's transposed view instead, one product each (``_linear``)
                return tuple(t.t() for t in parts)
            return _joined_t([cut(t) for t in parts], contiguous=contiguous and detach and on_cpu)

        return cut, joined

    def read_root(self, *, detach: bool = True, contiguous: bool = True) -> None:
        """Re-read the weights outside the decoder layers: embeddings, final norm, head, rotary."""
        _, joined = self._joiner(detach, contiguous)
        inner = self.model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.head_t = joined(weight_of(self.model.lm_head))  # (hidden, V)
        self.inv_freq = inner.rotary_emb.inv_freq.float()

    def read_layer(self, layer: torch.nn.Module, *, detach: bool = True, contiguous: bool = True) -> _Layer:
        """One decoder layer's weights, stacked and transposed."""
        cut, joined = self._joiner(detach, contiguous)
        a, m = layer.self_attn, layer.mlp
        qk_norm = None
        if hasattr(a, "q_norm"):
            qk_norm = torch.cat([a.q_norm.weight.expand(self.heads, -1),
                                 a.k_norm.weight.expand(self.kv_heads, -1)])  # (H + KV, D)
        biases = [bias_of(a.q_proj), bias_of(a.k_proj), bias_of(a.v_proj)]
        w = functools.partial(weight_of, terms=not detach)  # with gradients: adapters as their terms
        return _Layer(
            ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
            qkv_t=joined(w(a.q_proj), w(a.k_proj), w(a.v_proj)),
            qkv_bias=cut(torch.cat(biases)) if biases[0] is not None else None,
            qk_norm=qk_norm, o_t=joined(w(a.o_proj)), o_bias=bias_of(a.o_proj),
            gate_up_t=joined(w(m.gate_proj), w(m.up_proj)),
            down_t=joined(w(m.down_proj)),
        )

    # -- pieces -------------------------------------------------------------------------------

    @staticmethod
    def _linear(x: torch.Tensor, w_t: torch.Tensor | tuple[torch.Tensor, ...],
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, w, bias)`` with ``w_t`` = wᵀ, or the stacked product of its parts' (a
        layer read with gradients)."""
        if isinstance(w_t, tuple):  # parts (of a LoRA layer: its terms, ``tether.decoding.linear``)
            out = torch.cat([x @ part for part in w_t], dim=-1)
            return out if bias is None else out + bias
        if not isinstance(w_t, torch.Tensor):  # a LoRA layer's terms
            return x @ w_t if bias is None else x @ w_t + bias
        if bias is None:
            return x @ w_t
        return torch.addmm(bias, x, w_t) if x.dim() == 2 else x @ w_t + bias

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype != w.dtype:  # under autocast: a bfloat16 input, normalised in float32 as the model's own
            x = x.to(w.dtype)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x·cos + rotate_half(x)·sin, with ``cos``/``sin`` already full width (D) and ``sin``'s
        first half negated, so rotate_half is a plain swap of halves."""
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin)

    def _qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projections, q/k norm and rotary. h: (N, hidden) → q (N, H, D), k, v (N, KV, D)."""
        n, hd, kvh = h.shape[0], self.head_dim, self.kv_heads
        qkv = self._linear(h, layer.qkv_t, layer.qkv_bias).view(n, self.heads + 2 * kvh, hd)
        qk, v = qkv[:, : self.heads + kvh], qkv[:, self.heads + kvh:]  # (N, H + KV, D), (N, KV, D)
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (hd,), None, self.eps) * layer.qk_norm
        qk = self._rope(qk, cos, sin)
        return qk[:, : self.heads], qk[:, self.heads:], v

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = (self._rms(x, layer.ln2) @ layer.gate_up_t).chunk(2, dim=-1)
        return torch.addmm(x, self.act(gate).mul_(up), layer.down_t)  # x + (act(g)·u) Wdᵀ

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width (…, 1, D) cos and sign-folded sin for ``_rope``."""
        freqs = positions.float()[..., None] * self.inv_freq  # (..., D/2)
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), -1)[..., None, :], torch.cat((-sin, sin), -1)[..., None, :]

    # -- prefill and decode -------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
                repeats: int = 1) -> torch.Tensor:
        """Run the (U, P) left-padded prompts once each, and set up a KV cache for ``repeats``
        samples of each (B = U·repeats rows, prompt-major: prompt 0's samples first). Returns the
        last logits, (B, V). A GRPO group shares its prompt, so its prefill is computed once."""
        if self._stale:
            self._read_weights()
        u, p = ids.shape
        b = u * repeats
        self.batch = b
        self._batch = None
        self.capacity = p + max_new_tokens
        kvh, hd = self.kv_heads, self.head_dim
        like = dict(device=ids.device, dtype=self.model.model.embed_tokens.weight.dtype)
        layers = self.model.config.num_hidden_layers
        shape = (b, kvh, self.capacity, hd)  # (B, KV, S, D)
        if self._native:  # one buffer a layer, each slot's key and value side by side (decode_step.c)
            self.kv_cache = [self.buffer(f"kv{i}", (*shape[:3], 2, hd), **like) for i in range(layers)]
            self.k_cache = [kv[:, :, :, 0] for kv in self.kv_cache]  # (B, KV, S, D) views
            self.v_cache = [kv[:, :, :, 1] for kv in self.kv_cache]
        else:
            self.k_cache = [self.buffer(f"k{i}", shape, **like) for i in range(layers)]
            self.v_cache = [self.buffer(f"v{i}", shape, **like) for i in range(layers)]
        key_ok = mask.bool()  # (U, P)
        # additive key mask per (sequence, kv head), -inf on padding: (B·KV, 1, S); decode
        # steps extend it for free (the new columns are 0) and read a slice
        self.key_bias = self.buffer("key bias", (b * kvh, 1, self.capacity), **like, zero=True)
        self.key_bias[:, 0, :p].masked_fill_(~key_ok.repeat_interleave(repeats * kvh, 0), float("-inf"))
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (U, P)
        self.next_pos = (positions[:, -1] + 1).repeat_interleave(repeats, 0)  # (B,)
        self.length = p
        # cos and sign-folded sin of every position this batch can reach: (S, 2, 1, D), computed
        # in float32 and cast to the weights' dtype, as the reference does
        angles = self._angles(torch.arange(self.capacity, device=ids.device))
        self.rotary = torch.stack(angles, dim=1).to(like["dtype"])
        if self._native:
            from tether.decoding.native import NativeBatch

            self._batch = NativeBatch(self._packed, self, rows=u * p)
            return self._batch.prefill(ids, positions, repeats).repeat_interleave(repeats, 0)
        cos, sin = self.rotary[positions.reshape(-1)].unbind(1)
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()
        attend = key_ok[:, None, None, :] & causal  # (U, 1, P, P)
        x = F.embedding(ids, self.embed).reshape(u * p, -1)  # (U·P, hidden)
        group = self.heads // kvh
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms(x, layer.ln1), cos, sin)
            k4 = k.view(u, p, kvh, hd).transpose(1, 2)  # (U, KV, P, D)
            v4 = v.view(u, p, kvh, hd).transpose(1, 2)
            self.k_cache[i].view(u, repeats, kvh, self.capacity, hd)[:, :, :, :p] = k4[:, None]
            self.v_cache[i].view(u, repeats, kvh, self.capacity, hd)[:, :, :, :p] = v4[:, None]
            q4 = q.view(u, p, self.heads, hd).transpose(1, 2)  # (U, H, P, D)
            att = F.scaled_dot_product_attention(q4, k4.repeat_interleave(group, 1),
                                                 v4.repeat_interleave(group, 1), attn_mask=attend)
            x = x + self._linear(att.transpose(1, 2).reshape(u * p, -1), layer.o_t, layer.o_bias)
            x = self._mlp(layer, x)
        last = x.view(u, p, -1)[:, -1]  # (U, hidden)
        return (self._rms(last, self.norm) @ self.head_t).float().repeat_interleave(repeats, 0)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per sequence (B,); return next logits (B, V)."""
        t = self.length
        if t >= self.capacity:
            raise RuntimeError("KV cache is full")
        if self._batch is not None:
            logits = self._batch.step(tokens, t, self.next_pos)  # advances next_pos in place
            self.length = t + 1
            return logits
        return self._decode_python(tokens)

    @property
    def samples_natively(self) -> bool:
        """Whether ``decode_run`` can run: this batch is on the native path."""
        return self._batch is not None

    def decode_run(self, steps: int, tokens: torch.Tensor, logps: torch.Tensor, col: int, temperature: float,
                   uniforms: torch.Tensor | None, stop: torch.Tensor, done: torch.Tensor,
                   lengths: torch.Tensor) -> int:
        """Up to ``steps`` decode steps with sampling in one native call (one step between polls
        for new weights, or the sampler's whole loop while nothing can change them): each step
        decodes column ``col`` + k of ``tokens`` (B, N) and samples the next (log-probs into
        ``logps``) as ``sampling.sample`` draws it untruncated, from ``uniforms`` (steps, B, V):
        the ``torch.rand`` its sampler would take; greedy when None. Rows that sample a ``stop``
        id are marked ``done``, with their ``lengths``, and the call ends early once all are
        (``NativeBatch.run``). Returns the steps run. Native path only (``samples_natively``)."""
        t = self.length
        if t + steps > self.capacity:
            raise RuntimeError("KV cache is full")
        if self._batch is None:
            raise RuntimeError("decode_run runs on the native path only (see samples_natively)")
        ran, error = self._batch.run(t, steps, tokens, logps, col, self.next_pos, temperature, uniforms, stop,
                                     done, lengths)
        self.length = t + ran
        if error is not None:
            raise error
        return ran

    def _decode_python(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = self.batch, self.length
        kvh, hd, group = self.kv_heads, self.head_dim, self.heads // self.kv_heads
        bias = self.key_bias[:, :, : t + 1]  # (B·KV, 1, t + 1)
        cos, sin = self.rotary[self.next_pos].unbind(1)  # (B, 1, D) each
        x = F.embedding(tokens, self.embed)  # (B, hidden)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms(x, layer.ln1), cos, sin)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[:, :, t] = k
            vc[:, :, t] = v
            keys = kc.view(b * kvh, self.capacity, hd)[:, : t + 1]  # (B·KV, S, D), a view
            vals = vc.view(b * kvh, self.capacity, hd)[:, : t + 1]
            # scale·q·kᵀ + mask in one batched GEMM: (B·KV, G, S)
            scores = torch.baddbmm(bias, q.reshape(b * kvh, group, hd), keys.transpose(1, 2),
                                   alpha=self.scale)
            probs = torch.softmax(scores, dim=-1)
            att = torch.bmm(probs, vals).view(b, self.heads * hd)  # (B, H·D)
            x = (torch.addmm(x, att, layer.o_t) if layer.o_bias is None
                 else x + self._linear(att, layer.o_t, layer.o_bias))
            x = self._mlp(layer, x)
        self.length = t + 1
        self.next_pos = self.next_pos + 1
        return (self._rms(x, self.norm) @ self.head_t).float()
