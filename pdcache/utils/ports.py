"""Port numbers as command lines take them."""

from __future__ import annotations

import argparse


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535 (0: a free one). A port out of range was a
    bind() traceback at start."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0..65535")
    return port
