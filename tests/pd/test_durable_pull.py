"""The pull of pending pages from decode's host staging (docs/design.md §4.10, "Pull") on a
1 prefill + 1 decode stack (tiny preset, file storage, zmq transfer): 2 sessions, zero think
time, whole answers written at their end into a store whose writes take `WRITE_DELAY_S`
longer. With `pending_pull = "auto"`, decode's marks carry the expected write time it
measured (0.25 s a write and more, queued) and the next turn pulls the answer pages instead
of waiting for the write: every next turn's `storage_from_decode` is still the page
floor of the previous answer, nothing races, and the outputs equal those of the same run with
`pending_pull = "never"`, which waits for every page (pulled = 0). Both run with a cluster
secret: without one no pull is offered nor sent (docs/security.md)."""

from __future__ import annotations

import pytest

from pdcache.config.security import SecuritySettings
from pdcache.engine.loader import load_model
from tests.pd.test_durable_next_turn import (
    PROBE_ANSWER,
    answer_pages_tokens,
    assert_every_answer_found,
    pending,
)
from tests.pd.test_durable_next_turn import run as run_sessions
from tests.pd_harness import metric_value

ANSWER = 256
PAGE = 16
SESSIONS = 2
ANSWERS = [ANSWER, ANSWER, PROBE_ANSWER]
SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def run(tmp_path, tiny, mode: str):
    security = SecuritySettings.from_secret(SECRET)  # a pull needs the cluster secret
    return run_sessions(tmp_path, tiny, True, ANSWERS, SESSIONS, pending_pull=mode,
                        security=security)


def outputs(sessions) -> list[list[int]]:
    return [turn["output_ids"] for turns in sessions for _, turn in turns]


def test_auto_pulls_the_next_turn_s_pages_and_never_waits_for_them(tmp_path, tiny) -> None:
    pulled_run, metrics, receiver = run(tmp_path / "auto", tiny, "auto")
    assert_every_answer_found(pulled_run)
    assert pending(metrics, "raced") == 0
    # decode measured its writes on the harness's baseline request: every answer's mark
    # carries its expected write time (>= 0.25 s), far above a pull of 16 pages
    answer_pages = sum(answer_pages_tokens(p, a["output_ids"]) // PAGE
                       for turns in pulled_run for (p, a) in turns[:-1])
    assert pending(metrics, "pulled") >= answer_pages // 2
    assert pending(metrics, "found") == pending(metrics, "waited") + pending(metrics, "pulled")
    # a late answer (after its pull's deadline on a loaded machine) is served, not pulled
    assert receiver["pull_pages_served"] >= pending(metrics, "pulled")
    rejected = metric_value(metrics, "pdcache_pending_pull_pages_total", server="p0",
                            outcome="rejected")
    assert rejected == 0

    waited_run, metrics, receiver = run(tmp_path / "never", tiny, "never")
    assert_every_answer_found(waited_run)
    assert pending(metrics, "pulled") == 0 and pending(metrics, "raced") == 0
    assert pending(metrics, "waited") == pending(metrics, "found") > 0
    assert receiver["pull_requests"] == 0
    assert outputs(pulled_run) == outputs(waited_run)  # the pulled KV is the written KV
