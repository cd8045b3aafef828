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

Hybrid models (docs/design.md §4.14): a node's state checkpoint (`RadixNode.state_slot`, a slot
of the engine's `StateSlots`) is backed up with its pages: snapshotted into a host state slot
(`RadixNode.host_state_slot`) when its pages reach host, and written to storage as a state
object under `state_key(key of the node's last page, geometry)` after them. Only the tree's
checkpoints are written (the prompt's last full page, branch points, the answer's end:
the points a later request can hit), never every page. A checkpoint taken after its node was
backed up (the scheduler shows the node again, `backup`) or still on the node at its device
eviction is backed up then. No host state slot (after dropping the least recently used host
checkpoint) skips the state, counted: its pages' hits then end at an earlier checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pdcache.engine.radix import RadixNode
from pdcache.engine.state_cache import DeviceCheckpoints
from pdcache.kernels import KernelSet
from pdcache.offload_manager.hiradix import HiRadixTree
from pdcache.offload_manager.io_worker import IoKind, IoResult, IoTask, IoWorker
from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.config import storage_session, tenant_namespace

# (pages, host copies never to evict for them) -> host page ids, or None when there is no room
AllocHost = Callable[[int, frozenset[RadixNode]], list[int] | None]
PageKeys = Callable[[Sequence[int], str], list[bytes]]  # (tokens, salt) -> storage keys
Count = Callable[..., None]  # count(counter=delta, ...): the owner's stats, under its lock
# (host checkpoints never to drop for it) -> a host state slot, or None when there is no room
AllocHostState = Callable[[frozenset[RadixNode]], int | None]


class StorageWriter(Protocol):
    """Writes backed-up host pages to storage. The writer pins `host_ids` until the write
    has ended (the pages must not be reused while read). `Backup` writes through its own
    `IoWorker` unless it is given one (the cluster simulator's store, `pdcache.sim.cache`)."""

    def write_pages(self, keys: list[bytes], host_ids: list[int], namespace: str,
                    session: str) -> None: ...


