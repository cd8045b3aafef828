"""Two processes (a prefill and a decode node) share one hf3fs pool through the metadata
service: each reads, byte-exact, the pages the other wrote, with the writer's origin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig
from pdcache.offload_manager.storage.metadata_service import LocalMetadataService

PAGE_BYTES = 8192

_NODE = r"""
import json, sys, torch
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig
cfg = StorageConfig(**json.loads(sys.argv[1]))
backend = create_backend(cfg)
theirs = torch.randint(0, 256, (4, cfg.page_bytes), dtype=torch.uint8,
                       generator=torch.Generator().manual_seed(1))
out = torch.zeros_like(theirs)
origins = []
got = backend.get_into([bytes([1, i]) * 16 for i in range(4)], list(out), origins)
mine = torch.randint(0, 256, (4, cfg.page_bytes), dtype=torch.uint8,
                     generator=torch.Generator().manual_seed(2))
put = backend.put_from([bytes([2, i]) * 16 for i in range(4)], list(mine), origin="decode")
print(json.dumps({"got": got, "exact": bool(torch.equal(out, theirs)), "origins": origins,
                  "put": put}))
backend.close()
"""


def _pages(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (4, PAGE_BYTES), dtype=torch.uint8, generator=gen)


def test_two_processes_share_a_pool(tmp_path: Path) -> None:
    with LocalMetadataService(tmp_path / "state") as service:
        values = dict(
            backend="hf3fs",
            path=str(tmp_path / "data"),
            page_bytes=PAGE_BYTES,
            capacity_pages=32,
            fingerprint="fp",
            metadata=service.address,
        )
        prefill = create_backend(StorageConfig(**values))  # type: ignore[arg-type]
        try:
            assert (
                prefill.put_from([bytes([1, i]) * 16 for i in range(4)], list(_pages(1)))
                == [True] * 4
            )
            proc = subprocess.run(
                [sys.executable, "-c", _NODE, json.dumps(values)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert proc.returncode == 0, proc.stderr[-2000:]
            decode = json.loads(proc.stdout.strip().splitlines()[-1])
            assert decode == {
                "got": [True] * 4,
                "exact": True,
                "origins": ["prefill"] * 4,
                "put": [True] * 4,
            }
            out, origins = torch.zeros(4, PAGE_BYTES, dtype=torch.uint8), []
            keys = [bytes([2, i]) * 16 for i in range(4)]
            assert prefill.get_into(keys, list(out), origins) == [True] * 4
            assert torch.equal(out, _pages(2)) and origins == ["decode"] * 4
            assert prefill.stats()["used_pages"] == 8
        finally:
            prefill.close()
