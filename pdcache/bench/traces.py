"""Multi-turn traces, normalised: sessions of turns whose inputs are hash-id blocks.

Every supported format is parsed into one `Trace`:

* a `Session` is an ordered list of `Turn`s (a single-request session when the format has no
  conversation structure, e.g. Mooncake);
* a `Turn`'s input is one or more runs of *blocks* (`Blocks`: ids, where equal ids mean
  equal token blocks of `block_size` tokens, see `pdcache.bench.tokens`, and a token count
  that trims the run's last block);
* `with_history=True` means the turn's prompt is the session's previous prompt + the ids the
  server generated for it + this turn's blocks (token-exact replay of a conversation);
  `with_history=False` means the blocks are the whole prompt (Mooncake, Bailian rows already
  cover their full context);
* timing: `arrival_s` (seconds from trace start) for turns that start on the clock,
  `delay_s` (think time after the previous turn of the session completes) for dependent turns.

Formats (sent as docs/design.md §4.1 `/generate` requests): `mooncake` JSONL, `bailian` JSONL, `sharegpt` JSON,
`sessions` JSONL (Mooncake rows with `session_id`/`delay`, history accumulated), and the
`synthetic` agentic generator.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

MOONCAKE_BLOCK = 512
BAILIAN_BLOCK = 16


@dataclass(frozen=True)
class Blocks:
    """`num_tokens` tokens made of the blocks `ids` (the last one trimmed if partial)."""

    ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class Turn:
    """One request of a trace, before token expansion."""

    request_id: str
    session_id: str
    turn: int  # 0-based position in its session
    inputs: tuple[Blocks, ...]  # new input (with_history) or the whole prompt, in order
    output_len: int
    arrival_s: float = 0.0  # trace clock: when the turn arrives (first / independent turns)
    delay_s: float = 0.0  # think time after the parent completes (dependent turns)
    parent_id: str | None = None
    with_history: bool = False

    @property
    def input_len(self) -> int:
        return sum(b.num_tokens for b in self.inputs)

    @property
    def dependent(self) -> bool:
        """Whether this turn can only be sent after its parent completed."""
        return self.with_history and self.parent_id is not None


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]

    @property
    def start_s(self) -> float:
        return self.turns[0].arrival_s


@dataclass(frozen=True)
class Trace:
    """A whole trace: sessions sorted by start time, and the block size of its ids."""

    name: str
    block_size: int
    sessions: tuple[Session, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def turns(self) -> Iterator[Turn]:
        for session in self.sessions:
            yield from session.turns

    @property
    def multi_turn(self) -> bool:
        return any(len(s.turns) > 1 for s in self.sessions)


def blocks_for(length: int, block_size: int) -> int:
    return max(1, math.ceil(length / block_size)) if length > 0 else 0


class BlockIdAllocator:
    """Fresh block ids for inputs given only as token counts; never collides with `reserved`."""

    def __init__(self, start: int = 0) -> None:
        self.next_id = start

    def take(self, num_tokens: int, block_size: int) -> Blocks:
        count = blocks_for(num_tokens, block_size)
        ids = tuple(range(self.next_id, self.next_id + count))
        self.next_id += count
        return Blocks(ids, num_tokens)


def _sorted_sessions(sessions: Iterable[Session]) -> tuple[Session, ...]:
    """By start time; ties keep the file's order (a stable sort: the session ids broke them
    as strings, "r10" before "r9", and --max-requests then kept r10 over r9)."""
    return tuple(sorted(sessions, key=lambda s: s.start_s))


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from exc


def _first(row: dict[str, Any], names: tuple[str, ...], where: str) -> Any:
    for name in names:
        if name in row:
            return row[name]
    raise ValueError(f"{where}: missing field {names[0]!r}")


def _trace_blocks(hash_ids: list[int], input_len: int, block_size: int) -> Blocks:
    return Blocks(tuple(hash_ids[: blocks_for(input_len, block_size)]), input_len)


def _check_blocks(hash_ids: list[int], input_len: int, block_size: int, where: str) -> None:
    if len(hash_ids) * block_size < input_len:
        raise ValueError(
            f"{where}: {len(hash_ids)} blocks of {block_size} cover fewer than "
            f"input_length={input_len} tokens"
        )


# ---------------------------------------------------------------------------------------------
# Mooncake FAST'25 JSONL: {"timestamp" ms, "input_length", "output_length", "hash_ids"}


def parse_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK) -> Trace:
    """Each row is a self-contained request (no session id): one single-turn session each."""
    path = Path(path)
    sessions = []
    for i, row in enumerate(_read_jsonl(path)):
        where = f"{path}:row {i}"
        try:
            turn = _mooncake_turn(row, i, block_size, where)
        except (TypeError, AttributeError) as exc:  # a null or a wrong type: name the row
            raise ValueError(f"{where}: {exc}") from None
        sessions.append(Session(turn.session_id, (turn,)))
    return Trace("mooncake", block_size, _sorted_sessions(sessions), {"path": str(path)})


def _mooncake_turn(row: dict[str, Any], i: int, block_size: int, where: str) -> Turn:
    input_len = int(_first(row, ("input_length", "input_tokens"), where))
    hash_ids = [int(h) for h in row.get("hash_ids", [])]
    _check_blocks(hash_ids, input_len, block_size, where)
    ts_ms = float(_first(row, ("timestamp", "created_time"), where)) if (
        "timestamp" in row or "created_time" in row) else 0.0
    return Turn(
        request_id=f"r{i}", session_id=f"r{i}", turn=0,
        inputs=(_trace_blocks(hash_ids, input_len, block_size),),
        output_len=int(_first(row, ("output_length", "output_tokens"), where)),
        arrival_s=ts_ms / 1000.0,
    )


# ---------------------------------------------------------------------------------------------
# Qwen-Bailian JSONL: {"chat_id", "parent_chat_id" (-1 root), "turn", "timestamp" s, ...}


def _bailian_chain(chat_id: int, parent_of: dict[int, int]) -> tuple[int, int]:
    """(root chat id, depth) following parents present in the file; cycles stop the walk."""
    seen = {chat_id}
    while (parent := parent_of.get(chat_id, -1)) in parent_of and parent not in seen:
        seen.add(parent)
        chat_id = parent
    return chat_id, len(seen) - 1


def parse_bailian(path: str | Path, block_size: int = BAILIAN_BLOCK) -> Trace:
    """Rows already cover their whole context, so turns are self-contained prompts.

    Sessions follow `parent_chat_id` chains within the file (the topmost chat present names
    the session, `turn` is the depth in that chain, 0-based) so per-turn curves keep the
    conversation structure; requests are sent at their own timestamps.
    """
    path = Path(path)
    rows = list(_read_jsonl(path))
    parent_of = {int(r["chat_id"]): int(r.get("parent_chat_id", -1)) for r in rows}
    by_session: dict[int, list[Turn]] = {}
    for i, row in enumerate(rows):
        where = f"{path}:row {i}"
        chat_id = int(_first(row, ("chat_id",), where))
        input_len = int(_first(row, ("input_length",), where))
        hash_ids = [int(h) for h in row.get("hash_ids", [])]
        _check_blocks(hash_ids, input_len, block_size, where)
        parent = parent_of[chat_id]
        root, depth = _bailian_chain(chat_id, parent_of)
        turn = Turn(
            request_id=str(chat_id), session_id=str(root), turn=depth,
            inputs=(_trace_blocks(hash_ids, input_len, block_size),),
            output_len=int(_first(row, ("output_length",), where)),
            arrival_s=float(_first(row, ("timestamp",), where)),
            parent_id=str(parent) if parent in parent_of else None,
        )
        by_session.setdefault(root, []).append(turn)
    sessions = [
        Session(str(root), tuple(sorted(turns, key=lambda t: (t.arrival_s, t.turn))))
        for root, turns in by_session.items()
    ]
    return Trace("bailian", block_size, _sorted_sessions(sessions), {"path": str(path)})


# ---------------------------------------------------------------------------------------------
# Session JSONL (Mooncake rows + AIPerf's `session_id` / `delay` ms): history accumulates.


def parse_sessions(path: str | Path, block_size: int = MOONCAKE_BLOCK) -> Trace:
    """Rows of one `session_id` are its turns in file order; `input_length` is the NEW input.

    The first turn arrives at `timestamp` ms (or `delay` ms after the start, or 0); every
    later turn is sent `delay` ms after the previous one completed. `hash_ids` are optional;
    without them each turn gets fresh (unshared) blocks. A `block_size` field overrides the
    default per row.
    """
    path = Path(path)
    rows = list(_read_jsonl(path))
    max_id = max((max(r.get("hash_ids") or [-1]) for r in rows), default=-1)
    fresh = BlockIdAllocator(start=max_id + 1)
    by_session: dict[str, list[Turn]] = {}
    for i, row in enumerate(rows):
        where = f"{path}:row {i}"
        sid = str(_first(row, ("session_id",), where))
        input_len = int(_first(row, ("input_length", "input_tokens"), where))
        size = int(row.get("block_size", block_size))
        if size != block_size:
            raise ValueError(f"{where}: block_size {size} differs from the trace's {block_size}")
        hash_ids = [int(h) for h in row.get("hash_ids") or []]
        if hash_ids:
            _check_blocks(hash_ids, input_len, block_size, where)
            blocks = _trace_blocks(hash_ids, input_len, block_size)
        else:
            blocks = fresh.take(input_len, block_size)
        turns = by_session.setdefault(sid, [])
        delay_ms = float(_first(row, ("delay", "delay_ms"), where)) if (
            "delay" in row or "delay_ms" in row) else 0.0
        first = not turns
        start_ms = float(row.get("timestamp", delay_ms)) if first else 0.0
        turns.append(Turn(
            request_id=f"{sid}/{len(turns)}", session_id=sid, turn=len(turns),
            inputs=(blocks,),
            output_len=int(_first(row, ("output_length", "output_tokens"), where)),
            arrival_s=start_ms / 1000.0, delay_s=0.0 if first else delay_ms / 1000.0,
            parent_id=None if first else turns[-1].request_id, with_history=True,
        ))
    sessions = [Session(sid, tuple(turns)) for sid, turns in by_session.items()]
    return Trace("sessions", block_size, _sorted_sessions(sessions), {"path": str(path)})


# ---------------------------------------------------------------------------------------------
# ShareGPT JSON: [{"id", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}]

_USER_ROLES = {"human", "user", "system", "tool", "function", "observation"}
_ASSISTANT_ROLES = {"gpt", "assistant", "chatgpt", "bing", "bard", "model"}


def text_tokens(text: str, bytes_per_token: float) -> int:
    """Token count of a text without a tokenizer: UTF-8 bytes / bytes_per_token, at least 1."""
    return max(1, math.ceil(len(text.encode("utf-8")) / bytes_per_token))


def _sharegpt_pairs(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(user text, assistant text) pairs; user-side messages before an answer are merged."""
    pairs: list[tuple[str, str]] = []
    pending: list[str] = []
    for msg in messages:
        role = str(msg.get("from", msg.get("role", ""))).lower()
        text = str(msg.get("value", msg.get("content", "")))
        if role in _ASSISTANT_ROLES:
            if pending:  # an answer without a question (leading assistant turn) is dropped
                pairs.append(("\n".join(pending), text))
                pending = []
        elif role in _USER_ROLES:
            pending.append(text)
    return pairs


