"""The stored state object (docs/design.md §4.3): one request's recurrent state at one token,
a fixed 256-byte header followed by the state snapshot's bytes.

A state checkpoint (`pdcache.engine.state_pool.StateSnapshot.data`: conv states, then SSM
states, of every linear-attention layer) is stored under its state key
(`pdcache.engine.page_keys.state_key`: chained to the key of the page it follows). The header
names what the bytes fit, so a reader never restores a state into a pool of another shape:

| bytes | field |
|---|---|
| 4, u16, u16 | magic `PDST`, format version (1: checksum; 2: sealed, GMAC), header size (256) |
| 32 | state key |
| 16 | fingerprint digest (BLAKE2b-128 of the KV fingerprint, as pages) |
| 16 | geometry digest (BLAKE2b-128 of `RecurrentStateGeometry.key()`) |
| u64, u64 | token position (the state is the one after this many tokens), payload length |
| u8, u8, u16 | origin (`prefill` / `decode`), checksum algorithm (as pages), zero |
| u64 | payload checksum, or the writer's key check for algorithm `none` (as pages) |
| [128, 164) | sealed objects: writer id, nonce, GMAC tag over bytes [0, 128) and the payload |
| last 4 | CRC-32 of all preceding header bytes |

The MAC is the page MAC (`page_format.PageSealer`, the same key from the cluster secret, its
per-writer subkeys and counter nonces); its covered prefix is 128 bytes here instead of 88, and
the magic differs, so a page object never verifies as a state object or back. Why a header of
its own rather than the page header: a state has a geometry and a token position where a page
has layers and a page size, and a state object of 73.7 MiB (Qwen3-Next) pays nothing for 128
more header bytes.

`verify_state` returns a `StateVerdict`; anything but OK is a miss, counted by its reason
(`rejected_{reason}_states`, stats.py), never a state restored from the wrong bytes: another
fingerprint (`foreign`), another geometry (`geometry`), another payload length (`length`),
another token position than the caller expects (`position`), a failed MAC (`mac`) or
checksum (`checksum`), a bad header (`header`), a short object (`truncated`), another key's
object (`wrong_key`), a sealed object read without the key (`needs_key`).
"""

from __future__ import annotations

import enum
import hashlib
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import torch

from pdcache.offload_manager.storage.page_format import (
    CHECKSUM_CODES,
    KEY_BYTES,
    MAC_FIELD_BYTES,
    MAC_KEY_BYTES,
    NO_CHECKSUM,
    ORIGINS,
    PageSealer,
    byte_view,
    payload_checksum,
    resolve_checksum,
)

STATE_MAGIC = b"PDST"
STATE_FORMAT_VERSION = 1  # a payload checksum, no MAC
STATE_MAC_FORMAT_VERSION = 2  # sealed: GMAC over header bytes [0, STATE_MAC_OFFSET) + payload
STATE_HEADER_BYTES = 256
STATE_MAC_OFFSET = 128
DIGEST_BYTES = 16

# magic, version, header size, key, fingerprint digest, geometry digest, tokens, payload
# length, origin, checksum algorithm, zero, payload checksum
_BODY = struct.Struct("<4sHH32s16s16sQQBBHQ")
_CRC_OFFSET = STATE_HEADER_BYTES - 4
assert _BODY.size <= STATE_MAC_OFFSET and STATE_MAC_OFFSET + MAC_FIELD_BYTES <= _CRC_OFFSET
_CRC = struct.Struct("<I")
_CHECKSUM_NAMES = {code: name for name, code in CHECKSUM_CODES.items()}

# What `put_state` takes: the snapshot's flat uint8 CPU tensor, or any bytes-like object.
StateBuffer = torch.Tensor | bytes | bytearray | memoryview


class StateVerdict(enum.Enum):
    """Outcome of verifying one stored state object (module docstring)."""

    OK = "ok"
    EMPTY = "empty"  # a zeroed header: nothing stored there
    TRUNCATED = "truncated"
    CORRUPT = "header"  # bad magic, version, header size or header CRC
    BAD_CHECKSUM = "checksum"
    BAD_MAC = "mac"
    NEEDS_KEY = "needs_key"
    WRONG_KEY = "wrong_key"
    FOREIGN = "foreign"  # another KV fingerprint (model, TP shard, ...)
    GEOMETRY = "geometry"  # another state geometry
    LENGTH = "length"  # another payload length than this store's states
    POSITION = "position"  # another token position than the reader expects


