"""The I/O the simulator charges for: bandwidth pipes, the shared store's bandwidth and each
node's link to it, and the byte counts over time.

A `Pipe` is a FIFO resource of one bandwidth: an operation of `n` bytes occupies it for
`n / bandwidth` seconds, after the operations queued before it. A storage operation of a node
occupies two pipes at once, the store's (read or write, shared by every node) and the node's
link (one per direction); it completes when the later of the two is through, plus the
profile's per-operation latency. That is an approximation of a fair-shared network (a FIFO
per resource, not processor sharing), chosen because it is deterministic and cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcache.sim.profile import StorageCost


@dataclass
class Pipe:
    """One bandwidth resource, FIFO: `free_at` is when the operations queued so far end."""

    bandwidth_Bps: float  # noqa: N815
    free_at: float = 0.0
    busy_s: float = 0.0

    def occupy(self, now: float, nbytes: int) -> float:
        """Queue `nbytes`; returns when they are through."""
        start = max(now, self.free_at)
        duration = nbytes / self.bandwidth_Bps
        self.free_at = start + duration
        self.busy_s += duration
        return self.free_at


@dataclass
class Timeline:
    """Bytes per kind in buckets of `bucket_s` of simulated time (each operation's spread over
    the time its bytes moved)."""

    bucket_s: float
    buckets: dict[int, dict[str, float]] = field(default_factory=dict)

    def add(self, when: float, kind: str, nbytes: float) -> None:
        self._put(int(when // self.bucket_s), kind, nbytes)

    def _put(self, index: int, kind: str, nbytes: float) -> None:
        bucket = self.buckets.setdefault(index, {})
        bucket[kind] = bucket.get(kind, 0) + nbytes

    def add_span(self, start: float, end: float, kind: str, nbytes: int) -> None:
        """`nbytes` moved from `start` to `end`, spread over the buckets in proportion to
        the time of each (all in one bucket, a long write showed a peak many times the
        bandwidth it ran at)."""
        if end <= start:
            self.add(end, kind, nbytes)
            return
        first, last = int(start // self.bucket_s), int(end // self.bucket_s)
        for index in range(first, last + 1):
            lo = max(start, index * self.bucket_s)
            hi = min(end, (index + 1) * self.bucket_s)
            if hi > lo:
                self._put(index, kind, nbytes * (hi - lo) / (end - start))

    def rows(self, kinds: tuple[str, ...]) -> list[dict[str, float]]:
        """One row per bucket from 0 to the last: its start and each kind's bytes/s."""
        last = max(self.buckets, default=-1)
        rows = []
        for index in range(last + 1):
            bucket = self.buckets.get(index, {})
            row: dict[str, float] = {"t_s": index * self.bucket_s}
            row.update({f"{k}_Bps": bucket.get(k, 0) / self.bucket_s for k in kinds})
            rows.append(row)
        return rows


STORAGE_KINDS = ("read", "write_prefill", "write_decode")


class StorageIO:
    """The shared store's bandwidth, every node's links to it, and the bytes moved; the
    simulation's only owner of storage time."""

    def __init__(self, cost: StorageCost, bucket_s: float) -> None:
        self.cost = cost
        self.read = Pipe(cost.read_bandwidth_Bps)
        self.write = Pipe(cost.write_bandwidth_Bps)
        self._links: dict[tuple[str, str], Pipe] = {}
        self.timeline = Timeline(bucket_s)
        self.totals = dict.fromkeys(STORAGE_KINDS, 0)
        self.operations = 0

    def _link(self, node: str, direction: str) -> Pipe:
        key = (node, direction)
        if key not in self._links:
            self._links[key] = Pipe(self.cost.node_nic_Bps)
        return self._links[key]

    def transfer(self, now: float, node: str, nbytes: int, kind: str,
                 not_before: float | None = None) -> float:
        """Move `nbytes` between `node` and the store (`kind`: one of `STORAGE_KINDS`);
        returns when the operation completes. `not_before`: its data is there only then (a
        read of pages still being written, a write after its device -> host copy): it is
        queued now and ends no sooner than that time plus what it took from now. (Queued at
        that later time, FIFO pipes made every operation booked after it wait for it,
        earlier-timed ones of other nodes too: a read waiting on a write stalled the
        store's reads, one TTFT 100x too long.)"""
        store = self.read if kind == "read" else self.write
        link = self._link(node, "in" if kind == "read" else "out")
        through = max(store.occupy(now, nbytes), link.occupy(now, nbytes))
        if not_before is not None and not_before > now:
            through = max(through, not_before + (through - now))
        done = through + self.cost.op_latency_s + self.cost.metadata_op_s
        # the bytes moved at the slower of the two pipes, up to `through`
        moving = through - nbytes / min(store.bandwidth_Bps, link.bandwidth_Bps)
        self.timeline.add_span(max(now, moving), through, kind, nbytes)
        self.totals[kind] += nbytes
        self.operations += 1
        return done
