"""A decode node's stream after the router already sent the first token (docs/pd-protocol.md,
"First token from prefill"): `FirstTokenSkip` takes that token out of decode's chunks.

Decode-only: `DecodeApp` hands its `trim` to `ServerRoutes.respond` as the chunk filter of a
`PDParams.first_token_streamed` stream. Pure: no engine, no I/O; one per request, used on
the event loop only.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from pdcache.wire.generate_api import OUTPUT_LOGPROB_KEYS

log = logging.getLogger(__name__)


@dataclass
class FirstTokenSkip:
    """A decode node's stream whose first token the router already sent (prefill's stream,
    `PDParams.first_token_streamed`): `trim` takes each chunk `OutputBuilder.add` made and
    returns it without that token, or None when nothing is left to send. Incremental chunks
    lose the token's id, the `first_text` prefill sent with it and its output logprob
    entries; a cumulative chunk is dropped while it holds the first token alone (the next
    one holds everything again). A final chunk (`finish_reason` set) is always sent."""

    incremental: bool
    first_text: str
    _ids_left: int = field(default=1, init=False)
    _text_left: str = field(default="", init=False)  # of `first_text`, not yet seen in chunks

    def __post_init__(self) -> None:
        self._text_left = self.first_text

    def trim(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        meta_info = chunk["meta_info"]
        final = meta_info.get("finish_reason") is not None
        if not self.incremental:
            return chunk if final or len(chunk["output_ids"]) > 1 else None
        ids, text = chunk["output_ids"], chunk["text"]
        drop_ids = min(self._ids_left, len(ids))
        drop_text = self._drop_text(text)
        if not drop_ids and not drop_text:
            return chunk
        self._ids_left -= drop_ids
        trimmed = {**chunk, "text": text[drop_text:], "output_ids": ids[drop_ids:],
                   "meta_info": _without_first_logprobs(meta_info, drop_ids)}
        if not final and not trimmed["output_ids"] and not trimmed["text"]:
            return None
        return trimmed

    def _drop_text(self, text: str) -> int:
        """How many leading characters of `text` the client already has (`first_text`). The
        text released after token 1 alone is normally a prefix of decode's (it may span
        chunks); a tokenizer that re-renders earlier text once later tokens come breaks
        that: then only the common prefix is dropped (the client keeps the rest of what
        prefill sent, nothing of decode's text is lost) and it is logged."""
        left = self._text_left
        if not left or not text:
            return 0
        if text.startswith(left):
            self._text_left = ""
            return len(left)
        if left.startswith(text):
            self._text_left = left[len(text):]
            return len(text)
        common = len(os.path.commonprefix([left, text]))
        log.warning("decode's text does not start with the %d characters prefill streamed "
                    "with token 1 (%r vs %r): dropping only the %d in common", len(left),
                    left[:40], text[:40], common)
        self._text_left = ""
        return common


def _without_first_logprobs(meta_info: dict[str, Any], count: int) -> dict[str, Any]:
    """`meta_info` without the first `count` entries of its output logprob lists (the
    tokens taken out of the chunk), keeping `output_token_logprobs_length` in step."""
    if not count or not any(isinstance(meta_info.get(k), list) for k in OUTPUT_LOGPROB_KEYS):
        return meta_info
    trimmed = dict(meta_info)
    for key in OUTPUT_LOGPROB_KEYS:
        if isinstance(trimmed.get(key), list):
            trimmed[key] = trimmed[key][count:]
    if "output_token_logprobs" in trimmed:
        trimmed["output_token_logprobs_length"] = len(trimmed["output_token_logprobs"])
    return trimmed
