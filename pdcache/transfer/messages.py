"""Typed control-plane messages, msgpack-encoded, with strict decoding.

Wire format (protocol version 4): one ZMQ frame holding a msgpack map
`{"v": 4, "t": "<type>", <field>: <value>, ...}`; a field whose type is a dataclass (`Done`'s
`PrefillReport` and its `CachedTokens`) is a nested map of exactly its fields. Decoding
rejects — with a `MessageError` whose `kind` names the cause — anything oversized, not
msgpack, not a map, of another version, of an unknown type, with missing or extra fields (at
any depth), or with a field of the wrong type or out of range. Nothing here touches sockets
or state; it is pure and thread-safe.

Version 2 replaced version 1's free-form `done.stats` map and `done.first_token` with the
typed `done.report`. Version 3 added `report.first_logprob` and `report.input_logprobs`
(the first token's logprob and the prompt logprobs, packed by `pack_logprobs`). Version 4
added `register_ack.boot_id`, the prefill sender's random per-boot id, which an authenticated
decode binds every later frame to (docs/security.md), and two decode → prefill messages,
`pages_pending` and `pages_settled` (the durable next turn, docs/design.md §4.10). Versions 2
and 3 are still accepted (the fields they lack take their defaults: no logprobs, no boot id;
the two new types are refused in them); an authenticated control plane needs version 4 on
both sides, since its MAC contexts include the boot id.

Version 5 (the pull of pending pages, docs/design.md §4.10) added `pages_pending.eta_ms` and
`pages_pending.pull` (decode's expected time until the batch's write lands, and whether decode
serves `pull_pages` for it) and two messages: `pull_pages` (prefill → decode) and
`pages_pulled` (decode → prefill, the stored page objects). A frame is written in the lowest
version >= 4 that has its type and its non-default fields (`wire_version`), without the
fields later versions added (`encode`: a decoder refuses fields it does not know), so a
version-4 peer still reads every frame but the new ones (and a `pages_pending` that offers a
pull, which a decode does only with a cluster secret).

Version 6 (decode's prefix cache, docs/design.md §4.12) added `room_request.first_page`: the
prompt's pages before it are in decode's cache, and prefill writes only the pages from it on.
A request without reuse is still a version-4 frame; one with it needs a version-6 prefill
(an older one drops the frame, of a version it does not know, and the room fails at its
timeout): keep decode's prefix cache off while a cluster upgrades.

Version 7 (KV geometries, `pdcache.engine.kv_geometry`) added `register.num_slabs` (slabs per
layer of decode's pool: 2 for K and V, 1 for an MLA latent) and `register.kv_geometry` (the KV
fingerprint of decode's pages). A version-7 decode always sends the fingerprint, so its
Register needs a version-7 prefill: upgrade prefill nodes before decode nodes. A version-7
prefill still accepts older Registers (two slabs, no fingerprint to compare).

Version 8 (hybrid models' recurrent state, docs/design.md §4.5) added `register.state_base` /
`register.state_area_bytes` (decode's registered host state area; 0: none),
`room_request.state_offset` / `.state_bytes` / `.state_geometry` (where in that area the
room's state goes, its length and its `RecurrentStateGeometry.key()`; 0 bytes: no state
wanted) and `report.state_bytes` / `report.state_geometry` (the state prefill wrote with the
pages). A decode without a state area still writes version-7 Registers and version-4 room
requests; one with a state area needs a version-8 prefill (an older one drops its Register,
and `connect` times out). A version-8 prefill refuses (`state_mismatch`) a room whose two
sides disagree on the state: one without a state request when its model has a state (every
older decode), a geometry key or length other than its own.

Version 9 (window pages of sliding-window models, docs/design.md §4.14) added
`register.window_base` / `.window_num_layers` / `.window_num_pages` (decode keeps its sliding
layers' pages in a pool of their own: `base_addr` then holds the full layers only and
`kv_geometry` still names the model's geometry; 0: one pool) and `room_request.window_pages`
/ `.window_first_page` (the sliding pages of the prompt's window tail, its pages from
`window_first_page` to its last: prefill writes the full layers of every page and the
sliding layers of those only). A decode with a window pool needs a version-9 prefill.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import msgpack
import numpy as np

from pdcache.engine.api import CachedTokens, LogprobRequest, TokenLogprob

PROTOCOL_VERSION = 9
ACCEPTED_VERSIONS = (2, 3, 4, 5, 6, 7, 8, 9)
BASE_WIRE_VERSION = 4  # the lowest version a frame is written in (`wire_version`)
MAX_ROOM_ID = (1 << 63) - 1
MAX_CONTAINER_ITEMS = 256  # entries of any msgpack array or map
_INT64_MAX = (1 << 63) - 1
PAGE_KEY_BYTES = 32  # a stored page's key (SHA-256, docs/design.md §4.2)
MAX_KEYS_PER_MESSAGE = 4096  # pages_pending / pages_settled: 128 KiB of keys at most


class MessageError(ValueError):
    """A control message was rejected. `kind` is one of REJECT_KINDS (used as a counter key)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


