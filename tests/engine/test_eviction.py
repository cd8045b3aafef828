"""Eviction policies of the device tier (`pdcache.engine.eviction`): the session tracker's
turn clock, idle closure and bounds; the session-aware policy against LRU on a cyclic
multi-session pattern larger than the device pool, at tree level and through the engine
(session_id on GenerateRequest); exact accounting under both."""

from __future__ import annotations

import pytest

from pdcache.engine.api import GenerateRequest, SamplingParams
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.engine import Engine
from pdcache.engine.eviction import SessionTracker, make_policy
from pdcache.engine.kv_pool import PageAllocator
from pdcache.engine.loader import load_model
from pdcache.engine.radix import RadixTree

PAGE = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_tracker_turn_clock_gaps_idle_and_end() -> None:
    clock = Clock()
    tracker = SessionTracker(idle_s=10.0, clock=clock)
    for sid in ("a", "b", "c", "a"):  # a's gap: 3 turns
        tracker.observe_turn(sid)
    assert tracker.turns == 4
    assert tracker.expected_return("a") == 4 + 3
    assert tracker.expected_return("b") == 2 + 3  # one turn: the mean gap of all sessions
    tracker.observe_turn("")  # no session: not a turn of anything
    assert tracker.turns == 4
    clock.now = 9.0
    assert tracker.is_active("b")
    clock.now = 10.0
    assert not tracker.is_active("b") and not tracker.is_active("unknown")
    tracker.observe_turn("b")
    assert tracker.is_active("b")
    tracker.end("b")
    assert not tracker.is_active("b")
    tracker.observe_turn("b")  # a new turn reopens it
    assert tracker.is_active("b")


def test_tracker_is_bounded() -> None:
    tracker = SessionTracker(max_sessions=3)
    for i in range(10):
        tracker.observe_turn(f"s{i}")
    assert len(tracker) == 3 and tracker.is_active("s9") and not tracker.is_active("s0")


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="eviction policy must be one of"):
        make_policy("mru")
    with pytest.raises(ValueError, match="needs a SessionTracker"):
        make_policy("session")
    with pytest.raises(ValueError, match="device_eviction must be one of"):
        CacheConfig(device_eviction="mru")


def session_tokens(session: int, turns: int, pages_per_turn: int = 2) -> list[int]:
    base = 1000 * (session + 1)
    return list(range(base, base + turns * pages_per_turn * PAGE))


def tree_turn(
    tree: RadixTree, allocator: PageAllocator, session: int, turn: int, named: bool = True
) -> int:
    """One turn of `session` as the scheduler takes it (match + lock + evict + insert; the
    accounting checked): its device hits, in pages. `named=False`: the request names no
    session, so the tree learns none."""
    tokens = session_tokens(session, turn)
    match = tree.match_prefix(tokens)
    tree.lock(match.last_node)
    if named:
        tree.note_session(match.last_node, f"s{session}", new_turn=True)
    need = len(tokens) // PAGE - len(match.page_ids)
    tree.evict(need - allocator.num_free)
    result = tree.insert(tokens, match.page_ids + allocator.alloc(need))
    if named:
        tree.note_session(result.last_node, f"s{session}", new_turn=False)
    allocator.free(result.duplicate_page_ids)
    tree.unlock(match.last_node)
    tree.check()
    assert tree.total_pages == allocator.num_used
    return len(match.page_ids)


def session_tree(policy: str, device_pages: int) -> tuple[RadixTree, PageAllocator]:
    tracker = SessionTracker()
    allocator = PageAllocator(device_pages)
    return RadixTree(
        PAGE, allocator, policy=make_policy(policy, tracker), sessions=tracker
    ), allocator


def tree_round_robin(policy: str, sessions: int, turns: int, device_pages: int) -> int:
    """Device hits (pages) of `sessions` conversations taking turns round robin."""
    tree, allocator = session_tree(policy, device_pages)
    return sum(
        tree_turn(tree, allocator, session, turn)
        for turn in range(1, turns + 1)
        for session in range(sessions)
    )


def tree_staggered(policy: str, live: int, turns: int, total: int, device_pages: int) -> int:
    """Device hits of `total` conversations of `turns` turns each, `live` at a time round robin:
    one that took its last turn is replaced by a new one and never returns (nor says so), as
    in a replayed trace of finite sessions."""
    tree, allocator = session_tree(policy, device_pages)
    taken = dict.fromkeys(range(live), 0)  # live session -> turns taken
    started, hits = live, 0
    while taken:
        for session in list(taken):
            taken[session] += 1
            hits += tree_turn(tree, allocator, session, taken[session])
            if taken[session] == turns:
                del taken[session]
                if started < total:
                    taken[started] = 0
                    started += 1
    return hits


