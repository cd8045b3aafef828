"""Qwen3-Next's gated DeltaNet linear-attention layer over per-request recurrent state.

The layer keeps no KV pages: each sequence's conv state and SSM state live in a slot of the
caller's `RecurrentStatePool` (`ForwardBatch.state_pool`, slot `ForwardBatch.state_slots[b]`),
which the forward reads as "the state after `prefix_lens[b]` tokens" and overwrites with the
state after its new tokens. A sequence with `prefix_lens[b] == 0` starts from the zero state
whatever its slot holds.

The math is transformers' pure-torch path (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_*` of `modeling_qwen3_next.py`), op for
op: fp32 throughout, q and k L2-normed, q scaled by `key_head_dim ** -0.5`, the state decayed
by `exp(g)`, `g = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`. Prefill runs the
chunked form ("fast", chunks of 64 tokens) or, as a reference, the token-by-token recurrence
("reference"); decode always runs the recurrence, batched over sequences.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from pdcache.engine.config import ModelConfig
from pdcache.engine.forward import ForwardBatch, ForwardMode
from pdcache.engine.layers import GatedRMSNorm
from pdcache.engine.state_pool import RecurrentStatePool

DeltaPath = Literal["fast", "reference"]
CHUNK_SIZE = 64  # transformers' and FLA's chunk length


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (FLA's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _to_heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`[B, T, H, D]` / `[B, T, H]` inputs to fp32 `[B, H, T, ...]`, each key head repeated
    over its value heads, q and k L2-normed and q scaled."""
    repeat = v.shape[2] // k.shape[2]
    if repeat != 1:
        q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
    q, k, v, beta, g = (t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for t in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule by chunks: `q, k [B, T, Hk, Dk]`, `v [B, T, Hv, Dv]`, `g, beta
    [B, T, Hv]`, state `[B, Hv, Dk, Dv]` (None: zeros) -> (`[B, T, Hv, Dv]` in q's dtype,
    the fp32 final state)."""
    out_dtype, length = q.dtype, q.shape[1]
    q, k, v, decay, beta = _to_heads_first(q, k, v, g, beta)
    batch, heads, _, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, decay = (F.pad(t, (0, pad)) for t in (beta, decay))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(batch, heads, -1, chunk_size, t.shape[-1])
                            for t in (q, k, k_beta, v_beta))
    decay = decay.reshape(batch, heads, -1, chunk_size).cumsum(dim=3)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay.unsqueeze(4) - decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * decay.exp().unsqueeze(-1)
    # The UT transform: (I + strictly-lower part) solves all delta updates of a chunk at once.
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False,
                                               unitriangular=True)
    state = (torch.zeros(batch, heads, dk, dv, dtype=new_values.dtype, device=q.device)
             if initial_state is None else initial_state.to(new_values))
    out = torch.zeros_like(new_values)
    q = q * decay.exp().unsqueeze(-1)
    k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, -1, dv)[:, :, :length]
    return out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format), state


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time; the arguments and results of
    `chunk_gated_delta_rule`."""
    out_dtype = q.dtype
    q, k, v, decay, beta = _to_heads_first(q, k, v, g, beta)
    batch, heads, length, dk = k.shape
    state = (torch.zeros(batch, heads, dk, v.shape[-1], dtype=v.dtype, device=v.device)
             if initial_state is None else initial_state.to(v))
    out = torch.zeros_like(v)
    for t in range(length):
        state = state * decay[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t].unsqueeze(-1)
        remembered = (state * k_t).sum(dim=-2)
        delta = (v[:, :, t] - remembered) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t * delta.unsqueeze(-2)
        out[:, :, t] = (state * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(out_dtype), state


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of `x [B, C, T]` after the previous inputs `state
    [B, C, W]` (W = kernel - 1; zeros before the first token) with `weight [C, kernel]`:
    (`[B, C, T]`, the new state: the last W inputs)."""
    full = torch.cat((state.to(x.dtype), x), dim=-1)
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=x.shape[1])
    return F.silu(out).to(x.dtype), full[..., -state.shape[-1]:]


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (transformers' `Qwen3NextGatedDeltaNet` names:
    `in_proj_qkvz`, `in_proj_ba`, `conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj`). Owns its
    weights only; mutates the batch's state slots of its layer. `path` picks the prefill
    form: "fast" (chunked) or "reference" (token by token)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        lin = config.linear_attention
        geometry = config.state_geometry
        if lin is None or geometry is None:
            raise ValueError(f"layer {layer_id} is linear attention without a linear config")
        self.lin = lin
        self.layer_id = layer_id
        self.state_index = geometry.state_index(layer_id)
        self.path: DeltaPath = "fast"
        hidden = config.hidden_size
        self.in_proj_qkvz = nn.Linear(hidden, 2 * lin.key_dim + 2 * lin.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * lin.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(lin.conv_dim, lin.conv_dim, lin.conv_kernel, bias=False,
                                groups=lin.conv_dim, padding=lin.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(lin.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(lin.num_value_heads))
        self.norm = GatedRMSNorm(lin.value_head_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(lin.value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.state_pool
        if pool is None or batch.state_slots is None:
            raise ValueError("a linear-attention layer needs ForwardBatch.state_pool and "
                             "state_slots")
        mixed, z, b, a = self._project(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if batch.mode is ForwardMode.DECODE:
            core = self._decode(mixed, g, beta, batch, pool)
        else:
            per_sequence = zip(*(t.split(batch.extend_lens) for t in (mixed, g, beta)))
            core = torch.cat([
                self._extend_one(seq_mixed, seq_g, seq_beta, prefix > 0, slot, pool)
                for (seq_mixed, seq_g, seq_beta), prefix, slot
                in zip(per_sequence, batch.prefix_lens, batch.state_slots)])
        dv = self.lin.value_head_dim
        out = self.norm(core.reshape(-1, dv), z.reshape(-1, dv))
        return self.out_proj(out.reshape(x.shape[0], -1))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`mixed [T, conv_dim]` (q, k, v flattened, the conv's input), `z [T, Hv, Dv]` (the
        output gate), `b`, `a [T, Hv]` from transformers' per-key-head grouped layout."""
        lin, n = self.lin, x.shape[0]
        group = lin.num_value_heads // lin.num_key_heads
        qkvz = self.in_proj_qkvz(x).view(n, lin.num_key_heads, -1)
        q, k, v, z = torch.split(qkvz, [lin.key_head_dim, lin.key_head_dim,
                                        group * lin.value_head_dim, group * lin.value_head_dim],
                                 dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(n, lin.num_key_heads, 2 * group),
                           [group, group], dim=-1)
        mixed = torch.cat((q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)), dim=-1)
        z = z.reshape(n, lin.num_value_heads, lin.value_head_dim)
        return mixed, z, b.reshape(n, -1), a.reshape(n, -1)

    def _split_qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`[B, T, conv_dim]` -> q, k `[B, T, Hk, Dk]`, v `[B, T, Hv, Dv]`."""
        lin = self.lin
        q, k, v = torch.split(conv_out, [lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        shape = conv_out.shape[:2]
        return (q.reshape(*shape, -1, lin.key_head_dim), k.reshape(*shape, -1, lin.key_head_dim),
                v.reshape(*shape, -1, lin.value_head_dim))

    def _extend_one(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    has_prefix: bool, slot: int, pool: RecurrentStatePool) -> torch.Tensor:
        """One sequence's new tokens from its slot's state (zeros without a prefix); writes
        the state after them back. `[T, Hv, Dv]`."""
        conv_state = pool.conv[self.state_index, slot]
        if not has_prefix:
            conv_state = torch.zeros_like(conv_state)
        conv_out, new_conv = causal_conv(mixed.t()[None], conv_state[None],
                                         self.conv1d.weight.squeeze(1))
        q, k, v = self._split_qkv(conv_out.transpose(1, 2))
        if self.path not in ("fast", "reference"):
            raise ValueError(f"unknown DeltaNet path {self.path!r} (fast, reference)")
        rule = chunk_gated_delta_rule if self.path == "fast" else recurrent_gated_delta_rule
        initial = pool.ssm[self.state_index, slot][None] if has_prefix else None
        out, state = rule(q, k, v, g[None], beta[None], initial)
        pool.conv[self.state_index, slot] = new_conv[0]
        pool.ssm[self.state_index, slot] = state[0]
        return out[0]

    def _decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                batch: ForwardBatch, pool: RecurrentStatePool) -> torch.Tensor:
        """One token of every sequence, batched over the slots. `[B, Hv, Dv]`."""
        slots = torch.tensor(batch.state_slots, dtype=torch.long, device=mixed.device)
        conv_states = pool.conv[self.state_index].index_select(0, slots)
        conv_out, new_conv = causal_conv(mixed[:, :, None], conv_states,
                                         self.conv1d.weight.squeeze(1))
        q, k, v = self._split_qkv(conv_out.transpose(1, 2))
        initial = pool.ssm[self.state_index].index_select(0, slots)
        out, state = recurrent_gated_delta_rule(q, k, v, g[:, None], beta[:, None], initial)
        pool.conv[self.state_index].index_copy_(0, slots, new_conv)
        pool.ssm[self.state_index].index_copy_(0, slots, state)
        return out[:, 0]