def parse_sharegpt(
    path: str | Path, block_size: int = BAILIAN_BLOCK, bytes_per_token: float = 4.0
) -> Trace:
    """Each conversation is a session; turn t sends history + the t-th user message.

    Lengths come from the texts (UTF-8 bytes / `bytes_per_token`); the answer length is the
    recorded assistant message's. No timestamps: all sessions start at 0 (use afap/poisson).
    """
    path = Path(path)
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = data.get("data", [data])
    fresh = BlockIdAllocator()
    sessions = []
    for i, conv in enumerate(data):
        sid = str(conv.get("id", i))
        pairs = _sharegpt_pairs(conv.get("conversations", conv.get("messages", [])))
        turns: list[Turn] = []
        for t, (question, answer) in enumerate(pairs):
            input_len = text_tokens(question, bytes_per_token)
            turns.append(Turn(
                request_id=f"{sid}/{t}", session_id=sid, turn=t,
                inputs=(fresh.take(input_len, block_size),),
                output_len=text_tokens(answer, bytes_per_token),
                parent_id=turns[-1].request_id if turns else None, with_history=True,
            ))
        if turns:
            sessions.append(Session(sid, tuple(turns)))
    return Trace("sharegpt", block_size, tuple(sessions), {"path": str(path)})


# ---------------------------------------------------------------------------------------------
# Synthetic agentic sessions


