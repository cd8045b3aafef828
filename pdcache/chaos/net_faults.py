"""Network faults of `pdcache chaos`: delay or cut the path between a prefill and a decode.

`prepare` builds a `NetLab` (docs/chaos.md, "Storage and network faults"): one network
namespace per node, all on a host-only bridge `pdcTAGb` in a private /24 (10.231.N.0/24;
node i is 10.231.N.(i+1), the machine's own end of the bridge is 10.231.N.254, where the
router, the metadata service and mooncake_master stay), and a second host-only bridge
`pdcTAGq` joining the target prefill and decode namespaces alone: each of the two routes the
other's address over it (a /32 route), so their KV transfers and bootstrap traffic take that
path and nothing else does. Nodes run inside their namespace through
`[[node]] launch_prefix = ["nsenter", "--net=/run/netns/NS", "--"]` (only the network
namespace: mounts stay shared, so the storage faults reach them). The lab's addresses are
the namespaces' and the bridges' only; no route leads off the machine.

- `net-delay`: `tc qdisc replace ... netem delay D` on both namespace ends of the pair path
  (round trip +2D); heal deletes the qdiscs. Needs the kernel's sch_netem.
- `net-partition`: the machine-side ends of the pair path go down: both namespace ends lose
  carrier, their /32 routes stay, and every packet between the two nodes is dropped silently
  (connections time out, as in a real partition; the router still reaches both). Heal: up.

A topology whose hosts are several addresses needs a cluster secret: `prepare` creates
WORK_DIR/cluster.secret when the topology names none. Both faults share one lab (the first
`prepare` builds it, the other reuses it; `cleanup` removes it once). Root and iproute2 needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from pdcache.chaos.faults import Fault, FaultContext, Injection
from pdcache.chaos.os_tools import FaultSetupError, missing_privilege, override, run_tool

SUBNET_BASE = "10.231"
HOST_OCTET = 254  # the machine's own address on the lab bridge
MAIN_DEV, PAIR_DEV = "main0", "pair0"  # device names inside each namespace
SECRET_NAME = "cluster.secret"


@dataclass(frozen=True)
class NetLab:
    """Names and addresses of one soak's namespaces; `build` makes them, `remove` undoes."""

    tag: str  # 5 hex digits of the work directory: device names stay under 15 characters
    subnet: str  # "10.231.N"
    nodes: tuple[str, ...]  # node names, in topology order (node i is SUBNET.(i+1))
    prefill: str  # the pair whose path the faults hit
    decode: str

    @staticmethod
    def digest_of(work_dir: Path) -> str:
        """The hash of the work directory the lab's names and subnet derive from (its first 5
        hex digits are the tag)."""
        return hashlib.sha256(str(work_dir.resolve()).encode()).hexdigest()

    @classmethod
    def for_context(cls, ctx: FaultContext) -> NetLab:
        digest = cls.digest_of(ctx.work_dir)
        nodes = tuple(n.name for n in ctx.topology.nodes)
        prefills = [n.name for n in ctx.topology.nodes if n.role == "prefill"]
        decodes = [n.name for n in ctx.topology.nodes if n.role == "decode"]
        if not prefills or not decodes:
            raise FaultSetupError("network faults need a prefill and a decode node")
        if len(nodes) > 250:
            raise FaultSetupError("network faults address at most 250 nodes in one /24")
        return cls(
            digest[:5], f"{SUBNET_BASE}.{int(digest[5:7], 16)}", nodes, prefills[0], decodes[0]
        )

    # names

    def namespace(self, node: str) -> str:
        return f"pdc-{self.tag}-{node}"

    def address(self, node: str) -> str:
        return f"{self.subnet}.{self.nodes.index(node) + 1}"

    @property
    def host_address(self) -> str:
        return f"{self.subnet}.{HOST_OCTET}"

    @property
    def main_bridge(self) -> str:
        return f"pdc{self.tag}b"

    @property
    def pair_bridge(self) -> str:
        return f"pdc{self.tag}q"

    def main_port(self, node: str) -> str:
        return f"pdc{self.tag}n{self.nodes.index(node)}"

    def pair_port(self, node: str) -> str:
        return f"pdc{self.tag}p{(self.prefill, self.decode).index(node)}"

    @property
    def target(self) -> str:
        return f"net:{self.prefill}-{self.decode}"

    def launch_prefix(self, node: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.namespace(node)}", "--"]

    # lifecycle

    def exists(self) -> bool:
        listed = run_tool(["ip", "netns", "list"], check=False).stdout.split()
        return self.namespace(self.nodes[0]) in listed

    def build(self) -> None:
        """Namespaces, both bridges, the veth pairs and the pair routes (idempotent)."""
        if self.exists():
            return
        try:
            self._bridge(self.main_bridge, f"{self.host_address}/24")
            self._bridge(self.pair_bridge, None)
            for node in self.nodes:
                self._namespace(node)
            for node, peer in ((self.prefill, self.decode), (self.decode, self.prefill)):
                ns = self.namespace(node)
                self._veth(self.pair_port(node), ns, PAIR_DEV, self.pair_bridge)
                self._in(ns, "ip", "route", "add", f"{self.address(peer)}/32", "dev", PAIR_DEV)
        except BaseException:
            self.remove()
            raise

    def _bridge(self, name: str, address: str | None) -> None:
        run_tool(["ip", "link", "add", name, "type", "bridge"])
        if address:
            run_tool(["ip", "addr", "add", address, "dev", name])
        run_tool(["ip", "link", "set", name, "up"])

    def _namespace(self, node: str) -> None:
        ns = self.namespace(node)
        run_tool(["ip", "netns", "add", ns])
        # The pair path's packets arrive on the interface the sender's /32 route chose,
        # with the sender's main address: reverse-path filtering must not drop them.
        self._in(
            ns,
            "sysctl",
            "-qw",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        )
        self._in(ns, "ip", "link", "set", "lo", "up")
        self._veth(self.main_port(node), ns, MAIN_DEV, self.main_bridge)
        self._in(ns, "ip", "addr", "add", f"{self.address(node)}/24", "dev", MAIN_DEV)

    def _veth(self, host_end: str, ns: str, inner: str, bridge: str) -> None:
        run_tool(
            ["ip", "link", "add", host_end, "type", "veth", "peer", "name", inner, "netns", ns]
        )
        run_tool(["ip", "link", "set", host_end, "master", bridge])
        run_tool(["ip", "link", "set", host_end, "up"])
        self._in(ns, "ip", "link", "set", inner, "up")

    def _in(self, ns: str, *argv: str) -> None:
        run_tool(["ip", "netns", "exec", ns, *argv])

    def remove(self) -> None:
        """Kill what still runs in our namespaces (only our nodes can), delete them (which
        deletes their veth pairs) and both bridges. Tolerates a half-built lab."""
        listed = run_tool(["ip", "netns", "list"], check=False).stdout.split()
        for node in self.nodes:
            ns = self.namespace(node)
            if ns not in listed:
                continue
            for pid in run_tool(["ip", "netns", "pids", ns], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            run_tool(["ip", "netns", "del", ns], check=False)
        for bridge in (self.main_bridge, self.pair_bridge):
            run_tool(["ip", "link", "del", bridge], check=False)

    # what the faults do

    def set_pair_links(self, up: bool) -> None:
        for node in (self.prefill, self.decode):
            run_tool(["ip", "link", "set", self.pair_port(node), "up" if up else "down"])

    def set_pair_delay(self, delay_ms: float | None) -> None:
        """netem delay on both namespace ends of the pair path; None removes it."""
        for node in (self.prefill, self.decode):
            ns = self.namespace(node)
            if delay_ms is None:
                run_tool(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", PAIR_DEV, "root"],
                    check=False,
                )
            else:
                self._in(
                    ns,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    PAIR_DEV,
                    "root",
                    "netem",
                    "delay",
                    f"{delay_ms:.1f}ms",
                )

    # the topology

    def overrides(self, ctx: FaultContext) -> dict[str, str]:
        """--set overrides that put every node in its namespace and the shared services on
        the machine's bridge address (nodes cannot reach its 127.0.0.1)."""
        out: dict[str, str] = {}
        for node in self.nodes:
            out[f"node.{node}.host"] = json.dumps(self.address(node))
            out[f"node.{node}.launch_prefix"] = json.dumps(self.launch_prefix(node))
        storage = ctx.topology.storage
        if storage.uses_metadata_service:
            _, port = storage.metadata_address  # type: ignore[misc]
            out["storage.metadata"] = json.dumps(f"tcp://{self.host_address}:{port}")
        if storage.backend == "mooncake":
            _, port = storage.mooncake.master_address
            out["storage.mooncake.master"] = json.dumps(f"{self.host_address}:{port}")
            http = storage.mooncake.http_metadata_address
            if http is not None:
                out["storage.mooncake.metadata_server"] = json.dumps(
                    f"http://{self.host_address}:{http[1]}/metadata"
                )
        secret = override(ctx, "security.secret_file", ctx.topology.security.secret_file)
        if secret is None:
            out["security.secret_file"] = json.dumps(str(_ensure_secret(ctx.work_dir)))
        return out


def _ensure_secret(work_dir: Path) -> Path:
    from pdcache.utils.secret import create_secret

    path = work_dir.resolve() / SECRET_NAME
    if path.exists():
        return path
    work_dir.mkdir(parents=True, exist_ok=True)
    return create_secret(path)


def probe_namespaces(netem: bool) -> str | None:
    """Why network namespaces (and, with `netem`, tc netem) cannot be used here, or None:
    tried for real in a throwaway namespace."""
    missing = missing_privilege("ip", "nsenter", *(("tc",) if netem else ()))
    if missing:
        return missing
    ns = f"pdcprobe-{os.getpid()}"
    try:
        done = run_tool(["ip", "netns", "add", ns], check=False)
        if done.returncode != 0:
            return f"network namespaces not permitted (`ip netns add`: {done.stderr.strip()})"
        done = run_tool(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "ip",
                "link",
                "add",
                "v0",
                "type",
                "veth",
                "peer",
                "name",
                "v1",
            ],
            check=False,
        )
        if done.returncode != 0:
            return f"veth pairs not available ({done.stderr.strip()})"
        if netem:
            done = run_tool(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "v0",
                    "root",
                    "netem",
                    "delay",
                    "1ms",
                ],
                check=False,
            )
            if done.returncode != 0:
                return (
                    "tc netem is not available in this kernel (module sch_netem): "
                    f"{done.stderr.strip()}"
                )
    finally:
        run_tool(["ip", "netns", "del", ns], check=False)
    return None