def test_session_policy_beats_lru_on_a_cycle_twice_the_device_pool() -> None:
    # 8 sessions x 4 turns x 2 pages: 64 pages by the last round, over a 16-page pool
    lru = tree_round_robin("lru", 8, 4, 16)
    session = tree_round_robin("session", 8, 4, 16)
    assert session > 4 * lru, (session, lru)


def test_finished_sessions_sink_below_live_ones() -> None:
    # 6 live sessions x 5 turns x 2 pages, 30 sessions in all, a 40-page pool: the pages of a
    # finished session (overdue by more turns at every turn that passes) go before those of
    # the live ones. Ranked by expected return alone, the finished sessions, due first, were
    # kept longest: 172 page hits against LRU's 300
    lru = tree_staggered("lru", 6, 5, 30, 40)
    session = tree_staggered("session", 6, 5, 30, 40)
    assert session > 1.5 * lru, (session, lru)


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny", seed=0)
    return model


def engine_round_robin(model, policy: str, sessions: int = 6, turns: int = 3) -> int:
    """The same pattern through a started engine: session_id on each GenerateRequest."""
    cache = CacheConfig(page_size=PAGE, num_device_pages=16, device_eviction=policy)
    engine = Engine(EngineConfig(model=model.config, cache=cache), model).start()
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    hits = 0
    try:
        for turn in range(1, turns + 1):
            for session in range(sessions):
                # tiny's vocabulary: small ids; sessions differ from their first token on
                history = [3 + (session * 41 + i * 7) % 250 for i in range(turn * 2 * PAGE)]
                prompt = history + [7]  # the last token is always computed
                req = GenerateRequest(
                    f"s{session}-t{turn}", prompt, params, session_id=f"s{session}"
                )
                hits += engine.generate(req, timeout=60)[-1].cached.device
                engine.check_accounting()
        assert engine.tree.sessions.turns == sessions * turns
    finally:
        engine.shutdown(10)
    return hits


def test_engine_learns_sessions_and_session_policy_beats_lru(tiny) -> None:
    lru = engine_round_robin(tiny, "lru")
    session = engine_round_robin(tiny, "session")
    assert session > 2 * lru, (session, lru)


def test_session_policy_without_session_ids_evicts_like_lru() -> None:
    """No request names a session: every node ranks in the no-session band, by LRU, so the
    device keeps exactly what LRU keeps."""
    kept = {}
    for policy in ("lru", "session"):
        tree, allocator = session_tree(policy, 8)  # 4 of the 6 two-page prompts
        for i in (0, 1, 2, 0, 3, 1, 4, 0, 5):
            tree_turn(tree, allocator, i, 1, named=False)
        kept[policy] = {i for i in range(6) if tree.match_prefix(session_tokens(i, 1)).page_ids}
    assert kept["lru"] == {0, 1, 4, 5}  # 2 and 3 were least recently used when room ran out
    assert kept["session"] == kept["lru"]


def test_samples_of_one_prompt_count_one_turn(tiny) -> None:
    """n > 1: the followers (`prefill_leader`) of a session's request are the same turn."""
    import threading

    cache = CacheConfig(page_size=PAGE, num_device_pages=64, device_eviction="session")
    engine = Engine(EngineConfig(model=tiny.config, cache=cache), tiny).start()
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    prompt = [3 + i % 200 for i in range(13)]
    done = {rid: threading.Event() for rid in ("lead", "f1", "f2")}

    def collect(out) -> None:
        if out.finished:
            done[out.rid].set()

    try:
        for rid, leader in (("lead", None), ("f1", "lead"), ("f2", "lead")):
            req = GenerateRequest(rid, prompt, params, session_id="s", prefill_leader=leader)
            engine.submit(req, collect)
        assert all(event.wait(60) for event in done.values())
        assert engine.tree.sessions.num_turns("s") == 1
        engine.generate(GenerateRequest("next", prompt + [5] * 8, params, session_id="s"))
        assert engine.tree.sessions.num_turns("s") == 2
        engine.check_accounting()
    finally:
        engine.shutdown(10)
