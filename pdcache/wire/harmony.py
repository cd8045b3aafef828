"""Reading gpt-oss's harmony output: its messages split by channel, incrementally
(docs/tools.md, "gpt-oss (harmony)"; the format: pdcache.engine.harmony).

`HarmonyReader` is the one machine both `gpt-oss` parsers run (SGLang's `--reasoning-parser
gpt-oss` and `--tool-call-parser gpt-oss` share its HarmonyParser the same way). It turns text
pieces into events:

- `reasoning`: the body of an `analysis` message, streamed as it arrives;
- `answer`: the body of a `final` message, of a `commentary` message without recipient (a
  preamble the user sees), of a message in a channel harmony does not define (nothing is
  hidden), and text outside any message; streamed;
- `call`: a message with a recipient (`to=functions.NAME`, in the header before or after
  `<|channel|>`), held until its `<|call|>` (or `<|end|>`, or the output's end: `<|call|>`
  is an end-of-sequence token, dropped where the decoder drops those); with its raw text, so
  a later parser can read it again.

A message ends at its terminator, or where the next one starts (`<|start|>` / `<|channel|>`
in a body: a missing `<|end|>`), or with the output. A header the output never finished is
dropped. Markers split across pieces are held until they can be told from text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdcache.engine.harmony import CALL, CHANNEL, END, HARMONY_MARKERS, MESSAGE, RETURN, START

TERMINATORS = (END, CALL, RETURN)
NEXT_MESSAGE = (START, CHANNEL)  # in a body: the previous message was not terminated
RECIPIENT = re.compile(r"\bto=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]*)")
SHOWN_CHANNELS = ("final", "commentary")


@dataclass(frozen=True)
class HarmonyEvent:
    """One piece of read output: `kind` is reasoning, answer or call; `text` the body text
    (for a call, the arguments text); a call's `raw` (the whole message as written) and
    `recipient`."""

    kind: str
    text: str
    raw: str = ""
    recipient: str = ""


class HarmonyReader:
    """Incremental reader of one output: `feed` pieces, then `finish`. Owns its buffer and
    the message it is in; used from one event loop."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet read
        self._state = "outside"  # outside -> header -> body -> outside ...
        self._header = ""  # the current message's header, its opening marker included
        self._kind = ""  # the current body's event kind
        self._body = ""  # a call's body so far (other bodies are streamed, not kept)

    def feed(self, text: str) -> list[HarmonyEvent]:
        self._pending += text
        events: list[HarmonyEvent] = []
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[HarmonyEvent]:
        events: list[HarmonyEvent] = []
        while self._step(events, final=True):
            pass
        if self._state == "body":
            self._end_body(events, terminator="")
        self._state, self._header, self._pending = "outside", "", ""
        return events

    def _step(self, events: list[HarmonyEvent], final: bool) -> bool:
        """Read what can be read; False when the pending text must wait for more."""
        if not self._pending:
            return False
        if self._state == "outside":
            return self._outside(events, final)
        if self._state == "header":
            return self._in_header(final)
        return self._in_body(events, final)

    def _outside(self, events: list[HarmonyEvent], final: bool) -> bool:
        at, marker = _first(self._pending, (*NEXT_MESSAGE, *TERMINATORS))
        if not marker:
            self._release(events, "answer", final)
            return False
        self._emit(events, "answer", self._pending[:at])
        self._pending = self._pending[at + len(marker):]
        if marker in NEXT_MESSAGE:
            self._header, self._state = marker, "header"
        # a stray terminator outside a message marks nothing: it is skipped
        return True

    def _in_header(self, final: bool) -> bool:
        at, marker = _first(self._pending, (MESSAGE, *TERMINATORS))
        if marker == MESSAGE:
            self._header += self._pending[:at]
            self._pending = self._pending[at + len(MESSAGE):]
            self._kind = _body_kind(self._header)
            self._body, self._state = "", "body"
            return True
        if marker:  # a header that ends without a body: malformed, dropped
            self._pending = self._pending[at + len(marker):]
            self._state, self._header = "outside", ""
            return True
        if final:
            self._pending = ""  # an unfinished header carries no text
        return False

    def _in_body(self, events: list[HarmonyEvent], final: bool) -> bool:
        at, marker = _first(self._pending, (*TERMINATORS, *NEXT_MESSAGE))
        if marker:
            self._body_text(events, self._pending[:at])
            if marker in TERMINATORS:
                self._pending = self._pending[at + len(marker):]
                self._end_body(events, marker)
            else:  # the next message starts: this one ended unterminated
                self._pending = self._pending[at:]
                self._end_body(events, "")
            return True
        keep = 0 if final else _held(self._pending)
        self._body_text(events, self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]
        return False

    def _body_text(self, events: list[HarmonyEvent], text: str) -> None:
        if self._kind == "call":
            self._body += text
        else:
            self._emit(events, self._kind, text)

    def _end_body(self, events: list[HarmonyEvent], terminator: str) -> None:
        if self._kind == "call":
            recipient = RECIPIENT.search(self._header)
            raw = f"{self._header}{MESSAGE}{self._body}{terminator}"
            events.append(HarmonyEvent("call", self._body, raw,
                                       recipient.group(1) if recipient else ""))
        self._state, self._header, self._body = "outside", "", ""

    def _release(self, events: list[HarmonyEvent], kind: str, final: bool) -> None:
        keep = 0 if final else _held(self._pending)
        self._emit(events, kind, self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]

    @staticmethod
    def _emit(events: list[HarmonyEvent], kind: str, text: str) -> None:
        if not text:
            return
        if events and events[-1].kind == kind and kind != "call":
            events[-1] = HarmonyEvent(kind, events[-1].text + text)
        else:
            events.append(HarmonyEvent(kind, text))


def _body_kind(header: str) -> str:
    """What a message's body is, from its header: a call when it names a recipient, thinking
    in `analysis`, else shown to the user."""
    if RECIPIENT.search(header):
        return "call"
    channel = CHANNEL_NAME.search(header)
    if channel is not None and channel.group(1) == "analysis":
        return "reasoning"
    return "answer"


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of `markers` in `text` (at, marker); (-1, "") when none is."""
    found = [(at, m) for at, m in ((text.find(m), m) for m in markers) if at >= 0]
    return min(found) if found else (-1, "")


def _held(text: str) -> int:
    """How many trailing characters of `text` may still become a harmony marker."""
    for k in range(min(max(map(len, HARMONY_MARKERS)) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in HARMONY_MARKERS):
            return k
    return 0


def function_name(recipient: str) -> str:
    """The function a recipient names: `functions.NAME` → NAME; another namespace's
    recipient (`browser.search`, a built-in tool) is kept whole, so it names none of the
    request's functions."""
    prefix = "functions."
    return recipient[len(prefix):] if recipient.startswith(prefix) else recipient
