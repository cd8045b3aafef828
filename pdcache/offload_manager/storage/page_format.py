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

Authenticated pages (format version 3): with a page MAC key (`PageSpec.mac_key`, derived from the
cluster secret with `pdcache.utils.secret.derive_key(secret, "page-mac")`) every new page
carries a GMAC (AES-256-GCM used as a MAC, package `cryptography`) in header bytes [88, 124):
the writer's 8-byte id, a 12-byte nonce and the 16-byte tag over the payload (associated data)
and header bytes [0, 88) (every field above, key and fingerprint included); the header CRC
covers it too. Each writer (`PageSealer`, one per `PageSpec`) draws a random id and seals under
its own subkey, keyed BLAKE3 of (key, id), with a counter nonce, so no nonce repeats under one
AES key: GCM's one catastrophic misuse is ruled out by construction, not by a birthday bound.
A reader with a key serves only version-3 pages whose MAC verifies: a version-1 page, a
version-2 page (the keyed BLAKE3 MAC of an earlier release), or a version-3 page with a forged or
other-secret MAC, is `Verdict.BAD_MAC` (a counted miss) whatever its checksum. A reader without
a key ignores the MAC and checks pages of any version by their checksum (what lets a forged page
through), and refuses sealed pages that carry none (below). With a key, a verified MAC stands in for the checksum pass.

Sealed pages carry no payload checksum by default (checksum algorithm "none", `checksum =
"auto"` with a key): the MAC already covers every byte, and the xxh3 pass nearly doubled a
sealing writer's CPU on host pages not in cache (52-56 vs 30-31 us per 512 KiB page, the step
table of `pdcache bench storage`). The checksum field then holds the writer's key check
(`PageSealer.key_check`: keyed BLAKE3 of the writer id, cached per writer), covered by the MAC
and the header CRC, so a failed MAC is still labelled: the key check matches (the page was
sealed under this key and altered since) -> `BAD_CHECKSUM`, corruption; it does not (another
secret, a forger without the key, no MAC) -> `BAD_MAC`. What is given up: a reader without the
key cannot check such a page (`NEEDS_KEY`, a counted miss, logged once per store), nor can a
keyed reader of a release before algorithm "none" (it refuses the unknown algorithm, a miss,
and overwrites the page); `checksum = "xxh3"` with a key keeps the checksum in sealed pages for
such readers (mixed deployments, rolling upgrades: docs/security.md). As before, a forger who
controls the bytes also controls the label (copying a genuine key check makes a forgery read
as corruption, as a wrong checksum did): either way it is a miss, never served.

GMAC over keyed BLAKE3 by measurement on this CPU (VAES/VPCLMULQDQ, `pdcache bench storage`):
about 22 GB/s against 6.4 GB/s on 512 KiB-2 MiB pages, single-threaded, and it
releases the GIL; HMAC-SHA256 runs at 0.6-1.7 GB/s and AES-GCM-SIV at 1 GB/s in OpenSSL 4.

Scatter/gather: a payload may be given as a list of buffers (the runs of a page that is not
contiguous in host memory, e.g. K and V in an SGLang host pool); the stored object and its
checksum are exactly those of the runs concatenated in order (checksums are computed
streaming, run by run), so readers cannot tell the difference.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

MAGIC = b"PDKV"
FORMAT_VERSION = 1  # pages without a MAC
BLAKE3_MAC_FORMAT_VERSION = 2  # an earlier release's keyed BLAKE3 MAC: never verified now
MAC_FORMAT_VERSION = 3  # pages with a GMAC (module docstring)
FORMAT_VERSIONS = (FORMAT_VERSION, BLAKE3_MAC_FORMAT_VERSION, MAC_FORMAT_VERSION)
MAC_OFFSET = 88  # the MAC covers header bytes [0, MAC_OFFSET) and the payload
MAC_KEY_BYTES = 32
WRITER_ID_BYTES, NONCE_BYTES, TAG_BYTES = 8, 12, 16
MAC_FIELD_BYTES = WRITER_ID_BYTES + NONCE_BYTES + TAG_BYTES  # [88, 124): id, nonce, tag
HEADER_BYTES = 128
KEY_BYTES = 32
FINGERPRINT_DIGEST_BYTES = 16

