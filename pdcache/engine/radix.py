"""Radix prefix tree of the device tier, at page granularity.

Each edge holds whole pages: `node.key` is `num_pages * page_size` token ids and
`node.device_page_ids` the device pages holding their K/V. Children are keyed by the tokens of
their first page, so siblings always differ in their first page and a split happens only at
a page boundary. Trees are namespaced by `cache_salt`: each salt has its own root, so two
salts never share a node (nor a page).

Ownership: a page listed in a node belongs to the tree until `evict` frees it back to the
`PageAllocator`. Requests that reuse a prefix `lock` its last node (lock refs count up the
whole path); a node with `lock_ref > 0` is never evicted. `evict` frees unlocked leaves in
`policy` order; under a policy with `stable_keys` (LRU) it keeps them ranked across passes
(`_LeafHeap`, lazily invalidated: every change that may make a node evictable re-pushes it,
`_note_leaf`), so a pass costs its victims, not a walk of the tree.

Threading: nothing here locks. Every method must be called from the engine thread (the one
that owns the allocator and the requests).

HiCache extension points (`pdcache.offload_manager`): a node carries `host_page_ids`
(None = not on host) and `hit_count`; `device_page_ids is None` means its device copy was
evicted while the node lives on (host-only). The invariant is that on-device nodes form a
top sub-tree: a node on device has its parent on device. `match_prefix` stops at the first
node that is not on device; `_on_device_evicted(node)` decides whether a node whose device
pages were freed is removed (here: when it has no host copy and no children) and
`on_evict(node, page_ids)` observes every device eviction before the pages are freed.

Layer kinds (docs/design.md §4.14): a match is a hit only at a point where the cache of every
layer kind can be restored. Full attention needs the matched pages, which the walk itself
guarantees. Other kinds add a `RestoreRule` (`restore_rules`): a linear layer
(`StateCheckpointRule`) needs the recurrent state after exactly the hit's last token, i.e. a
node end carrying a state checkpoint (`node.state_slot`, a slot of the engine's
`RecurrentStatePool` that the tree owns until it frees it through `checkpoints`, exactly once:
with the node's device pages, or before them when `drop_lru_checkpoint` makes room); a
sliding layer whose pages out of every window are freed (`SlidingWindowRule`, window pages:
`pdcache.engine.window_pages`) needs the sliding pages of the `window - 1` tokens before the
point (`node.window_page_ids`, owned by the tree and freed through `window_allocator` with
the node's device pages; None entries are tombstones). The hit is the deepest
point every rule accepts (the minimum over kinds); `MatchResult.limited_by` names the rule that
refused the deeper page match, and `count_match` counts it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdcache.engine.eviction import EvictionPolicy, EvictKey, LruPolicy, SessionTracker
from pdcache.engine.kv_pool import PageAllocator

PageKey = tuple[int, ...]


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree: whole pages of tokens and where their K/V lives."""

    key: PageKey
    parent: RadixNode | None
    salt: str
    num_pages: int
    device_page_ids: list[int] | None = None
    host_page_ids: list[int] | None = None
    lock_ref: int = 0
    hit_count: int = 0
    last_access: int = 0
    session_id: str = ""  # the conversation that last used this node ("" = none known)
    children: dict[PageKey, RadixNode] = field(default_factory=dict)
    # hybrid models: the pool slot holding the recurrent state after this node's last token
    # (owned by the tree; None = no checkpoint here)
    state_slot: int | None = None
    # HiCache (hybrid models): the host state pool slot holding the same checkpoint, kept with
    # the node's host pages (owned by `HiRadixTree`; None = no host checkpoint)
    host_state_slot: int | None = None
    # sliding-window models with window pages (pdcache.engine.window_pages): the sliding
    # layers' page of each page of the node, None where it was freed (a tombstone); None for
    # other models and for a node without device pages
    window_page_ids: list[int | None] | None = None
    # its device pages may not hold its tokens' K/V (a host → device load into them failed
    # after the node was restored): never matched, dropped once unlocked (`drop_suspects`)
    suspect: bool = False

    @property
    def on_device(self) -> bool:
        return self.device_page_ids is not None

    @property
    def backed_up(self) -> bool:
        return self.host_page_ids is not None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def num_device_pages(self) -> int:
        return self.num_pages if self.device_page_ids is not None else 0

    def path_from_root(self) -> list[RadixNode]:
        """Nodes from the first below the root down to this one."""
        path: list[RadixNode] = []
        node: RadixNode | None = self
        while node is not None and not node.is_root:
            path.append(node)
            node = node.parent
        return path[::-1]


