"""A stand-in node for the launcher tests: HTTP GET /health on HOST:PORT, plus one child process.

Used until the real node CLIs accept `--config/--node`; it exercises exactly what the launcher
relies on: a port to health-check, a process group with a grandchild that must not outlive a
stop, a log. `--ready-after S` delays readiness; `--never-ready` never answers 200;
`--exit-at-once` exits 3 on start (a node that cannot come up); `--foreign-listener` serves its
port from an orphaned process outside its tree (what another stack's service looks like) and
itself only sleeps.
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
    parser.add_argument("--exit-at-once", action="store_true")
    parser.add_argument("--foreign-listener", action="store_true")
    args = parser.parse_args()
    if args.exit_at_once:
        print("stub node: failing on start", flush=True)
        return 3
    if args.foreign_listener:
        return _serve_from_an_orphan(args.port, args.child_pid_file)
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


def _serve_from_an_orphan(port: int, pid_file: str) -> int:
    """Start a server on `port` in a new session through a short-lived middle process (so the
    server is reparented away from this tree), write its pid, then sleep."""
    serve = [sys.executable, __file__, "--port", str(port), "--child-pid-file",
             pid_file + ".orphan"]  # this stub, serving normally
    spawn = (f"import subprocess; p = subprocess.Popen({serve!r}, start_new_session=True); "
             f"open({pid_file!r}, 'w').write(str(p.pid))")
    subprocess.run([sys.executable, "-c", spawn], check=True)  # exits: the server is orphaned
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