# magic, version, header size, key, fingerprint digest, layers, page size, dtype, origin,
# checksum algorithm, payload length, payload checksum; zero padding; the last 4 bytes are the
# crc32 of all bytes before them, so no bit of the header goes unchecked.
_BODY = struct.Struct("<4sHH32s16sIIBBHQQ")
_HEADER_CRC_OFFSET = HEADER_BYTES - 4
assert _BODY.size <= MAC_OFFSET and MAC_OFFSET + MAC_FIELD_BYTES <= _HEADER_CRC_OFFSET
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
# "none": a sealed (version-3) page without a payload checksum; its checksum field holds the
# writer's key check instead (PageSealer.key_check): the MAC alone covers the payload.
NO_CHECKSUM = "none"
CHECKSUM_CODES: dict[str, int] = {"crc32": 0, "xxh3": 1, NO_CHECKSUM: 2}
_CHECKSUM_NAMES = {code: name for name, code in CHECKSUM_CODES.items()}


def resolve_checksum(name: str, sealed: bool = False) -> str:
    """ "auto" -> "none" for sealed pages (the MAC covers the payload), else the fastest
    available algorithm; an unavailable one is an error, and so is "none" without a MAC."""
    if name == "auto":
        if sealed:
            return NO_CHECKSUM
        return "xxh3" if _CHECKSUM_FNS["xxh3"] is not None else "crc32"
    if name == NO_CHECKSUM:
        if not sealed:
            raise ValueError(
                "checksum 'none' needs a page MAC key: a page without a MAC must carry a checksum"
            )
        return name
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
    # a sealed page without a payload checksum (algorithm "none"), read by a reader without
    # the page MAC key: nothing it can check the page with (this node lacks the secret)
    NEEDS_KEY = "needs_key"
    WRONG_KEY = "wrong_key"  # a valid page of another key (a reused slot)


@dataclass(frozen=True)
class PageSpec:
    """What every page of one store must match: the KV fingerprint and the page shape."""

    fingerprint: str
    payload_bytes: int
    num_layers: int = 0
    page_size: int = 0
    dtype: str = "uint8"
    # written into new pages; reads follow each page's header. "auto": xxh3 (crc32 without
    # xxhash), or "none" with a mac_key (module docstring); "xxh3" with a mac_key keeps a
    # checksum in sealed pages, for readers without the key
    checksum: str = "auto"
    mac_key: bytes | None = field(default=None, repr=False)  # None: pages carry no MAC
    fingerprint_digest: bytes = field(init=False, repr=False)
    # (layers, page size, dtype code, payload bytes) as a header stores them, for parse_header
    header_shape: tuple[int, int, int, int] = field(init=False, repr=False, compare=False)
    sealer: PageSealer | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.payload_bytes <= 0:
            raise ValueError(f"payload_bytes must be > 0, got {self.payload_bytes}")
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"unknown dtype '{self.dtype}'; choose one of {sorted(DTYPE_CODES)}")
        digest = hashlib.blake2b(self.fingerprint.encode(), digest_size=16).digest()
        object.__setattr__(self, "fingerprint_digest", digest)
        object.__setattr__(self, "header_shape", (self.num_layers, self.page_size,
                                                  DTYPE_CODES[self.dtype], self.payload_bytes))
        sealed = self.mac_key is not None
        object.__setattr__(self, "checksum", resolve_checksum(self.checksum, sealed))
        if self.mac_key is not None and len(self.mac_key) != MAC_KEY_BYTES:
            raise ValueError(f"mac_key must be {MAC_KEY_BYTES} bytes, got {len(self.mac_key)}")
        sealer = PageSealer(self.mac_key) if self.mac_key is not None else None
        object.__setattr__(self, "sealer", sealer)

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes


# A host page as backends accept it: one 1-D contiguous uint8 CPU tensor, or a tuple of them
# (its runs, scatter/gather: the payload is their concatenation, in order).
HostPage = torch.Tensor | tuple[torch.Tensor, ...]
# A payload as the functions below accept it: one buffer, or a list of runs.
Payload = memoryview | bytes | bytearray | list[memoryview]


def byte_view(page: torch.Tensor) -> memoryview:
    """A writable memoryview over a 1-D contiguous uint8 CPU tensor (no copy). Checked on the
    numpy view (a per-page hot path: ~1.2 us against ~1.9 us for the torch attribute checks)."""
    if page.dtype is not torch.uint8 or page.dim() != 1:
        raise ValueError("host pages must be 1-D contiguous uint8 tensors")
    try:
        array = page.numpy()
    except (TypeError, RuntimeError) as exc:  # a CUDA/meta tensor, or one needing grad
        raise ValueError("host pages must live in CPU memory") from exc
    if not array.flags.c_contiguous:
        raise ValueError("host pages must be 1-D contiguous uint8 tensors")
    return memoryview(array)