@dataclass
class MatchResult:
    """A device-resident prefix: `page_ids` hold tokens `[0, cached_len)`.

    `last_node` is the deepest node the match touched (it may extend past `cached_len` when the
    match ended inside it); lock it to keep `page_ids` alive. It is the salt's root (or None
    when the salt has no tree yet) for an empty match. `matched_len` is the device pages'
    match before the restore rules cut it to `cached_len`; `limited_by` names the rule that
    refused the deeper point (e.g. "state": no checkpoint of a linear layer's state there).
    """

    page_ids: list[int]
    cached_len: int
    last_node: RadixNode | None
    matched_len: int = 0
    limited_by: str | None = None
    # sliding-window models: the sliding layers' pages of `page_ids` (None: a tombstone)
    window_page_ids: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.matched_len = max(self.matched_len, self.cached_len)


class RestoreRule(Protocol):
    """Whether one layer kind's cache can be restored after the first `num_pages` pages of
    `node` (its pages on device; `start_page`: the pages before `node` on its path, which
    the caller walking the path knows). `kind` is the geometry's layer kind ("linear",
    "sliding"); `reason` what `MatchResult.limited_by` says when it refuses."""

    kind: str
    reason: str

    def restorable(self, node: RadixNode, num_pages: int, start_page: int) -> bool: ...


@dataclass(frozen=True)
class StateCheckpointRule:
    """Linear layers: the recurrent state exists only at a node end with a checkpoint."""

    kind: str = "linear"
    reason: str = "state"

    def restorable(self, node: RadixNode, num_pages: int, start_page: int) -> bool:
        return num_pages == node.num_pages and node.state_slot is not None


@dataclass(frozen=True)
class SlidingWindowRule:
    """Sliding layers whose pages out of every live window were freed: a point is
    restorable when the sliding pages of its last `window - 1` tokens (all that attention
    from it reads) are still there, in the node or its ancestors."""

    window: int
    page_size: int
    kind: str = "sliding"
    reason: str = "window"

    def restorable(self, node: RadixNode, num_pages: int, start_page: int) -> bool:
        end = start_page + num_pages  # the point, in pages
        first = max(0, end * self.page_size - self.window + 1) // self.page_size
        needed, index, item = end - first, num_pages, node
        while needed > 0 and item is not None and not item.is_root:
            pages = item.window_page_ids
            for page in range(index - 1, max(index - needed, 0) - 1, -1):
                if pages is None or pages[page] is None:
                    return False
            needed -= index
            item = item.parent
            index = item.num_pages if item is not None else 0
        return True


class CheckpointSlots(Protocol):
    """Who takes back a checkpoint slot the tree frees (`pdcache.engine.state_cache`)."""

    def free_checkpoint(self, slot: int) -> None: ...

    def is_used(self, slot: int) -> bool: ...


@dataclass
class InsertResult:
    """`duplicate_page_ids`: pages of the caller whose tokens the tree already held on device;
    the caller still owns them and must free them. Every other given page now belongs to the
    tree."""

    duplicate_page_ids: list[int]
    last_node: RadixNode
    num_new_pages: int
    # window pages: the caller's sliding pages the tree already had (freed by the caller)
    duplicate_window_page_ids: list[int] = field(default_factory=list)


EvictCallback = Callable[[RadixNode, list[int]], None]


