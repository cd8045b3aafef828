"""Incremental detokenisation: output ids become final text, stop strings cut it.

Shared by the servers (which decode their engine's ids) and the router (which decodes a
node's ids for the agent API's parsers), so it depends on nothing but a decode function.
"""

from __future__ import annotations

from collections.abc import Callable


class TextAssembler:
    """Incremental detokenization with optional stop strings.

    Decodes a small window of recent ids (not the whole output per token) and releases text
    only when final: never a dangling partial character (decoded as U+FFFD) and never a
    prefix of a stop string that a later token might complete.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str],
                 keep_stop: bool = False) -> None:
        self._decode = decode
        self._stops = stops
        # per stop string, its prefix lengths (longest first) by their last character: a
        # token's hold-back check tries only the prefixes that end as the text does (every
        # prefix of every stop per token cost 0.4 s a token at 32k-character stops)
        self._stop_ends = [_prefix_ends(stop) for stop in stops]
        self._keep_stop = keep_stop  # SGLang's no_stop_trim: the text ends with the stop
        self.matched: str | None = None  # the stop string that ended the text
        self.ids: list[int] = []
        self._text = ""  # decoded text of ids[:_read]
        self._prefix = 0  # ids[_prefix:_read] give context to the next decode
        self._read = 0
        self._emitted = 0  # chars of _text already returned
        self.stopped = False

    def add(self, new_ids: list[int]) -> str:
        """Take the next ids; returns the text that became final."""
        self.ids.extend(new_ids)
        self._text += self._decode_window(final=False)
        if self._stops and self._cut_at_stop():
            return self._release(len(self._text))
        return self._release(self._safe_len())

    def flush(self) -> str:
        """The output ended: release everything, partial characters included."""
        if not self.stopped:
            self._text += self._decode_window(final=True)
        return self._release(len(self._text))

    @property
    def text(self) -> str:
        return self._text

    @property
    def emitted(self) -> str:
        """The text released so far (never a stop-string prefix still held back)."""
        return self._text[: self._emitted]

    def _decode_window(self, final: bool) -> str:
        # decoding ids with their predecessors keeps tokenizers that render word boundaries
        # from context (SentencePiece spaces) exact
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def _cut_at_stop(self) -> bool:
        start = max(0, self._emitted - max(len(s) for s in self._stops))
        hits = [(i, s) for i, s in ((self._text.find(s, start), s) for s in self._stops) if i >= 0]
        if not hits:
            return False
        at, self.matched = min(hits, key=lambda hit: hit[0])
        self._text = self._text[: at + (len(self.matched) if self._keep_stop else 0)]
        self.stopped = True
        return True

    def _safe_len(self) -> int:
        """Where the text may be released up to: before its longest tail that begins a stop."""
        end, hold = len(self._text), 0
        if not end:
            return self._emitted
        last = self._text[-1]
        for stop, ends in zip(self._stops, self._stop_ends, strict=True):
            for k in ends.get(last, ()):
                if k <= hold:
                    break  # longest first: no longer tail of this stop is left
                if k <= end and self._text.endswith(stop[:k]):
                    hold = k
                    break
        return max(end - hold, self._emitted)

    def _release(self, upto: int) -> str:
        delta = self._text[self._emitted : upto]
        self._emitted = max(self._emitted, upto)
        return delta


def _prefix_ends(stop: str) -> dict[str, list[int]]:
    """The lengths k of `stop`'s proper prefixes, longest first, keyed by `stop[k - 1]`."""
    ends: dict[str, list[int]] = {}
    for k in range(len(stop) - 1, 0, -1):
        ends.setdefault(stop[k - 1], []).append(k)
    return ends