def payload_views(page: HostPage) -> list[memoryview]:
    """The buffers of a host page (one, or one per run), no copy."""
    if isinstance(page, tuple):
        return [byte_view(run) for run in page]
    return [byte_view(page)]


def host_page_nbytes(page: HostPage) -> int:
    if isinstance(page, tuple):
        return sum(run.numel() for run in page)
    return page.numel()


def check_host_batch(spec: PageSpec, keys: Sequence[bytes], pages: Sequence[HostPage]) -> None:
    """ValueError unless there is one host page per key, each of the store's payload size: a
    backend checks a whole batch before any I/O, so a bad page never leaves half a batch (or
    half a pipelined group) done."""
    if len(keys) != len(pages):
        raise ValueError(f"{len(keys)} keys but {len(pages)} host pages")
    for page in pages:
        if host_page_nbytes(page) != spec.payload_bytes:
            raise ValueError(
                f"host page of {host_page_nbytes(page)} bytes, store pages are "
                f"{spec.payload_bytes} bytes"
            )


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
        _checksum_field(spec, payload),
    )
    body += bytes(MAC_OFFSET - len(body))
    if spec.sealer is not None:
        body += spec.sealer.seal(body, payload)
    body += bytes(_HEADER_CRC_OFFSET - len(body))
    return body + _CRC.pack(zlib.crc32(body))


def _checksum_field(spec: PageSpec, payload: Payload) -> int:
    if spec.checksum == NO_CHECKSUM:
        assert spec.sealer is not None  # resolve_checksum allows "none" only with a key
        return spec.sealer.key_check()
    return payload_checksum(payload, spec.checksum)


class PageSealer:
    """Computes and checks page MACs under one key: GMAC, i.e. AES-256-GCM with the payload as
    associated data and header bytes [0, MAC_OFFSET) as the (discarded) plaintext.

    Owns this writer's random id, its subkey (keyed BLAKE3 of key and id) and nonce counter, and
    a bounded cache of other writers' ciphers and key checks for verifying; one lock guards the
    counter and the cache, never a MAC computation (OpenSSL releases the GIL, so I/O threads MAC in
    parallel). Thread-safe.
    """

    CACHED_WRITERS = 256  # verifying ciphers kept; a page of an unseen writer derives anew

    def __init__(self, mac_key: bytes) -> None:
        self._mac_key = mac_key
        self._writer_id = secrets.token_bytes(WRITER_ID_BYTES)
        self._next_nonce = int.from_bytes(secrets.token_bytes(NONCE_BYTES), "little")
        self._lock = threading.Lock()
        self._ciphers: dict[bytes, tuple[bytes, Any, int]] = {}
        self._own = self._cipher(self._writer_id)

    def key_check(self, writer_id: bytes | None = None) -> int:
        """A 64-bit value that only this key gives for `writer_id` (default: this writer's):
        keyed BLAKE3 of the id, apart from the subkey. A sealed page without a checksum stores
        it in the checksum field, so a reader whose MAC check fails can tell a page sealed
        under its own key and altered since (corruption) from one sealed under another key
        or none (forgery, another secret). Costs nothing per page: cached per writer."""
        if writer_id is None or writer_id == self._writer_id:
            return self._own[2]  # never evicted: held apart from the cache
        return self._cipher(writer_id)[2]

    def seal(self, head: bytes, payload: Payload, mac_offset: int = MAC_OFFSET) -> bytes:
        """The MAC field (writer id, nonce, tag) for header bytes `head[:mac_offset]` + payload.
        `mac_offset`: where the covered header bytes end and the MAC field starts (pages:
        `MAC_OFFSET`; state objects, state_format.py, have a longer header)."""
        with self._lock:
            counter = self._next_nonce
            self._next_nonce = (counter + 1) % (1 << (8 * NONCE_BYTES))
        nonce = counter.to_bytes(NONCE_BYTES, "little")
        return self._writer_id + nonce + self._tag(self._own, nonce, head[:mac_offset], payload)

    @staticmethod
    def writer_of(head: bytes, mac_offset: int = MAC_OFFSET) -> bytes:
        """The writer id stored in a sealed header."""
        return head[mac_offset : mac_offset + WRITER_ID_BYTES]

    def verify(self, head: bytes, payload: Payload, mac_offset: int = MAC_OFFSET) -> bool:
        """Whether the MAC field stored in `head` (at `mac_offset`) is this key's MAC of
        `head[:mac_offset]` + payload."""
        field_bytes = head[mac_offset : mac_offset + MAC_FIELD_BYTES]
        writer_id = field_bytes[:WRITER_ID_BYTES]
        nonce = field_bytes[WRITER_ID_BYTES : WRITER_ID_BYTES + NONCE_BYTES]
        stored_tag = field_bytes[WRITER_ID_BYTES + NONCE_BYTES :]
        tag = self._tag(self._cipher(writer_id), nonce, head[:mac_offset], payload)
        return hmac.compare_digest(tag, stored_tag)

    def _cipher(self, writer_id: bytes) -> tuple[bytes, Any, int]:
        with self._lock:
            cipher = self._ciphers.get(writer_id)
        if cipher is not None:
            return cipher
        import blake3  # dependencies of pdcache; only stores with a secret load them
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        subkey = blake3.blake3(b"pdcache page writer " + writer_id, key=self._mac_key).digest()
        check = blake3.blake3(b"pdcache page key check " + writer_id, key=self._mac_key)
        cipher = (subkey, AESGCM(subkey), int.from_bytes(check.digest(8), "little"))
        with self._lock:
            if len(self._ciphers) >= self.CACHED_WRITERS:
                self._ciphers.pop(next(iter(self._ciphers)))  # oldest first: ids are random
            self._ciphers[writer_id] = cipher
        return cipher

    @staticmethod
    def _tag(cipher: tuple[bytes, Any, int], nonce: bytes, covered: bytes,
             payload: Payload) -> bytes:
        subkey, aead, _ = cipher
        if not isinstance(payload, list) or len(payload) == 1:
            data = payload[0] if isinstance(payload, list) else payload
            return aead.encrypt(nonce, covered, data)[-TAG_BYTES:]
        return _streamed_tag(subkey, nonce, covered, payload)