class _NetFault(Fault):
    """Shared by net-delay and net-partition: the lab, its overrides and its removal."""

    netem = False

    def unavailable(self, ctx: FaultContext) -> str | None:
        roles = {n.role for n in ctx.topology.nodes}
        if not {"prefill", "decode"} <= roles:
            return "needs a PD topology (a prefill and a decode node)"
        return probe_namespaces(self.netem)

    def lab(self, ctx: FaultContext) -> NetLab:
        return NetLab.for_context(ctx)

    def prepare(self, ctx: FaultContext) -> dict[str, str]:
        lab = self.lab(ctx)
        lab.build()
        ctx.say(
            f"{self.kind}: nodes in namespaces pdc-{lab.tag}-* on {lab.subnet}.0/24; "
            f"faults hit {lab.target}"
        )
        return lab.overrides(ctx)

    def cleanup(self, ctx: FaultContext) -> None:
        self.lab(ctx).remove()


class NetDelay(_NetFault):
    """Latency on the prefill-decode path: netem on both of its ends."""

    kind = "net-delay"
    netem = True
    delay_range_ms = (20.0, 200.0)

    def inject(self, ctx: FaultContext) -> Injection:
        lab = self.lab(ctx)
        delay = round(ctx.rng.uniform(*self.delay_range_ms), 1)
        lab.set_pair_delay(delay)
        return Injection(self.kind, lab.target, f"netem delay {delay}ms each way")

    def heal(self, ctx: FaultContext) -> None:
        self.lab(ctx).set_pair_delay(None)


class NetPartition(_NetFault):
    """The prefill-decode path cut: its links down, packets dropped silently."""

    kind = "net-partition"

    def inject(self, ctx: FaultContext) -> Injection:
        lab = self.lab(ctx)
        lab.set_pair_links(up=False)
        return Injection(self.kind, lab.target, "pair path down (silent drops)")

    def heal(self, ctx: FaultContext) -> None:
        self.lab(ctx).set_pair_links(up=True)


NET_FAULTS: dict[str, type[Fault]] = {cls.kind: cls for cls in (NetDelay, NetPartition)}
