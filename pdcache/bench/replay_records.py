"""What one replayed request left: `RequestRecord` (one line of `requests.jsonl`, filled from
the answer's `meta`) and the prompt-length check (`check_prompt_tokens`: the server must have
seen exactly the prompt the replay sent, else `PromptMismatchError`, counted as
`prompt_mismatch`). Plain data, no I/O; filled on the replay's event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class PromptMismatchError(Exception):
    """The server's `prompt_tokens` differs from the prompt the replay sent."""

    def __init__(self, sent: int, seen: int, session_id: str | None) -> None:
        where = f"session {session_id!r}" if session_id else "no session_id"
        super().__init__(
            f"sent {sent} prompt tokens, the server saw {seen} ({where}): another history was "
            "prepended; replay with a fresh --session-prefix")
        self.sent, self.seen = sent, seen


PROMPT_MISMATCH = "prompt_mismatch"


def check_prompt_tokens(rec: RequestRecord) -> None:
    """Raise PromptMismatchError if the answer's meta named another prompt length. Answers
    without `prompt_tokens` (servers that do not report it) are not checked."""
    seen = rec.server_prompt_tokens
    if seen is not None and seen != rec.prompt_tokens:
        raise PromptMismatchError(rec.prompt_tokens, seen, rec.sent_session_id)


@dataclass
class RequestRecord:
    """One line of requests.jsonl."""

    request_id: str
    session_id: str
    turn: int
    ok: bool = False
    error: str | None = None
    http_status: int | None = None
    dispatch_s: float = 0.0
    # waited for --concurrency after its schedule let it go (open-loop modes): latency the
    # client added, which ttft_s and e2e_s (timed from dispatch) leave out
    queued_s: float = 0.0
    prompt_tokens: int = 0
    new_input_tokens: int = 0
    max_new_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    cached_storage_from_decode: int = 0
    computed_tokens: int | None = None
    theoretical_cached_tokens: int = 0
    ttft_s: float | None = None
    server_ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prefill_node: str | None = None
    decode_node: str | None = None
    sent_session_id: str | None = None  # the `session_id` sent (None: none was sent)
    server_prompt_tokens: int | None = None  # the answer's `meta.prompt_tokens`

    def apply_meta(self, meta: dict[str, Any]) -> None:
        details = meta.get("cached_tokens_details") or {}
        seen = meta.get("prompt_tokens")
        self.server_prompt_tokens = None if seen is None else int(seen)
        self.cached_tokens = int(meta.get("cached_tokens") or 0)
        for tier in ("device", "host", "storage", "storage_from_decode"):
            setattr(self, f"cached_{tier}", int(details.get(tier) or 0))
        computed = meta.get("computed_tokens")
        self.computed_tokens = None if computed is None else int(computed)
        ttft = meta.get("ttft_s")
        self.server_ttft_s = None if ttft is None else float(ttft)
        self.prefill_node = meta.get("prefill_node")
        self.decode_node = meta.get("decode_node")
