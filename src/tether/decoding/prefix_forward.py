"""Per-token log-probs of GRPO rows with each group's shared prompt computed once.

A rollout batch is groups of ``G`` samples of one prompt. A plain forward runs every row's
prompt tokens again, G times over, and back-propagates them G times; in short-answer tasks the
prompt is most of the tokens. ``SharedPrefixForward`` runs each distinct prompt once (causal
attention over the prompts), then every row's completion tokens, attending to their own prompt's
keys and values (gathered from the shared prompt pass) and causally to each other. Gradients flow
into the shared prompt pass from every row of its group, so the result — log-probs and their
gradients — is the plain forward's, with the prompt work divided by G.

Completions are packed: every linear layer, norm and activation runs on the real completion
tokens only (T of them), not on a (rows × longest completion) grid, so rows shorter than the
longest cost nothing for their padding; only attention lays them out as a grid. With the short,
varied answers of verifiable-reward tasks the padding was about a third of the grid.

It uses the lean decoder's arithmetic (``FastDecoder``: the same Llama/Qwen math as the
transformers forward, op for op in float32), with its stacked weights kept in the autograd
graph. Rows sharing a prompt must be adjacent (a TrainBatch is prompt-major); any run of equal
adjacent prompts is treated as one group, so a mini-batch that splits a group still works.

On a model FSDP2 shards (learner ranks), weights outside a module's own forward are shards. The
forward then runs as FSDP forward methods (``register_fsdp_forward_method``): the whole pass as
one of the root module's, which gathers the embeddings, final norm and head, and each decoder
layer's part as one of that layer's, which gathers its weights just for it and reduce-scatters
their gradients after its backward, as the model's own forward would.

A layer marked for recomputation (``tether.recompute``, ``train.activation_checkpointing``) runs
its part under ``torch.utils.checkpoint`` when gradients are on: inside the layer's FSDP forward
method on ranks, as the model's own forward is inside the layer's hooks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tether import recompute
from tether.decoding.fast_decoder import FastDecoder, supports
from tether.decoding.vocab import entropy_of, scaled_logits

__all__ = ["SharedPrefixForward", "supports"]


@dataclass(frozen=True)
class _Layout:
    """What every layer needs besides the hidden states: sizes (rows N, distinct prompts U,
    longest prompt and completion), rotary angles of every row's position (prompts first), each
    row's group, the packed completions' places in the (N, Cmax) grid, and the attention mask.
    No gradient flows through any of it."""

    n: int
    u: int
    p_max: int
    c_max: int
    cos: torch.Tensor  # (U·Pmax + T, 1, D): the prompt rows', then the packed completions'
    sin: torch.Tensor
    group: torch.Tensor  # (N,)
    packed: torch.Tensor  # (T,)
    attend: torch.Tensor  # (N, 1, Cmax, Pmax + Cmax)


_ROOT_METHOD = "tether_shared_prefix_forward"
_LAYER_METHOD = "tether_shared_prefix_layer"


def _is_sharded(model: torch.nn.Module) -> bool:
    """True for a model ``fully_shard`` has made an FSDP2 module (learner ranks)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


