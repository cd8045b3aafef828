"""Typed control-plane messages, msgpack-encoded, with strict decoding.

Wire format (protocol version 1): one ZMQ frame holding a msgpack map
`{"v": 1, "t": "<type>", <field>: <value>, ...}`. Decoding rejects — with a `MessageError`
whose `kind` names the cause — anything oversized, not msgpack, not a map, of another
version, of an unknown type, with missing or extra fields, or with a field of the wrong type
or out of range. Nothing here touches sockets or state; it is pure and thread-safe.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
MAX_ROOM_ID = (1 << 63) - 1
MAX_STATS_ITEMS = 256
MAX_STATS_DEPTH = 3
_INT64_MAX = (1 << 63) - 1


class MessageError(ValueError):
    """A control message was rejected. `kind` is one of REJECT_KINDS (used as a counter key)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


REJECT_KINDS = ("oversized", "malformed", "version", "unknown_type", "bad_field")


@dataclass(frozen=True)
class Message:
    """Base of all control messages; `TYPE` is the wire tag."""

    TYPE: ClassVar[str] = ""


@dataclass(frozen=True)
class Register(Message):
    """Decode → prefill, once per prefill peer: where and how to write into decode's pool.

    The page of layer l, K/V k, page p lives at base_addr + ((l*2+k)*num_pages + p)*page_bytes.
    `session` is the engine's address of decode's endpoint (opaque to the control plane).
    """

    TYPE: ClassVar[str] = "register"
    decode_id: str
    engine: str
    session: bytes
    base_addr: int
    num_layers: int
    num_pages: int
    page_bytes: int


@dataclass(frozen=True)
class RegisterAck(Message):
    """Prefill → decode: registration accepted (`error` empty) or refused (`error` says why)."""

    TYPE: ClassVar[str] = "register_ack"
    prefill_id: str
    error: str


@dataclass(frozen=True)
class RoomRequest(Message):
    """Decode → prefill, per room: destination pages (int32 little-endian) for `num_tokens`."""

    TYPE: ClassVar[str] = "room_request"
    room: int
    dst_pages: bytes
    num_tokens: int

    def page_ids(self) -> np.ndarray:
        return np.frombuffer(self.dst_pages, dtype="<i4").astype(np.int64)


@dataclass(frozen=True)
class Started(Message):
    """Prefill → decode: the engine began writing this room's KV."""

    TYPE: ClassVar[str] = "started"
    room: int


@dataclass(frozen=True)
class Done(Message):
    """Prefill → decode: all KV of the room has landed; first token and cache statistics."""

    TYPE: ClassVar[str] = "done"
    room: int
    first_token: int
    nbytes: int
    stats: dict = field(default_factory=dict)


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


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Register, RegisterAck, RoomRequest, Started, Done, Abort, AbortAck, Ping, Pong)
}
_FIELDS: dict[str, dict[str, type]] = {
    name: typing.get_type_hints(cls) for name, cls in MESSAGE_TYPES.items()
}
for _hints in _FIELDS.values():
    _hints.pop("TYPE", None)


def encode(msg: Message) -> bytes:
    """Serialise `msg` (version and type tag included)."""
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": msg.TYPE}
    body.update(dataclasses.asdict(msg))
    return msgpack.packb(body, use_bin_type=True)


def decode(raw: bytes | memoryview, max_bytes: int) -> Message:
    """Parse one frame into its typed message or raise MessageError (never anything else)."""
    if len(raw) > max_bytes:
        raise MessageError("oversized", f"{len(raw)} bytes > limit {max_bytes}")
    body = _unpack(raw, max_bytes)
    if not isinstance(body, dict):
        raise MessageError("malformed", f"top level is {type(body).__name__}, not a map")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise MessageError("version", f"version {version!r}, expected {PROTOCOL_VERSION}")
    type_tag = body.pop("t", None)
    cls = MESSAGE_TYPES.get(type_tag) if isinstance(type_tag, str) else None
    if cls is None:
        raise MessageError("unknown_type", f"message type {type_tag!r}")
    _check_fields(type_tag, body)
    msg = cls(**body)
    _check_ranges(msg)
    return msg


def _unpack(raw: bytes | memoryview, max_bytes: int) -> Any:
    try:
        return msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True,
            max_bin_len=max_bytes, max_str_len=max_bytes,
            max_array_len=MAX_STATS_ITEMS, max_map_len=MAX_STATS_ITEMS,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise MessageError("malformed", f"not a msgpack document ({exc})") from None


def _check_fields(type_tag: str, body: dict[str, Any]) -> None:
    expected = _FIELDS[type_tag]
    missing = [name for name in expected if name not in body]
    extra = [name for name in body if name not in expected]
    if missing or extra:
        raise MessageError("bad_field", f"{type_tag}: missing {missing}, unexpected {extra}")
    for name, kind in expected.items():
        if not _is_instance(body[name], kind):
            got = type(body[name]).__name__
            raise MessageError("bad_field", f"{type_tag}.{name}: expected {kind.__name__}, got {got}")


def _is_instance(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _check_ranges(msg: Message) -> None:
    for name, value in dataclasses.asdict(msg).items():
        if isinstance(value, int) and not isinstance(value, bool):
            low = -1 if name == "first_token" else 0
            if not low <= value <= _INT64_MAX:
                raise MessageError("bad_field", f"{msg.TYPE}.{name}={value} out of range")
    if isinstance(msg, RoomRequest):
        _check_pages(msg)
    if isinstance(msg, Done):
        _check_plain(msg.stats, depth=0)


def _check_pages(msg: RoomRequest) -> None:
    if len(msg.dst_pages) % 4:
        raise MessageError("bad_field", f"room_request.dst_pages: {len(msg.dst_pages)} bytes")
    if len(msg.dst_pages) == 0 or msg.num_tokens == 0:
        raise MessageError("bad_field", "room_request: no pages or no tokens")
    if msg.page_ids().min() < 0:
        raise MessageError("bad_field", "room_request.dst_pages: negative page id")


def _check_plain(obj: Any, depth: int) -> None:
    """Statistics are JSON-like: str keys, scalar leaves, bounded nesting."""
    if depth > MAX_STATS_DEPTH:
        raise MessageError("bad_field", "done.stats nested too deeply")
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str):
                raise MessageError("bad_field", f"done.stats key {key!r} is not a string")
            _check_plain(value, depth + 1)
    elif isinstance(obj, list):
        for value in obj:
            _check_plain(value, depth + 1)
    elif not (obj is None or isinstance(obj, (bool, int, float, str))):
        raise MessageError("bad_field", f"done.stats value of type {type(obj).__name__}")


def check_stats(stats: Any) -> None:
    """ValueError unless `stats` can travel in `Done` (str keys, JSON-like bounded values)."""
    if not isinstance(stats, dict):
        raise ValueError(f"stats must be a dict, got {type(stats).__name__}")
    try:
        _check_plain(stats, depth=0)
    except MessageError as err:
        raise ValueError(err.detail) from None


def pack_pages(page_ids: np.ndarray | list[int]) -> bytes:
    """Page ids as the int32 little-endian bytes RoomRequest carries."""
    arr = np.asarray(page_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("page ids must fit in int32 and be >= 0")
    return arr.astype("<i4").tobytes()