REJECT_KINDS = ("oversized", "malformed", "version", "unknown_type", "bad_field",
                "unauthenticated", "stale", "replayed",  # these three: control.parse
                "stale_boot")  # a genuine decode frame for another prefill boot (control.py)


@dataclass(frozen=True)
class Message:
    """Base of all control messages; `TYPE` is the wire tag."""

    TYPE: ClassVar[str] = ""


@dataclass(frozen=True)
class Register(Message):
    """Decode → prefill, once per prefill peer: where and how to write into decode's pool.

    The page of layer l, slab k, page p lives at
    base_addr + ((l*num_slabs + k)*num_pages + p)*page_bytes (`page_bytes`: one slab's page).
    `session` is the engine's address of decode's endpoint (opaque to the control plane).
    Since version 7, `num_slabs` (2: K and V; 1: an MLA latent) and `kv_geometry`, the KV
    fingerprint of decode's pages (empty from older peers): prefill refuses a peer whose pages
    are of another geometry even where the byte counts happen to agree. Since version 8,
    `state_base` / `state_area_bytes`: decode's registered host area for recurrent states
    (`transfer.state_area.StateArea`; 0: none), where room requests point their state.
    """

    TYPE: ClassVar[str] = "register"
    decode_id: str
    engine: str
    session: bytes
    base_addr: int
    num_layers: int
    num_pages: int
    page_bytes: int
    num_slabs: int = 2  # since version 7
    kv_geometry: str = ""  # since version 7
    state_base: int = 0  # since version 8
    state_area_bytes: int = 0  # since version 8
    window_base: int = 0  # since version 9: decode's sliding layers' own pool (0: none)
    window_num_layers: int = 0  # since version 9
    window_num_pages: int = 0  # since version 9


@dataclass(frozen=True)
class RegisterAck(Message):
    """Prefill → decode: registration accepted (`error` empty) or refused (`error` says why)."""

    TYPE: ClassVar[str] = "register_ack"
    prefill_id: str
    error: str
    boot_id: bytes = b""  # since version 4: the sender's random per-boot id


@dataclass(frozen=True)
class RoomRequest(Message):
    """Decode → prefill, per room: destination pages (int32 little-endian) for `num_tokens`.
    Since version 6, `first_page`: decode holds the prompt's pages before it already (its
    prefix cache), so `dst_pages` receive the prompt's pages `first_page`, `first_page + 1`,
    ... (prefill writes only those). Since version 8, `state_bytes` > 0 asks for the request's
    recurrent state too: `state_bytes` bytes of geometry `state_geometry` (its
    `RecurrentStateGeometry.key()`) at `state_offset` in decode's registered state area."""

    TYPE: ClassVar[str] = "room_request"
    room: int
    dst_pages: bytes
    num_tokens: int
    first_page: int = 0  # since version 6
    state_offset: int = 0  # since version 8
    state_bytes: int = 0  # since version 8; 0: no state wanted
    state_geometry: str = ""  # since version 8
    window_pages: bytes = b""  # since version 9: the window tail's sliding pages (int32)
    window_first_page: int = 0  # since version 9: the prompt page the first of them holds

    def page_ids(self) -> np.ndarray:
        return np.frombuffer(self.dst_pages, dtype="<i4").astype(np.int64)

    def window_page_ids(self) -> np.ndarray:
        return np.frombuffer(self.window_pages, dtype="<i4").astype(np.int64)


