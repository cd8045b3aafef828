"""Frozen configuration objects of the engine: model shape and KV-cache sizing.

The scheduler's limits are `pdcache.engine.scheduler_config.SchedulerConfig`, and the cache
settings `CacheConfig` shares with `[cache]` are `pdcache.engine.cache_settings`, kept apart
from this module (which imports torch) because the topology schema embeds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdcache.engine.cache_settings import STATE_CHECKPOINT_POLICIES, DeviceCacheSettings
from pdcache.engine.eviction import EVICTION_POLICIES, SessionTracker
from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.moe import MoEConfig
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.engine.state_geometry import LinearAttentionConfig, RecurrentStateGeometry

# Grouped-query attention (a K and a V cache); the MoE ones with sparse MLP blocks.
GQA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",  # alternating sliding/full layers, attention sinks, MoE
    "Qwen3NextForCausalLM",  # gated DeltaNet linear layers (a recurrent state) + gated attention
)
# Multi-head latent attention (one latent cache row) with MoE: DeepSeek-V2/V3, Kimi K2.
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ARCHITECTURES = (*GQA_ARCHITECTURES, *MLA_ARCHITECTURES)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The name `DTYPES` (and `KVGeometry.dtype`) gives a torch dtype: "bfloat16", ..."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_scaling` / `rope_parameters`): "llama3" (Llama 3.1+)
    or "yarn" (DeepSeek-V2/V3, Kimi K2: frequencies blended between `beta_fast` and
    `beta_slow` rotations, cos/sin scaled by `attention_factor`, and with `mscale_all_dim`
    the softmax scale by its mscale squared)."""

    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    rope_type: str = "llama3"
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 0.0  # yarn: 0 = unset
    mscale_all_dim: float = 0.0  # yarn: 0 = unset
    attention_factor: float | None = None  # yarn: None = from factor and the mscales
    truncate: bool = True  # yarn: round the correction range outwards


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder: attention (GQA or MLA), its cache (`kv_geometry`) and its MLP
    blocks (dense, or `moe`). Field names follow Hugging Face `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None = None  # Mistral; full attention is used when None
    # gpt-oss: each layer's attention (HF `layer_types`: "full_attention" or
    # "sliding_attention", windowed by `sliding_window`); empty: every layer alike
    layer_types: tuple[str, ...] = ()
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins every softmax
    o_proj_bias: bool = False  # gpt-oss: `attention_bias` covers o_proj too
    # Qwen3-Next: the gated DeltaNet shape of its "linear_attention" layers (None: there are
    # none) and the share of head_dim its attention rotates (partial RoPE)
    linear_attention: LinearAttentionConfig | None = None
    partial_rotary_factor: float = 1.0
    # MLA (DeepSeek-V2/V3, Kimi K2): the cache is one latent per token (`kv_lora_rank` 0: not
    # MLA); queries through a `q_lora_rank` bottleneck (None: one projection)
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # DeepSeek-V3: RoPE on interleaved (even, odd) pairs
    moe: MoEConfig | None = None  # sparse MLP blocks (None: every layer dense)
    # DeepSeek-V3's multi-token-prediction layers, stored after the decoder's: not run (no
    # speculative decoding), their tensors not loaded
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    name: str = "model"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of layer `layer_id`'s attention (None: full attention)."""
        if self.layer_types and self.layer_types[layer_id] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def kv_geometry(self) -> KVGeometry:
        """What this model caches per token on every layer (every tier's shapes and bytes),
        with the layer kinds ("sliding" with the window, "full", "linear": no KV) when the
        layers differ."""
        if self.is_mla:
            return KVGeometry.mla(self.num_hidden_layers, self.kv_lora_rank,
                                  self.qk_rope_head_dim, self.dtype)
        geometry = KVGeometry.mha(self.num_hidden_layers, self.num_key_value_heads,
                                  self.head_dim, self.dtype)
        windows = [self.layer_window(i) for i in range(self.num_hidden_layers)]
        if not any(windows) and not self.linear_layer_ids:
            return geometry
        kinds = tuple("linear" if i in self.linear_layer_ids else "sliding" if w else "full"
                      for i, w in enumerate(windows))
        return geometry.with_layer_kinds(kinds, self.sliding_window or 0)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        """The layers of HF kind "linear_attention" (no KV: a recurrent state per request)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")

    @property
    def state_geometry(self) -> RecurrentStateGeometry | None:
        """Each request's recurrent state on the linear layers (None: the model has none)."""
        if not self.linear_layer_ids:
            return None
        if self.linear_attention is None:
            raise ValueError("linear_attention layers need ModelConfig.linear_attention")
        return RecurrentStateGeometry(self.linear_layer_ids, self.linear_attention, self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's cache across all layers."""
        return self.kv_geometry.token_bytes


@dataclass(frozen=True)
class CacheConfig(DeviceCacheSettings):
    """Device KV pool sizing and prefix-cache switches: `[cache]`'s `DeviceCacheSettings`
    (page size, device eviction, session idle time, state checkpoint slots; inherited) and
    the pool's size."""

    num_device_pages: int = 2048
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.state_checkpoint_slots < 0:
            raise ValueError("state_checkpoint_slots must be >= 0")
        if not 0 <= self.sliding_pages <= self.num_device_pages:
            raise ValueError(f"sliding_pages must be 0 (as many as device pages) to "
                             f"{self.num_device_pages} (device pages), got {self.sliding_pages}")
        if self.device_eviction not in EVICTION_POLICIES:
            raise ValueError(f"device_eviction must be one of {EVICTION_POLICIES}")
        if self.state_checkpoints not in STATE_CHECKPOINT_POLICIES:
            raise ValueError(f"state_checkpoints must be one of {STATE_CHECKPOINT_POLICIES}")
        if self.session_idle_s <= 0:
            raise ValueError("session_idle_s must be > 0")

    def make_sessions(self) -> SessionTracker:
        """The tracker the node's tiers share (one per engine)."""
        return SessionTracker(self.session_idle_s)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine process needs; built once and passed explicitly."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    seed: int = 0
    kernels: str = "auto"  # KV kernel backend (pdcache.kernels.KernelSet): auto = by device

    def __post_init__(self) -> None:
        self.scheduler.check()
