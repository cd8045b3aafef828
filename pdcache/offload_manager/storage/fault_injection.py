"""Slow storage on purpose: a wrapper that delays the calls of another backend.

Two keys turn it on, for two uses:
- `[storage] write_delay_s = S`: every `put_from` starts S seconds late. A configured store,
  not a test double: it emulates a slow or distant store (a loaded 3FS cluster, Mooncake
  Store across a WAN) on a laptop, so benchmarks and the tests of the durable next turn
  (docs/design.md §4.10) can make decode's storage write lose the race deterministically.
- `[storage] fault_injection = "/abs/path/control"` (chaos only), which only
`pdcache chaos` (its `storage-slow` fault) and tests set: the key is off by default, it
must name an absolute path, and the control file must exist when the backend opens (else the
node refuses to start), so a config cannot turn it on by accident. The control file holds one
number, the delay in seconds each data call (`exists_prefix`, `get_into`, `read_layers`,
`put_from`, `delete`, and the state objects' `put_state`, `get_state_into`, `exists_state`,
`delete_states`) waits before it reaches the wrapped backend; the harness rewrites it to
inject and to heal.
It is re-read at most every `REREAD_S` (a missing or unreadable file reads as 0: no delay).

Thread-safety: the cached delay is behind a lock; the wrapped backend is thread-safe itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.layer_reads import LayerStream
from pdcache.offload_manager.storage.page_format import HostPage
from pdcache.offload_manager.storage.state_format import StateBuffer, StateSpec

log = logging.getLogger(__name__)
REREAD_S = 0.1  # the control file is read at most this often
MAX_DELAY_S = 600.0  # a larger number in the control file is clamped (a typo, not an outage)


def read_delay_file(path: Path) -> float:
    """Seconds of delay in the control file; 0 when it is missing, empty or not a number."""
    try:
        text = path.read_text().strip()
    except OSError:
        return 0.0
    try:
        value = float(text) if text else 0.0
    except ValueError:
        return 0.0
    return min(max(value, 0.0), MAX_DELAY_S) if value == value else 0.0  # NaN reads as 0


class DelayInjectingBackend(StorageBackend):
    """Delays each call to `inner` by the control file's current value (docs/chaos.md), and
    each `put_from` by `write_delay_s` more.

    Owns nothing but the cached delay; `close()` closes `inner`. Tool methods of the wrapped
    backend (`keys`, `clear`, `read_object`, `register_host_memory`, ...) pass straight through.
    """

    def __init__(
        self,
        inner: StorageBackend,
        control_file: Path | None = None,
        write_delay_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self._clock = clock  # when the control file is stale (tests pass a fake one)
        self.control_file = control_file
        self.write_delay_s = write_delay_s
        self._lock = threading.Lock()
        self._delayed_calls = 0
        self._delayed_ms = 0
        self._delay_s = 0.0
        self._read_at = clock()
        if control_file is not None:
            self._open_control(control_file)

    def _open_control(self, control_file: Path) -> None:
        if not control_file.is_absolute():
            raise ValueError(
                f"storage.fault_injection = {str(control_file)!r}: must be an "
                "absolute path (a chaos/test-only key)"
            )
        if not control_file.is_file():
            raise ValueError(
                f"storage.fault_injection = {str(control_file)!r}: no such control "
                "file; this key is for `pdcache chaos` and tests only, which "
                "create the file before the node starts"
            )
        self._delay_s = read_delay_file(control_file)
        log.warning(
            "storage: fault injection enabled (delays from %s): chaos/test use only", control_file
        )

    def current_delay_s(self) -> float:
        """The control file's delay now, re-read when the cached value is stale (0 without)."""
        if self.control_file is None:
            return 0.0
        now = self._clock()
        with self._lock:
            if now - self._read_at < REREAD_S:
                return self._delay_s
            self._read_at = now
        delay = read_delay_file(self.control_file)  # outside the lock: a read may be slow
        with self._lock:
            self._delay_s = delay
        return delay

    def _wait(self, write: bool = False) -> None:
        delay = self.current_delay_s() + (self.write_delay_s if write else 0.0)
        if delay > 0:
            with self._lock:
                self._delayed_calls += 1
                self._delayed_ms += int(delay * 1000)
            time.sleep(delay)  # the injected fault (or emulated store latency) itself

    # StorageBackend

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        self._wait()
        return self.inner.exists_prefix(keys)

    def get_into(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[HostPage],
        origins: list[str | None] | None = None,
    ) -> list[bool]:
        self._wait()
        return self.inner.get_into(keys, host_pages, origins)

    def put_from(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[HostPage],
        origin: str = "prefill",
        namespace: str = "",
        session: str = "",
    ) -> list[bool]:
        self._wait(write=True)
        return self.inner.put_from(keys, host_pages, origin, namespace, session=session)

    @property
    def streams_layers(self) -> bool:
        """Whether the wrapped backend reads layer-major (`read_layers`); explicit so that
        the layer-streamed prefetch never bypasses the delay through `__getattr__`."""
        return bool(getattr(self.inner, "streams_layers", False))

    def read_layers(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[HostPage],
        stream: LayerStream,
        origins: list[str | None] | None = None,
    ) -> list[bool]:
        """The wrapped backend's layer-major read (storage/layer_reads.py), delayed like
        `get_into`: a slow store is slow for streamed prefetches too."""
        self._wait()
        return self.inner.read_layers(keys, host_pages, stream, origins)  # type: ignore[attr-defined]

    def end_session(self, session: str) -> None:
        self.inner.end_session(session)  # the base's no-op would hide the wrapped backend's

    # state objects: explicit, so the base's refusals never hide the wrapped backend's calls

    @property
    def state_spec(self) -> StateSpec | None:  # type: ignore[override]
        return self.inner.state_spec

    @property
    def supports_states(self) -> bool:
        return self.inner.supports_states

    def put_state(self, key: bytes, state: StateBuffer, tokens: int, origin: str = "prefill",
                  namespace: str = "", session: str = "") -> bool:
        self._wait(write=True)
        return self.inner.put_state(key, state, tokens, origin, namespace, session)

    def get_state_into(self, key: bytes, out: torch.Tensor, tokens: int | None = None
                       ) -> str | None:
        self._wait()
        return self.inner.get_state_into(key, out, tokens)

    def exists_state(self, key: bytes) -> bool:
        self._wait()
        return self.inner.exists_state(key)

    def exists_states(self, keys: Sequence[bytes]) -> list[bool]:
        self._wait()
        return self.inner.exists_states(keys)

    def delete_states(self, keys: Sequence[bytes]) -> None:
        self._wait()
        self.inner.delete_states(keys)

    def delete(self, keys: Sequence[bytes]) -> None:
        self._wait()
        self.inner.delete(keys)

    def stats(self) -> dict[str, int | float]:
        out = self.inner.stats()
        with self._lock:
            out.update(injected_delays=self._delayed_calls, injected_delay_ms=self._delayed_ms)
        return out

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # only reached for names this class lacks: the wrapped backend's tools
        return getattr(self.inner, name)