class SharedPrefixForward(FastDecoder):
    """``__call__(input_ids, attention_mask, mask, temperature)`` → per-token log-probs (N, L − 1)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.sharded = _is_sharded(model)
        head = model.get_output_embeddings()
        self._tied = head is not None and head.weight is model.get_input_embeddings().weight
        if self.sharded:
            from torch.distributed.fsdp import register_fsdp_forward_method

            for layer in model.model.layers:
                setattr(layer, _LAYER_METHOD, functools.partial(self._run_layer, layer))
                register_fsdp_forward_method(layer, _LAYER_METHOD)
            setattr(model, _ROOT_METHOD, self._forward)
            register_fsdp_forward_method(model, _ROOT_METHOD)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor,
                 temperature: float, *, with_entropy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_ids``/``attention_mask``: (N, L) right-padded prompt + completion rows;
        ``mask``: (N, L − 1), 1 on the columns that predict completion tokens (TrainBatch's
        layout). Returns log π at ``temperature`` in that layout (0 off the completion columns),
        and the entropy of each predicting distribution if asked."""
        run = getattr(self.model, _ROOT_METHOD) if self.sharded else self._forward
        return run(input_ids, attention_mask, mask, temperature, with_entropy)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor,
                 temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.read_root(detach=not torch.is_grad_enabled(), contiguous=False)
        n, width = input_ids.shape
        device = input_ids.device
        seq_len = attention_mask.sum(1)  # (N,)
        has_completion = mask.sum(1) > 0
        # the first predicting column is the last prompt token's position
        prompt_len = torch.where(has_completion, mask.argmax(1) + 1, seq_len)  # (N,)
        comp_len = seq_len - prompt_len  # (N,)
        p_max, c_max = int(prompt_len.max()), max(int(comp_len.max()), 1)

        # groups: runs of adjacent rows with the same prompt
        cols = torch.arange(p_max, device=device)
        prompts = torch.where(cols < prompt_len[:, None], input_ids[:, :p_max], -1)  # (N, Pmax)
        new_group = torch.ones(n, dtype=torch.bool, device=device)
        new_group[1:] = (prompts[1:] != prompts[:-1]).any(1)
        group = new_group.long().cumsum(0) - 1  # (N,) group index of each row
        firsts = new_group.nonzero().squeeze(1)  # (U,)
        u_ids = input_ids[firsts, :p_max]  # (U, Pmax), right-padded (pads are never attended to)

        # completions: token k of row n sits at position prompt_len + k. Only the real ones are
        # computed ("packed", T of them, row-major so a row's tokens are consecutive); attention
        # alone sees them laid out as (N, Cmax), padding at the end of each row.
        k = torch.arange(c_max, device=device)
        comp_pos = prompt_len[:, None] + k  # (N, Cmax)
        comp_ok = k < comp_len[:, None]  # (N, Cmax)
        packed = comp_ok.reshape(-1).nonzero().squeeze(1)  # (T,) indices into the N·Cmax grid
        row_of, k_of = packed // c_max, packed % c_max  # (T,) each
        pos_t = comp_pos.reshape(-1)[packed]  # (T,)
        tok_t = input_ids.gather(1, comp_pos.clamp(max=width - 1)).reshape(-1)[packed]  # (T,)

        u = u_ids.shape[0]
        cos, sin = self._angles(torch.cat([cols.repeat(u), pos_t]))
        # completion queries see their prompt's real tokens and earlier completion tokens; padded
        # completion keys come after every real one of their row, so the causal part hides them
        see_prompt = cols < prompt_len[:, None]  # (N, Pmax)
        see_comp = torch.ones(c_max, c_max, dtype=torch.bool, device=device).tril()  # (Cmax, Cmax)
        attend = torch.cat([see_prompt[:, None, None, :].expand(n, 1, c_max, p_max),
                            see_comp.expand(n, 1, c_max, c_max)], dim=-1)  # (N, 1, Cmax, Pmax + Cmax)

        at = _Layout(n=n, u=u, p_max=p_max, c_max=c_max, cos=cos, sin=sin, group=group,
                     packed=packed, attend=attend)
        # the prompts' rows (U·Pmax) and the packed completions' (T) travel as one tensor, so each
        # weight is one matrix multiply each way and one gradient (one embedding gradient too: the
        # tied head's is vocabulary × hidden, zero-filled for every lookup); only attention
        # splits them
        # with the output head tied to the embedding (one parameter), the lookup's gradient is
        # taken sparse: autograd adds its rows into the head's dense gradient in place, where a
        # dense one is a vocabulary × hidden tensor zero-filled for every backward (545 MB at
        # Qwen2-0.5B); an untied embedding's gradient stays dense, as the optimizers need
        x = F.embedding(torch.cat([u_ids.reshape(-1), tok_t]), self.embed,
                        sparse=self._tied and not self.sharded)  # (U·Pmax + T, hidden)
        for layer in self.model.model.layers:
            run = getattr(layer, _LAYER_METHOD) if self.sharded else functools.partial(self._run_layer, layer)
            x = run(x, at)
        xp, xc = x[: u * p_max], x[u * p_max:]

        # completion token 0 is predicted by the prompt's last position, token k by completion
        # k − 1, which is the packed row just before it
        hidden_p = xp.view(u, p_max, -1)[group, prompt_len - 1]  # (N, hidden)
        previous = torch.cat([xc.new_zeros(1, xc.shape[1]), xc])[:-1]  # (T, hidden)
        predicting = torch.where((k_of == 0)[:, None], hidden_p[row_of], previous)  # (T, hidden)
        logits = scaled_logits(self._rms(predicting, self.norm) @ self.head_t, temperature)
        logp_all = torch.log_softmax(logits, dim=-1)  # (T, V)
        logp_t = logp_all.gather(-1, tok_t[:, None]).squeeze(-1)  # (T,)
        # into the (N, L − 1) layout: completion token k sits in column prompt_len − 1 + k
        column = prompt_len[row_of] - 1 + k_of  # (T,)
        logp = logp_t.new_zeros(n, width - 1).index_put((row_of, column), logp_t)
        entropy = None
        if with_entropy:
            ent_t = entropy_of(logp_all)
            entropy = ent_t.new_zeros(n, width - 1).index_put((row_of, column), ent_t)
        return logp, entropy

    def _run_layer(self, module: torch.nn.Module, x: torch.Tensor, at: _Layout) -> torch.Tensor:
        """``_layer``, its activations recomputed in the backward when ``module`` is marked
        (``tether.recompute``; inside a sharded layer's FSDP forward method, as the model's own
        forward is inside its hooks)."""
        return recompute.run(module, self._layer, module, x, at)

    def _layer(self, module: torch.nn.Module, x: torch.Tensor, at: _Layout) -> torch.Tensor:
        """One decoder layer over the hidden states ``x``: the prompts' (U·Pmax, hidden), then the
        packed completions' (T, hidden), with ``module``'s weights read now."""
        layer = self.read_layer(module, detach=not torch.is_grad_enabled(), contiguous=False)
        n, u, p_max, c_max = at.n, at.u, at.p_max, at.c_max
        kvh, hd, heads = self.kv_heads, self.head_dim, self.heads
        group_heads = heads // kvh

        def grid(x: torch.Tensor) -> torch.Tensor:
            """(T, h, D) packed → (N, h, Cmax, D), zeros where there is no token."""
            full = x.new_zeros(n * c_max, *x.shape[1:]).index_copy(0, at.packed, x)
            return full.view(n, c_max, *x.shape[1:]).transpose(1, 2)

        split = u * p_max
        q, k, v = self._qkv(layer, self._rms(x, layer.ln1), at.cos, at.sin)
        qp, kp, vp, qc, kc, vc = q[:split], k[:split], v[:split], q[split:], k[split:], v[split:]
        kp4 = kp.view(u, p_max, kvh, hd).transpose(1, 2)  # (U, KV, Pmax, D)
        vp4 = vp.view(u, p_max, kvh, hd).transpose(1, 2)
        qp4 = qp.view(u, p_max, heads, hd).transpose(1, 2)  # (U, H, Pmax, D)
        att_p = F.scaled_dot_product_attention(qp4, kp4.repeat_interleave(group_heads, 1),
                                               vp4.repeat_interleave(group_heads, 1), is_causal=True)
        keys = torch.cat([kp4[at.group], grid(kc)], dim=2)  # (N, KV, Pmax + Cmax, D)
        vals = torch.cat([vp4[at.group], grid(vc)], dim=2)
        att_c = F.scaled_dot_product_attention(grid(qc), keys.repeat_interleave(group_heads, 1),
                                               vals.repeat_interleave(group_heads, 1), attn_mask=at.attend)
        att_c = att_c.transpose(1, 2).reshape(n * c_max, -1).index_select(0, at.packed)  # (T, H·D)
        att = torch.cat([att_p.transpose(1, 2).reshape(split, -1), att_c])  # (U·Pmax + T, H·D)
        return self._train_mlp(layer, x + self._linear(att, layer.o_t, layer.o_bias))

    def _train_mlp(self, layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear(self._rms(x, layer.ln2), layer.gate_up_t).chunk(2, dim=-1)
        if isinstance(layer.down_t, torch.Tensor):
            return torch.addmm(x, self.act(gate) * up, layer.down_t)
        return x + self._linear(self.act(gate) * up, layer.down_t)  # a LoRA layer's terms