@dataclass(frozen=True)
class Started(Message):
    """Prefill → decode: the engine began writing this room's KV."""

    TYPE: ClassVar[str] = "started"
    room: int


@dataclass(frozen=True)
class PrefillReport:
    """What the prefill node reports with `done`: the first token it sampled and how the
    prompt was served there (the decode node's response `meta` and metrics use these).

    `cached` splits the reused prompt tokens by tier; `computed_tokens` ran through prefill's
    forward; `prefill_node` names the node. `first_token` -1 means "none" (transfer tests).
    With logprobs asked for, `first_logprob` packs the first token's `TokenLogprob` and
    `input_logprobs` the prompt's (`pack_logprobs`; empty bytes: none), read back with
    `first_token_logprob()` / `prompt_logprobs()`. `state_bytes` / `state_geometry`: the
    recurrent state the sender wrote with the pages (0 / "": none); the sender sets them."""

    first_token: int
    prompt_tokens: int = 0
    computed_tokens: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)
    prefill_node: str = ""
    first_logprob: bytes = b""  # since version 3
    input_logprobs: bytes = b""  # since version 3
    state_bytes: int = 0  # since version 8
    state_geometry: str = ""  # since version 8

    def first_token_logprob(self) -> TokenLogprob | None:
        entries = unpack_logprobs(self.first_logprob)
        return entries[0] if entries else None

    def prompt_logprobs(self) -> list[TokenLogprob] | None:
        return unpack_logprobs(self.input_logprobs)


@dataclass(frozen=True)
class Done(Message):
    """Prefill → decode: all KV of the room has landed (`nbytes` of it); prefill's report."""

    TYPE: ClassVar[str] = "done"
    room: int
    nbytes: int
    report: PrefillReport


@dataclass(frozen=True)
class Abort(Message):
    """Either way: the room failed; the sender of this message no longer touches its pages."""

    TYPE: ClassVar[str] = "abort"
    room: int
    reason: str
    code: str = "aborted"  # one of rooms.FAILURE_CODES


@dataclass(frozen=True)
class AbortAck(Message):
    """Prefill → decode: the aborted room's pages will not be written any more."""

    TYPE: ClassVar[str] = "abort_ack"
    room: int


@dataclass(frozen=True)
class Ping(Message):
    TYPE: ClassVar[str] = "ping"
    seq: int


@dataclass(frozen=True)
class Pong(Message):
    TYPE: ClassVar[str] = "pong"
    seq: int


@dataclass(frozen=True)
class PagesPending(Message):
    """Decode → every registered prefill peer (since version 4): decode's offload has
    scheduled these stored-page keys (`PAGE_KEY_BYTES` each, concatenated) for a storage
    write; a prefill may wait for them instead of recomputing. The mark is void after
    `ttl_ms` unless `pages_settled` comes first."""

    TYPE: ClassVar[str] = "pages_pending"
    keys: bytes
    ttl_ms: int
    # since version 5: decode's expected time until this batch's write lands (its writer's
    # queue ahead of it plus itself, times its mean measured write latency; 0 = unknown), and
    # 1 when decode serves `pull_pages` for these keys while they are in its host staging
    eta_ms: int = 0
    pull: int = 0

    def key_list(self) -> list[bytes]:
        return split_keys(self.keys)


