"""The one interface every KV data engine implements, and the registry that picks one.

An engine moves bytes from this process's memory into a peer's registered memory:

- target side (decode): `register_target(addr, nbytes)` exposes a region to peers;
  `session()` is the opaque address a peer needs to reach it (sent in `Register`).
- initiator side (prefill): `register_source(addr, nbytes)` declares local memory it reads;
  `add_peer(session)` returns a handle; `submit(peer, batch)` starts a batched write and
  returns a ticket; `wait(ticket, timeout_s)` blocks until every byte has landed in the
  peer's memory or raises `EngineError` (failure, dead peer, deadline); `drain(ticket,
  timeout_s)` gives up on a ticket only once none of its bytes can still land (True), or
  says it could not know that in time (False).

Completion is notified to the peer over the control plane (`Done`), never by the engine, so
the same ordering guarantee holds for every engine. Engines are used by one transfer worker
per ticket; `submit`/`wait`/`add_peer` must be safe to call from several worker threads.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from pdcache.transfer.config import TransferConfig
from pdcache.transfer.layout import WriteBatch
from pdcache.utils.registry import Registry


class EngineError(RuntimeError):
    """A data-engine operation failed; the message says which peer and why."""


class EngineTimeout(EngineError):
    """wait() ran out of time; the ticket is still valid (wait again, or cancel it)."""


class KVTransferEngine(ABC):
    """See the module docstring for the contract."""

    name: str = ""

    def __init__(self, config: TransferConfig) -> None:
        """Never writes the process environment: see `environment`."""
        self.config = config

    @classmethod
    def environment(cls, config: TransferConfig, inherited: Mapping[str, str]) -> dict[str, str]:
        """Variables this engine's library reads only from the process environment, for
        `config`; `inherited` (the current environment) keeps explicit settings. The process
        entry point applies them once, before the first engine starts
        (`pdcache.config.process_environment`). None by default."""
        return {}

    @abstractmethod
    def session(self) -> bytes:
        """This endpoint's address for peers (valid once targets are registered)."""

    @abstractmethod
    def register_target(self, addr: int, nbytes: int) -> None:
        """Let peers write into [addr, addr + nbytes)."""

    @abstractmethod
    def register_source(self, addr: int, nbytes: int) -> None:
        """Declare [addr, addr + nbytes) as memory this endpoint writes from."""

    @abstractmethod
    def add_peer(self, session: bytes) -> Any:
        """Prepare writes to the endpoint `session`; returns the peer handle for submit()."""

    def remove_peer(self, peer: Any) -> None:  # noqa: B027 - optional hook
        """Forget a peer (after it died or unregistered)."""

    @abstractmethod
    def submit(self, peer: Any, batch: WriteBatch) -> Any:
        """Start writing `batch` to `peer`; returns a ticket for wait()."""

    @abstractmethod
    def wait(self, ticket: Any, timeout_s: float) -> None:
        """Block until the ticket's bytes landed.

        Raises EngineTimeout when `timeout_s` passes first (the ticket stays valid) and
        EngineError when the write failed (the ticket is finished). Engines whose library only
        offers a blocking completion call (Mooncake) may overrun `timeout_s` up to the
        library's own transfer timeout.
        """

    def cancel(self, ticket: Any) -> None:  # noqa: B027 - optional hook
        """Give up on a ticket: stop or drop what can still be stopped; never raises. Bytes
        already on their way may still land afterwards: see `drain`."""

    def drain(self, ticket: Any, timeout_s: float) -> bool:
        """Give up on a ticket once no byte of it can land in the peer's memory any more:
        True when its write is known to be over (landed or failed) within `timeout_s`; False
        when it is not (the ticket is then cancelled, and its bytes may still land). Never
        raises. A sender drains a cancelled room's tickets before it tells decode the room is
        over, because decode frees the pages on that word (docs/design.md §4.5). This default
        waits for the ticket; an engine whose `wait` can fail while bytes are still on their
        way says so in `write_over`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.wait(ticket, min(max(deadline - time.monotonic(), 0.0), 0.05))
                return True
            except EngineTimeout:
                if time.monotonic() >= deadline:
                    self.cancel(ticket)
                    return False
            except EngineError:
                return self.write_over(ticket)
            except Exception:  # never raises: an unknown failure is an unknown write
                self.cancel(ticket)
                return False

    def write_over(self, ticket: Any) -> bool:
        """After `wait` raised EngineError for `ticket`: whether its write is over (no byte
        of it can land any more). True unless the engine says otherwise."""
        return True

    @abstractmethod
    def close(self) -> None:
        """Release sockets, threads and registrations. Idempotent."""

    def write(self, peer: Any, batch: WriteBatch, timeout_s: float) -> None:
        """submit + wait; on timeout the ticket is cancelled and EngineTimeout raised."""
        ticket = self.submit(peer, batch)
        try:
            self.wait(ticket, timeout_s)
        except EngineTimeout:
            self.cancel(ticket)
            raise


ENGINES: Registry[KVTransferEngine] = Registry("transfer engine")
ENGINES.register("zmq", "pdcache.transfer.engines.zmq_engine:ZmqEngine")
ENGINES.register("mooncake", "pdcache.transfer.engines.mooncake_engine:MooncakeEngine",
                 package="mooncake-transfer-engine-non-cuda")
ENGINES.register("nixl", "pdcache.transfer.engines.nixl_engine:NixlEngine", package="nixl-cu12")


def create_engine(config: TransferConfig) -> KVTransferEngine:
    """Instantiate the engine named by `config.engine` (imports its dependency lazily)."""
    return ENGINES.get(config.engine)(config)
