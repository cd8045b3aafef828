"""A `python -m pdcache ...` subprocess that is ready once it prints a line with a prefix
(`pdcache serve`'s URL line, the router's), with its output kept for failure messages."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time


class PdcacheProcess:
    """Starts `python -m pdcache ARGS`, waits up to `timeout_s` for a line starting with
    `ready_prefix`; `url` is the rest of that line. AssertionError (with the last output) if
    the process exits or stays silent instead. With `wait=False` the constructor only starts
    the process (several then start side by side); `wait_ready()` waits and sets `url`."""

    def __init__(self, args: list[str], ready_prefix: str, timeout_s: float,
                 env: dict[str, str] | None = None, wait: bool = True) -> None:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "pdcache", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=full_env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        self._ready = (ready_prefix, timeout_s)
        self.url = ""
        threading.Thread(target=self._pump, daemon=True).start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> str:
        """Waits for the ready line (at most the constructor's `timeout_s` from now)."""
        if not self.url:
            self.url = self._wait_ready(*self._ready)
        return self.url

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def _wait_ready(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            self.log.append(line)
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        self.kill()
        raise AssertionError("process did not become ready:\n" + "".join(self.log[-40:]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.drain()
        return self.proc.returncode

    def drain(self) -> None:
        """Move what the process wrote last into `log`."""
        time.sleep(0.2)  # let the pump thread read the last lines
        while not self.lines.empty():
            self.log.append(self.lines.get_nowait())