class RadixTree:
    """Page-granular prefix tree over the device pages of one `PageAllocator`."""

    def __init__(
        self,
        page_size: int,
        allocator: PageAllocator,
        on_evict: EvictCallback | None = None,
        policy: EvictionPolicy | None = None,
        sessions: SessionTracker | None = None,
        *,
        restore_rules: Sequence[RestoreRule] = (),
        checkpoints: CheckpointSlots | None = None,
        window_allocator: PageAllocator | None = None,
    ) -> None:
        """`policy` ranks device evictions (default LRU); `sessions` (shared with the
        policies that read it) learns conversations from `note_session`; `restore_rules`
        cut matches to restorable points (none: every matched page is a hit);
        `checkpoints` takes back the state checkpoints nodes carry (hybrid models);
        `window_allocator` the sliding layers' pages nodes carry (window pages)."""
        self.page_size = page_size
        self.allocator = allocator
        self.on_evict = on_evict
        # sees a checkpoint `drop_lru_checkpoint` is about to free (HiCache under write_back
        # backs it up: the last chance to keep the state there)
        self.on_checkpoint_drop: Callable[[RadixNode], None] | None = None
        self.policy: EvictionPolicy = policy or LruPolicy()
        self.sessions = sessions
        self._roots: dict[str, RadixNode] = {}
        self._clock = itertools.count(1)
        self._device_pages = 0  # device pages owned by the tree
        self._locked_pages = 0  # ... of which in nodes with lock_ref > 0
        self.num_evicted_pages = 0
        self.restore_rules: tuple[RestoreRule, ...] = tuple(restore_rules)
        self.checkpoints = checkpoints
        # the nodes with a state_slot, by id: the LRU drop looks at these, not the whole tree
        self._checkpoint_nodes: dict[int, RadixNode] = {}
        self.window_allocator = window_allocator
        self._window_pages = 0  # sliding pages owned by the tree (tombstones not counted)
        self.num_evicted_checkpoints = 0  # freed with their node's pages
        self.num_dropped_checkpoints = 0  # freed alone, to make room for a newer one
        self.limited_matches: dict[str, int] = {}  # admissions cut by a rule, by reason
        self.limited_tokens: dict[str, int] = {}  # ... and the matched tokens they lost
        # stable-key policies: the evictable leaves, ranked, kept across passes (`evict`)
        self._leaf_heap: _LeafHeap | None = None
        self._suspects: list[RadixNode] = []  # `mark_suspect`, until `drop_suspects`
        self.num_dropped_suspect_pages = 0

    # ---- sizes -------------------------------------------------------------------------
    @property
    def total_pages(self) -> int:
        """Device pages the tree owns."""
        return self._device_pages

    @property
    def locked_pages(self) -> int:
        return self._locked_pages

    @property
    def evictable_pages(self) -> int:
        """Device pages `evict` could free now (all pages of unlocked nodes)."""
        return self._device_pages - self._locked_pages

    @property
    def window_pages(self) -> int:
        """Sliding-layer pages the tree owns (window pages)."""
        return self._window_pages

    @property
    def num_checkpoints(self) -> int:
        """State checkpoints (pool slots) the tree owns."""
        return len(self._checkpoint_nodes)

    # ---- lookup ------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], salt: str = "") -> MatchResult:
        """Longest prefix of `token_ids`' full pages under `salt` that is on device and
        restorable for every layer kind (`restore_rules`; see the module docstring).

        Read-only: mutates nothing, not even LRU clocks (`lock` touches the path)."""
        path = self._device_path(token_ids, salt)
        match = self._pages_of(path, salt)
        if not self.restore_rules or not path:
            return match
        done = match.cached_len // self.page_size
        limited_by = self._refusal(path[-1][0], path[-1][1], done - path[-1][1])
        if limited_by is None:
            return match
        for node, matched in reversed(path):  # the deepest point every rule accepts
            done -= matched
            for num_pages in range(matched, 0, -1):
                if self._refusal(node, num_pages, done) is None:
                    hit = done + num_pages
                    return MatchResult(match.page_ids[:hit], hit * self.page_size, node,
                                       match.cached_len, limited_by,
                                       match.window_page_ids[:hit])
        return MatchResult([], 0, self._roots.get(salt), match.cached_len, limited_by)

    def match_pages(self, token_ids: Sequence[int], salt: str = "") -> MatchResult:
        """Longest device-resident prefix of `token_ids`' full pages under `salt`, whatever
        the restore rules say (where a request's own pages went: `Scheduler.cache_prompt`).
        Read-only."""
        return self._pages_of(self._device_path(token_ids, salt), salt)

    def _pages_of(self, path: list[tuple[RadixNode, int]], salt: str) -> MatchResult:
        """The match of a device path (`_device_path`)."""
        last_node = self._roots.get(salt)
        page_ids: list[int] = []
        window_page_ids: list[int | None] = []
        for node, matched in path:
            page_ids.extend(node.device_page_ids[:matched])
            if self.window_allocator is not None:
                # one window entry per page, whatever the node: a short list would shift
                # every later node's sliding pages onto the wrong positions
                window_page_ids.extend(self._window_list(node)[:matched])
            last_node = node
        return MatchResult(page_ids, len(page_ids) * self.page_size, last_node,
                           window_page_ids=window_page_ids)

    def node_at(self, token_ids: Sequence[int], salt: str = "") -> RadixNode | None:
        """The on-device node whose last token is exactly the last of `token_ids` (whole
        pages), or None when the device path does not end at a node boundary there."""
        path = self._device_path(token_ids, salt)
        matched = sum(pages for _, pages in path) * self.page_size
        if not path or matched != len(token_ids) or path[-1][1] != path[-1][0].num_pages:
            return None
        return path[-1][0]

    def count_match(self, match: MatchResult) -> None:
        """Count an admission's match that a restore rule cut (stats: `limited_matches`)."""
        if match.limited_by is None:
            return
        reason = match.limited_by
        self.limited_matches[reason] = self.limited_matches.get(reason, 0) + 1
        lost = match.matched_len - match.cached_len
        self.limited_tokens[reason] = self.limited_tokens.get(reason, 0) + lost

    def _device_path(self, token_ids: Sequence[int],
                     salt: str) -> list[tuple[RadixNode, int]]:
        path: list[tuple[RadixNode, int]] = []
        for node, matched in self.walk(token_ids, salt):
            if not node.on_device or node.suspect:
                break
            path.append((node, matched))
        return path

    def _refusal(self, node: RadixNode, num_pages: int, start_page: int) -> str | None:
        """The reason of the first rule that cannot restore after `num_pages` of `node`
        (`start_page` pages before it on its path)."""
        for rule in self.restore_rules:
            if not rule.restorable(node, num_pages, start_page):
                return rule.reason
        return None

    def walk(self, token_ids: Sequence[int], salt: str = "") -> list[tuple[RadixNode, int]]:
        """The nodes `token_ids`' full pages run through, whatever their residency, each with
        how many of its pages match (only the last may match partially). Read-only; the
        host tier uses it to find host-resident pages below the device prefix."""
        node = self._roots.get(salt)
        tokens = tuple(token_ids)
        num_pages = len(tokens) // self.page_size
        path: list[tuple[RadixNode, int]] = []
        done = 0
        while node is not None and done < num_pages:
            child = node.children.get(self._page_at(tokens, done))
            if child is None:
                break
            matched = self._count_matching_pages(child.key, tokens, done)
            path.append((child, matched))
            done += matched
            node = child if matched == child.num_pages else None
        return path

    # ---- insert ------------------------------------------------------------------------
    def insert(
        self, token_ids: Sequence[int], page_ids: Sequence[int], salt: str = "",
        window_page_ids: Sequence[int | None] | None = None,
    ) -> InsertResult:
        """Record that `page_ids[i]` holds the K/V of full page i of `token_ids` (and
        `window_page_ids[i]` its sliding layers', None where freed: window pages).

        Mutates the tree (may split nodes, create one leaf) and the LRU clocks of the path.
        Takes ownership of every given page except the returned duplicates; a tombstone of
        the tree takes the caller's sliding page for it."""
        tokens = tuple(token_ids)
        num_pages = min(len(page_ids), len(tokens) // self.page_size)
        node = self._root_for(salt)
        done, duplicates, now = 0, [], next(self._clock)
        window_duplicates: list[int] = []
        while done < num_pages:
            child = node.children.get(self._page_at(tokens, done))
            if child is None:
                node = self._add_leaf(node, tokens, page_ids, done, num_pages, window_page_ids)
                node.last_access = now
                self._note_leaf(node)
                return InsertResult(duplicates, node, num_pages - done, window_duplicates)
            matched = self._count_matching_pages(child.key, tokens, done, num_pages - done)
            if matched < child.num_pages:
                child = self._split(child, matched)
            duplicates += self._adopt_or_dedupe(child, page_ids[done : done + matched])
            if window_page_ids is not None:
                window_duplicates += self._merge_window(
                    child, window_page_ids[done : done + matched])
            child.last_access = now
            node, done = child, done + matched
        self._note_leaf(node)  # the nodes above it have it as an on-device child
        return InsertResult(duplicates, node, 0, window_duplicates)

    # ---- lock refs ---------------------------------------------------------------------
    def lock(self, node: RadixNode | None) -> None:
        """Protect `node` and its ancestors from eviction; touches their LRU clocks. Every
        `lock` needs exactly one `unlock` of the same node."""
        now = next(self._clock)
        for item in self._ancestors(node):
            if item.lock_ref == 0:
                self._locked_pages += item.num_device_pages
            item.lock_ref += 1
            item.last_access = now

    def count_hit(self, node: RadixNode | None) -> None:
        """A request was admitted on `node`'s path: its and its ancestors' hit counts (the
        write_through_selective threshold). Counted once per request; `lock` counted the
        scheduler's own locks too (a prompt seen once counted up to a hit per page)."""
        for item in self._ancestors(node):
            item.hit_count += 1

    def unlock(self, node: RadixNode | None) -> None:
        for item in self._ancestors(node):
            if item.lock_ref <= 0:
                raise AssertionError("unlock of a radix node that is not locked")
            item.lock_ref -= 1
            if item.lock_ref == 0:
                self._locked_pages -= item.num_device_pages
                self._note_leaf(item)

    # ---- suspect device pages ------------------------------------------------------------
    def mark_suspect(self, nodes: Iterable[RadixNode]) -> None:
        """The device pages of `nodes` may not hold their K/V (a load into them failed): no
        match goes into them from now on; `drop_suspects` frees them."""
        for node in nodes:
            if not node.suspect:
                node.suspect = True
                self._suspects.append(node)

    @property
    def has_suspects(self) -> bool:
        return bool(self._suspects)

    def on_suspect_path(self, node: RadixNode | None) -> bool:
        """Whether `node` or an ancestor is suspect (a request locking it read them)."""
        return any(item.suspect for item in self._ancestors(node))

    def drop_suspects(self) -> int:
        """Free the device copies of the suspect nodes and of everything on device below
        them (computed on top of them), without the eviction hook: none of it may reach a
        lower tier. A node keeps its host copy (HiCache: the host pages the failed load read
        are intact). Nodes still locked wait for a later call. Returns the pages freed."""
        freed, left = 0, []
        on_evict, self.on_evict = self.on_evict, None
        try:
            for node in self._suspects:
                below = [item for item in [node, *self._descendants(node)] if item.on_device]
                if any(item.lock_ref > 0 for item in below):
                    left.append(node)
                    continue
                for item in reversed(below):  # children first: device nodes stay a top tree
                    freed += self._evict_device(item)
                node.suspect = False
        finally:
            self.on_evict = on_evict
        self._suspects = [node for node in left if node.suspect]
        self.num_dropped_suspect_pages += freed
        return freed

    def _descendants(self, node: RadixNode) -> list[RadixNode]:
        """Every node below `node`, parents before children."""
        found, stack = [], list(node.children.values())
        while stack:
            item = stack.pop()
            found.append(item)
            stack.extend(item.children.values())
        return found

    # ---- sessions ----------------------------------------------------------------------
    def note_session(self, node: RadixNode | None, session_id: str, new_turn: bool) -> None:
        """`node` and its ancestors now serve conversation `session_id` (a shared prefix
        belongs to the last session that used it); `new_turn`: a turn of it arrived."""
        if not session_id:
            return
        if new_turn and self.sessions is not None:
            self.sessions.observe_turn(session_id)
        for item in self._ancestors(node):
            item.session_id = session_id

    # ---- eviction ----------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free the device pages of unlocked leaves, in the order of `self.policy` (LRU by
        default), until at least `num_pages` are freed or nothing evictable is left; returns
        the pages freed (whole nodes are freed, so it may exceed `num_pages`)."""
        if num_pages <= 0 or self.evictable_pages == 0:
            return 0
        heap = self._eviction_heap()
        freed = 0
        while freed < num_pages:
            node = heap.pop_evictable(self._evictable)
            if node is None:
                break
            parent = node.parent
            freed += self._evict_device(node)
            if parent is not None and self._evictable(parent):
                heap.push(parent)
        return freed

    def _eviction_heap(self) -> _LeafHeap:
        """The ranked device leaves of this pass. A policy with stable keys keeps one heap
        across passes (`_leaf_heap`, fed by `_note_leaf`, rebuilt when garbage outgrows the
        tree); any other policy ranks every leaf afresh against one `key_fn()` snapshot."""
        if not self.policy.stable_keys:
            self._leaf_heap = None
            return _LeafHeap(self.policy, self._device_leaves(), check_keys=False)
        heap = self._leaf_heap
        if heap is None or heap.policy is not self.policy:
            heap = self._leaf_heap = _LeafHeap(self.policy, self._device_leaves(),
                                               check_keys=True)
        return heap

    def _device_leaves(self) -> list[RadixNode]:
        """The `_evictable` nodes in `_iter_nodes` order, in one inlined walk (it runs on
        every pass of a policy without stable keys) that skips the sub-trees off device:
        nothing below a node off device is on device."""
        found: list[RadixNode] = []
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            if node.device_page_ids is None:
                continue
            children = node.children
            leaf = True
            if children:
                stack.extend(children.values())
                leaf = all(child.device_page_ids is None for child in children.values())
            if leaf and node.lock_ref == 0:
                found.append(node)
        return found

    def _note_leaf(self, node: RadixNode) -> None:
        """`node` may have become evictable or changed its key: the kept heap must rank it
        (a stale entry is skipped when it surfaces)."""
        heap = self._leaf_heap
        if heap is None or not self._evictable(node):
            return
        if len(heap) > 2 * self._device_pages + 64:  # mostly stale: rebuilt by the next pass
            self._leaf_heap = None
            return
        heap.push(node)

    def flush(self) -> int:
        """Evict everything that is not locked; returns the pages freed."""
        return self.evict(self._device_pages)

    # ---- state checkpoints (hybrid models) ---------------------------------------------
    def set_checkpoint(self, node: RadixNode, slot: int) -> bool:
        """`slot` holds the recurrent state after `node`'s last token: the tree owns it now.
        False (the caller keeps `slot`) when `node` already has one (the same state)."""
        assert node.on_device and not node.is_root, "a checkpoint needs an on-device node"
        if node.state_slot is not None:
            return False
        node.state_slot = slot
        self._checkpoint_nodes[id(node)] = node
        return True

    def drop_lru_checkpoint(self) -> bool:
        """Free the least recently used checkpoint (unlocked nodes first); the node stays, a
        prefix of deeper checkpoints. False when the tree holds none."""
        if not self._checkpoint_nodes:
            return False
        victim = min(self._checkpoint_nodes.values(),
                     key=lambda n: (n.lock_ref > 0, n.last_access))
        if self.on_checkpoint_drop is not None:
            self.on_checkpoint_drop(victim)
        self._free_checkpoint(victim)
        self.num_dropped_checkpoints += 1
        return True

    def _free_checkpoint(self, node: RadixNode) -> None:
        slot, node.state_slot = node.state_slot, None
        if slot is None:
            return
        del self._checkpoint_nodes[id(node)]
        assert self.checkpoints is not None, "a checkpoint without its slots' owner"
        self.checkpoints.free_checkpoint(slot)

    # ---- checks ------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError on any broken invariant (page ownership, counters, shape)."""
        seen: set[int] = set()
        slots: set[int] = set()
        window_seen: set[int] = set()
        device_pages = locked_pages = 0
        for node in self._iter_nodes():
            self._check_node(node, seen)
            self._check_window(node, window_seen)
            device_pages += node.num_device_pages
            if node.lock_ref > 0:
                locked_pages += node.num_device_pages
            if node.state_slot is not None:
                assert node.on_device, "a checkpoint on a node without device pages"
                assert node.state_slot not in slots, f"state slot {node.state_slot} held twice"
                assert self.checkpoints is not None and self.checkpoints.is_used(
                    node.state_slot), f"tree holds free state slot {node.state_slot}"
                slots.add(node.state_slot)
        assert device_pages == self._device_pages, (device_pages, self._device_pages)
        assert locked_pages == self._locked_pages, (locked_pages, self._locked_pages)
        assert len(slots) == len(self._checkpoint_nodes), (len(slots), len(self._checkpoint_nodes))
        assert all(n.state_slot is not None for n in self._checkpoint_nodes.values()), \
            "a node left among the checkpoint holders without its slot"
        assert len(window_seen) == self._window_pages, (len(window_seen), self._window_pages)
        self._check_leaf_heap()

    def _check_leaf_heap(self) -> None:
        """The kept heap ranks every evictable leaf under its current key."""
        heap = self._leaf_heap
        if heap is None or heap.policy is not self.policy:
            return
        ranked = heap.entries()
        for node in self._device_leaves():
            assert (id(node), heap.key(node)) in ranked, "an evictable leaf the heap lost"

    def num_nodes(self) -> int:
        return sum(1 for _ in self._iter_nodes())

    # ---- internals ---------------------------------------------------------------------
    def _page_at(self, tokens: PageKey, page_index: int) -> PageKey:
        start = page_index * self.page_size
        return tokens[start : start + self.page_size]

    def _count_matching_pages(
        self, key: PageKey, tokens: PageKey, first_page: int, max_pages: int | None = None
    ) -> int:
        """Whole pages of `key` equal to `tokens` from page `first_page` on."""
        size = self.page_size
        limit = min(len(key) // size, len(tokens) // size - first_page)
        if max_pages is not None:
            limit = min(limit, max_pages)
        offset = first_page * size
        if key[: limit * size] == tokens[offset : offset + limit * size]:
            return limit
        matched = 0
        while matched < limit and (
            self._page_at(key, matched) == self._page_at(tokens, first_page + matched)
        ):
            matched += 1
        return matched

    def _root_for(self, salt: str) -> RadixNode:
        root = self._roots.get(salt)
        if root is None:
            root = RadixNode(key=(), parent=None, salt=salt, num_pages=0, device_page_ids=[])
            self._roots[salt] = root
        return root

    def _ancestors(self, node: RadixNode | None) -> Iterator[RadixNode]:
        while node is not None and not node.is_root:
            yield node
            node = node.parent

    def _add_leaf(
        self, parent: RadixNode, tokens: PageKey, page_ids: Sequence[int], first: int, end: int,
        window_page_ids: Sequence[int | None] | None = None,
    ) -> RadixNode:
        size = self.page_size
        leaf = RadixNode(
            key=tokens[first * size : end * size],
            parent=parent,
            salt=parent.salt,
            num_pages=end - first,
            device_page_ids=list(page_ids[first:end]),
        )
        if window_page_ids is not None:
            leaf.window_page_ids = list(window_page_ids[first:end])
            self._window_pages += _count_present(leaf.window_page_ids)
        else:
            leaf.window_page_ids = self.tombstones(leaf.num_pages)
        parent.children[self._page_at(leaf.key, 0)] = leaf
        self._device_pages += leaf.num_pages
        return leaf

    def tombstones(self, num_pages: int) -> list[int | None] | None:
        """The window list of `num_pages` device pages without sliding pages: all
        tombstones on a window model (every device node has one entry per page), None
        otherwise."""
        return None if self.window_allocator is None else [None] * num_pages

    def _window_list(self, node: RadixNode) -> list[int | None]:
        """`node`'s sliding pages, tombstones where it has none (a window model)."""
        pages = node.window_page_ids
        return [None] * node.num_pages if pages is None else pages

    def _merge_window(self, node: RadixNode, window_page_ids: Sequence[int | None]) -> list[int]:
        """`window_page_ids` hold the sliding layers of `node`'s pages: a tombstone (or a
        node without them) takes the caller's page; where both have one, the caller's is a
        duplicate (returned)."""
        held = node.window_page_ids
        if held is None:
            held = node.window_page_ids = [None] * node.num_pages
        duplicates: list[int] = []
        for index, mine in enumerate(window_page_ids):
            if mine is None or held[index] == mine:
                continue
            if held[index] is None:
                held[index] = mine
                self._window_pages += 1
            else:
                duplicates.append(mine)
        return duplicates

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut `node` after `num_pages` pages; returns the new upper part (the parent of
        `node`, which keeps its identity, lock refs and children)."""
        size = self.page_size
        upper = RadixNode(
            key=node.key[: num_pages * size],
            parent=node.parent,
            salt=node.salt,
            num_pages=num_pages,
            device_page_ids=_head(node.device_page_ids, num_pages),
            host_page_ids=_head(node.host_page_ids, num_pages),
            window_page_ids=_head(node.window_page_ids, num_pages),
            lock_ref=node.lock_ref,
            hit_count=node.hit_count,
            last_access=node.last_access,
            session_id=node.session_id,
        )
        if node.suspect:
            self.mark_suspect([upper])
        node.key = node.key[num_pages * size :]
        node.num_pages -= num_pages
        node.device_page_ids = _tail(node.device_page_ids, num_pages)
        node.host_page_ids = _tail(node.host_page_ids, num_pages)
        node.window_page_ids = _tail(node.window_page_ids, num_pages)
        upper.parent.children[self._page_at(upper.key, 0)] = upper
        upper.children[self._page_at(node.key, 0)] = node
        node.parent = upper
        return upper

    def _adopt_or_dedupe(self, node: RadixNode, page_ids: Sequence[int]) -> list[int]:
        """`page_ids` hold the same tokens as `node`: the caller's own copies are duplicates;
        a node without device pages adopts them."""
        if node.device_page_ids is None:
            node.device_page_ids = list(page_ids)
            self._device_pages += node.num_pages
            if node.lock_ref > 0:
                self._locked_pages += node.num_pages
            return []
        return [mine for mine, held in zip(page_ids, node.device_page_ids) if mine != held]

    def _evictable(self, node: RadixNode) -> bool:
        if node.is_root or not node.on_device or node.lock_ref > 0:
            return False
        return not any(child.on_device for child in node.children.values())

    def _evict_device(self, node: RadixNode) -> int:
        page_ids = node.device_page_ids or []
        if self.on_evict is not None:  # sees the checkpoint too (HiCache backs it up)
            self.on_evict(node, page_ids)
        if node.state_slot is not None:  # the state after pages about to go: freed first
            self._free_checkpoint(node)
            self.num_evicted_checkpoints += 1
        self.allocator.free(page_ids)
        self._free_window_pages(node)
        node.device_page_ids = None
        self._device_pages -= len(page_ids)
        self.num_evicted_pages += len(page_ids)
        self._on_device_evicted(node)
        return len(page_ids)

    def reclaim_window_pages(self, keep: set[int], wanted: int) -> list[int]:
        """Free up to `wanted` of the tree's sliding pages that are not in `keep`, leaving
        tombstones, in nodes eviction cannot take (a running request's locked path: every
        earlier turn's window tails on it stay there otherwise, however far behind the
        request's window they are). Hits needing them are cut to an earlier restorable
        point by `SlidingWindowRule`. Returns the pages freed; the caller drops its own
        copies of them (`Scheduler._reclaim_window_pages`)."""
        freed: list[int] = []
        for node in self._iter_nodes():
            pages = node.window_page_ids or []
            for index, page in enumerate(pages):
                if page is not None and page not in keep:
                    pages[index] = None
                    freed.append(page)
                    if len(freed) == wanted:
                        break
            if len(freed) == wanted:
                break
        if freed:
            assert self.window_allocator is not None, "window pages without their allocator"
            self.window_allocator.free(freed)
            self._window_pages -= len(freed)
        return freed

    def adopt_window_page(self, node: RadixNode, index: int, page: int) -> None:
        """`page` (filled by the caller: a window tail restored from a lower tier) is the
        sliding page of `node`'s page `index`, a tombstone until now; the tree owns it."""
        if node.window_page_ids is None:
            node.window_page_ids = [None] * node.num_pages
        assert node.window_page_ids[index] is None, "a present sliding page overwritten"
        node.window_page_ids[index] = page
        self._window_pages += 1

    def _free_window_pages(self, node: RadixNode) -> None:
        """Free the sliding pages of a node whose device pages go (tombstones skipped)."""
        window, node.window_page_ids = node.window_page_ids, None
        present = [page for page in window or [] if page is not None]
        if present:
            assert self.window_allocator is not None, "window pages without their allocator"
            self.window_allocator.free(present)
            self._window_pages -= len(present)

    def _on_device_evicted(self, node: RadixNode) -> None:
        """Drop a node whose device copy is gone unless it still has a host copy or
        children (HiCache keeps host-only nodes)."""
        if node.host_page_ids is not None or node.children:
            return
        parent = node.parent
        assert parent is not None
        del parent.children[self._page_at(node.key, 0)]
        if parent.is_root and not parent.children:
            del self._roots[parent.salt]

    def _iter_nodes(self) -> Iterator[RadixNode]:
        """Every non-root node, parents before children."""
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _check_node(self, node: RadixNode, seen: set[int]) -> None:
        size = self.page_size
        assert node.num_pages >= 1 and len(node.key) == node.num_pages * size, "bad node key"
        assert node.parent is not None and node.parent.children.get(node.key[:size]) is node
        assert node.salt == node.parent.salt, "node under a foreign salt"
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "lock refs"
        if node.on_device:
            assert node.parent.is_root or node.parent.on_device, "device node under evicted one"
            assert len(node.device_page_ids) == node.num_pages, "page count != key pages"
            for page_id in node.device_page_ids:
                assert page_id not in seen, f"page {page_id} held twice by the tree"
                assert self.allocator.is_used(page_id), f"tree holds free page {page_id}"
                seen.add(page_id)
        else:
            assert node.lock_ref == 0, "locked node without device pages"


    def _check_window(self, node: RadixNode, seen: set[int]) -> None:
        """A node's sliding pages: one per page, on device only, each held once and used;
        every device node of a window model has them (tombstones where freed)."""
        if node.window_page_ids is None:
            assert self.window_allocator is None or not node.on_device, (
                "a device node without its window list")
            return
        assert node.on_device, "window pages on a node without device pages"
        assert len(node.window_page_ids) == node.num_pages, "window page count != key pages"
        for page_id in node.window_page_ids:
            if page_id is None:
                continue
            assert page_id not in seen, f"window page {page_id} held twice by the tree"
            assert self.window_allocator is not None and self.window_allocator.is_used(
                page_id), f"tree holds free window page {page_id}"
            seen.add(page_id)


class _LeafHeap:
    """Device leaves ranked by `policy` (lower key first; ties in insertion order). Entries
    are checked when they surface (lazy deletion): one whose node is no longer evictable, or
    (`check_keys`: a heap kept across passes) whose key changed since, is dropped - the tree
    pushes the node again whenever it may have become evictable or been re-keyed."""

    def __init__(self, policy: EvictionPolicy, nodes: Iterable[RadixNode], *,
                 check_keys: bool) -> None:
        self.policy = policy
        self.key = policy.key_fn()
        self._check_keys = check_keys
        self._order = itertools.count()
        self._heap = [(self.key(n), next(self._order), n) for n in nodes]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (self.key(node), next(self._order), node))

    def pop_evictable(self, evictable: Callable[[RadixNode], bool]) -> RadixNode | None:
        while self._heap:
            key, _, node = heapq.heappop(self._heap)
            if evictable(node) and (not self._check_keys or key == self.key(node)):
                return node
        return None

    def entries(self) -> set[tuple[int, EvictKey]]:
        """(node id, key) of every entry (`RadixTree.check`)."""
        return {(id(node), key) for key, _, node in self._heap}


def _count_present(page_ids: Sequence[int | None]) -> int:
    return sum(1 for page in page_ids if page is not None)


def _head(page_ids: list | None, n: int) -> list | None:
    return None if page_ids is None else page_ids[:n]


def _tail(page_ids: list | None, n: int) -> list | None:
    return None if page_ids is None else page_ids[n:]
