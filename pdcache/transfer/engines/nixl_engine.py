"""`nixl` engine: NVIDIA NIXL agents (UCX backend here; UCX/GDS/... on clusters).

The target's `session()` is its NIXL agent metadata (taken after its memory is registered);
the initiator adds it as a remote agent and posts one WRITE request per batch, polled with
`check_xfer_state`. UCX reads its settings only from the environment; machines without
InfiniBand need UCX_NET_DEVICES=lo when the host is loopback and UCX_MODULES='^ib*'
(otherwise processes that loaded UCX next to libibverbs crash at exit). `NixlEngine` never
writes them: `NixlEngine.environment(config, os.environ)` gives them to the process entry
point, which sets them once before UCX loads. Each agent runs a UCX progress thread that the
target needs (TCP is a software transport: the target's worker must progress for data to land)
and that polls with no delay, so a live engine uses one core; `close()` destroys the agent.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcache.transfer.config import TransferConfig
from pdcache.transfer.engines.base import EngineError, EngineTimeout, KVTransferEngine
from pdcache.transfer.layout import WriteBatch
from pdcache.utils.registry import import_optional

_PACKAGE = "nixl-cu12"
_DRAM = "DRAM"


def _load_api():
    return import_optional("nixl_cu12._api", "transfer engine 'nixl'", _PACKAGE)


@dataclass
class _Ticket:
    peer: str
    handle: Any
    nbytes: int
    done: bool = False


class NixlEngine(KVTransferEngine):
    """See the module docstring. NIXL agent calls are serialised by one lock."""

    name = "nixl"

    @classmethod
    def environment(cls, config: TransferConfig, inherited: Mapping[str, str]) -> dict[str, str]:
        """UCX defaults (module docstring); inherited values win."""
        wanted = {"UCX_MODULES": "^ib*"}
        if config.local_host in ("127.0.0.1", "localhost"):
            wanted["UCX_NET_DEVICES"] = "lo"
        return {key: value for key, value in wanted.items() if key not in inherited}

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        api = _load_api()
        self._agent_name = f"pdcache-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        agent_config = api.nixl_agent_config(backends=[config.nixl_backend])
        self._agent: Any = api.nixl_agent(self._agent_name, agent_config)
        if config.nixl_backend not in self._agent.backends:
            raise EngineError(f"nixl: backend {config.nixl_backend!r} is not available "
                              f"(plugins: {self._agent.get_plugin_list()})")
        self._lock = threading.Lock()
        self._registered: list[Any] = []

    def _live(self) -> Any:
        """The agent; the caller holds `_lock`. After `close()` every call is an EngineError."""
        if self._agent is None:
            raise EngineError("nixl: the engine is closed")
        return self._agent

    def session(self) -> bytes:
        with self._lock:
            return bytes(self._live().get_agent_metadata())

    def register_target(self, addr: int, nbytes: int) -> None:
        self._register(addr, nbytes)

    def register_source(self, addr: int, nbytes: int) -> None:
        self._register(addr, nbytes)

    def _register(self, addr: int, nbytes: int) -> None:
        with self._lock:
            try:
                descs = self._live().register_memory([(addr, nbytes, 0, "")], _DRAM)
            except Exception as exc:
                raise EngineError(f"nixl: register_memory({addr:#x}, {nbytes}): {exc}") from exc
            self._registered.append(descs)

    def add_peer(self, session: bytes) -> str:
        with self._lock:
            try:
                name = self._live().add_remote_agent(session)
            except Exception as exc:
                raise EngineError(f"nixl: bad peer metadata ({exc})") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            try:
                self._live().remove_remote_agent(peer)
            except Exception:
                pass  # already gone

    def submit(self, peer: str, batch: WriteBatch) -> _Ticket:
        zeros = np.zeros(len(batch), dtype=np.uint64)
        local = np.stack([batch.srcs.astype(np.uint64), batch.lengths.astype(np.uint64), zeros], 1)
        remote = np.stack([batch.dsts.astype(np.uint64), batch.lengths.astype(np.uint64), zeros],
                          1)
        with self._lock:
            try:
                agent = self._live()
                local_descs = agent.get_xfer_descs(local, _DRAM)
                remote_descs = agent.get_xfer_descs(remote, _DRAM)
                handle = agent.initialize_xfer("WRITE", local_descs, remote_descs, peer)
                state = agent.transfer(handle)
            except Exception as exc:
                raise EngineError(f"nixl → {peer}: posting a write failed ({exc})") from exc
        ticket = _Ticket(peer, handle, batch.nbytes)
        if state == "ERR":
            self._finish(ticket)
            raise EngineError(f"nixl → {peer}: write of {batch.nbytes} bytes was rejected")
        return ticket

    def wait(self, ticket: _Ticket, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pause = 50e-6  # back off to 1 ms: UCX's own progress thread already spins
        while True:
            state = self._state(ticket)
            if state == "DONE":
                self._finish(ticket)
                return
            if state != "PROC":
                self._finish(ticket)
                raise EngineError(f"nixl → {ticket.peer}: write of {ticket.nbytes} bytes failed")
            if time.monotonic() >= deadline:
                raise EngineTimeout(f"nixl → {ticket.peer}: not done in {timeout_s:.3g}s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _state(self, ticket: _Ticket) -> str:
        with self._lock:
            try:
                return self._live().check_xfer_state(ticket.handle)
            except Exception:
                return "ERR"

    def _finish(self, ticket: _Ticket) -> None:
        if ticket.done:
            return
        ticket.done = True
        with self._lock:
            try:
                self._live().release_xfer_handle(ticket.handle)
            except Exception:
                pass  # NIXL could not cancel an active transfer; nothing else to do

    def cancel(self, ticket: _Ticket) -> None:
        """Releasing the handle of a transfer still in PROC asks NIXL to cancel it, which a
        backend may refuse (the write then goes on): `drain` (the base class's) cancels only
        after the state left PROC or its bound passed, and says which."""
        self._finish(ticket)

    def close(self) -> None:
        with self._lock:
            agent = self._agent
            if agent is None:
                return
            registered, self._registered = self._registered, []
            for descs in registered:
                try:
                    agent.deregister_memory(descs)
                except Exception:
                    pass
            # Dropping the C++ agent joins its UCX progress thread, which polls with no delay
            # (NIXL's Python API sets none): an agent kept past close() spins a core until
            # the process exits. Our reference to the Python wrapper is not always its last
            # (a traceback, a failed test's frames keep `agent` locals: ten such agents at
            # 100 % each starved a whole CI run), so the wrapper lets go of the C++ agent too.
            self._agent = None
            with contextlib.suppress(Exception):  # a wrapper without the attribute
                agent.agent = None  # the wrapper is never used after this
