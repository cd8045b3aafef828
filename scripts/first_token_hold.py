"""How long the router holds prefill's first event until decode's stream opened (the TTFT the
hold can add, docs/pd-protocol.md "First token from prefill"): per streamed request through a
real 1P1D tiny stack, the time from P's first event at the router to its release, with
`prefill_waits_for_decode` on and off, and the client's TTFT.

    PYTHONPATH=$PWD python scripts/first_token_hold.py 30   # requests per gate setting
"""

import pathlib
import statistics
import sys
import tempfile
import time
import uuid

from pdcache.engine.loader import load_model
from pdcache.router import proxy
from tests.router.test_pd import pd_router, start_pd

held, first_at = [], {}
real_resolve, real_first = proxy._resolve, proxy.RouteStream._first_from_prefill


def resolve(future, value):
    first_at[id(future)] = time.monotonic()
    real_resolve(future, value)


async def timed(self):
    event = await real_first(self)
    held.append(time.monotonic() - first_at[id(self._prefill_first)])
    return event


proxy._resolve, proxy.RouteStream._first_from_prefill = resolve, timed
stack = start_pd(pathlib.Path(tempfile.mkdtemp()), load_model("tiny", seed=0))
try:
    for gate in (True, False):
        stack.prefill_server.pd.controller.wait_for_decode = gate
        held.clear()
        ttft = []
        with pd_router(stack) as client:
            for i in range(int(sys.argv[1])):
                body = {
                    "input_ids": [(i * 11 + 3 * j) % 250 for j in range(200)],
                    "stream": True,
                    "cache_salt": uuid.uuid4().hex,
                    "incremental_streaming_output": True,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
                }
                start = time.monotonic()
                with client.stream("POST", "/generate", json=body) as r:
                    lines = r.iter_lines()
                    next(line for line in lines if line.startswith("data: "))
                    ttft.append(time.monotonic() - start)
                    rest = list(lines)
                assert rest and rest[-2] == "data: [DONE]" or "data: [DONE]" in rest, rest[-3:]
        q = statistics.quantiles(held, n=10)
        print(
            f"prefill_waits_for_decode={gate}: n={len(held)} held_ms p50={statistics.median(held) * 1e3:.3f}"
            f" p90={q[-1] * 1e3:.3f} max={max(held) * 1e3:.3f}; client TTFT p50={statistics.median(ttft) * 1e3:.1f} ms"
        )
finally:
    stack.close()
