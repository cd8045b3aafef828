"""The stored page object of docs/design.md §4.3: a fixed 128-byte header followed by the payload.

Header fields (little-endian): magic, format version, header size, page key, a digest of the
KV fingerprint, layer count, page size (tokens), dtype, origin (prefill | decode), payload
length, the payload checksum and its algorithm, and a CRC-32 of the header itself. Every
backend stores exactly `header || payload` per page and checks it with `verify_page` on read:
any mismatch is a miss, never wrong KV.

Payload checksum: XXH3-64 (package `xxhash`) when installed, else zlib CRC-32; the header names
the algorithm, so readers verify pages of either kind. Measured on 512 KiB pages here: XXH3
about 50 GB/s from cache, CRC-32 2-5 GB/s, i.e. as slow as the page-cache read it verifies,
which would halve storage read throughput. zlib's CRC-32 releases the GIL on large buffers;
python-xxhash's XXH3 holds it (about 10 us per 512 KiB page: two threads hashing take twice
as long as one, measured).

Authenticated pages (format version 2): with a page MAC key (`PageSpec.mac_key`, derived from the
cluster secret with `pdcache.utils.secret.derive_key(secret, "page-mac")`) every new page
carries a 32-byte keyed BLAKE3 MAC at header offset 88, over header bytes [0, 88) (every field
above, key and fingerprint included) followed by the payload; the header CRC covers the MAC
too. A reader with a key serves only version-2 pages whose MAC verifies: a version-1 page, or
a version-2 page with a forged or other-secret MAC, is `Verdict.BAD_MAC` (a counted miss)
whatever its checksum. A reader without a key ignores the MAC and checks pages of either
version by their checksum (today's behaviour, and what lets a forged page through). With a
key, a verified MAC stands in for the checksum pass (the checksum is still written, for
keyless readers, and computed on a failed MAC only, to count corruption apart from forgery).
Keyed BLAKE3 over HMAC-SHA256 by measurement on this CPU (docs/security.md, `pdcache bench
storage`): 2-6 GB/s against 0.6-1.7 GB/s on 8 KiB-2 MiB pages, single-threaded (blake3's
`max_threads` was slower on the two shared cores here).

Scatter/gather: a payload may be given as a list of buffers (the runs of a page that is not
contiguous in host memory, e.g. K and V in an SGLang host pool); the stored object and its
checksum are exactly those of the runs concatenated in order (checksums are computed
streaming, run by run), so readers cannot tell the difference.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MAGIC = b"PDKV"
FORMAT_VERSION = 1  # pages without a MAC
MAC_FORMAT_VERSION = 2  # pages with a keyed BLAKE3 MAC (module docstring)
FORMAT_VERSIONS = (FORMAT_VERSION, MAC_FORMAT_VERSION)
MAC_OFFSET = 88  # the MAC covers header bytes [0, MAC_OFFSET) and then the payload
MAC_BYTES = 32
HEADER_BYTES = 128
KEY_BYTES = 32
FINGERPRINT_DIGEST_BYTES = 16

# magic, version, header size, key, fingerprint digest, layers, page size, dtype, origin,
# checksum algorithm, payload length, payload checksum; zero padding; the last 4 bytes are the
# crc32 of all bytes before them, so no bit of the header goes unchecked.
_BODY = struct.Struct("<4sHH32s16sIIBBHQQ")
_HEADER_CRC_OFFSET = HEADER_BYTES - 4
assert _BODY.size <= MAC_OFFSET and MAC_OFFSET + MAC_BYTES <= _HEADER_CRC_OFFSET
_CRC = struct.Struct("<I")

ORIGINS: tuple[str, ...] = ("prefill", "decode")
DTYPE_CODES: dict[str, int] = {
    "uint8": 1,
    "float32": 2,
    "bfloat16": 3,
    "float16": 4,
    "float8_e4m3fn": 5,
    "float8_e5m2": 6,
    "int8": 7,
}


def _xxh3() -> Callable[..., int] | None:
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_64_intdigest


_CHECKSUM_FNS: dict[str, Callable[..., int] | None] = {"crc32": zlib.crc32, "xxh3": _xxh3()}
CHECKSUM_CODES: dict[str, int] = {"crc32": 0, "xxh3": 1}
_CHECKSUM_NAMES = {code: name for name, code in CHECKSUM_CODES.items()}


def resolve_checksum(name: str) -> str:
    """ "auto" -> the fastest available algorithm; an unavailable one is an error."""
    if name == "auto":
        return "xxh3" if _CHECKSUM_FNS["xxh3"] is not None else "crc32"
    if name not in CHECKSUM_CODES:
        raise ValueError(f"unknown checksum '{name}'; choose one of {sorted(CHECKSUM_CODES)}")
    if _CHECKSUM_FNS[name] is None:
        from pdcache.utils.registry import MissingDependencyError

        raise MissingDependencyError(f"page checksum '{name}'", "xxhash")
    return name


class Verdict(enum.Enum):
    """Outcome of verifying one stored page."""

    OK = "ok"
    EMPTY = "empty"  # no page here (zeroed or never written slot)
    TRUNCATED = "truncated"  # fewer bytes than header + payload
    CORRUPT = "corrupt"  # bad magic/version/header crc
    BAD_CHECKSUM = "bad_checksum"  # the payload does not match the header's checksum
    BAD_MAC = "bad_mac"  # no MAC, or one that does not verify under this store's key
    FOREIGN = "foreign"  # another fingerprint, shape or dtype
    WRONG_KEY = "wrong_key"  # a valid page of another key (a reused slot)


@dataclass(frozen=True)
class PageSpec:
    """What every page of one store must match: the KV fingerprint and the page shape."""

    fingerprint: str
    payload_bytes: int
    num_layers: int = 0
    page_size: int = 0
    dtype: str = "uint8"
    checksum: str = "auto"  # written into new pages; reads follow each page's header
    mac_key: bytes | None = field(default=None, repr=False)  # None: pages carry no MAC
    fingerprint_digest: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.payload_bytes <= 0:
            raise ValueError(f"payload_bytes must be > 0, got {self.payload_bytes}")
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"unknown dtype '{self.dtype}'; choose one of {sorted(DTYPE_CODES)}")
        digest = hashlib.blake2b(self.fingerprint.encode(), digest_size=16).digest()
        object.__setattr__(self, "fingerprint_digest", digest)
        object.__setattr__(self, "checksum", resolve_checksum(self.checksum))
        if self.mac_key is not None and len(self.mac_key) != MAC_BYTES:
            raise ValueError(f"mac_key must be {MAC_BYTES} bytes, got {len(self.mac_key)}")

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes


# A host page as backends accept it: one 1-D contiguous uint8 CPU tensor, or a tuple of them
# (its runs, scatter/gather: the payload is their concatenation, in order).
HostPage = torch.Tensor | tuple[torch.Tensor, ...]
# A payload as the functions below accept it: one buffer, or a list of runs.
Payload = memoryview | bytes | bytearray | list[memoryview]


def byte_view(page: torch.Tensor) -> memoryview:
    """A writable memoryview over a 1-D contiguous uint8 CPU tensor (no copy)."""
    if page.dtype != torch.uint8 or page.dim() != 1 or not page.is_contiguous():
        raise ValueError("host pages must be 1-D contiguous uint8 tensors")
    if page.device.type != "cpu":
        raise ValueError("host pages must live in CPU memory")
    return memoryview(page.numpy()).cast("B")


def payload_views(page: HostPage) -> list[memoryview]:
    """The buffers of a host page (one, or one per run), no copy."""
    if isinstance(page, tuple):
        return [byte_view(run) for run in page]
    return [byte_view(page)]


def host_page_nbytes(page: HostPage) -> int:
    if isinstance(page, tuple):
        return sum(run.numel() for run in page)
    return page.numel()


def payload_nbytes(payload: Payload) -> int:
    if isinstance(payload, list):
        return sum(len(part) for part in payload)
    return len(payload)


def payload_checksum(payload: Payload, algorithm: str = "crc32") -> int:
    """Checksum of the payload (of its runs concatenated, for a list)."""
    fn = _CHECKSUM_FNS[algorithm]
    if fn is None:
        raise ValueError(f"checksum '{algorithm}' is not available (pip install xxhash)")
    if not isinstance(payload, list):
        return fn(payload)
    if len(payload) == 1:
        return fn(payload[0])
    if algorithm == "crc32":
        crc = 0
        for part in payload:
            crc = zlib.crc32(part, crc)
        return crc
    import xxhash

    state = xxhash.xxh3_64()
    for part in payload:
        state.update(part)
    return state.intdigest()


def encode_header(spec: PageSpec, key: bytes, origin: str, payload: Payload) -> bytes:
    """The 128-byte header of `payload` stored under `key`."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"page keys are {KEY_BYTES} bytes, got {len(key)}")
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, got '{origin}'")
    if payload_nbytes(payload) != spec.payload_bytes:
        raise ValueError(
            f"payload is {payload_nbytes(payload)} bytes, the store expects {spec.payload_bytes}"
        )
    body = _BODY.pack(
        MAGIC,
        FORMAT_VERSION if spec.mac_key is None else MAC_FORMAT_VERSION,
        HEADER_BYTES,
        key,
        spec.fingerprint_digest,
        spec.num_layers,
        spec.page_size,
        DTYPE_CODES[spec.dtype],
        ORIGINS.index(origin),
        CHECKSUM_CODES[spec.checksum],
        spec.payload_bytes,
        payload_checksum(payload, spec.checksum),
    )
    body += bytes(MAC_OFFSET - len(body))
    if spec.mac_key is not None:
        body += page_mac(spec.mac_key, body, payload)
    body += bytes(_HEADER_CRC_OFFSET - len(body))
    return body + _CRC.pack(zlib.crc32(body))