# the reason label of each refusal: counter `rejected_{label}_states`
STATE_REJECT_REASONS: Mapping[StateVerdict, str] = MappingProxyType(
    {v: v.value for v in StateVerdict if v is not StateVerdict.OK})


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()


@dataclass(frozen=True)
class StateSpec:
    """What every state object of one store must match: the KV fingerprint (as pages), the
    state geometry (`RecurrentStateGeometry.key()`) and its byte size (`state_bytes()`)."""

    fingerprint: str
    geometry: str
    state_bytes: int
    checksum: str = "auto"  # as PageSpec: "none" with a mac_key, else xxh3 (crc32)
    mac_key: bytes | None = field(default=None, repr=False)
    fingerprint_digest: bytes = field(init=False, repr=False)
    geometry_digest: bytes = field(init=False, repr=False)
    sealer: PageSealer | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.state_bytes <= 0:
            raise ValueError(f"state_bytes must be > 0, got {self.state_bytes}")
        if not self.geometry:
            raise ValueError("a state spec needs the state geometry's key")
        if self.mac_key is not None and len(self.mac_key) != MAC_KEY_BYTES:
            raise ValueError(f"mac_key must be {MAC_KEY_BYTES} bytes, got {len(self.mac_key)}")
        sealed = self.mac_key is not None
        object.__setattr__(self, "checksum", resolve_checksum(self.checksum, sealed))
        object.__setattr__(self, "fingerprint_digest", _digest(self.fingerprint))
        object.__setattr__(self, "geometry_digest", _digest(self.geometry))
        sealer = PageSealer(self.mac_key) if self.mac_key is not None else None
        object.__setattr__(self, "sealer", sealer)

    @property
    def object_bytes(self) -> int:
        return STATE_HEADER_BYTES + self.state_bytes


def state_view(state: StateBuffer) -> memoryview:
    """A byte view of a state buffer (no copy): a 1-D contiguous uint8 CPU tensor (a snapshot,
    a host state slot) or a bytes-like object. ValueError for anything else."""
    if isinstance(state, torch.Tensor):
        return byte_view(state)
    return memoryview(state).cast("B")


def check_state(spec: StateSpec, state: memoryview) -> None:
    """ValueError unless `state` is one state of this store (a caller's bug, not a miss)."""
    if len(state) != spec.state_bytes:
        raise ValueError(f"state of {len(state)} bytes, this store's states are "
                         f"{spec.state_bytes} bytes ({spec.geometry})")


