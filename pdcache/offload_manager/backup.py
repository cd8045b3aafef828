"""Backup: the write policy, device → host → storage (docs/design.md §4.2, §4.9).

Owns the backup `IoWorker` (thread `pdcache-io-backup`, when there is storage) and the policy
decisions: `write_through` backs up every inserted node; `write_through_selective` only nodes
hit at least `write_through_threshold` times; `write_back` backs up a node when the device
evicts it (`on_device_evict`, the tree's eviction hook). With an `exclusive` host tier (a victim
cache) a page enters the host tier only when the device evicts it, and storage writes then
happen at that moment whatever the write policy.

A backup copies a node's device pages to fresh host pages (engine thread: it mutates the node's
`host_page_ids` and the host pool), then queues their storage write; the host pages stay pinned
until the write ended. The write's completion runs on the backup IO thread and touches only
thread-safe state: the host pool's pins (its own lock) and the owner's counters (`count`, which
takes the owner's stats lock). No lock of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdcache.engine.radix import RadixNode
from pdcache.kernels import KernelSet
from pdcache.offload_manager.hiradix import HiRadixTree
from pdcache.offload_manager.io_worker import IoKind, IoResult, IoTask, IoWorker
from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.config import storage_session, tenant_namespace

# (pages, host copies never to evict for them) -> host page ids, or None when there is no room
AllocHost = Callable[[int, frozenset[RadixNode]], list[int] | None]
PageKeys = Callable[[Sequence[int], str], list[bytes]]  # (tokens, salt) -> storage keys
Count = Callable[..., None]  # count(counter=delta, ...): the owner's stats, under its lock


class Backup:
    """Backs nodes up to host and storage under `write_policy` / `host_mode` (module
    docstring). Engine thread, except the write completions (backup IO thread)."""

    def __init__(self, tree: HiRadixTree, device_kv: torch.Tensor, kernels: KernelSet,
                 storage: StorageBackend | None, write_policy: str, write_through_threshold: int,
                 host_mode: str, max_queued_io: int, page_keys: PageKeys, alloc_host: AllocHost,
                 count: Count) -> None:
        self.tree = tree
        self.host_pool = tree.host_pool
        self.device_kv = device_kv
        self.kernels = kernels
        self.write_policy = write_policy
        self.write_through_threshold = write_through_threshold
        self.host_mode = host_mode
        self._page_keys = page_keys
        self._alloc_host = alloc_host
        self._count = count
        self.worker = IoWorker(storage, "backup", max_queued_io) if storage else None

    @property
    def writes_on_evict(self) -> bool:
        """Backups happen at device eviction (write_back, or an exclusive host tier), not on
        insert."""
        return self.write_policy == "write_back" or self.host_mode == "exclusive"

    def backup(self, token_ids: Sequence[int], salt: str, last_node: RadixNode | None) -> None:
        """Apply the write policy to the nodes on the path to `last_node` (just inserted or
        hit): copy them to host and write them to storage."""
        if last_node is None or self.writes_on_evict:
            return
        path = last_node.path_from_root()
        keep = frozenset(path)  # room for a child must not cost its parent's new host copy
        keys: list[bytes] | None = None
        offset = 0
        for node in path:
            if node.on_device and not node.backed_up and self._wants_backup(node):
                keys = keys or self._page_keys(token_ids, salt)
                self._backup_node(node, keys[offset : offset + node.num_pages], keep)
            offset += node.num_pages

    def on_device_evict(self, node: RadixNode, page_ids: list[int]) -> None:
        """write_back / exclusive host: the last chance to keep this node's KV is before its
        pages are freed. write_back never evicts host pages here; the exclusive host tier
        makes room by its host policy when the victim ranks above what it would evict."""
        if not self.writes_on_evict or node.backed_up:
            return
        if self.host_mode == "exclusive":
            if not self.tree.host_admits(node, len(page_ids)):
                self._count(victim_dropped_pages=len(page_ids))
                return
            host_ids = self._alloc_host(len(page_ids), frozenset())
        else:
            host_ids = self.host_pool.alloc(len(page_ids))
        if host_ids is None:
            self._count(backup_skipped_pages=len(page_ids))
            return
        self._copy_to_host(node, page_ids, host_ids)
        if self.worker is not None and node.key:
            self._write(self._node_keys(node), host_ids, tenant_namespace(node.salt),
                        node.session_id)

    def _wants_backup(self, node: RadixNode) -> bool:
        if self.write_policy == "write_through_selective":
            return node.hit_count >= self.write_through_threshold
        return True

    def _backup_node(self, node: RadixNode, keys: list[bytes],
                     keep: frozenset[RadixNode]) -> None:
        host_ids = self._alloc_host(node.num_pages, keep)
        if host_ids is None:
            self._count(backup_skipped_pages=node.num_pages)
            return
        assert node.device_page_ids is not None  # on_device
        self._copy_to_host(node, node.device_page_ids, host_ids)
        if self.worker is not None:
            self._write(keys, host_ids, tenant_namespace(node.salt), node.session_id)

    def _copy_to_host(self, node: RadixNode, device_ids: list[int], host_ids: list[int]) -> None:
        """The node's device pages → `host_ids`, which become its host copy."""
        self.kernels.device_to_host(self.device_kv, self.host_pool.host_kv,
                                    torch.tensor(device_ids, dtype=torch.long),
                                    torch.tensor(host_ids, dtype=torch.long))
        self.host_pool.commit(host_ids)
        node.host_page_ids = host_ids
        self._count(backup_host_pages=len(host_ids))

    def _write(self, keys: list[bytes], host_ids: list[int], namespace: str = "",
               session: str = "") -> None:
        assert self.worker is not None
        self.host_pool.pin(host_ids)

        def done(result: IoResult) -> None:  # backup IO thread
            self.host_pool.unpin(host_ids)
            ok = sum(result.ok)
            self._count(backup_storage_pages=ok, backup_failed_pages=len(keys) - ok,
                        storage_errors=1 if result.error else 0)

        task = IoTask(IoKind.WRITE, keys, self.host_pool.page_bytes(host_ids), done, "prefill",
                      namespace=namespace, session=storage_session(namespace, session))
        if not self.worker.submit(task):
            self.host_pool.unpin(host_ids)
            self._count(backup_failed_pages=len(keys))

    def _node_keys(self, node: RadixNode) -> list[bytes]:
        path = node.path_from_root()
        tokens = [t for n in path for t in n.key]
        keys = self._page_keys(tokens, node.salt)
        return keys[-node.num_pages :]