def page_mac(mac_key: bytes, head: bytes, payload: Payload) -> bytes:
    """Keyed BLAKE3 of header bytes [0, MAC_OFFSET) followed by the payload (its runs, in
    order). blake3 releases the GIL on large buffers, so I/O threads hash in parallel."""
    import blake3  # a dependency of pdcache; only stores with a secret load it

    state = blake3.blake3(head[:MAC_OFFSET], key=mac_key)
    for part in payload if isinstance(payload, list) else [payload]:
        state.update(part)
    return state.digest()


@dataclass(frozen=True)
class HeaderInfo:
    key: bytes
    origin: str
    payload_bytes: int
    checksum: int
    algorithm: str
    version: int = FORMAT_VERSION
    head: bytes = b""  # the header's bytes (the MAC is verified over them and the payload)


def parse_header(spec: PageSpec, header: memoryview | bytes) -> tuple[Verdict, HeaderInfo | None]:
    """Check a header against `spec` without looking at the payload."""
    if len(header) < HEADER_BYTES:
        return Verdict.TRUNCATED, None
    head = bytes(header[:HEADER_BYTES])
    if head[:4] != MAGIC:
        return (Verdict.EMPTY if not any(head) else Verdict.CORRUPT), None
    body = head[:_HEADER_CRC_OFFSET]
    (stored_crc,) = _CRC.unpack_from(head, _HEADER_CRC_OFFSET)
    if zlib.crc32(body) != stored_crc:
        return Verdict.CORRUPT, None
    fields = _BODY.unpack_from(body)
    _, version, header_bytes, key, fp, layers, page_size, dtype, origin, algo, length, crc = fields
    if version not in FORMAT_VERSIONS or header_bytes != HEADER_BYTES or origin >= len(ORIGINS):
        return Verdict.CORRUPT, None
    algorithm = _CHECKSUM_NAMES.get(algo)
    if algorithm is None or _CHECKSUM_FNS[algorithm] is None:
        return Verdict.FOREIGN, None  # a page this process cannot verify
    shape = (layers, page_size, dtype, length)
    expected = (spec.num_layers, spec.page_size, DTYPE_CODES[spec.dtype], spec.payload_bytes)
    if fp != spec.fingerprint_digest or shape != expected:
        return Verdict.FOREIGN, None
    return Verdict.OK, HeaderInfo(key, ORIGINS[origin], length, crc, algorithm, version, head)


