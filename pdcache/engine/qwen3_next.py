"""Qwen3-Next (`Qwen3NextForCausalLM`) at the model level: a hybrid decoder of gated DeltaNet
linear-attention layers (`pdcache.engine.gated_deltanet`, recurrent state per request in a
`RecurrentStatePool`) and, every `full_attention_interval`-th layer, gated full attention over
the paged KV pool; MoE feed-forwards with a sigmoid-gated shared expert
(`pdcache.engine.moe.Qwen3NextMoeBlock`).

Parameter names are transformers' (`model.layers.0.linear_attn.in_proj_qkvz.weight`,
`model.layers.3.self_attn.q_proj.weight`, ...). The forward mutates only `device_kv` (the new
tokens' K/V rows of the attention layers, at `batch.out_slots`, in the pool's rows
`KVGeometry.kv_layer_index`: linear layers have none) and the batch's state slots.

The engine runs it on the device tier (`pdcache.engine.loader` builds it; the scheduler gives
each running request a state slot and the prefix cache state checkpoints:
`pdcache.engine.state_cache`); host/storage tiers and P→D do not carry the state yet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdcache.engine.config import DTYPES, ModelConfig
from pdcache.engine.forward import ForwardBatch
from pdcache.engine.gated_deltanet import GatedDeltaNet
from pdcache.engine.layers import (
    ZeroCentredRMSNorm,
    apply_partial_rope,
    rope_cos_sin,
    rope_frequencies,
)
from pdcache.engine.model import Attention
from pdcache.engine.moe import convert_checkpoint_tensors, make_mlp, moe_config_from_hf
from pdcache.engine.state_geometry import LinearAttentionConfig
from pdcache.engine.weights import iter_safetensors, load_weights, safetensors_files

ARCHITECTURE = "Qwen3NextForCausalLM"
_LAYER_TYPES = ("linear_attention", "full_attention")


class GatedAttention(Attention):
    """Qwen3-Next's full attention: `q_proj` yields each head's query and an output gate
    (`[H, 2D]`, query first), zero-centred q/k norms, RoPE on the first
    `partial_rotary_factor` of each head, `sigmoid(gate)` on the attention output before
    `o_proj`. Reads and writes KV row `kv_layer` of the pool (its `layer_id`: the row, not the
    model layer, since linear layers keep none)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        nn.Module.__init__(self)
        c = config
        self.model_layer = layer_id
        self.layer_id = c.kv_geometry.kv_layer_index(layer_id)
        self.num_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.head_dim
        self.scale = c.head_dim**-0.5
        self.sliding_window = None
        self.sinks = None
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, 2 * self.num_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * c.head_dim, c.hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, device_kv: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, gate = self.q_proj(x).view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_partial_rope(self.q_norm(q), cos, sin)
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        k = apply_partial_rope(k, cos, sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if batch.wait_layer is not None:
            batch.wait_layer(self.layer_id)
        batch.kernels.store_kv(device_kv, self.layer_id, batch.out_slots, k, v)
        out = self._attend(q, k, v, batch, device_kv).reshape(n, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


class Qwen3NextDecoderLayer(nn.Module):
    """One layer: `linear_attn` (a `GatedDeltaNet`) or `self_attn` (a `GatedAttention`) by
    `layer_types`, then the feed-forward; zero-centred pre-norms."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer_id] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_id)
        else:
            self.self_attn = GatedAttention(config, layer_id)
        self.mlp = make_mlp(config.moe, config.hidden_size, config.intermediate_size, layer_id)
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size,
                                                           config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, device_kv: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.linear_attn(h, batch)
        else:
            h = self.self_attn(h, cos, sin, batch, device_kv)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextStack(nn.Module):
    """The `model.` part: embeddings, layers, final (zero-centred) norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3NextForCausalLM(nn.Module):
    """Qwen3-Next over a paged KV pool (attention layers) and a `RecurrentStatePool` (linear
    layers, `batch.state_pool` / `batch.state_slots`). Holds no per-request state; returns
    fp32 logits `[n, vocab]` for `batch.logits_indices` (default: each sequence's last new
    token), as `CausalLM.forward`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.state_geometry is None:
            raise ValueError(f"{config.name}: Qwen3-Next without linear_attention layers")
        self.config = config
        self.model = Qwen3NextStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        # A plain attribute, not a buffer: `.to(bfloat16)` must not round the frequencies.
        self._inv_freq, _ = rope_frequencies(rotary_dim, config.rope_theta, None)

    def forward(self, batch: ForwardBatch, device_kv: torch.Tensor) -> torch.Tensor:
        self._check_state_pool(batch)
        x = self.model.embed_tokens(batch.input_ids)
        if self._inv_freq.device != x.device:
            self._inv_freq = self._inv_freq.to(x.device)
        cos, sin = rope_cos_sin(batch.positions, self._inv_freq, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch, device_kv)
        rows = batch.logits_indices
        if rows is None:
            rows = batch.last_token_indices()
        return self.lm_head(self.model.norm(x[rows])).float()

    def _check_state_pool(self, batch: ForwardBatch) -> None:
        pool, slots = batch.state_pool, batch.state_slots
        if pool is None or slots is None or len(slots) != batch.batch_size:
            raise ValueError(f"{ARCHITECTURE} needs a state pool and one state slot per "
                             f"sequence (got {None if slots is None else len(slots)} slots "
                             f"for {batch.batch_size} sequences)")
        if pool.geometry != self.config.state_geometry:
            raise ValueError(f"state pool of another geometry: {pool.geometry.describe()}; "
                             f"the model's: {self.config.state_geometry.describe()}")


# ---- config.json and checkpoints ------------------------------------------------------------

def qwen3_next_config_from_hf(hf: dict[str, Any], name: str = "model",
                              dtype: str | None = None) -> ModelConfig:
    """A `Qwen3NextConfig` config.json dict as a ModelConfig; ValueError naming what we do not
    run (a rope type other than default, another activation, an unknown layer kind)."""
    arch = (hf.get("architectures") or [ARCHITECTURE])[0]
    if arch != ARCHITECTURE:
        raise ValueError(f"not a {ARCHITECTURE} config: {arch!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (only silu)")
    rope = dict(hf.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{ARCHITECTURE}: rope_type {rope.get('rope_type')!r} is not "
                         f"supported (default only)")
    layers = int(hf["num_hidden_layers"])
    layer_types = tuple(hf.get("layer_types") or _interval_layer_types(hf, layers))
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown or len(layer_types) != layers:
        raise ValueError(f"{ARCHITECTURE}: layer_types {unknown or len(layer_types)} "
                         f"(runs {', '.join(_LAYER_TYPES)}, one per layer)")
    heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    return ModelConfig(
        architecture=ARCHITECTURE,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        layer_types=layer_types,
        linear_attention=LinearAttentionConfig(
            conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
            key_head_dim=int(hf["linear_key_head_dim"]),
            value_head_dim=int(hf["linear_value_head_dim"]),
            num_key_heads=int(hf["linear_num_key_heads"]),
            num_value_heads=int(hf["linear_num_value_heads"]),
        ),
        partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                             hf.get("partial_rotary_factor", 0.25))),
        moe=moe_config_from_hf(hf, ARCHITECTURE),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        dtype=dtype or _checkpoint_dtype(hf),
        name=name,
    )


def _interval_layer_types(hf: dict[str, Any], layers: int) -> list[str]:
    # Qwen3NextConfig's default: full attention on every `full_attention_interval`-th layer.
    interval = int(hf.get("full_attention_interval", 4))
    return ["linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(layers)]


def _checkpoint_dtype(hf: dict[str, Any]) -> str:
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return dtype if dtype in DTYPES else "float32"


def load_qwen3_next(path: str | Path, dtype: str | None = None) -> Qwen3NextForCausalLM:
    """A Qwen3-Next checkpoint directory (config.json, *.safetensors) as our model, eval mode,
    gradients off; per-expert tensors are fused as for Qwen3-MoE."""
    path = Path(path)
    config = qwen3_next_config_from_hf(json.loads((path / "config.json").read_text()),
                                       path.name, dtype)
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(config)
    model = model.to_empty(device="cpu").to(config.torch_dtype)
    if config.tie_word_embeddings:  # to_empty re-creates parameters: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    tensors = iter_safetensors(safetensors_files(path))
    if config.moe is not None:
        tensors = convert_checkpoint_tensors(tensors, config.moe)
    load_weights(model, tensors)  # reads named_parameters() and config only
    model.eval()
    model.requires_grad_(False)
    return model
