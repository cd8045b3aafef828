"""Ports and topologies for tests that start servers on 127.0.0.1."""

from __future__ import annotations

import socket
from pathlib import Path


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now (all bound at once, so never the same one
    twice; a later bind may still race another process, as with any free-port probe)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def unified_topology(directory: Path, name: str, port: int, *extra_args: str) -> Path:
    """DIRECTORY/NAME.toml: one `pdcache serve` node u0 (tiny preset) on 127.0.0.1:PORT, with
    `extra_args` appended to its command line; for benches that launch a topology."""
    quoted = ", ".join(f'"{a}"' for a in extra_args)
    path = directory / f"{name}.toml"
    path.write_text(f"""
[model]
preset = "tiny"

[launch]
health_timeout_s = 120
stop_grace_s = 5.0

[[node]]
name = "u0"
role = "unified"
port = {port}
command = ["{{python}}", "-m", "pdcache", "serve", "--model", "{{model}}", "--host", "{{host}}",
           "--port", "{{port}}", "--page-size", "{{page_size}}", "--log-level", "warning"]
extra_args = [{quoted}]
""")
    return path