@dataclass(frozen=True)
class PagesSettled(Message):
    """Decode → every registered prefill peer (since version 4): the write of these keys
    ended; `landed[i]` is 1 when key i is committed in storage (readable now), 0 when it will
    not come (dropped under backpressure, or the write failed)."""

    TYPE: ClassVar[str] = "pages_settled"
    keys: bytes
    landed: bytes

    def key_list(self) -> list[bytes]:
        return split_keys(self.keys)

    def landed_list(self) -> list[bool]:
        return [bool(b) for b in self.landed]


@dataclass(frozen=True)
class PullPages(Message):
    """Prefill → decode (since version 5): send me the stored page objects of these keys
    (`PAGE_KEY_BYTES` each) from your host staging, while their storage write has not landed.
    Answered by one or more `pages_pulled` with the same `pull_id`."""

    TYPE: ClassVar[str] = "pull_pages"
    pull_id: int
    keys: bytes
    # how long the prefill waits for the answer (ms, >= 1): decode drops a pull it could not
    # start serving in time (the prefill has fallen back to the wait by then)
    ttl_ms: int = 1000

    def key_list(self) -> list[bytes]:
        return split_keys(self.keys)


@dataclass(frozen=True)
class PagesPulled(Message):
    """Decode → prefill (since version 5): part of the answer to `pull_pages` `pull_id`. For
    key i, `found[i]` is 1 when its page object (the storage format of page_format.py: header
    and payload, MAC'd with the page key when one is configured) is in `objects`, 0 when decode
    no longer (or never) had it staged. `objects` holds the found pages' objects, in key
    order, each `object_bytes` long. The prefill verifies each as it would a storage read."""

    TYPE: ClassVar[str] = "pages_pulled"
    pull_id: int
    keys: bytes
    found: bytes
    object_bytes: int
    objects: bytes

    def key_list(self) -> list[bytes]:
        return split_keys(self.keys)

    def found_list(self) -> list[bool]:
        return [bool(b) for b in self.found]


PULLED_OVERHEAD_BYTES = 1024  # a pages_pulled frame besides its keys and objects (+ auth)


def pack_keys(keys: list[bytes]) -> bytes:
    """Page keys as the bytes `pages_pending` / `pages_settled` carry."""
    if any(len(key) != PAGE_KEY_BYTES for key in keys):
        raise ValueError(f"page keys must be {PAGE_KEY_BYTES} bytes")
    return b"".join(keys)


def split_keys(raw: bytes) -> list[bytes]:
    return [raw[i : i + PAGE_KEY_BYTES] for i in range(0, len(raw), PAGE_KEY_BYTES)]


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Register, RegisterAck, RoomRequest, Started, Done, Abort, AbortAck, Ping, Pong,
                PagesPending, PagesSettled, PullPages, PagesPulled)
}
_NESTED: tuple[type, ...] = (PrefillReport, CachedTokens)  # dataclasses allowed as fields
# fields an older sender does not send, by the version that added them: their defaults apply
_ADDED_IN: Mapping[int, Mapping[type, frozenset[str]]] = MappingProxyType({
    3: MappingProxyType({PrefillReport: frozenset({"first_logprob", "input_logprobs"})}),
    4: MappingProxyType({RegisterAck: frozenset({"boot_id"})}),
    5: MappingProxyType({PagesPending: frozenset({"eta_ms", "pull"})}),
    6: MappingProxyType({RoomRequest: frozenset({"first_page"})}),
    7: MappingProxyType({Register: frozenset({"num_slabs", "kv_geometry"})}),
    8: MappingProxyType({
        Register: frozenset({"state_base", "state_area_bytes"}),
        RoomRequest: frozenset({"state_offset", "state_bytes", "state_geometry"}),
        PrefillReport: frozenset({"state_bytes", "state_geometry"})}),
    9: MappingProxyType({
        Register: frozenset({"window_base", "window_num_layers", "window_num_pages"}),
        RoomRequest: frozenset({"window_pages", "window_first_page"})}),
})
# message types by the version that added them (older versions refuse them)
_TYPE_SINCE: Mapping[type, int] = MappingProxyType({
    PagesPending: 4, PagesSettled: 4, PullPages: 5, PagesPulled: 5})
