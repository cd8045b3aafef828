"""What one request's recurrent state is, on every linear-attention layer: the state
counterpart of `pdcache.engine.kv_geometry` (which knows the KV pages).

A linear-attention layer (Qwen3-Next's gated DeltaNet) keeps no KV pages. Instead every
request carries, per such layer, a fixed-size state that summarises all its tokens so far:

- the *conv state* `[conv_dim, conv_kernel - 1]`: the last `conv_kernel - 1` inputs of the
  layer's causal depthwise convolution (zeros before the first token), in the model dtype (the
  dtype the convolution reads, as transformers caches it);
- the *SSM state* `[num_value_heads, key_head_dim, value_head_dim]`: the delta rule's
  recurrent matrix per value head, always fp32 (transformers' torch paths and the FLA kernels
  accumulate it in fp32; a bf16 copy would not continue to the same logits).

A state is "the state at token n": restoring it and running token n on gives the logits of a
cold run. Torch-free on purpose, as `kv_geometry` is.

`CheckpointGeometry` is what the tiers need of any such fixed-size checkpoint blob (a host
state slot, a stored state object): its bytes, the key that keeps other shapes apart and the
storage key of the one after a page. A recurrent state is one; a sliding-window model's
*window tail* (`pdcache.engine.window_pages.WindowTailGeometry`) is the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdcache.engine.kv_geometry import ELEMENT_BYTES
from pdcache.engine.page_keys import state_key

SSM_DTYPE = "float32"


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Shape of a gated DeltaNet layer (HF `linear_*` config.json keys): key heads of
    `key_head_dim` (queries and keys), value heads of `value_head_dim` (`num_value_heads` a
    multiple of `num_key_heads`), a causal depthwise conv of `conv_kernel` taps over q, k, v."""

    conv_kernel: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int

    def __post_init__(self) -> None:
        sizes = (self.conv_kernel, self.key_head_dim, self.value_head_dim, self.num_key_heads,
                 self.num_value_heads)
        if min(sizes) < 1:
            raise ValueError(f"linear attention needs positive sizes, got {self}")
        if self.conv_kernel < 2:
            raise ValueError(f"a causal conv of {self.conv_kernel} tap keeps no state")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"{self.num_value_heads} value heads are not a multiple of "
                             f"{self.num_key_heads} key heads")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v concatenated."""
        return 2 * self.key_dim + self.value_dim


class CheckpointGeometry(Protocol):
    """A fixed-size checkpoint taken after a page-aligned token count: what host state slots
    hold (`HostStatePool`), storage stores as state objects and the tiers restore. Frozen
    and comparable: two checkpoints are interchangeable only when their geometries are equal."""

    def state_bytes(self) -> int:
        """Bytes of one checkpoint."""

    def key(self) -> str:
        """The string storage binds (`StorageConfig.state_geometry`)."""

    def describe(self) -> str:
        """One line for logs and errors."""

    def object_key(self, page_key: bytes) -> bytes:
        """The storage key of the checkpoint after the page whose key is `page_key`."""


@dataclass(frozen=True)
class RecurrentStateGeometry:
    """The recurrent state of one request on every linear layer (`layer_ids`, model layer
    numbers in order), its shapes, dtypes and bytes. Two states are interchangeable only when
    their geometries are equal (`key()` is the string a fingerprint carries)."""

    layer_ids: tuple[int, ...]
    linear: LinearAttentionConfig
    conv_dtype: str  # the model dtype
    ssm_dtype: str = SSM_DTYPE

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("a recurrent state needs at least one linear layer")
        if list(self.layer_ids) != sorted(set(self.layer_ids)) or self.layer_ids[0] < 0:
            raise ValueError(f"linear layer ids must be distinct, ascending and >= 0: "
                             f"{self.layer_ids}")
        for dtype in (self.conv_dtype, self.ssm_dtype):
            if dtype not in ELEMENT_BYTES:
                raise ValueError(f"state dtype {dtype!r} is not supported; supported: "
                                 f"{', '.join(ELEMENT_BYTES)}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def state_index(self, layer_id: int) -> int:
        """Row of model layer `layer_id` in the pool's layer dimension; ValueError otherwise."""
        if layer_id not in self.layer_ids:
            raise ValueError(f"layer {layer_id} is not a linear layer (those: {self.layer_ids})")
        return self.layer_ids.index(layer_id)

    @property
    def conv_shape(self) -> tuple[int, int]:
        """One layer's conv state: `[conv_dim, conv_kernel - 1]`."""
        return (self.linear.conv_dim, self.linear.conv_kernel - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        """One layer's SSM state: `[num_value_heads, key_head_dim, value_head_dim]`."""
        lin = self.linear
        return (lin.num_value_heads, lin.key_head_dim, lin.value_head_dim)

    @property
    def conv_bytes(self) -> int:
        """Bytes of the conv states of all linear layers (the first section of a snapshot)."""
        rows, width = self.conv_shape
        return self.num_layers * rows * width * ELEMENT_BYTES[self.conv_dtype]

    @property
    def ssm_bytes(self) -> int:
        """Bytes of the SSM states of all linear layers (the second section of a snapshot)."""
        heads, k, v = self.ssm_shape
        return self.num_layers * heads * k * v * ELEMENT_BYTES[self.ssm_dtype]

    def state_bytes(self) -> int:
        """Bytes of one request's whole state: what a snapshot holds, stores and transfers."""
        return self.conv_bytes + self.ssm_bytes

    def key(self) -> str:
        """The fields a fingerprint carries: states of unequal keys never mix."""
        rows, width = self.conv_shape
        heads, k, v = self.ssm_shape
        layers = ",".join(map(str, self.layer_ids))
        return (f"state=gdn;layers={layers};conv={rows}x{width}:{self.conv_dtype};"
                f"ssm={heads}x{k}x{v}:{self.ssm_dtype};key_heads={self.linear.num_key_heads}")

    def object_key(self, page_key: bytes) -> bytes:
        """`state_key` of the state after the page keyed `page_key`."""
        return state_key(page_key, self.key())

    def describe(self) -> str:
        """One line for logs and errors."""
        return (f"recurrent state of {self.num_layers} linear layers: conv {self.conv_shape} "
                f"{self.conv_dtype} + SSM {self.ssm_shape} {self.ssm_dtype} = "
                f"{self.state_bytes():,} B/request")
