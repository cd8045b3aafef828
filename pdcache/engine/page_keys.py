"""Chained page keys shared by every node, backend, router and benchmark (docs/design.md §4.2).

`h_0 = SHA256(salt || tokens_0)`, `h_i = SHA256(h_{i-1} || tokens_i)`, tokens as little-endian
uint32. Only full pages get keys. The salt binds a key to the KV fingerprint (model, dtype,
page size, layout, TP shard) and to the tenant namespace, so foreign pages never match.

The "sglang" key scheme (bottom of this module) names the same pages the way SGLang's HiCache
does, salted the same way, so pdcache nodes and SGLang nodes running the pdcache storage
plugin (`pdcache.integrations.sglang`) share pages. It needs only hashlib and numpy, so a
node uses it without importing the integration. `PageKeyScheme` is the one object nodes
(HiCache, the decode offload manager) compute their storage keys with, in either scheme.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEY_BYTES = 32


def kv_fingerprint(
    model_name: str,
    dtype: str,
    page_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    layout: str = "page_first",
    tp_rank: int = 0,
    tp_size: int = 1,
) -> str:
    """A stable string naming everything that makes two KV pages interchangeable."""
    return (
        f"model={model_name};dtype={dtype};page={page_size};layers={num_layers};"
        f"kv_heads={num_kv_heads};head_dim={head_dim};layout={layout};tp={tp_rank}/{tp_size}"
    )


def make_salt(fingerprint: str, namespace: str = "") -> bytes:
    """Salt of the first page's hash: fingerprint and tenant namespace, length-prefixed."""
    fp = fingerprint.encode()
    ns = namespace.encode()
    return struct.pack("<I", len(fp)) + fp + struct.pack("<I", len(ns)) + ns


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def chain_page_keys(
    token_ids: Sequence[int] | np.ndarray,
    page_size: int,
    salt: bytes,
    prev_key: bytes | None = None,
) -> list[bytes]:
    """Keys of every full page of `token_ids`.

    With `prev_key`, the chain continues after a page whose key is `prev_key` (so a decode node
    can extend the prompt's chain with the answer's pages).
    """
    num_full = len(token_ids) // page_size
    keys: list[bytes] = []
    prev = salt if prev_key is None else prev_key
    for i in range(num_full):
        page = token_ids[i * page_size : (i + 1) * page_size]
        prev = hashlib.sha256(prev + _token_bytes(page)).digest()
        keys.append(prev)
    return keys


def key_hex(key: bytes) -> str:
    return key.hex()


# --------------------------------------------------------------------------- state checkpoints

_STATE_KEY_TAG = b"pdcache recurrent state v1"


def state_key(page_key: bytes, geometry_key: str) -> bytes:
    """The storage key of a recurrent-state checkpoint taken right after the page whose
    storage key is `page_key` (docs/design.md §4.2), for states of `geometry_key`
    (`RecurrentStateGeometry.key()`).

    `SHA256(tag ‖ len(geometry) ‖ geometry ‖ page_key)`. The page key already binds the
    fingerprint, the tenant salt and every token up to that page (either scheme), so the state
    key inherits those bindings; the geometry makes states of other shapes or dtypes never
    share a key. Never a page key: a page key hashes a 32-byte key (or a length-prefixed salt)
    followed by token ids, this starts with a fixed tag that is neither.
    """
    if len(page_key) != KEY_BYTES:
        raise ValueError(f"page keys are {KEY_BYTES} bytes, got {len(page_key)}")
    geometry = geometry_key.encode()
    return hashlib.sha256(
        _STATE_KEY_TAG + struct.pack("<I", len(geometry)) + geometry + page_key
    ).digest()


def state_keys(page_keys: Sequence[bytes], geometry_key: str) -> list[bytes]:
    """`state_key` of each page key: the checkpoints a chain of pages can have."""
    return [state_key(key, geometry_key) for key in page_keys]


# --------------------------------------------------------------------------- window pages

_WINDOW_KEY_TAG = b"pdcache window page v1"


def window_page_key(page_key: bytes, layers_key: str) -> bytes:
    """The storage key of a page's sliding-window layers stored as their own object (window
    pages, docs/design.md §4.14), for the page whose storage key is `page_key` and the
    sliding layers named by `layers_key` (the sliding geometry's fingerprint or layout key).

    `SHA256(tag ‖ len(layers) ‖ layers ‖ page_key)`, as `state_key`: it inherits the page
    key's bindings (fingerprint, tenant salt, every token up to that page), the layers key
    keeps other layer mixes or windows apart, and its own tag keeps it from ever equalling
    a page key or a state key.
    """
    if len(page_key) != KEY_BYTES:
        raise ValueError(f"page keys are {KEY_BYTES} bytes, got {len(page_key)}")
    layers = layers_key.encode()
    return hashlib.sha256(
        _WINDOW_KEY_TAG + struct.pack("<I", len(layers)) + layers + page_key
    ).digest()


def window_page_keys(page_keys: Sequence[bytes], layers_key: str) -> list[bytes]:
    """`window_page_key` of each page key."""
    return [window_page_key(key, layers_key) for key in page_keys]


# --------------------------------------------------------------------------- sglang scheme

_SGLANG_SEED_TAG = b"sglang-cache-namespace-v1"