def _streamed_tag(subkey: bytes, nonce: bytes, covered: bytes, runs: list[memoryview]) -> bytes:
    """The same tag as `AESGCM(subkey).encrypt(nonce, covered, b"".join(runs))`, without the
    join: the runs are fed to GCM's associated data one by one (GHASH continues across calls)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    encryptor = Cipher(algorithms.AES(subkey), modes.GCM(nonce)).encryptor()
    for run in runs:
        encryptor.authenticate_additional_data(run)
    encryptor.update(covered)
    encryptor.finalize()
    return encryptor.tag


class HeaderInfo(NamedTuple):
    """A parsed header (a tuple: built once per page read, cheaper than a frozen dataclass;
    with the precomputed `PageSpec.header_shape`, parse_header went from 4.4 to 1.5 us)."""

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
    if algorithm == NO_CHECKSUM:
        if version != MAC_FORMAT_VERSION:
            return Verdict.CORRUPT, None  # only a sealed page may go without a checksum
        if spec.sealer is None:
            return Verdict.NEEDS_KEY, None  # nothing this keyless reader can check it with
    elif algorithm is None or _CHECKSUM_FNS[algorithm] is None:
        return Verdict.FOREIGN, None  # a page this process cannot verify
    if fp != spec.fingerprint_digest or (layers, page_size, dtype, length) != spec.header_shape:
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
    if spec.sealer is not None:
        # A verified MAC covers the payload (and the checksum field), so the checksum pass is
        # skipped; only a failed MAC pays for it, to tell corruption from forgery.
        sealer = spec.sealer
        if info.version == MAC_FORMAT_VERSION and sealer.verify(info.head, payload):
            return Verdict.OK, info.origin
        if info.algorithm == NO_CHECKSUM:  # sealed under this key (key check) and altered since?
            corrupt = info.checksum == sealer.key_check(sealer.writer_of(info.head))
        else:
            corrupt = payload_checksum(payload, info.algorithm) != info.checksum
        return (Verdict.BAD_CHECKSUM if corrupt else Verdict.BAD_MAC), None
    if payload_checksum(payload, info.algorithm) != info.checksum:
        return Verdict.BAD_CHECKSUM, None
    return Verdict.OK, info.origin


def encode_object(spec: PageSpec, key: bytes, origin: str, payload: Payload) -> bytes:
    """`header || payload` as one bytes object (tools and tests; backends avoid the copy)."""
    body = b"".join(payload) if isinstance(payload, list) else bytes(payload)
    return encode_header(spec, key, origin, payload) + body