@dataclass(frozen=True)
class SyntheticSpec:
    """Sessions x turns of an agent loop.

    Turn 0 = shared system prompt + a per-session task; every later turn appends a tool
    result; every turn answers `answer` tokens. Lengths are drawn from `dist` around their
    mean; think time (s) between a turn's completion and the next one from `think_dist`.
    """

    sessions: int = 8
    turns: int = 4
    system_prompt: int = 1024
    user: int = 128
    tool_result: int = 200
    answer: int = 128
    dist: str = "constant"  # constant | uniform | lognormal | exponential
    spread: float = 0.25  # uniform: +-spread*mean; lognormal: sigma
    think_time: float = 0.0
    think_dist: str = "exponential"
    stagger: float = 0.0  # seconds between session starts
    block: int = 16  # block size of the generated ids
    seed: int = 0


_SYNTHETIC_ALIASES = {
    "system": "system_prompt", "tool": "tool_result", "think": "think_time",
    "output": "answer", "num_sessions": "sessions", "num_turns": "turns",
}


def parse_synthetic_spec(text: str) -> SyntheticSpec:
    """`key=value,...` (see `SyntheticSpec`); unknown keys are errors naming the valid ones."""
    spec = SyntheticSpec()
    fields = {f: type(getattr(spec, f)) for f in spec.__dataclass_fields__}
    updates: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key = _SYNTHETIC_ALIASES.get(key.strip(), key.strip())
        if not sep or key not in fields:
            raise ValueError(f"synthetic trace: bad item {item!r}; keys: {', '.join(fields)}")
        updates[key] = fields[key](value.strip())
    return replace(spec, **updates)


