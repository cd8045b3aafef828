"""PagePipeline (storage/page_pipeline.py): the CPU step of a page group overlaps the I/O of the
next, results keep item order, and no step of a call still runs once the call has returned."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import pytest

from pdcache.offload_manager.storage import page_pipeline
from pdcache.offload_manager.storage.page_pipeline import (
    MIN_GROUP_BYTES,
    THREAD_NAME,
    AdaptiveChoice,
    PagePipeline,
    group_pages_for,
)

WAIT_S = 10.0  # bounded waits: a step that never overlaps fails the test instead of hanging


@pytest.mark.parametrize(("group_pages", "overlaps"), [(2, True), (0, False)])
def test_verify_of_a_group_runs_on_the_helper_while_the_next_group_is_read(
    group_pages: int, overlaps: bool
) -> None:
    """Group 0's verify waits for group 1's read to start: only an overlapped pipeline lets it
    see that (inline, the read of group 1 comes after the verify of group 0 returned)."""
    pipeline = PagePipeline(group_pages)
    second_read = threading.Event()
    seen: dict[int, bool] = {}
    threads: set[str] = set()

    def read(group: list[int]) -> list[int]:
        if group[0] == 2:
            second_read.set()
        return group

    def verify(group: list[int]) -> list[int]:
        threads.add(threading.current_thread().name)
        if group[0] == 0:
            seen[0] = second_read.wait(WAIT_S if overlaps else 0.2)
        return [10 * i for i in group]

    try:
        assert pipeline.read_then_verify([0, 1, 2, 3], read, verify) == [0, 10, 20, 30]
    finally:
        pipeline.close()
    assert seen[0] is overlaps
    assert all(name.startswith(THREAD_NAME) for name in threads) is overlaps


def test_a_single_group_runs_inline_without_a_thread() -> None:
    pipeline = PagePipeline(4)
    threads: list[str] = []

    def verify(group: list[int]) -> list[int]:
        threads.append(threading.current_thread().name)
        return group

    assert pipeline.read_then_verify([1, 2, 3], lambda g: g, verify) == [1, 2, 3]
    assert threads == [threading.current_thread().name] * 3  # page by page, on the caller
    assert pipeline._helper is None  # noqa: SLF001 - no thread was started for it
    pipeline.close()


def test_a_verify_error_is_raised_after_every_group_ended() -> None:
    pipeline = PagePipeline(1)
    release = threading.Event()
    ended: list[int] = []

    def verify(group: list[int]) -> list[int]:
        if group == [0]:
            raise RuntimeError("bad group 0")
        if group == [2]:
            release.wait(WAIT_S)
        ended.append(group[0])
        return group

    def read(group: list[int]) -> list[int]:
        if group == [2]:
            threading.Timer(0.2, release.set).start()  # group 2's verify ends after the error
        return group

    with pytest.raises(RuntimeError, match="bad group 0"):
        pipeline.read_then_verify([0, 1, 2], read, verify)
    assert sorted(ended) == [1, 2]  # nothing still runs on the caller's pages
    pipeline.close()


def test_a_read_error_is_the_one_raised_and_earlier_verifies_have_ended() -> None:
    pipeline = PagePipeline(1)
    ended: list[int] = []

    def read(group: list[int]) -> list[int]:
        if group == [2]:
            raise OSError("disk gone")
        return group

    def verify(group: list[int]) -> list[int]:
        ended.append(group[0])
        raise ValueError("verify fails too")

    with pytest.raises(OSError, match="disk gone"):
        pipeline.read_then_verify([0, 1, 2, 3], read, verify)
    assert sorted(ended) == [0, 1]
    pipeline.close()


@pytest.mark.parametrize(("group_pages", "overlaps"), [(2, True), (0, False)])
def test_seal_runs_one_group_ahead_of_the_write(group_pages: int, overlaps: bool) -> None:
    """The write of group 0 waits for the seal of group 1 to start: only a pipeline that seals
    ahead lets it see that (inline, group 1 is sealed after group 0's write returned)."""
    pipeline = PagePipeline(group_pages)
    second_seal = threading.Event()
    seen: dict[int, bool] = {}
    written: list[int] = []

    def seal(group: list[int]) -> list[int]:
        if group[0] == 2:
            second_seal.set()
        return group

    def write(group: list[int]) -> list[bool]:
        if group[0] == 0:
            seen[0] = second_seal.wait(WAIT_S if overlaps else 0.2)
        written.extend(group)
        return [True] * len(group)

    try:
        assert pipeline.seal_then_write([0, 1, 2, 3], seal, write) == [True] * 4
    finally:
        pipeline.close()
    assert written == [0, 1, 2, 3]
    assert seen[0] is overlaps


def test_a_write_error_waits_for_the_seal_running_ahead() -> None:
    pipeline = PagePipeline(1)
    sealed: list[int] = []
    release = threading.Event()

    def seal(group: list[int]) -> list[int]:
        if group == [1]:
            release.wait(WAIT_S)
        sealed.append(group[0])
        return group

    def write(group: list[int]) -> list[bool]:
        if group == [0]:
            threading.Timer(0.2, release.set).start()
            raise OSError("no space")
        return [True]

    with pytest.raises(OSError, match="no space"):
        pipeline.seal_then_write([0, 1, 2], seal, write)
    assert sealed == [0, 1]  # group 1's seal ended before the call raised; group 2 never ran
    pipeline.close()


def test_close_joins_the_helper_and_later_calls_run_inline() -> None:
    pipeline = PagePipeline(1)
    helpers: list[threading.Thread] = []

    def verify(group: list[int]) -> list[int]:
        helpers.append(threading.current_thread())
        return group

    assert pipeline.read_then_verify([0, 1, 2], lambda g: g, verify) == [0, 1, 2]
    assert {t.name.startswith(THREAD_NAME) for t in helpers} == {True}
    pipeline.close()
    assert not any(t.is_alive() for t in helpers)
    helpers.clear()
    assert pipeline.read_then_verify([0, 1, 2], lambda g: g, verify) == [0, 1, 2]
    assert helpers == [threading.current_thread()] * 3  # inline, page by page, on the caller
    pipeline.close()  # idempotent


def test_negative_group_is_an_error() -> None:
    with pytest.raises(ValueError, match="group_pages"):
        PagePipeline(-1)


def test_inline_runs_both_steps_a_batch_of_inline_group_at_a_time() -> None:
    """Inline is the engines' own page-by-page (or ring-batch) order, not one big batch: each
    page is verified right after its read, while it is hot in cache."""
    steps: list[tuple[str, list[int]]] = []

    def read(group: list[int]) -> list[int]:
        steps.append(("read", group))
        return group

    def verify(group: list[int]) -> list[int]:
        steps.append(("verify", group))
        return group

    assert PagePipeline(0, inline_group=2).read_then_verify([0, 1, 2], read, verify) == [0, 1, 2]
    assert steps == [("read", [0, 1]), ("verify", [0, 1]), ("read", [2]), ("verify", [2])]


def test_a_second_caller_finds_the_helper_busy_and_verifies_on_its_own_thread() -> None:
    """Callers never queue behind each other's groups: while one call holds the helper, a
    concurrent call runs inline (on its own thread, in parallel), and both get their own
    results."""
    pipeline = PagePipeline(1)
    first_verifying, release = threading.Event(), threading.Event()
    threads: dict[str, set[str]] = {"a": set(), "b": set()}

    def verify_as(who: str) -> object:
        def verify(group: list[int]) -> list[int]:
            threads[who].add(threading.current_thread().name)
            if who == "a" and group == [0]:
                first_verifying.set()
                release.wait(WAIT_S)
            return [f"{who}{i}" for i in group]  # type: ignore[misc]
        return verify

    results: dict[str, list] = {}
    first = threading.Thread(target=lambda: results.update(
        a=pipeline.read_then_verify([0, 1, 2], lambda g: g, verify_as("a"))))
    first.start()
    try:
        assert first_verifying.wait(WAIT_S)
        results["b"] = pipeline.read_then_verify([0, 1, 2], lambda g: g, verify_as("b"))
    finally:
        release.set()
        first.join(WAIT_S)
        pipeline.close()
    assert results == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"]}
    assert {name.startswith(THREAD_NAME) for name in threads["a"]} == {True}
    assert threads["b"] == {threading.current_thread().name}


def test_a_step_on_the_helper_that_calls_the_pipeline_runs_inline_instead_of_deadlocking() -> None:
    pipeline = PagePipeline(1)

    def verify(group: list[int]) -> list[int]:
        inner = pipeline.read_then_verify([10, 11], lambda g: g, lambda g: g)  # on the helper
        return [i + sum(inner) for i in group]

    done: list[list[int]] = []
    caller = threading.Thread(target=lambda: done.append(
        pipeline.read_then_verify([0, 1], lambda g: g, verify)))
    caller.start()
    caller.join(WAIT_S)
    pipeline.close()
    assert done == [[21, 22]]


def test_only_sealed_stores_pipeline_and_a_group_holds_at_least_two_mib() -> None:
    """(read, write, adaptive): an explicit N groups both, 0 neither; auto (None) groups both
    and chooses each call by measurement."""
    assert group_pages_for(4, 512 << 10, sealed=False) == (0, 0, False)  # xxh3: page by page
    assert group_pages_for(None, 2 << 20, sealed=False) == (0, 0, False)
    assert group_pages_for(0, 2 << 20, sealed=True) == (0, 0, False)  # switched off
    assert group_pages_for(4, 512 << 10, sealed=True) == (4, 4, False)
    assert group_pages_for(4, 128 << 10, sealed=True) == (16, 16, False)
    assert MIN_GROUP_BYTES // (128 << 10) == 16
    assert group_pages_for(8, 2 << 20, sealed=True) == (8, 8, False)
    assert group_pages_for(None, 128 << 10, sealed=True) == (16, 16, True)
    assert group_pages_for(None, 2 << 20, sealed=True) == (1, 1, True)  # one 2 MiB page a group


def _drive(choice: AdaptiveChoice, seconds_of: Callable[[bool], float], calls: int,
           pages: int = 1) -> list[bool]:
    """`calls` calls as a store makes them: ask the way, run it (`seconds_of(way)`), record."""
    ways = []
    for _ in range(calls):
        ways.append(choice.pipelined())
        choice.record(ways[-1], seconds_of(ways[-1]), pages=pages)
    return ways


def test_adaptive_choice_warms_up_both_ways_in_turn_then_takes_the_faster_and_explores() -> None:
    choice = AdaptiveChoice()
    warmup = 2 * AdaptiveChoice.WARMUP
    ways = _drive(choice, lambda way: 0.010 if way else 0.020, warmup + 2 * 16, pages=10)
    assert ways[:warmup] == [True, False] * AdaptiveChoice.WARMUP  # in turn: the same load
    # every EXPLORE_EVERY-th choice (counting the warm-up's) tries the slower way once
    explored = [i for i, way in enumerate(ways, start=1) if i > warmup and not way]
    assert explored == [AdaptiveChoice.EXPLORE_EVERY, 2 * AdaptiveChoice.EXPLORE_EVERY]
    stats = choice.stats("pipeline_read")
    assert stats["pipeline_read_pipelined_ns_per_page"] == 1_000_000
    assert stats["pipeline_read_inline_ns_per_page"] == 2_000_000


def test_adaptive_choice_turns_when_the_load_changes_and_wants_a_margin() -> None:
    """Pipelined must be MARGIN faster to be chosen (it takes a second core); once its calls
    slow down (another job took the core) the cost follows and page by page wins. (Call
    counts keep the last calls checked clear of the explorations at 16 and 32.)"""
    choice = AdaptiveChoice()
    _drive(choice, lambda way: 0.99 if way else 1.0, 2 * AdaptiveChoice.WARMUP)
    assert choice.pipelined() is False  # 1 % faster: not enough
    ways = _drive(choice, lambda way: 0.99 if way else 2.0, 8)  # page by page slowed down
    assert ways[0] is False and ways[-3:] == [True] * 3
    ways = _drive(choice, lambda way: 4.0 if way else 2.0, 16)  # then the pipeline, more
    assert ways[1] is True and ways[-3:] == [False] * 3


def test_slow_calls_neither_decide_the_choice_nor_hold_it() -> None:
    """The first pipelined call also starts the helper thread, and a page-cache writeback can
    stall a few calls in a row: such outliers must not make the faster way look slower. (An
    exponential average seeded with the first call failed this: 4.0 s a page after the warm-up
    against page by page's 1.5; so did the median of each way's last 3 calls: the burst of 2
    slow calls turned it, and the pipeline, no longer run, was judged by that burst until
    explored twice.)"""
    choice = AdaptiveChoice()
    pipelined_s = iter([5.0] + [1.0] * 11 + [1.6, 1.7] + [1.0] * 100)
    ways = _drive(choice, lambda way: next(pipelined_s) if way else 1.5, 40)
    after_warmup = ways[2 * AdaptiveChoice.WARMUP :]
    explored = [i for i in range(1, len(ways) + 1) if i % AdaptiveChoice.EXPLORE_EVERY == 0]
    assert after_warmup.count(False) == len(explored)  # page by page only when explored
    assert choice.stats("r")["r_pipelined_ns_per_page"] == 1_000_000_000


def test_calls_from_before_a_change_of_load_leave_the_window() -> None:
    """The pipeline ran at 1.0 s a page and page by page at 3.0 during the warm-up; then the
    load changed (pipelined 2.0, page by page 1.0). Page by page's warm-up calls leave the
    window of the last EXPLORE_EVERY choices by choice 21, so its exploration at 16 decides and
    page by page runs from then on (but the next exploration). (The median of all the calls
    kept, without the window, went on pipelining until choice 48.)"""
    choice = AdaptiveChoice()
    warmup = 2 * AdaptiveChoice.WARMUP
    calls = [0]

    def seconds_of(way: bool) -> float:
        calls[0] += 1
        if calls[0] <= warmup:
            return 1.0 if way else 3.0
        return 2.0 if way else 1.0

    ways = _drive(choice, seconds_of, 40)
    assert ways[warmup] is True  # right after the warm-up the pipeline was the faster
    pipelined_from_22 = [i for i, way in enumerate(ways, start=1) if way and i >= 22]
    assert pipelined_from_22 == [2 * AdaptiveChoice.EXPLORE_EVERY]  # only its exploration


class _Clock:
    """The pipeline's clock, advanced only by the steps: timings without the machine's load."""

    def __init__(self) -> None:
        self._now = 0.0
        self._lock = threading.Lock()

    def perf_counter(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


@pytest.mark.parametrize("slow_on", ["caller", "helper"])
def test_an_adaptive_pipeline_runs_the_way_that_measured_faster(
    slow_on: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real calls on real threads, a clock only the steps move: verify costs 30 ms a group on
    the slow side. After the warm-up an adaptive pipeline runs every call the fast way, but
    the explored one; it fails if the choice ignores what it measured."""
    clock = _Clock()
    monkeypatch.setattr(page_pipeline, "time", clock)
    pipeline = PagePipeline(1, adaptive=True)
    caller = threading.current_thread()

    def verify(group: list[int]) -> list[int]:
        on_helper = threading.current_thread() is not caller
        if on_helper is (slow_on == "helper"):
            clock.advance(0.03)
        return group

    try:
        for _ in range(AdaptiveChoice.EXPLORE_EVERY):
            assert pipeline.read_then_verify([0, 1, 2], lambda g: g, verify) == [0, 1, 2]
    finally:
        pipeline.close()
    stats = pipeline.stats()
    calls = (stats["pipeline_read_pipelined_calls"], stats["pipeline_read_inline_calls"])
    runs = AdaptiveChoice.EXPLORE_EVERY
    slow = AdaptiveChoice.WARMUP + 1  # its warm-up, and the last call explores it
    assert calls == ((runs - slow, slow) if slow_on == "caller" else (slow, runs - slow))
    assert stats["pipeline_read_busy_calls"] == 0
    assert stats["pipeline_write_pipelined_calls"] == stats["pipeline_write_inline_calls"] == 0


def test_a_call_that_chose_the_pipeline_but_found_the_helper_busy_measures_nothing() -> None:
    """A read that finds a write holding the helper runs page by page beside it, against its
    choice: it is counted busy, not a sample of page by page (which would then look slower
    than it is, and fill page by page's warm-up with calls that never chose it)."""
    pipeline = PagePipeline(1, adaptive=True)
    sealing, release = threading.Event(), threading.Event()

    def seal(group: list[int]) -> list[int]:
        if group == [0]:
            sealing.set()
            release.wait(WAIT_S)
        return group

    writer = threading.Thread(
        target=lambda: pipeline.seal_then_write([0, 1], seal, lambda g: g))
    writer.start()
    try:
        assert sealing.wait(WAIT_S)  # the write's first seal holds the helper
        assert pipeline.read_then_verify([0, 1], lambda g: g, lambda g: g) == [0, 1]
    finally:
        release.set()
        writer.join(WAIT_S)
        pipeline.close()
    stats = pipeline.stats()
    assert (stats["pipeline_read_busy_calls"], stats["pipeline_read_inline_calls"],
            stats["pipeline_read_pipelined_calls"]) == (1, 0, 0)
    assert stats["pipeline_write_pipelined_calls"] == 1


def test_reads_and_writes_take_their_own_group_size() -> None:
    """`write_group_pages` 0 keeps writes on the caller, page by page, while reads overlap."""
    pipeline = PagePipeline(1, write_group_pages=0)
    threads: dict[str, set[str]] = {"verify": set(), "seal": set()}

    def record(step: str):
        def run(group: list[int]) -> list[int]:
            threads[step].add(threading.current_thread().name)
            return group
        return run

    try:
        assert pipeline.seal_then_write([0, 1, 2], record("seal"), lambda g: g) == [0, 1, 2]
        assert pipeline._helper is None  # noqa: SLF001 - no helper for page-by-page writes
        assert pipeline.read_then_verify([0, 1, 2], lambda g: g, record("verify")) == [0, 1, 2]
    finally:
        pipeline.close()
    assert threads["seal"] == {threading.current_thread().name}
    assert all(name.startswith(THREAD_NAME) for name in threads["verify"])


def test_a_pipeline_dropped_without_close_ends_its_helper_thread() -> None:
    """The helper thread holds no reference to its pipeline: a store that is never closed
    (dropped by a test, a failed set-up) does not leave a thread behind for the process."""
    pipeline = PagePipeline(1)
    assert pipeline.read_then_verify([0, 1], lambda g: g, lambda g: g) == [0, 1]
    helper = pipeline._helper_thread  # noqa: SLF001
    assert helper is not None and helper.is_alive()
    del pipeline
    gc.collect()
    helper.join(WAIT_S)
    assert not helper.is_alive()
