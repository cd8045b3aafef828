"""Exact token history per session, so turn t+1's input is turn t's input ids + output ids +
the new message's tokens: no re-tokenisation drift can break the page-key chain."""

from __future__ import annotations

import hashlib
import itertools
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdcache.engine.tokenizer import Message, Tokenizer


@dataclass
class Session:
    token_ids: array = field(default_factory=lambda: array("I"))  # 4 bytes per token
    turns: int = 0
    last_used: float = field(default_factory=time.monotonic)
    version: int = 0  # the store's commit that made this history (`SessionStore.version`)


class SessionStore:
    """LRU map session key → Session, bounded in count, total tokens and idle time. The key is
    the client's `session_id`, or (tenant, session_id) on a router with tenants
    (`pdcache.router.tenants.session_key`).

    Used from the router's event loop only. A turn is committed only when it finished
    successfully, so a failed turn can be retried from the same history, and only onto the
    history its prompt was built from (`version` when it was built): of two turns of one
    session in flight at once the first to finish commits, the other is refused (the last
    one used to win, dropping the other's answer from the history silently), and a turn in
    flight when its session was closed does not bring the closed history back.

    Room is shared fairly: past a bound the least recently used session *of the owner (the
    key's tenant) holding the most* goes, so one tenant opening sessions by the thousand
    evicts its own (it used to evict every other tenant's conversations). A history that was
    evicted or expired leaves a fingerprint (`lost`): a later turn that does not resend it is
    refused (`lost` True) instead of running on the new message alone without saying so.
    """

    def __init__(self, max_sessions: int = 10_000, idle_ttl_s: float = 3600.0,
                 max_total_tokens: int = 64 * 2**20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self.max_total_tokens = max_total_tokens  # 64 Mi tokens = 256 MiB of history
        self._clock = clock
        self.total_tokens = 0
        self.refused_commits = 0  # turns whose session changed while they ran
        self._sessions: OrderedDict[Hashable, Session] = OrderedDict()
        self._versions = itertools.count(1)  # never reused: a closed session's is gone for good
        # sessions closed since: their version, so that a turn begun before the close (on
        # no history as on some) does not commit after it; bounded like the sessions
        self._closed: OrderedDict[Hashable, int] = OrderedDict()
        # per owner: its sessions in LRU order and its tokens (the fair eviction)
        self._owned: dict[Hashable, OrderedDict[Hashable, None]] = {}
        self._owner_tokens: dict[Hashable, int] = {}
        # histories evicted or expired: (length, sha256 of their ids), bounded like sessions
        self._lost: OrderedDict[Hashable, tuple[int, bytes]] = OrderedDict()

    def history(self, session_id: Hashable) -> list[int]:
        """The session's token history; a turn built on it counts as its use (the idle TTL
        runs from the last turn's start: a turn that began just inside it and finished past
        it found its session expired at commit and was refused)."""
        self._expire()
        session = self._sessions.get(session_id)
        if session is None:
            return []
        session.last_used = self._clock()
        self._sessions.move_to_end(session_id)
        self._owned[_owner(session_id)].move_to_end(session_id)
        return list(session.token_ids)

    def version(self, session_id: Hashable) -> int:
        """Which history `history` gives now: the commit that wrote it, 0 for none (a new,
        closed, expired or evicted session). Take it with the history a prompt is built
        from and give it back to `commit`."""
        session = self._sessions.get(session_id)
        if session is not None:
            return session.version
        return self._closed.get(session_id, 0)

    def commit(self, session_id: Hashable, input_ids: list[int], output_ids: list[int],
               base_version: int) -> bool:
        """Record a finished turn whose prompt was built on history `base_version`: the
        session's history becomes input_ids + output_ids. False, nothing recorded, when the
        session moved on since (another turn committed, it was closed or dropped)."""
        if self.version(session_id) != base_version:
            self.refused_commits += 1
            return False
        self._closed.pop(session_id, None)
        self._lost.pop(session_id, None)
        session = self._pop(session_id) or Session()
        session.token_ids = array("I", input_ids)
        session.token_ids.extend(output_ids)
        session.turns += 1
        session.last_used = self._clock()
        session.version = next(self._versions)
        self._put(session_id, session)
        while len(self._sessions) > self.max_sessions:
            self._evict(max(self._owned, key=lambda owner: len(self._owned[owner])))
        while self.total_tokens > self.max_total_tokens:
            self._evict(max(self._owner_tokens, key=self._owner_tokens.__getitem__))
        return True

    def lost(self, session_id: Hashable, prompt_ids: Sequence[int]) -> bool:
        """Whether a turn of `session_id` with prompt `prompt_ids` would run without the
        history the session had: it was evicted or expired, and the prompt does not begin
        with it (a client that resends the whole conversation continues)."""
        if session_id in self._sessions:
            return False
        mark = self._lost.get(session_id)
        if mark is None:
            return False
        length, digest = mark
        return len(prompt_ids) < length or _digest(prompt_ids[:length]) != digest

    def close(self, session_id: Hashable) -> bool:
        """Forget a session the client closed (`/close_session`); False if none was known.
        A turn in flight since before the close does not commit (its first turn included:
        a new session's version was 0 before and after the close)."""
        self._closed[session_id] = next(self._versions)
        self._closed.move_to_end(session_id)
        while len(self._closed) > self.max_sessions:
            self._closed.popitem(last=False)
        self._lost.pop(session_id, None)
        return self._pop(session_id) is not None

    def _put(self, session_id: Hashable, session: Session) -> None:
        owner = _owner(session_id)
        self._sessions[session_id] = session
        self._owned.setdefault(owner, OrderedDict())[session_id] = None
        self._owner_tokens[owner] = self._owner_tokens.get(owner, 0) + len(session.token_ids)
        self.total_tokens += len(session.token_ids)

    def _pop(self, session_id: Hashable) -> Session | None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return None
        owner = _owner(session_id)
        owned = self._owned[owner]
        del owned[session_id]
        self._owner_tokens[owner] -= len(session.token_ids)
        if not owned:
            del self._owned[owner], self._owner_tokens[owner]
        self.total_tokens -= len(session.token_ids)
        return session

    def _evict(self, owner: Hashable) -> None:
        """Drop `owner`'s least recently used session, leaving its fingerprint."""
        self._forget(next(iter(self._owned[owner])))

    def _forget(self, session_id: Hashable) -> None:
        session = self._pop(session_id)
        if session is None:
            return
        self._lost[session_id] = (len(session.token_ids), _digest(session.token_ids))
        self._lost.move_to_end(session_id)
        while len(self._lost) > self.max_sessions:
            self._lost.popitem(last=False)

    def turns(self, session_id: Hashable) -> int:
        session = self._sessions.get(session_id)
        return session.turns if session else 0

    def __len__(self) -> int:
        return len(self._sessions)

    def _expire(self) -> None:
        now = self._clock()
        while self._sessions:
            sid, oldest = next(iter(self._sessions.items()))
            if now - oldest.last_used <= self.idle_ttl_s:
                break
            self._forget(sid)


def _owner(session_id: Hashable) -> Hashable:
    """Whose session it is: the tenant of a (tenant, id) key; one owner without tenants."""
    return session_id[0] if isinstance(session_id, tuple) else None


def _digest(token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(array("I", token_ids).tobytes()).digest()


class ChatContinuation:
    """Token ids that continue a session's exact history with new chat messages.

    Derived once from the chat template by rendering probe conversations: `closing` ends an
    assistant turn (e.g. `<|im_end|>\\n`), and the new messages are rendered as the template
    would render them after an assistant turn (with the generation prompt). A template that is
    not prefix-stable (it rewrites earlier turns) cannot be continued: ValueError.
    """

    _USER: Message = {"role": "user", "content": "x"}
    _ANSWER = "y"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._closing: list[int] | None = None
        self._turn_prefix: list[int] | None = None
        self._error: str | None = None
        try:
            self._derive()
        except ValueError as exc:
            self._error = str(exc)

    def _derive(self) -> None:
        template = self._tokenizer.apply_chat_template
        asked = template([self._USER], add_generation_prompt=True)
        turn = template([self._USER, {"role": "assistant", "content": self._ANSWER}],
                        add_generation_prompt=False)
        answer = self._tokenizer.encode(self._ANSWER)
        rest = _strip_prefix(turn, asked, "the assistant turn")
        self._closing = _strip_prefix(rest, answer, "the assistant answer")
        self._turn_prefix = turn

    def continue_ids(self, history: Sequence[int], messages: list[Message],
                     tools: list[dict[str, Any]] | None = None,
                     template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """history (ending with the previous answer's ids) + the end of that answer's turn +
        the new messages + the generation prompt (`tools`, `template_kwargs`: as the template
        renders turns after its tools block and with those variables)."""
        if self._error is not None or self._closing is None or self._turn_prefix is None:
            raise ValueError(f"this model's chat template cannot continue a session "
                             f"({self._error}); send the whole conversation without session_id")
        probe = [self._USER, {"role": "assistant", "content": self._ANSWER}]
        template = self._tokenizer.apply_chat_template
        full = template([*probe, *messages], add_generation_prompt=True, tools=tools,
                        template_kwargs=template_kwargs)
        prefix = self._turn_prefix
        if tools or template_kwargs:
            prefix = template(probe, add_generation_prompt=False, tools=tools,
                              template_kwargs=template_kwargs)
        new_turns = _strip_prefix(full, prefix, "the new messages")
        closing = self._closing
        done = max((k for k in range(len(closing) + 1)
                    if k == 0 or list(history[-k:]) == closing[:k]), default=0)
        return [*history, *closing[done:], *new_turns]


def _strip_prefix(ids: Sequence[int], prefix: Sequence[int], what: str) -> list[int]:
    if list(ids[: len(prefix)]) != list(prefix):
        raise ValueError(f"the chat template does not render {what} as a continuation")
    return list(ids[len(prefix):])
