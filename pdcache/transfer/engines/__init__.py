"""KV data engines (zmq, mooncake, nixl) behind `engines.base.KVTransferEngine`."""

from __future__ import annotations

from pdcache.transfer.engines.base import (
    ENGINES,
    EngineError,
    EngineTimeout,
    KVTransferEngine,
    create_engine,
)

__all__ = ["ENGINES", "EngineError", "EngineTimeout", "KVTransferEngine", "create_engine"]