def stored_payload_bytes(header: memoryview | bytes) -> int | None:
    """The payload length a stored header claims (tools that walk raw stores, e.g. the chaos
    harness corrupting pages), or None when `header` does not start with the magic."""
    if len(header) < _BODY.size or bytes(header[:4]) != MAGIC:
        return None
    return int(_BODY.unpack_from(bytes(header[: _BODY.size]))[-2])


def verify_page(
    spec: PageSpec, key: bytes, header: memoryview | bytes, payload: Payload, nbytes: int
) -> tuple[Verdict, str | None]:
    """Verify a page read into (`header`, `payload`); `nbytes` is how many bytes were read.

    Returns the verdict and, when OK, the origin recorded in the header.
    """
    if nbytes <= 0:
        return Verdict.EMPTY, None
    verdict, info = parse_header(spec, header[: min(nbytes, HEADER_BYTES)])
    if info is None:
        return verdict, None
    if info.key != key:
        return Verdict.WRONG_KEY, None
    if nbytes < spec.object_bytes:
        return Verdict.TRUNCATED, None
    if spec.mac_key is not None:
        # A verified MAC covers the payload (and the checksum field), so the checksum pass is
        # skipped; only a failed MAC pays for it, to tell corruption from forgery.
        if _mac_ok(spec.mac_key, info, payload):
            return Verdict.OK, info.origin
        if payload_checksum(payload, info.algorithm) != info.checksum:
            return Verdict.BAD_CHECKSUM, None
        return Verdict.BAD_MAC, None
    if payload_checksum(payload, info.algorithm) != info.checksum:
        return Verdict.BAD_CHECKSUM, None
    return Verdict.OK, info.origin


def _mac_ok(mac_key: bytes, info: HeaderInfo, payload: Payload) -> bool:
    if info.version != MAC_FORMAT_VERSION:
        return False  # an unauthenticated page: anyone could have written it
    stored = info.head[MAC_OFFSET : MAC_OFFSET + MAC_BYTES]
    return hmac.compare_digest(page_mac(mac_key, info.head, payload), stored)


def encode_object(spec: PageSpec, key: bytes, origin: str, payload: Payload) -> bytes:
    """`header || payload` as one bytes object (tools and tests; backends avoid the copy)."""
    body = b"".join(payload) if isinstance(payload, list) else bytes(payload)
    return encode_header(spec, key, origin, payload) + body
