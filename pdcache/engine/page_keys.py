"""Chained page keys shared by every node, backend, router and benchmark (DESIGN.md §4.2).

`h_0 = SHA256(salt || tokens_0)`, `h_i = SHA256(h_{i-1} || tokens_i)`, tokens as little-endian
uint32. Only full pages get keys. The salt binds a key to the KV fingerprint (model, dtype,
page size, layout, TP shard) and to the tenant namespace, so foreign pages never match.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

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
