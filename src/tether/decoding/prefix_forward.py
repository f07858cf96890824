"""Per-token log-probs of GRPO rows with each group's shared prompt computed once.

A rollout batch is groups of ``G`` samples of one prompt. A plain forward runs every row's
prompt tokens again, G times over, and back-propagates them G times; in short-answer tasks the
prompt is most of the tokens. ``SharedPrefixForward`` runs each distinct prompt once (causal
attention over the prompts), then every row's completion tokens, attending to their own prompt's
keys and values (gathered from the shared prompt pass) and causally to each other. Gradients flow
into the shared prompt pass from every row of its group, so the result — log-probs and their
gradients — is the plain forward's, with the prompt work divided by G.

It uses the lean decoder's arithmetic (``FastDecoder``: the same Llama/Qwen math as the
transformers forward, op for op in float32), with its stacked weights kept in the autograd
graph. Rows sharing a prompt must be adjacent (a TrainBatch is prompt-major); any run of equal
adjacent prompts is treated as one group, so a mini-batch that splits a group still works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tether.decoding.fast_decoder import FastDecoder, supports

__all__ = ["SharedPrefixForward", "supports"]


class SharedPrefixForward(FastDecoder):
    """``__call__(input_ids, attention_mask, mask, temperature)`` → per-token log-probs (N, L − 1)."""

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor,
                 temperature: float, *, with_entropy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_ids``/``attention_mask``: (N, L) right-padded prompt + completion rows;
        ``mask``: (N, L − 1), 1 on the columns that predict completion tokens (TrainBatch's
        layout). Returns log π at ``temperature`` in that layout (0 off the completion columns),
        and the entropy of each predicting distribution if asked."""
        self.refresh(detach=not torch.is_grad_enabled(), contiguous=False)
        n, width = input_ids.shape
        seq_len = attention_mask.sum(1)  # (N,)
        has_completion = mask.sum(1) > 0
        # the first predicting column is the last prompt token's position
        prompt_len = torch.where(has_completion, mask.argmax(1) + 1, seq_len)  # (N,)
        comp_len = seq_len - prompt_len  # (N,)
        p_max, c_max = int(prompt_len.max()), max(int(comp_len.max()), 1)

        # groups: runs of adjacent rows with the same prompt
        cols = torch.arange(p_max)
        prompts = torch.where(cols < prompt_len[:, None], input_ids[:, :p_max], -1)  # (N, Pmax)
        new_group = torch.ones(n, dtype=torch.bool)
        new_group[1:] = (prompts[1:] != prompts[:-1]).any(1)
        group = new_group.long().cumsum(0) - 1  # (N,) group index of each row
        firsts = new_group.nonzero().squeeze(1)  # (U,)
        u_ids = input_ids[firsts, :p_max]  # (U, Pmax), right-padded (pads are never attended to)

        # completions: (N, Cmax) tokens at positions prompt_len + k
        k = torch.arange(c_max)
        comp_pos = prompt_len[:, None] + k  # (N, Cmax)
        comp_ok = k < comp_len[:, None]  # (N, Cmax)
        comp_ids = input_ids.gather(1, comp_pos.clamp(max=width - 1))  # (N, Cmax)

        kvh, hd, heads = self.kv_heads, self.head_dim, self.heads
        group_heads = heads // kvh
        u = u_ids.shape[0]
        cos_p, sin_p = self._angles(cols.repeat(u))
        cos_c, sin_c = self._angles(comp_pos.reshape(-1))
        # completion queries see their prompt's real tokens and earlier completion tokens
        see_prompt = cols < prompt_len[:, None]  # (N, Pmax)
        see_comp = torch.ones(c_max, c_max, dtype=torch.bool).tril()  # (Cmax, Cmax)
        attend = torch.cat([see_prompt[:, None, None, :].expand(n, 1, c_max, p_max),
                            see_comp.expand(n, 1, c_max, c_max)], dim=-1)  # (N, 1, Cmax, Pmax + Cmax)

        xp = F.embedding(u_ids, self.embed).reshape(u * p_max, -1)  # (U·Pmax, hidden)
        xc = F.embedding(comp_ids, self.embed).reshape(n * c_max, -1)  # (N·Cmax, hidden)
        for layer in self.layers:
            qp, kp, vp = self._qkv(layer, self._rms(xp, layer.ln1), cos_p, sin_p)
            qc, kc, vc = self._qkv(layer, self._rms(xc, layer.ln1), cos_c, sin_c)
            kp4 = kp.view(u, p_max, kvh, hd).transpose(1, 2)  # (U, KV, Pmax, D)
            vp4 = vp.view(u, p_max, kvh, hd).transpose(1, 2)
            qp4 = qp.view(u, p_max, heads, hd).transpose(1, 2)  # (U, H, Pmax, D)
            att_p = F.scaled_dot_product_attention(qp4, kp4.repeat_interleave(group_heads, 1),
                                                   vp4.repeat_interleave(group_heads, 1), is_causal=True)
            keys = torch.cat([kp4[group], kc.view(n, c_max, kvh, hd).transpose(1, 2)], dim=2)
            vals = torch.cat([vp4[group], vc.view(n, c_max, kvh, hd).transpose(1, 2)], dim=2)
            qc4 = qc.view(n, c_max, heads, hd).transpose(1, 2)  # (N, H, Cmax, D)
            att_c = F.scaled_dot_product_attention(qc4, keys.repeat_interleave(group_heads, 1),
                                                   vals.repeat_interleave(group_heads, 1), attn_mask=attend)
            xp = xp + self._linear(att_p.transpose(1, 2).reshape(u * p_max, -1), layer.o_t, layer.o_bias)
            xc = xc + self._linear(att_c.transpose(1, 2).reshape(n * c_max, -1), layer.o_t, layer.o_bias)
            xp = self._train_mlp(layer, xp)
            xc = self._train_mlp(layer, xc)

        # completion token 0 is predicted by the prompt's last position, token k by completion k − 1
        hidden_p = xp.view(u, p_max, -1)[group, prompt_len - 1]  # (N, hidden)
        hidden_c = xc.view(n, c_max, -1)
        predicting = torch.cat([hidden_p[:, None], hidden_c[:, :-1]], dim=1)  # (N, Cmax, hidden)
        logits = (self._rms(predicting, self.norm) @ self.head_t).float() / temperature
        logp_all = torch.log_softmax(logits, dim=-1)  # (N, Cmax, V)
        logp_c = logp_all.gather(-1, comp_ids[..., None]).squeeze(-1) * comp_ok  # (N, Cmax)
        # scatter into the (N, L − 1) layout: completion token k sits in column prompt_len − 1 + k
        where = prompt_len[:, None] - 1 + k  # (N, Cmax); invalid k land past the row's end
        out = torch.zeros(n, width - 1 + c_max, dtype=logp_c.dtype).scatter(1, where, logp_c)
        logp = out[:, : width - 1]
        entropy = None
        if with_entropy:
            with torch.no_grad():
                ent_c = -(logp_all.exp() * logp_all).sum(-1) * comp_ok
                entropy = torch.zeros(n, width - 1 + c_max).scatter(1, where, ent_c)[:, : width - 1]
        return logp, entropy

    def _train_mlp(self, layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = (self._rms(x, layer.ln2) @ layer.gate_up_t).chunk(2, dim=-1)
        return torch.addmm(x, self.act(gate) * up, layer.down_t)
