"""A lean decode path for Llama-family models (Llama, Qwen2, Qwen3): same weights, fewer ops.

At the sizes Tether runs on CPU, a transformers forward spends more time in per-module Python
and small ops than in matrix multiplies. This path reads the model's parameters (``refresh`` re-reads
them after every weight load) and runs each step with:

- a preallocated KV cache, written in place (no concatenation per step), with each prompt's
  prefill run once and shared by its group of samples;
- q, k and v (and gate and up) as one matrix multiply each, from stacked weights: views when
  the parts already lie back to back (a worker bound to the weight channel), else copies
  rebuilt on every weight load;
- one RMSNorm and one rotary embedding over q and k together;
- decode attention as two flat batched matmuls over (batch × kv-heads);
- 2-D activations in decode, so every linear is one GEMM.

Numerics follow the reference implementation op for op in float32; the engine's log-probs match
a teacher-forced transformers forward to ~1e-6 (tested). ``supports(model)`` says whether a model
can use it; anything else falls back to the transformers forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def _stacked(parts: list[torch.Tensor], *, differentiable: bool) -> torch.Tensor:
    """``torch.cat(parts)`` along rows; unless ``differentiable``, a view instead of a copy when
    the parts already lie back to back in one storage (a worker's parameters bound to the weight
    channel's block, where q, k, v and gate, up are adjacent), so a weight load re-stacks
    nothing."""
    first = parts[0]
    if differentiable:
        return torch.cat(parts)
    adjacent = all(t.is_contiguous() and t.dtype == first.dtype and t.shape[1:] == first.shape[1:]
                   and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                   for t in parts)
    offset = first.storage_offset()
    for t in parts:
        adjacent = adjacent and t.storage_offset() == offset
        offset += t.numel()
    if not adjacent:
        return torch.cat(parts)
    rows = sum(t.shape[0] for t in parts)
    with torch.no_grad():
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                       (rows, *first.shape[1:]))


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: torch.Tensor  # (H·D + 2·KV·D, hidden): q, k and v projections stacked
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # (H + KV, D) for Qwen3, else None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # (2·I, hidden): gate and up projections stacked
    down: torch.Tensor


class FastDecoder:
    """Prefill and single-token decode with an in-place KV cache, for one batch at a time."""

    def __init__(self, model: torch.nn.Module) -> None:
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
        self.refresh()

    def refresh(self, *, detach: bool = True) -> None:
        """Re-read the parameters; call after every weight load (q/k norm weights are combined
        into one table here, which a load makes stale). ``detach=False`` keeps the stacked
        copies in the autograd graph, for a training forward."""
        grad = not detach
        cut = (lambda t: t) if grad else (lambda t: t.detach())
        inner = self.model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.head = self.model.lm_head.weight
        self.inv_freq = inner.rotary_emb.inv_freq.float()
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            qk_norm = None
            if hasattr(a, "q_norm"):
                qk_norm = torch.cat([a.q_norm.weight.expand(self.heads, -1),
                                     a.k_norm.weight.expand(self.kv_heads, -1)])  # (H + KV, D)
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            self.layers.append(_Layer(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                qkv=cut(_stacked([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], differentiable=grad)),
                qkv_bias=cut(torch.cat(biases)) if biases[0] is not None else None,
                qk_norm=qk_norm, o=a.o_proj.weight, o_bias=a.o_proj.bias,
                gate_up=cut(_stacked([m.gate_proj.weight, m.up_proj.weight], differentiable=grad)),
                down=m.down_proj.weight,
            ))

    # -- pieces -------------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
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
        qkv = F.linear(h, layer.qkv, layer.qkv_bias).view(n, self.heads + 2 * kvh, hd)
        qk, v = qkv[:, : self.heads + kvh], qkv[:, self.heads + kvh:]  # (N, H + KV, D), (N, KV, D)
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (hd,), None, self.eps) * layer.qk_norm
        qk = self._rope(qk, cos, sin)
        return qk[:, : self.heads], qk[:, self.heads:], v

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(self._rms(x, layer.ln2), layer.gate_up).chunk(2, dim=-1)
        return torch.addmm(x, self.act(gate).mul_(up), layer.down.t())  # x + (act(g)·u) Wdᵀ

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
        u, p = ids.shape
        b = u * repeats
        self.batch, self.prompt_len = b, p
        self.capacity = p + max_new_tokens
        kvh, hd = self.kv_heads, self.head_dim
        self.k_cache = [torch.empty(b, kvh, self.capacity, hd) for _ in self.layers]  # (B, KV, S, D)
        self.v_cache = [torch.empty(b, kvh, self.capacity, hd) for _ in self.layers]
        self.key_ok = torch.zeros(b, self.capacity, dtype=torch.bool)  # (B, S)
        self.key_ok[:, :p] = mask.bool().repeat_interleave(repeats, 0)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (U, P)
        self.next_pos = (positions[:, -1] + 1).repeat_interleave(repeats, 0)  # (B,)
        self.length = p
        cos, sin = self._angles(positions.reshape(-1))
        causal = torch.ones(p, p, dtype=torch.bool).tril()
        attend = (self.key_ok[::repeats, None, None, :p] & causal)  # (U, 1, P, P)
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
            x = x + F.linear(att.transpose(1, 2).reshape(u * p, -1), layer.o, layer.o_bias)
            x = self._mlp(layer, x)
        last = x.view(u, p, -1)[:, -1]  # (U, hidden)
        return F.linear(self._rms(last, self.norm), self.head).repeat_interleave(repeats, 0)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per sequence (B,); return next logits (B, V)."""
        b, t = self.batch, self.length
        if t >= self.capacity:
            raise RuntimeError("KV cache is full")
        kvh, hd, group = self.kv_heads, self.head_dim, self.heads // self.kv_heads
        self.key_ok[:, t] = True
        # additive key mask per (sequence, kv head): (B·KV, 1, S)
        bias = torch.zeros(b, 1, t + 1).masked_fill_(~self.key_ok[:, None, : t + 1], float("-inf"))
        bias = bias.repeat_interleave(kvh, dim=0)
        cos, sin = self._angles(self.next_pos)
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
            x = (torch.addmm(x, att, layer.o.t()) if layer.o_bias is None
                 else x + F.linear(att, layer.o, layer.o_bias))
            x = self._mlp(layer, x)
        self.length = t + 1
        self.next_pos = self.next_pos + 1
        return F.linear(self._rms(x, self.norm), self.head)
