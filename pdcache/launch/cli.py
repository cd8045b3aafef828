"""`pdcache launch CONFIG`: start, render or print the deployment a topology file describes.

Exit codes: 0 after a requested shutdown (Ctrl-C, SIGTERM) or a successful render/dry run;
1 when a process cannot come up or dies under `--no-restart`; 2 for an invalid topology or
invalid flags (the message names the file, the key and what was expected).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdcache.config import Topology, TopologyError, load_topology
from pdcache.launch.launcher import (
    SECRET_FILE_NAME,
    ProcessSpec,
    build_process_specs,
    ensure_secret,
    launcher_for,
    select_host,
    ssh_specs,
)

DEFAULT_LOG_DIR = "./.pdcache/logs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="topology TOML file (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key: model.preset=tiny, node.p0.port=31000 (repeatable)")
    parser.add_argument("--render", choices=["sglang", "k8s"],
                        help="print the equivalent deployment instead of starting it: SGLang's "
                             "commands, or Kubernetes manifests (docs/kubernetes.md)")
    parser.add_argument("--k8s-mode", choices=["rbg", "plain"], default=None,
                        help="with --render k8s: a RoleBasedGroup (rbg) or StatefulSets + "
                             "Services (plain); default [kubernetes] mode")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="with --render k8s: one file per manifest in DIR instead of stdout")
    parser.add_argument("--log-dir", default=DEFAULT_LOG_DIR,
                        help=f"per-process logs and processes.json (default {DEFAULT_LOG_DIR})")
    parser.add_argument("--no-restart", action="store_true",
                        help="when a process dies, stop everything and exit 1 instead of restarting it")
    parser.add_argument("--host", metavar="NAME", help="start only the processes of this host")
    parser.add_argument("--ssh", action="store_true",
                        help="start every host's part over ssh (pdcache launch --host on each)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, start nothing")


def run(args: argparse.Namespace) -> int:
    try:
        overrides = list(args.overrides)
        if args.render == "k8s":  # the pods' own secret, mounted (render_k8s): not this host's
            from pdcache.launch.render_k8s import SECRET_OVERRIDE

            overrides.insert(0, SECRET_OVERRIDE)
        topology = load_topology(args.config, overrides)
        if args.render == "sglang":
            from pdcache.launch.render_sglang import render_sglang

            sys.stdout.write(render_sglang(topology))
            return 0
        if args.render == "k8s":
            return render_kubernetes(topology, args)
        topology = with_cluster_secret(topology, args)
        specs = plan(topology, args)
    except TopologyError as exc:
        print(f"pdcache launch: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValueError as exc:  # SecretError: an unusable existing secret file
        print(f"pdcache launch: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print_plan(specs, Path(args.log_dir))
        return 0
    launcher = launcher_for(topology, specs, Path(args.log_dir), restart=not args.no_restart)
    return launcher.run()


def render_kubernetes(topology: Topology, args: argparse.Namespace) -> int:
    """Print (or write to --out) the manifests of `topology`."""
    from pdcache.launch.render_k8s import render_k8s, to_yaml, write_manifests

    docs = render_k8s(topology, args.k8s_mode)
    if args.out is None:
        sys.stdout.write(to_yaml(docs))
        return 0
    for path in write_manifests(docs, Path(args.out)):
        print(path)
    return 0


def with_cluster_secret(topology: Topology, args: argparse.Namespace) -> Topology:
    """`topology` with `[security] secret_file` set: as given, or the launcher's own
    (LOG_DIR/cluster.secret, created mode 0600 unless it exists; a dry run creates nothing).
    The override travels to every node with the others (`--set security.secret_file=...`).
    A multi-host topology never gets here without one (validation refuses it); with `--ssh`
    each host's launcher makes its own (a path on this machine would not exist there)."""
    if topology.security.enabled or getattr(args, "ssh", False):
        return topology
    path = Path(args.log_dir).resolve() / SECRET_FILE_NAME
    if not args.dry_run:
        path = ensure_secret(Path(args.log_dir))
    overrides = [*topology.overrides, f"security.secret_file={json.dumps(str(path))}"]
    return load_topology(topology.source, overrides)


def plan(topology: Topology, args: argparse.Namespace) -> list[ProcessSpec]:
    """The processes this invocation starts (all, one host's, or one ssh per host)."""
    specs = build_process_specs(topology)
    if args.ssh and args.host:
        raise TopologyError(topology.source, "", "--ssh and --host exclude each other")
    if args.ssh:
        remote_specs = build_process_specs(topology, config_path=args.config)
        flags = ["--log-dir", args.log_dir] + (["--no-restart"] if args.no_restart else [])
        return ssh_specs(topology, remote_specs, args.config, flags)
    if args.host:
        selected = select_host(specs, args.host)
        if not selected:
            hosts = ", ".join(dict.fromkeys(s.host for s in specs))
            raise TopologyError(topology.source, "", f"--host {args.host}: nothing runs there (hosts: {hosts})")
        return selected
    return specs


def print_plan(specs: list[ProcessSpec], log_dir: Path) -> None:
    for spec in specs:
        checks = ", ".join(c.describe() for c in spec.health) or "none"
        print(f"# {spec.name} ({spec.role} on {spec.host}; health {checks}; log {log_dir / spec.name}.log)")
        print(spec.shell_line())
