"""Frozen configuration objects of the engine: model shape and KV-cache sizing."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdcache.engine.eviction import EVICTION_POLICIES, SessionTracker
from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.moe import MoEConfig

# Grouped-query attention (a K and a V cache); the MoE ones with sparse MLP blocks.
GQA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
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

    @property
    def kv_geometry(self) -> KVGeometry:
        """What this model caches per token on every layer (every tier's shapes and bytes)."""
        if self.is_mla:
            return KVGeometry.mla(self.num_hidden_layers, self.kv_lora_rank,
                                  self.qk_rope_head_dim, self.dtype)
        return KVGeometry.mha(self.num_hidden_layers, self.num_key_value_heads, self.head_dim,
                              self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's cache across all layers."""
        return self.kv_geometry.token_bytes


@dataclass(frozen=True)
class CacheConfig:
    """Device KV pool sizing and prefix-cache switches."""

    page_size: int = 16
    num_device_pages: int = 2048
    enable_prefix_cache: bool = True
    # which cached pages the device tree evicts first (`pdcache.engine.eviction`): "lru" or
    # "session" (closed sessions first, active ones expected back last next)
    device_eviction: str = "lru"
    session_idle_s: float = 300.0  # a session without a turn for this long is closed

    def __post_init__(self) -> None:
        if self.device_eviction not in EVICTION_POLICIES:
            raise ValueError(f"device_eviction must be one of {EVICTION_POLICIES}")
        if self.session_idle_s <= 0:
            raise ValueError("session_idle_s must be > 0")

    def make_sessions(self) -> SessionTracker:
        """The tracker the node's tiers share (one per engine)."""
        return SessionTracker(self.session_idle_s)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: the token budget bounds each prefill chunk.

    `max_pending_reservations` bounds the decode node's admission queue: PD requests whose
    pages cannot be reserved yet wait there, in arrival order, until running requests free
    them (`Engine.reserve_when_free`); 0 refuses at once when the pool is short.
    `decode_reserve_tokens` is how much of a request's answer an admission keeps room for
    (at most its `max_new_tokens`): a client that sends no `max_tokens` asks for the whole
    context, and keeping room for all of it would admit one such request at a time. Past it,
    decoding takes pages as they free (retraction where offload allows it), as SGLang's
    reserved decode tokens do; with offload on and every request past its reserve, decoding
    can stall until requests finish or reach their deadline.

    `decode_step_interval_ms` (0: off) is the least time from the start of one decode step to
    the next (`Engine._pace_decode`): a decode node that shares its host's CPU with prefill
    trades TPOT for the prefill's TTFT, as a unified engine does when it puts prefill chunks
    between decode steps.

    `compute_share` (None: off) names the file through which engines that share compute (one
    host's cores, one GPU) order their work as one unified engine would: an engine announces
    while it has prefill work (queued or computing), and one about to run a decode step holds
    it back while another announces, at most `decode_yield_max_ms`
    (`pdcache.engine.compute_share`, docs/design.md §4.13)."""

    max_running_requests: int = 64
    chunked_prefill_tokens: int = 2048
    max_queued_requests: int = 1024
    max_pending_reservations: int = 256
    decode_reserve_tokens: int = 512
    decode_step_interval_ms: int = 0
    compute_share: str | None = None
    decode_yield_max_ms: int = 300

    def __post_init__(self) -> None:
        if self.decode_step_interval_ms < 0:
            raise ValueError("decode_step_interval_ms must be >= 0")
        if self.decode_yield_max_ms < 1:
            raise ValueError("decode_yield_max_ms must be >= 1")
        if self.compute_share == "":
            raise ValueError("compute_share must name a file (None: off)")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine process needs; built once and passed explicitly."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    seed: int = 0
    kernels: str = "auto"  # KV kernel backend (pdcache.kernels.KernelSet): auto = by device