def encode_state_header(spec: StateSpec, key: bytes, tokens: int, origin: str,
                        payload: memoryview) -> bytes:
    """The 256-byte header of `payload`, the state after `tokens` tokens, stored under `key`."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"state keys are {KEY_BYTES} bytes, got {len(key)}")
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, got '{origin}'")
    if tokens < 0:
        raise ValueError(f"a state's token position is >= 0, got {tokens}")
    check_state(spec, payload)
    sealer = spec.sealer
    if spec.checksum == NO_CHECKSUM:
        assert sealer is not None  # resolve_checksum allows "none" only with a key
        checksum = sealer.key_check()
    else:
        checksum = payload_checksum(payload, spec.checksum)
    body = _BODY.pack(
        STATE_MAGIC, STATE_FORMAT_VERSION if sealer is None else STATE_MAC_FORMAT_VERSION,
        STATE_HEADER_BYTES, key, spec.fingerprint_digest, spec.geometry_digest, tokens,
        spec.state_bytes, ORIGINS.index(origin), CHECKSUM_CODES[spec.checksum], 0, checksum,
    )
    body += bytes(STATE_MAC_OFFSET - len(body))
    if sealer is not None:
        body += sealer.seal(body, payload, STATE_MAC_OFFSET)
    body += bytes(_CRC_OFFSET - len(body))
    return body + _CRC.pack(zlib.crc32(body))


class StateHeader(NamedTuple):
    """A parsed state header."""

    key: bytes
    tokens: int
    origin: str
    payload_bytes: int
    checksum: int
    algorithm: str
    version: int
    head: bytes  # the header's bytes (the MAC covers its first STATE_MAC_OFFSET)


def parse_state_header(spec: StateSpec, header: memoryview | bytes
                       ) -> tuple[StateVerdict, StateHeader | None]:
    """Check a header against `spec` without the payload: its integrity, then what it fits."""
    if len(header) < STATE_HEADER_BYTES:
        return StateVerdict.TRUNCATED, None
    head = bytes(header[:STATE_HEADER_BYTES])
    if head[:4] != STATE_MAGIC:
        return (StateVerdict.CORRUPT if any(head) else StateVerdict.EMPTY), None
    (stored_crc,) = _CRC.unpack_from(head, _CRC_OFFSET)
    if zlib.crc32(head[:_CRC_OFFSET]) != stored_crc:
        return StateVerdict.CORRUPT, None
    (_, version, header_bytes, key, fp, geometry, tokens, length, origin, algo, _,
     checksum) = _BODY.unpack_from(head)
    versions = (STATE_FORMAT_VERSION, STATE_MAC_FORMAT_VERSION)
    algorithm = _CHECKSUM_NAMES.get(algo)
    if (version not in versions or header_bytes != STATE_HEADER_BYTES
            or origin >= len(ORIGINS) or algorithm is None):
        return StateVerdict.CORRUPT, None
    if algorithm == NO_CHECKSUM and version != STATE_MAC_FORMAT_VERSION:
        return StateVerdict.CORRUPT, None  # only a sealed object may go without a checksum
    if fp != spec.fingerprint_digest:
        return StateVerdict.FOREIGN, None
    if geometry != spec.geometry_digest:
        return StateVerdict.GEOMETRY, None
    if length != spec.state_bytes:
        return StateVerdict.LENGTH, None
    if algorithm == NO_CHECKSUM and spec.sealer is None:
        return StateVerdict.NEEDS_KEY, None
    return StateVerdict.OK, StateHeader(key, tokens, ORIGINS[origin], length, checksum,
                                        algorithm, version, head)


def verify_state(spec: StateSpec, key: bytes, header: memoryview | bytes, payload: memoryview,
                 nbytes: int, tokens: int | None = None) -> tuple[StateVerdict, str | None]:
    """Verify a state object read into (`header`, `payload`); `nbytes`: how many bytes of the
    object were read; `tokens`: the position the reader expects (None: any). Returns the
    verdict and, when OK, the origin its writer recorded."""
    if nbytes <= 0:
        return StateVerdict.EMPTY, None
    verdict, info = parse_state_header(spec, header[: min(nbytes, STATE_HEADER_BYTES)])
    if info is None:
        return verdict, None
    if info.key != key:
        return StateVerdict.WRONG_KEY, None
    if tokens is not None and info.tokens != tokens:
        return StateVerdict.POSITION, None
    if nbytes < spec.object_bytes:
        return StateVerdict.TRUNCATED, None
    verdict = _verify_payload(spec, info, payload)
    return verdict, (info.origin if verdict is StateVerdict.OK else None)


def _verify_payload(spec: StateSpec, info: StateHeader, payload: memoryview) -> StateVerdict:
    """The MAC (a keyed reader: a verified MAC stands in for the checksum, as for pages) or
    the checksum; a failed MAC is corruption when the object carries this key's key check or a
    checksum that fails too, a forgery (or another secret) otherwise."""
    sealer = spec.sealer
    if sealer is None:
        ok = payload_checksum(payload, info.algorithm) == info.checksum
        return StateVerdict.OK if ok else StateVerdict.BAD_CHECKSUM
    if (info.version == STATE_MAC_FORMAT_VERSION
            and sealer.verify(info.head, payload, STATE_MAC_OFFSET)):
        return StateVerdict.OK
    if info.algorithm == NO_CHECKSUM:
        writer = sealer.writer_of(info.head, STATE_MAC_OFFSET)
        corrupt = info.checksum == sealer.key_check(writer)
    else:
        corrupt = payload_checksum(payload, info.algorithm) != info.checksum
    return StateVerdict.BAD_CHECKSUM if corrupt else StateVerdict.BAD_MAC


def encode_state_object(spec: StateSpec, key: bytes, tokens: int, origin: str,
                        state: StateBuffer) -> bytes:
    """`header || payload` as one bytes object (tools, tests, copying backends)."""
    payload = state_view(state)
    return encode_state_header(spec, key, tokens, origin, payload) + bytes(payload)


def decode_state_object(spec: StateSpec, key: bytes, blob: bytes | memoryview,
                        tokens: int | None = None) -> tuple[StateVerdict, str | None]:
    """`verify_state` of a whole stored object held in memory (copying backends, tools)."""
    view = memoryview(blob)
    if len(view) > spec.object_bytes:  # longer than its header can claim: not ours
        return StateVerdict.LENGTH, None
    payload = view[STATE_HEADER_BYTES:]
    padded = payload if len(payload) == spec.state_bytes else memoryview(
        bytes(payload) + bytes(spec.state_bytes - len(payload)))
    return verify_state(spec, key, view[:STATE_HEADER_BYTES], padded, len(view), tokens)
