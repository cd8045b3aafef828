"""pdcache: prefill/decode-disaggregated LLM serving whose KV cache outlives the turn."""

from __future__ import annotations

__version__ = "0.1.0"