class Backup:
    """Backs nodes up to host and storage under `write_policy` / `host_mode` (module
    docstring). Engine thread, except the write completions (backup IO thread)."""

    def __init__(self, tree: HiRadixTree, device_kv: torch.Tensor, kernels: KernelSet,
                 storage: StorageBackend | None, write_policy: str, write_through_threshold: int,
                 host_mode: str, max_queued_io: int, page_keys: PageKeys, alloc_host: AllocHost,
                 count: Count, states: DeviceCheckpoints | None = None,
                 alloc_host_state: AllocHostState | None = None,
                 storage_writer: StorageWriter | None = None) -> None:
        self.tree = tree
        self.storage_writer = storage_writer  # replaces the IoWorker for page writes
        # the device's checkpoints at node ends: a hybrid model's state slots, or a
        # sliding-window model's window tails (docs/design.md §4.14)
        self.states = states
        self._alloc_host_state = alloc_host_state
        self._writes_states = bool(storage is not None and states is not None
                                   and storage.supports_states)
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
    def writes_storage(self) -> bool:
        """Backed-up pages are also written to storage (an IoWorker or a `storage_writer`)."""
        return self.worker is not None or self.storage_writer is not None

    @property
    def writes_on_evict(self) -> bool:
        """Backups happen at device eviction (write_back, or an exclusive host tier), not on
        insert."""
        return self.write_policy == "write_back" or self.host_mode == "exclusive"

    def backup(self, token_ids: Sequence[int], salt: str, last_node: RadixNode | None) -> None:
        """Apply the write policy to the nodes on the path to `last_node` (just inserted or
        hit): copy them to host and write them to storage. An exclusive host frees the host
        copies of the path's nodes that are on device again (`_release_host_copies`)."""
        if last_node is not None and self.host_mode == "exclusive":
            self._release_host_copies(last_node)
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
            elif self._state_pending(node):  # a checkpoint taken after its pages' backup
                keys = keys or self._page_keys(token_ids, salt)
                self._backup_state(node, keys[offset + node.num_pages - 1],
                                   (offset + node.num_pages) * self.tree.page_size, keep)
            offset += node.num_pages

    def _release_host_copies(self, last_node: RadixNode) -> None:
        """Exclusive host: a node holds its pages on one tier. A request that recomputed
        pages whose node was on host only (its host match cut short: a prompt logprob
        span, a hybrid point without a host checkpoint) gave the node device pages on
        insert; its host copy then only took room (kept until host eviction reached it).
        A node whose host state has no device checkpoint beside it keeps its host copy."""
        ids = [page for node in last_node.path_from_root()
               if node.on_device and not node.suspect and node.host_page_ids is not None
               and (node.host_state_slot is None
                    or (self.states is not None and self.states.has_checkpoint(node)))
               for page in node.host_page_ids]
        if ids:
            self._count(host_released_pages=self.tree.drop_host_copies(last_node, ids))

    def on_device_evict(self, node: RadixNode, page_ids: list[int]) -> None:
        """write_back / exclusive host: the last chance to keep this node's KV is before its
        pages are freed. Room on host is made by the host eviction policy (an exclusive
        tier only when the victim ranks above what it would evict). A write_back host that
        never evicted here froze once full: every later victim was dropped, not even
        written to storage."""
        if not self.writes_on_evict:
            return
        if node.backed_up:
            if self._state_pending(node) and node.key:
                self._backup_state_of(node)
            return
        if self.host_mode == "exclusive":
            if not self.tree.host_admits(node, len(page_ids)):
                self._count(victim_dropped_pages=len(page_ids))
                return
        host_ids = self._alloc_host(len(page_ids), frozenset())
        if host_ids is None:
            self._count(backup_skipped_pages=len(page_ids))
            return
        self._copy_to_host(node, page_ids, host_ids)
        if self.writes_storage and node.key:
            self._write(self._node_keys(node), host_ids, tenant_namespace(node.salt),
                        node.session_id)
        if self._state_pending(node) and node.key:
            self._backup_state_of(node)

    def on_checkpoint_drop(self, node: RadixNode) -> None:
        """write_back: a device checkpoint dropped for room (the least recently used) is the
        last chance to keep the state at `node` — its pages reach host at their eviction, the
        state would not. Backed up now, with the node's pages when they have no host copy
        yet. An exclusive host keeps a node on one tier only: there the state goes up only
        with pages already on host. write_through backed it up when it was taken."""
        if not self.writes_on_evict or self.states is None or not node.key:
            return
        if node.host_page_ids is None and self.host_mode != "exclusive":
            assert node.device_page_ids is not None
            self.on_device_evict(node, node.device_page_ids)  # pages, then the state
        elif self._state_pending(node):
            self._backup_state_of(node)

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
        if self.writes_storage:
            self._write(keys, host_ids, tenant_namespace(node.salt), node.session_id)
        if self._state_pending(node):
            tokens = sum(n.num_pages for n in node.path_from_root()) * self.tree.page_size
            self._backup_state(node, keys[-1], tokens, keep)

    def _copy_to_host(self, node: RadixNode, device_ids: list[int], host_ids: list[int]) -> None:
        """The node's device pages → `host_ids`, which become its host copy."""
        self.kernels.device_to_host(self.device_kv, self.host_pool.host_kv,
                                    torch.tensor(device_ids, dtype=torch.long),
                                    torch.tensor(host_ids, dtype=torch.long))
        self.host_pool.commit(host_ids)
        node.host_page_ids = host_ids
        self._count(backup_host_pages=len(host_ids),
                    backup_host_kv_bytes=len(host_ids) * self.host_pool.page_nbytes)

    def _write(self, keys: list[bytes], host_ids: list[int], namespace: str = "",
               session: str = "") -> None:
        if self.storage_writer is not None:
            self.storage_writer.write_pages(keys, host_ids, namespace, session)
            return
        assert self.worker is not None
        self.host_pool.pin(host_ids)

        def done(result: IoResult) -> None:  # backup IO thread
            ok = sum(result.ok)
            # counted before the unpin: `HiCache.io_idle` (no page pinned) must imply that
            # every finished write's counters are final
            self._count(backup_storage_pages=ok, backup_failed_pages=len(keys) - ok,
                        backup_storage_kv_bytes=ok * self.host_pool.page_nbytes,
                        storage_errors=1 if result.error else 0)
            self.host_pool.unpin(host_ids)

        task = IoTask(IoKind.WRITE, keys, self.host_pool.page_bytes(host_ids), done, "prefill",
                      namespace=namespace, session=storage_session(namespace, session))
        if not self.worker.submit(task):
            self.host_pool.unpin(host_ids)
            self._count(backup_failed_pages=len(keys))

    # ---- state checkpoints (hybrid models) -----------------------------------------------
    def _state_pending(self, node: RadixNode) -> bool:
        """`node` has a device checkpoint and host pages but no host checkpoint yet."""
        return (self.states is not None and node.host_page_ids is not None
                and node.host_state_slot is None and self.states.has_checkpoint(node))

    def _backup_state_of(self, node: RadixNode) -> None:
        path = node.path_from_root()
        tokens = [t for n in path for t in n.key]
        self._backup_state(node, self._page_keys(tokens, node.salt)[-1], len(tokens),
                           frozenset(path))

    def _backup_state(self, node: RadixNode, last_page_key: bytes, num_tokens: int,
                      keep: frozenset[RadixNode]) -> None:
        """Device checkpoint → a host state slot (the node's host checkpoint) → storage, as
        the state object of the node's last page."""
        assert self.states is not None and self._alloc_host_state is not None
        host_states = self.tree.host_states
        assert host_states is not None, "a hybrid model's tiers need a host state pool"
        slot = self._alloc_host_state(keep)
        if slot is None:
            self._count(backup_skipped_states=1)
            return
        host_states.store(slot, self.states.snapshot_checkpoint(node))
        self.tree.set_host_checkpoint(node, slot)
        self._count(backup_host_states=1, backup_host_state_bytes=host_states.slot_nbytes)
        if self._writes_states and self.worker is not None:
            key = host_states.geometry.object_key(last_page_key)
            self._write_state(key, slot, num_tokens, tenant_namespace(node.salt),
                              node.session_id)

    def _write_state(self, key: bytes, slot: int, num_tokens: int, namespace: str,
                     session: str) -> None:
        assert self.worker is not None and self.tree.host_states is not None
        host_states = self.tree.host_states
        host_states.pin(slot)

        def done(result: IoResult) -> None:  # backup IO thread
            ok = sum(result.ok)
            self._count(backup_storage_states=ok, backup_failed_states=1 - ok,
                        backup_storage_state_bytes=ok * host_states.slot_nbytes,
                        storage_errors=1 if result.error else 0)
            host_states.unpin(slot)  # after counting, as for pages

        task = IoTask(IoKind.WRITE_STATE, [key], [host_states.data[slot]], done, "prefill",
                      namespace=namespace, session=storage_session(namespace, session),
                      tokens=[num_tokens])
        if not self.worker.submit(task):
            host_states.unpin(slot)
            self._count(backup_failed_states=1)

    def _node_keys(self, node: RadixNode) -> list[bytes]:
        path = node.path_from_root()
        tokens = [t for n in path for t in n.key]
        keys = self._page_keys(tokens, node.salt)
        return keys[-node.num_pages :]