_LOGPROB_HEADER = np.dtype("<i4")


# what a Done message holds besides its packed logprobs, with room to spare (msgpack framing,
# the report's numbers, the first token's logprob, the auth trailer)
DONE_OVERHEAD_BYTES = 4096


def prompt_logprobs_bytes(num_positions: int, top_n: int, num_token_ids: int) -> int:
    """The size `pack_logprobs` gives `num_positions` prompt entries, each with `top_n` top and
    `num_token_ids` selected pairs: 12 bytes per entry (id, logprob, two lengths) plus 8 per
    pair, and the 12-byte header. Exact for full rows (rows are padded to the widths)."""
    if num_positions <= 0:
        return 0
    return 12 + num_positions * (12 + 8 * (max(top_n, 0) + max(num_token_ids, 0)))


def prompt_logprobs_too_large(
    prompt_len: int, request: LogprobRequest | None, max_message_bytes: int
) -> str:
    """Why the prompt logprobs `request` asks of a `prompt_len`-token prompt cannot ride a
    Done message within `max_message_bytes` ("" when they fit or none are asked for)."""
    if request is None or request.input_start is None:
        return ""
    size = prompt_logprobs_bytes(prompt_len - request.input_start, request.top_n,
                                 len(request.token_ids))
    if size + DONE_OVERHEAD_BYTES <= max_message_bytes:
        return ""
    return (f"the prompt logprobs asked for take about {size} bytes, over the "
            f"{max_message_bytes}-byte limit of the P/D message that carries them: raise "
            "logprob_start_len or lower top_logprobs_num / token_ids_logprob")


def pack_logprobs(entries: list[TokenLogprob] | None) -> bytes:
    """`entries` as bytes: an int32 header (count, top width, selected width), then per entry
    int32 token id, float32 logprob (NaN: None), int16 top / selected lengths, and the top and
    selected (id, logprob) pairs padded to the widths. b"" for None. Logprobs are float32
    values (the sampler's), so the round trip is exact."""
    if entries is None:
        return b""
    count = len(entries)
    top_width = max((len(e.top) for e in entries), default=0)
    sel_width = max((len(e.selected) for e in entries), default=0)
    header = np.array([count, top_width, sel_width], dtype=_LOGPROB_HEADER)
    ids = np.array([e.token_id for e in entries], dtype="<i4")
    values = np.array([np.nan if e.logprob is None else e.logprob for e in entries], "<f4")
    lengths = np.array([[len(e.top), len(e.selected)] for e in entries], "<i2").reshape(count, 2)
    parts = [header.tobytes(), ids.tobytes(), values.tobytes(), lengths.tobytes()]
    for width, pick in ((top_width, "top"), (sel_width, "selected")):
        pair_ids = np.zeros((count, width), "<i4")
        pair_values = np.zeros((count, width), "<f4")
        for row, entry in enumerate(entries):
            pairs = getattr(entry, pick)
            for col, (token, logprob) in enumerate(pairs):
                pair_ids[row, col], pair_values[row, col] = token, logprob
        parts += [pair_ids.tobytes(), pair_values.tobytes()]
    return b"".join(parts)


def unpack_logprobs(raw: bytes) -> list[TokenLogprob] | None:
    """The inverse of `pack_logprobs`; MessageError("bad_field") for bytes it did not write."""
    if not raw:
        return None
    try:
        return _unpack_logprobs(memoryview(raw))
    except (ValueError, IndexError) as exc:
        raise MessageError("bad_field", f"report logprobs: {exc}") from None