def sglang_namespace_seed(cache_salt: str | None = None, extra_key: str | None = None) -> bytes:
    """SGLang's storage chain seed for a request namespace; b"" when it has none.

    Mirrors `sglang.srt.mem_cache.utils.storage_namespace_seed` (0.5.23): SHA-256 over a tag
    and, for (extra_key, cache_salt), a presence byte plus length-prefixed UTF-8.
    """
    if extra_key is None and cache_salt is None:
        return b""
    digest = hashlib.sha256(_SGLANG_SEED_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def sglang_chain_hashes(
    token_ids: Sequence[int] | np.ndarray,
    page_size: int,
    cache_salt: str | None = None,
    extra_key: str | None = None,
    prior_hash: str | None = None,
) -> list[str]:
    """SGLang's storage page hashes (hex) of every full page of `token_ids`.

    `prior_hash` continues a chain after that page (a decode node extending the prompt).
    """
    if prior_hash is not None:
        return [k.hex() for k in chain_page_keys(token_ids, page_size, bytes.fromhex(prior_hash))]
    seed = sglang_namespace_seed(cache_salt, extra_key)
    return [k.hex() for k in chain_page_keys(token_ids, page_size, seed)]


def derive_storage_key(salt: bytes, sglang_hash: str, piece: int | None = None) -> bytes:
    """The pdcache storage key of one SGLang page hash under `salt`. Raises ValueError.

    `piece` names one contiguous run of the page in the plugin's "split" payload (0 = K, 1 = V).
    """
    raw = bytes.fromhex(sglang_hash)
    if len(raw) != KEY_BYTES:
        raise ValueError(f"SGLang page hashes are 32 bytes of hex, got {sglang_hash!r}")
    return _derive(salt, raw, piece)


def _derive(salt: bytes, raw_hash: bytes, piece: int | None = None) -> bytes:
    suffix = b"" if piece is None else bytes([piece])
    return hashlib.sha256(salt + raw_hash + suffix).digest()


def sglang_compatible_page_keys(
    token_ids: Sequence[int] | np.ndarray,
    page_size: int,
    fingerprint: str,
    namespace: str = "",
    cache_salt: str | None = None,
    prior_hash: str | None = None,
) -> list[bytes]:
    """Storage keys a pdcache node uses to share pages with SGLang nodes running the plugin."""
    salt = make_salt(fingerprint, namespace)
    hashes = sglang_chain_hashes(token_ids, page_size, cache_salt, prior_hash=prior_hash)
    return [derive_storage_key(salt, h) for h in hashes]


# --------------------------------------------------------------------------- node key scheme

KEY_SCHEMES = ("pdcache", "sglang")


def check_key_scheme(name: str) -> str:
    """`name` if it is a known key scheme; ValueError naming the allowed ones otherwise."""
    if name not in KEY_SCHEMES:
        raise ValueError(f"unknown key scheme {name!r}; expected one of: {', '.join(KEY_SCHEMES)}")
    return name


@dataclass(frozen=True)
class PageKeyScheme:
    """How a node names its stored pages; the one chaining rule HiCache and decode offload use.

    - "pdcache": `chain_page_keys` salted with `make_salt(fingerprint, tenant)` (docs/design.md
      §4.2); a non-empty `namespace` is appended to that salt, length-prefixed.
    - "sglang": SGLang's hash chain (seeded with the tenant as SGLang's `cache_salt`, "" =
      none), each hash stored under `derive_storage_key(make_salt(fingerprint, namespace), h)`:
      the keys SGLang servers running the pdcache plugin with `key_namespace = namespace` and
      `model_name` = the fingerprint's model name use.

    Chain state (`keys`' second result, `prior` of the next call) is opaque bytes: the last
    key ("pdcache") or the last SGLang hash ("sglang"), so a decode node continues the
    prompt's chain with the answer's pages in either scheme.
    """

    fingerprint: str
    page_size: int
    scheme: str = "pdcache"
    namespace: str = ""

    def __post_init__(self) -> None:
        check_key_scheme(self.scheme)

    def keys(
        self,
        token_ids: Sequence[int] | np.ndarray,
        tenant: str = "",
        prior: bytes | None = None,
    ) -> tuple[list[bytes], bytes | None]:
        """(storage keys of every full page of `token_ids`, chain state after the last one).

        `prior`: the chain state after the page just before `token_ids` (None: from the start).
        """
        if self.scheme == "sglang":
            return self._sglang_keys(token_ids, tenant, prior)
        keys = chain_page_keys(token_ids, self.page_size, self._pdcache_salt(tenant), prior)
        return keys, keys[-1] if keys else prior

    def _pdcache_salt(self, tenant: str) -> bytes:
        salt = make_salt(self.fingerprint, tenant)
        if not self.namespace:
            return salt  # exactly the keys of nodes without a namespace
        namespace = self.namespace.encode()
        return salt + struct.pack("<I", len(namespace)) + namespace

    def _sglang_keys(
        self, token_ids: Sequence[int] | np.ndarray, tenant: str, prior: bytes | None
    ) -> tuple[list[bytes], bytes | None]:
        seed = prior if prior is not None else sglang_namespace_seed(tenant or None)
        hashes = chain_page_keys(token_ids, self.page_size, seed)
        salt = make_salt(self.fingerprint, self.namespace)
        return [_derive(salt, h) for h in hashes], hashes[-1] if hashes else prior
