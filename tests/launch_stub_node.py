"""A stand-in node for the launcher tests: HTTP GET /health on HOST:PORT, plus one child process.

Used until the real node CLIs accept `--config/--node`; it exercises exactly what the launcher
relies on: a port to health-check, a process group with a grandchild that must not outlive a
stop, a log. `--ready-after S` delays readiness; `--never-ready` never answers 200.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--child-pid-file", required=True)
    parser.add_argument("--ready-after", type=float, default=0.0)
    parser.add_argument("--never-ready", action="store_true")
    args = parser.parse_args()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(args.child_pid_file, "w") as fh:
        fh.write(str(child.pid))
    ready_at = time.monotonic() + args.ready_after

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            ok = self.path == "/health" and not args.never_ready and time.monotonic() >= ready_at
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"not ready")

        def log_message(self, *a: object) -> None:
            pass

    print(f"stub node on {args.host}:{args.port}, child {child.pid}", flush=True)
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
