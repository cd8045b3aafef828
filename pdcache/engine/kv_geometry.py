"""What one token's KV cache is, on every layer: the one place that knows a cache's shape.

Every tier holds the cache of a page as the same nested array, layer-first on the device and
page-first everywhere else:

- device pool `device_kv[L, K, P, S, H, D]`, host pool `host_kv[P, L, K, S, H, D]`, a stored
  page's payload and a staging page `[L, K, S, H, D]`;
- `K` is the number of *slabs* a layer caches per token: 2 for multi-head / grouped-query
  attention (a K slab and a V slab of `H` kv heads × `D` head_dim), 1 for multi-head latent
  attention (MLA: one latent row per token, `H = 1`, `D = kv_lora_rank + qk_rope_head_dim`,
  of which attention reads the first `kv_lora_rank` elements as its values).

Tiers, page formats, storage backends, the transfer layout, the control messages, decode
offload and the SGLang plugin take a `KVGeometry` and ask it for shapes, byte counts and the
fingerprint fields; none of them spells a layout (a test reads every module for it). The
kernels (`pdcache.kernels`) take the tensors and read `K`, `H`, `D` from their shapes.

`layer_kinds` is where per-layer mixes go: "full" (attends to every earlier token),
"sliding" (attends to the last `sliding_window` tokens: gpt-oss's alternate layers, Mistral's
every layer) and "linear" (no KV at all: a linear-attention layer whose per-request recurrent
state lives in `pdcache.engine.state_pool`, Qwen3-Next's gated DeltaNet). A sliding layer
keeps every page of its sequence on every tier (the same `[L, K, S, H, D]` page as a full
layer), except on the device tier of a unified device-only engine, which splits the layers
into two page spaces (`pdcache.engine.window_pages`: each a geometry of one kind, the other
layers marked "linear") and frees the sliding pages out of every live window. A linear
layer has no row in any page: `L` in every shape below is `num_kv_layers` (the layers with
KV, in layer order; `kv_layer_index` maps a model layer to its row), and `token_bytes` /
`page_bytes` count only those layers. Other kinds are refused.

Torch-free on purpose: configuration, routers and planners size caches without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdcache.engine.page_keys import kv_fingerprint

# Cache kinds: "mha" = a K and a V slab per layer (MHA, GQA, MQA); "mla" = one latent slab.
KV_KINDS = ("mha", "mla")
# Per-layer cache kinds: "linear" layers keep no KV (a recurrent state instead).
LAYER_KINDS = ("full", "sliding", "linear")
ELEMENT_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
# The stored byte order of a page (`page_first`: all layers of one page contiguous). The MLA
# value matches SGLang's HiCache plugin fingerprint of the same model, whose MLA pages have the
# same bytes, so both read each other's pages.
_FINGERPRINT_LAYOUT = {"mha": "page_first", "mla": "mla"}


@dataclass(frozen=True)
class KVGeometry:
    """The cache of one token on every layer, and what follows from it for a page.

    `heads` × `head_dim` elements per slab per token; `value_dim` of each row is what attention
    reads as V (all of it for "mha"; the latent's first `kv_lora_rank` elements for "mla").
    """

    kind: str
    num_layers: int
    heads: int
    head_dim: int
    value_dim: int
    dtype: str
    rope_dim: int = 0  # "mla": the decoupled-RoPE part at the end of each row
    layer_kinds: tuple[str, ...] = ()  # empty: every layer "full"
    sliding_window: int = 0  # the window of the "sliding" layers (0: there are none)

    def __post_init__(self) -> None:
        if self.kind not in KV_KINDS:
            raise ValueError(f"unknown KV kind {self.kind!r}; kinds: {', '.join(KV_KINDS)}")
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"KV dtype {self.dtype!r} is not supported; "
                             f"supported: {', '.join(ELEMENT_BYTES)}")
        if min(self.num_layers, self.heads, self.head_dim, self.value_dim) < 1:
            raise ValueError(f"KV geometry needs positive sizes, got {self}")
        if self.value_dim > self.head_dim:
            raise ValueError(f"value_dim {self.value_dim} exceeds the row width {self.head_dim}")
        if self.kind == "mha" and self.value_dim != self.head_dim:
            raise ValueError("an MHA cache reads whole V rows (value_dim == head_dim)")
        if self.kind == "mla" and (self.heads != 1 or self.value_dim + self.rope_dim
                                   != self.head_dim):
            raise ValueError("an MLA latent is one row of kv_lora_rank + qk_rope_head_dim")
        unknown = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"layer kinds {unknown} are not run by this engine; "
                             f"supported: {', '.join(LAYER_KINDS)}")
        if self.layer_kinds and len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"{len(self.layer_kinds)} layer kinds for {self.num_layers} layers")
        if self.layer_kinds and self.num_kv_layers == 0:
            raise ValueError(f"every layer is 'linear' ({self.layer_kinds}): a geometry needs "
                             f"at least one layer with KV pages")
        if ("sliding" in self.layer_kinds) != (self.sliding_window > 0):
            raise ValueError(f"sliding layers need a positive sliding_window and a window "
                             f"needs sliding layers (kinds {self.layer_kinds}, window "
                             f"{self.sliding_window})")

    def with_layer_kinds(self, layer_kinds: tuple[str, ...], sliding_window: int = 0
                         ) -> KVGeometry:
        """This geometry with per-layer kinds ("full" / "sliding" / "linear") and the sliding
        window; `num_layers` stays the model's layer count."""
        return replace(self, layer_kinds=layer_kinds, sliding_window=sliding_window)

    def layer_kind(self, layer: int) -> str:
        """"full", "sliding" or "linear": what layer `layer` attends to (the kinds' docstring
        above)."""
        return self.layer_kinds[layer] if self.layer_kinds else "full"

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The model layers that keep KV pages (all but the "linear" ones), in order."""
        return tuple(i for i in range(self.num_layers) if self.layer_kind(i) != "linear")

    @property
    def num_kv_layers(self) -> int:
        """`L` of every page and pool shape: the layers with KV."""
        return len(self.kv_layers)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers without KV (a recurrent state per request instead)."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "linear")

    def kv_layer_index(self, layer: int) -> int:
        """Row of model layer `layer` in the pools' `L` dimension; ValueError for a layer that
        keeps no KV (a "linear" one) or one out of range."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        if self.layer_kind(layer) == "linear":
            raise ValueError(f"layer {layer} is a 'linear' layer: it keeps no KV pages")
        return self.kv_layers.index(layer)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """The layers that attend to the last `sliding_window` tokens only."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "sliding")

    @classmethod
    def mha(cls, num_layers: int, kv_heads: int, head_dim: int, dtype: str) -> KVGeometry:
        """Multi-head or grouped-query attention: K and V of `kv_heads` × `head_dim`."""
        return cls("mha", num_layers, kv_heads, head_dim, head_dim, dtype)

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, rope_dim: int, dtype: str) -> KVGeometry:
        """Multi-head latent attention: one `kv_lora_rank + rope_dim` latent per token."""
        return cls("mla", num_layers, 1, kv_lora_rank + rope_dim, kv_lora_rank, dtype, rope_dim)

    @classmethod
    def from_device_shape(cls, shape: tuple[int, ...], dtype: str) -> KVGeometry:
        """The geometry of an existing device pool `[L, K, P, S, H, D]`, as far as its shape
        tells: enough for every tier's shapes, bytes and fingerprint (an MLA pool's split of
        its row into values and RoPE is not in the shape: its `value_dim` is the whole row)."""
        if len(shape) != 6 or shape[1] not in (1, 2):
            raise ValueError(f"not a device KV pool [L, K, P, S, H, D] of 1 or 2 slabs: "
                             f"{tuple(shape)}")
        layers, slabs, _, _, heads, dim = shape
        if slabs == 2:
            return cls.mha(layers, heads, dim, dtype)
        return cls("mla", layers, heads, dim, dim, dtype)

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def num_slabs(self) -> int:
        """Slabs per layer: 2 (K, V) for "mha", 1 (the latent) for "mla"."""
        return 2 if self.kind == "mha" else 1

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's cache across all layers with KV."""
        return self.num_kv_layers * self.num_slabs * self.row_elements * self.element_bytes

    @property
    def row_elements(self) -> int:
        """Elements of one token in one slab of one layer."""
        return self.heads * self.head_dim

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page across all layers and slabs: a host page, a stored payload."""
        return page_size * self.token_bytes

    def slab_page_bytes(self, page_size: int) -> int:
        """Bytes of one page of one slab of one layer: the unit the transfer engines move."""
        return page_size * self.row_elements * self.element_bytes

    def page_shape(self, page_size: int) -> tuple[int, ...]:
        """One page, page-first: `[L, K, S, H, D]` (a host page, a stored payload)."""
        return (self.num_kv_layers, self.num_slabs, page_size, self.heads, self.head_dim)

    def device_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        """The device pool, layer-first: `[L, K, P, S, H, D]`."""
        return (self.num_kv_layers, self.num_slabs, num_pages, page_size, self.heads,
                self.head_dim)

    def host_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        """A host pool or staging buffer, page-first: `[P, L, K, S, H, D]`."""
        return (num_pages, *self.page_shape(page_size))

    def check_device_shape(self, shape: tuple[int, ...], what: str = "device_kv") -> None:
        """ValueError unless `shape` is a device pool of this geometry (any page count/size)."""
        if len(shape) != 6 or (shape[0], shape[1], shape[4], shape[5]) != (
                self.num_kv_layers, self.num_slabs, self.heads, self.head_dim):
            want = self.device_shape(0, 0)
            raise ValueError(f"{what} shape {tuple(shape)} is not the model's KV geometry "
                             f"[L, K, P, S, H, D] = [{want[0]}, {want[1]}, P, S, {want[4]}, "
                             f"{want[5]}] ({self.describe()})")

    # ---- identity --------------------------------------------------------------------------
    def fingerprint(self, model_name: str, page_size: int, tp_rank: int = 0,
                    tp_size: int = 1, byte_order: str | None = None) -> str:
        """The KV fingerprint (`pdcache.engine.page_keys.kv_fingerprint`) of pages of this
        geometry: two caches share pages only when these strings are equal. `byte_order`
        names another order of the same bytes (SGLang's split payloads); None: ours."""
        layout = byte_order or _FINGERPRINT_LAYOUT[self.kind]
        base = kv_fingerprint(model_name, self.dtype, page_size, self.num_layers, self.heads,
                              self.head_dim, layout, tp_rank, tp_size)
        # Only mixed geometries carry their kinds, so every all-"full" fingerprint (and the
        # pages stored under it) stays what it was.
        return base + self._kinds_suffix()

    def _kinds_suffix(self) -> str:
        if not self.sliding_layers and not self.linear_layers:
            return ""
        kinds = "".join(kind[0].upper() for kind in self.layer_kinds)  # F / S / L per layer
        return f";layer_kinds={kinds};window={self.sliding_window}"

    def layout_key(self, page_size: int) -> str:
        """The fingerprint without a model name: what two pools must agree on to exchange
        pages byte for byte (P→D transfer compares it at registration)."""
        return self.fingerprint("", page_size)

    def describe(self) -> str:
        """One line for logs and errors: kind, row, layers, dtype, bytes per token."""
        if self.kind == "mla":
            row = f"MLA latent {self.head_dim} ({self.value_dim} + {self.rope_dim} rope)"
        else:
            row = f"K+V {self.heads} heads x {self.head_dim}"
        notes = []
        if self.sliding_layers:
            notes.append(f"{len(self.sliding_layers)} sliding, window {self.sliding_window}")
        if self.linear_layers:
            notes.append(f"{len(self.linear_layers)} linear without KV")
        kinds = f" ({'; '.join(notes)})" if notes else ""
        return (f"{row} x {self.num_layers} layers{kinds}, {self.dtype}: "
                f"{self.token_bytes:,} B/token")