def _sampler(dist: str, spread: float, rng: np.random.Generator) -> Callable[[float], float]:
    samplers: dict[str, Callable[[float], float]] = {
        "constant": lambda mean: mean,
        "uniform": lambda mean: rng.uniform(mean * (1 - spread), mean * (1 + spread)),
        # mean-preserving lognormal
        "lognormal": lambda mean: rng.lognormal(math.log(max(mean, 1e-9)) - spread**2 / 2, spread),
        "exponential": lambda mean: rng.exponential(mean) if mean > 0 else 0.0,
    }
    if dist not in samplers:
        raise ValueError(f"unknown distribution {dist!r}; one of {', '.join(samplers)}")
    return samplers[dist]


def synthetic_trace(spec: SyntheticSpec) -> Trace:
    rng = np.random.default_rng(spec.seed)
    length = _sampler(spec.dist, spec.spread, rng)
    think = _sampler(spec.think_dist, spec.spread, rng)
    fresh = BlockIdAllocator()
    system_blocks = fresh.take(spec.system_prompt, spec.block)
    sessions = []
    for s in range(spec.sessions):
        sid = f"s{s}"
        turns: list[Turn] = []
        for t in range(spec.turns):
            new_len = max(1, round(length(spec.user if t == 0 else spec.tool_result)))
            inputs = (fresh.take(new_len, spec.block),)
            if t == 0 and spec.system_prompt > 0:
                inputs = (system_blocks, *inputs)
            turns.append(Turn(
                request_id=f"{sid}/{t}", session_id=sid, turn=t, inputs=inputs,
                output_len=max(1, round(length(spec.answer))),
                arrival_s=s * spec.stagger if t == 0 else 0.0,
                delay_s=0.0 if t == 0 else max(0.0, float(think(spec.think_time))),
                parent_id=turns[-1].request_id if turns else None, with_history=True,
            ))
        sessions.append(Session(sid, tuple(turns)))
    return Trace("synthetic", spec.block, _sorted_sessions(sessions), {"spec": spec.__dict__})


# ---------------------------------------------------------------------------------------------
# Loading by spec, and transforms

FORMATS = ("mooncake", "bailian", "sharegpt", "sessions", "synthetic")


def load_trace(spec: str, block_size: int | None = None) -> Trace:
    """`FORMAT:PATH` (mooncake, bailian, sharegpt, sessions) or `synthetic:key=value,...`.

    `block_size` overrides the format's block size (for files whose ids use another one).
    """
    fmt, sep, rest = spec.partition(":")
    if not sep or fmt not in FORMATS:
        raise ValueError(f"trace spec {spec!r}: expected FORMAT:PATH with FORMAT in {FORMATS}")
    if fmt == "synthetic":
        return synthetic_trace(parse_synthetic_spec(rest))
    if not Path(rest).is_file():
        raise ValueError(f"trace file not found: {rest}")
    parsers: dict[str, Callable[..., Trace]] = {
        "mooncake": parse_mooncake, "bailian": parse_bailian,
        "sharegpt": parse_sharegpt, "sessions": parse_sessions,
    }
    return parsers[fmt](rest) if block_size is None else parsers[fmt](rest, block_size)


def limit_requests(trace: Trace, max_requests: int) -> Trace:
    """The first `max_requests` turns, whole sessions in start order (the last may be cut)."""
    kept: list[Session] = []
    left = max_requests
    for session in trace.sessions:
        if left <= 0:
            break
        kept.append(Session(session.session_id, session.turns[:left]))
        left -= len(kept[-1].turns)
    return replace(trace, sessions=tuple(kept))


def _rescale(blocks: Blocks, old: int, new: int) -> Blocks:
    if not blocks.ids:
        return blocks
    tail = blocks.num_tokens - (len(blocks.ids) - 1) * old  # tokens in the last block
    return Blocks(blocks.ids, (len(blocks.ids) - 1) * new + max(1, math.ceil(tail * new / old)))


def rescale_blocks(trace: Trace, new_block_size: int) -> Trace:
    """Each id now stands for `new_block_size` tokens (sharing pattern kept, lengths scaled).

    This shrinks real traces for CPU runs: Mooncake's 512-token blocks replayed as 16-token
    blocks keep every prefix relation with 1/32 of the tokens. Output lengths are unchanged.
    """
    old = trace.block_size
    sessions = tuple(
        Session(s.session_id, tuple(
            replace(t, inputs=tuple(_rescale(b, old, new_block_size) for b in t.inputs))
            for t in s.turns
        ))
        for s in trace.sessions
    )
    meta = {**trace.meta, "rescaled_from_block_size": old}
    return replace(trace, block_size=new_block_size, sessions=sessions, meta=meta)