def _unpack_logprobs(raw: memoryview) -> list[TokenLogprob]:
    count, top_width, sel_width = (int(v) for v in np.frombuffer(raw[:12], _LOGPROB_HEADER))
    if min(count, top_width, sel_width) < 0:
        raise ValueError("negative size")
    expected = 12 + count * (4 + 4 + 4) + count * 8 * (top_width + sel_width)
    if len(raw) != expected:
        raise ValueError(f"{len(raw)} bytes, the header says {expected}")
    offset = 12

    def take(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        nonlocal offset
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        array = np.frombuffer(raw[offset : offset + size], dtype).reshape(shape)
        offset += size
        return array

    ids, values = take("<i4", (count,)), take("<f4", (count,))
    lengths = take("<i2", (count, 2))
    top_ids, top_values = take("<i4", (count, top_width)), take("<f4", (count, top_width))
    sel_ids, sel_values = take("<i4", (count, sel_width)), take("<f4", (count, sel_width))
    if (lengths < 0).any() or (lengths[:, 0] > top_width).any() or (
            lengths[:, 1] > sel_width).any():
        raise ValueError("pair counts beyond the widths")
    entries = []
    for row in range(count):
        num_top, num_sel = int(lengths[row, 0]), int(lengths[row, 1])
        value = float(values[row])
        entries.append(TokenLogprob(
            int(ids[row]),
            None if np.isnan(value) else value,
            tuple(zip(top_ids[row, :num_top].tolist(), top_values[row, :num_top].tolist())),
            tuple(zip(sel_ids[row, :num_sel].tolist(), sel_values[row, :num_sel].tolist())),
        ))
    return entries


def _hints(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    hints.pop("TYPE", None)
    return hints


_FIELDS: dict[type, dict[str, type]] = {
    cls: _hints(cls) for cls in (*MESSAGE_TYPES.values(), *_NESTED)
}


def wire_version(msg: Message) -> int:
    """The lowest version (>= BASE_WIRE_VERSION) that has `msg`'s type and every field of it
    (nested ones too: `done.report`) that is not at its default: older peers read what they
    can."""
    return max(BASE_WIRE_VERSION, _TYPE_SINCE.get(type(msg), 0), _fields_version(msg))


def _fields_version(obj: Any) -> int:
    """The newest version that added a field of `obj` (or of a nested dataclass) that is not
    at its default; 0 when none is."""
    version = 0
    for added_in, added in _ADDED_IN.items():
        for name in added.get(type(obj), ()):
            if getattr(obj, name) != _FIELD_DEFAULTS[type(obj)][name]:
                version = max(version, added_in)
    for item in dataclasses.fields(obj):
        value = getattr(obj, item.name)
        if isinstance(value, _NESTED):
            version = max(version, _fields_version(value))
    return version


_FIELD_DEFAULTS: dict[type, dict[str, Any]] = {
    cls: {f.name: f.default for f in dataclasses.fields(cls)}
    for cls in (*MESSAGE_TYPES.values(), *_NESTED)
}


def encode(msg: Message) -> bytes:
    """Serialise `msg` in its `wire_version` (version and type tag included): the fields a
    later version added are left out, at any depth, so a peer of that version, which refuses
    unknown fields, reads the frame."""
    version = wire_version(msg)
    body: dict[str, Any] = {"v": version, "t": msg.TYPE}
    body.update(_body_for(msg, version))
    return msgpack.packb(body, use_bin_type=True)


def _body_for(obj: Any, version: int) -> dict[str, Any]:
    """`obj`'s fields as a map without those a version after `version` added (they are at
    their defaults, `wire_version`: the peer assumes them); nested dataclasses likewise."""
    body = {}
    for item in dataclasses.fields(obj):
        value = getattr(obj, item.name)
        body[item.name] = _body_for(value, version) if isinstance(value, _NESTED) else value
    for added_in, added in _ADDED_IN.items():
        if added_in > version:
            for name in added.get(type(obj), ()):
                body.pop(name, None)
    return body


def decode(raw: bytes | memoryview, max_bytes: int) -> Message:
    """Parse one frame into its typed message or raise MessageError (never anything else)."""
    if len(raw) > max_bytes:
        raise MessageError("oversized", f"{len(raw)} bytes > limit {max_bytes}")
    body = _unpack(raw, max_bytes)
    if not isinstance(body, dict):
        raise MessageError("malformed", f"top level is {type(body).__name__}, not a map")
    version = body.pop("v", None)
    if isinstance(version, bool) or version not in ACCEPTED_VERSIONS:
        raise MessageError("version", f"version {version!r}, expected one of "
                                      f"{ACCEPTED_VERSIONS}")
    type_tag = body.pop("t", None)
    cls = MESSAGE_TYPES.get(type_tag) if isinstance(type_tag, str) else None
    if cls is None or version < _TYPE_SINCE.get(cls, 0):
        raise MessageError("unknown_type", f"message type {type_tag!r} (version {version})")
    msg = _build(cls, body, type_tag, version)
    if isinstance(msg, Done):  # the packed logprobs must be ones pack_logprobs wrote
        unpack_logprobs(msg.report.first_logprob)
        unpack_logprobs(msg.report.input_logprobs)
    _check_ranges(msg)
    return msg


def _unpack(raw: bytes | memoryview, max_bytes: int) -> Any:
    try:
        return msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True,
            max_bin_len=max_bytes, max_str_len=max_bytes,
            max_array_len=MAX_CONTAINER_ITEMS, max_map_len=MAX_CONTAINER_ITEMS,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise MessageError("malformed", f"not a msgpack document ({exc})") from None


def _build(cls: type, body: dict[str, Any], where: str, version: int) -> Any:
    """`cls(**body)` once `body` has exactly `cls`'s fields, each of its type (nested
    dataclass fields are maps, built the same way); an older version's body may lack the
    fields later versions added."""
    expected = dict(_FIELDS[cls])
    for added_in, added in _ADDED_IN.items():
        if version < added_in:
            for name in added.get(cls, ()):
                if name not in body:
                    expected.pop(name)
    missing = [name for name in expected if name not in body]
    extra = [name for name in body if name not in expected]
    if missing or extra:
        raise MessageError("bad_field", f"{where}: missing {missing}, unexpected {extra}")
    values: dict[str, Any] = {}
    for name, kind in expected.items():
        value = body[name]
        if kind in _NESTED and isinstance(value, dict):
            value = _build(kind, value, f"{where}.{name}", version)
        elif not _is_instance(value, kind):
            got = type(value).__name__
            raise MessageError("bad_field", f"{where}.{name}: expected {kind.__name__}, got {got}")
        values[name] = value
    return cls(**values)


def _is_instance(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _check_ranges(msg: Message) -> None:
    _check_ints(dataclasses.asdict(msg), msg.TYPE)
    if isinstance(msg, RoomRequest):
        _check_pages(msg)
        _check_state_fields(msg.state_bytes, msg.state_geometry, "room_request")
        if not msg.state_bytes and msg.state_offset:
            raise MessageError("bad_field", "room_request.state_offset without a state")
    if isinstance(msg, Register) and (msg.state_base == 0) != (msg.state_area_bytes == 0):
        raise MessageError("bad_field", "register: a state area needs its address and size")
    if isinstance(msg, Register) and len({msg.window_base == 0, msg.window_num_layers == 0,
                                          msg.window_num_pages == 0}) > 1:
        raise MessageError("bad_field", "register: a window pool needs its address, layers "
                                        "and pages")
    if isinstance(msg, Done):
        _check_state_fields(msg.report.state_bytes, msg.report.state_geometry, "done.report")
    if isinstance(msg, PagesPending | PagesSettled | PullPages | PagesPulled):
        _check_keys(msg)
    if isinstance(msg, PagesPulled):
        _check_pulled(msg)


def _check_state_fields(state_bytes: int, state_geometry: str, where: str) -> None:
    """A state is announced by both its length and its geometry key, or by neither."""
    if (state_bytes == 0) != (state_geometry == ""):
        raise MessageError("bad_field", f"{where}: state_bytes={state_bytes} with state "
                                        f"geometry {state_geometry!r}")


def _check_pulled(msg: PagesPulled) -> None:
    count = len(msg.keys) // PAGE_KEY_BYTES
    if len(msg.found) != count or any(b > 1 for b in msg.found):
        raise MessageError("bad_field", "pages_pulled.found: one 0/1 byte per key expected")
    found = sum(msg.found)
    if (found and msg.object_bytes == 0) or len(msg.objects) != found * msg.object_bytes:
        raise MessageError("bad_field", f"pages_pulled.objects: {len(msg.objects)} bytes for "
                                        f"{found} pages of {msg.object_bytes}")


def _check_keys(msg: PagesPending | PagesSettled | PullPages | PagesPulled) -> None:
    count, rest = divmod(len(msg.keys), PAGE_KEY_BYTES)
    if rest or not 0 < count <= MAX_KEYS_PER_MESSAGE:
        raise MessageError("bad_field", f"{msg.TYPE}.keys: {len(msg.keys)} bytes")
    if isinstance(msg, PagesPending | PullPages) and msg.ttl_ms == 0:
        raise MessageError("bad_field", f"{msg.TYPE}.ttl_ms: 0")
    if isinstance(msg, PagesPending) and msg.pull > 1:
        raise MessageError("bad_field", f"pages_pending.pull: {msg.pull}, expected 0 or 1")
    if isinstance(msg, PagesSettled) and (
            len(msg.landed) != count or any(b > 1 for b in msg.landed)):
        raise MessageError("bad_field", "pages_settled.landed: one 0/1 byte per key expected")


def _check_ints(fields: dict[str, Any], where: str) -> None:
    """Every integer (nested ones too) is a non-negative int64; `first_token` may be -1."""
    for name, value in fields.items():
        if isinstance(value, dict):
            _check_ints(value, f"{where}.{name}")
        elif isinstance(value, int) and not isinstance(value, bool):
            low = -1 if name == "first_token" else 0
            if not low <= value <= _INT64_MAX:
                raise MessageError("bad_field", f"{where}.{name}={value} out of range")


def _check_pages(msg: RoomRequest) -> None:
    if len(msg.dst_pages) % 4:
        raise MessageError("bad_field", f"room_request.dst_pages: {len(msg.dst_pages)} bytes")
    if len(msg.dst_pages) == 0 or msg.num_tokens == 0:
        raise MessageError("bad_field", "room_request: no pages or no tokens")
    if msg.page_ids().min() < 0:
        raise MessageError("bad_field", "room_request.dst_pages: negative page id")
    if len(msg.window_pages) % 4:
        raise MessageError("bad_field",
                           f"room_request.window_pages: {len(msg.window_pages)} bytes")
    if msg.window_pages and msg.window_page_ids().min() < 0:
        raise MessageError("bad_field", "room_request.window_pages: negative page id")
    if not msg.window_pages and msg.window_first_page:
        raise MessageError("bad_field", "room_request.window_first_page without window pages")


def check_report(report: Any) -> None:
    """ValueError unless `report` is a PrefillReport that `decode` would accept."""
    if not isinstance(report, PrefillReport) or not isinstance(report.cached, CachedTokens):
        raise ValueError(f"the report must be a PrefillReport, got {type(report).__name__}")
    body = dataclasses.asdict(report)
    try:
        _build(PrefillReport, body, "done.report", PROTOCOL_VERSION)
        _check_ints(body, "done.report")
        _check_state_fields(report.state_bytes, report.state_geometry, "done.report")
        unpack_logprobs(report.first_logprob)
        unpack_logprobs(report.input_logprobs)
    except MessageError as err:
        raise ValueError(err.detail) from None


def pack_pages(page_ids: np.ndarray | list[int]) -> bytes:
    """Page ids as the int32 little-endian bytes RoomRequest carries."""
    arr = np.asarray(page_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("page ids must fit in int32 and be >= 0")
    return arr.astype("<i4").tobytes()
