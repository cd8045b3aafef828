from __future__ import annotations

import pytest

from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.router.policy import NodeState, NoHealthyNodeError, PairSelector, PrefixIndex
from pdcache.router.sessions import SessionStore


def nodes() -> list[NodeState]:
    return [
        NodeState("p0", "http://p0", "prefill"),
        NodeState("p1", "http://p1", "prefill"),
        NodeState("d0", "http://d0", "decode"),
        NodeState("d1", "http://d1", "decode"),
    ]


def test_round_robin_skips_unhealthy() -> None:
    ns = nodes()
    sel = PairSelector()
    assert [sel.pick_decode(ns).name for _ in range(4)] == ["d0", "d1", "d0", "d1"]
    ns[3].healthy = False
    assert {sel.pick_decode(ns).name for _ in range(3)} == {"d0"}
    ns[2].healthy = False
    with pytest.raises(NoHealthyNodeError, match="decode"):
        sel.pick_decode(ns)


def test_least_load() -> None:
    ns = nodes()
    ns[0].in_flight, ns[1].in_flight = 5, 2
    sel = PairSelector("least_load", "least_load")
    assert sel.pick_prefill(ns, []).name == "p1"


def test_cache_aware_prefers_longest_known_prefix() -> None:
    ns = nodes()
    salt = make_salt("fp")
    conv_a = chain_page_keys(list(range(64)), 16, salt)
    conv_b = chain_page_keys(list(range(100, 164)), 16, salt)
    sel = PairSelector("cache_aware")
    sel.index.record("p1", conv_a[:3])
    sel.index.record("p0", conv_b)
    ns[1].in_flight = 7  # busier, but it holds conv_a's prefix
    assert sel.pick_prefill(ns, conv_a).name == "p1"
    assert sel.pick_prefill(ns, conv_b).name == "p0"
    unknown = chain_page_keys(list(range(500, 532)), 16, salt)
    assert sel.pick_prefill(ns, unknown).name == "p0"  # miss: least loaded
    ns[1].healthy = False
    assert sel.pick_prefill(ns, conv_a).name == "p0"


@pytest.mark.parametrize("balance", [0, 3])
def test_cache_aware_spreads_a_prefix_every_prompt_shares(balance: int) -> None:
    """Every session opens with one system prompt: without a bound (balance 0, the policy
    before it) each new session matches the node that served the first one and all traffic
    lands there; with balance 3 a match wins only while its node has at most 3 requests in
    flight beyond the least loaded one, so the load spreads, and a session's next turn still
    goes where its prefix is while that node is within the bound."""
    ns = nodes()
    sel = PairSelector("cache_aware", "round_robin", balance=balance)
    salt = make_salt("fp")
    system = list(range(32))
    picked = []
    for session in range(10):  # none finishes: each adds one request in flight
        keys = chain_page_keys(system + [1000 + session] * 16, 16, salt)
        node = sel.pick_prefill(ns, keys)
        node.in_flight += 1
        sel.index.record(node.name, keys)
        picked.append(node.name)
    if balance == 0:
        assert picked == ["p0"] * 10
        return
    counts = {name: picked.count(name) for name in ("p0", "p1")}
    assert abs(counts["p0"] - counts["p1"]) <= balance + 1 and counts["p1"] >= 3
    ns[0].in_flight = ns[1].in_flight = 0
    next_turn = chain_page_keys(system + [1000 + 9] * 16 + [7] * 16, 16, salt)
    assert sel.pick_prefill(ns, next_turn).name == picked[9]


def test_prefix_index_is_bounded_lru() -> None:
    index = PrefixIndex(capacity=3)
    keys = [bytes([i]) * 32 for i in range(5)]
    index.record("p", keys)
    assert index.match_len("p", keys) == 0  # the first keys were evicted
    assert index.match_len("p", keys[2:]) == 3


def test_session_history_commits_only_finished_turns() -> None:
    store = SessionStore(max_sessions=2)
    assert store.history("s") == [] and store.version("s") == 0
    assert store.commit("s", [1, 2, 3], [4, 5], base_version=0)
    assert store.history("s") == [1, 2, 3, 4, 5] and store.turns("s") == 1
    assert store.commit("s", [1, 2, 3, 4, 5, 6], [7], store.version("s"))
    assert store.history("s") == [1, 2, 3, 4, 5, 6, 7] and store.turns("s") == 2
    store.commit("t", [9], [9], 0)
    store.commit("u", [8], [8], 0)
    assert store.history("s") == [] and len(store) == 2  # LRU bound


def test_a_session_turn_commits_only_onto_the_history_it_was_built_on() -> None:
    store = SessionStore()
    store.commit("s", [1, 2], [3], 0)
    base = store.version("s")
    # two turns of "s" in flight at once, both built on [1, 2, 3]: the first to finish
    # commits; the other is refused (it used to overwrite it, the last finisher winning)
    assert store.commit("s", [1, 2, 3, 10], [11], base)
    assert not store.commit("s", [1, 2, 3, 20], [21], base)
    assert store.history("s") == [1, 2, 3, 10, 11] and store.turns("s") == 2
    # a turn in flight when its session was closed does not bring the history back
    in_flight = store.version("s")
    assert store.close("s")
    assert not store.commit("s", [1, 2, 3, 10, 11, 12], [13], in_flight)
    assert store.history("s") == [] and len(store) == 0
    assert store.refused_commits == 2
    # ... nor a turn built on it after a new history began (versions are never reused)
    assert store.commit("s", [5], [6], store.version("s"))
    assert not store.commit("s", [1, 2, 3, 10, 11, 12], [13], in_flight)
    assert store.history("s") == [5, 6]
    # a session's first turn in flight when it was closed does not open it again either
    base = store.version("new")
    store.close("new")
    assert not store.commit("new", [7], [8], base) and store.history("new") == []


def test_a_session_s_idle_time_runs_from_its_last_turn_s_start() -> None:
    """A turn that began inside the idle TTL and ended past it found its session expired at
    commit (the TTL ran from the last commit): refused, and the history gone."""
    now = [0.0]
    store = SessionStore(idle_ttl_s=10.0, clock=lambda: now[0])
    store.commit("s", [1], [2], 0)
    now[0] = 9.0
    assert store.history("s") == [1, 2]  # turn 2 starts
    base = store.version("s")
    now[0] = 15.0  # a long turn: it ends 15 s after turn 1's commit
    assert store.commit("s", [1, 2, 3], [4], base)
    now[0] = 24.0
    assert store.history("s") == [1, 2, 3, 4]
    now[0] = 40.0  # idle for 16 s
    assert store.history("s") == [] and len(store) == 0


def test_session_idle_expiry() -> None:
    store = SessionStore(idle_ttl_s=0.0)
    store.commit("s", [1], [2], 0)
    assert store.history("s") == []


def test_session_store_is_bounded_in_total_tokens() -> None:
    store = SessionStore(max_total_tokens=10)
    store.commit("a", [1, 2, 3], [4], 0)
    store.commit("b", [5, 6, 7], [8, 9], 0)
    assert store.total_tokens == 9 and len(store) == 2
    store.commit("c", [10, 11], [12], 0)  # 12 tokens > 10: the least recent session goes
    assert store.history("a") == [] and store.history("b") == [5, 6, 7, 8, 9]
    assert store.total_tokens == 8
    store.commit("b", [5, 6, 7, 8, 9, 1], [2], store.version("b"))  # frees the old history
    assert store.total_tokens == 10 and store.history("c") == [10, 11, 12]


def test_one_owner_s_flood_evicts_its_own_sessions() -> None:
    """Past the bound the least recently used session of the owner holding the most goes:
    tenant a opening sessions by the dozen evicts its own, never b's (a shared LRU dropped
    b's conversation)."""
    store = SessionStore(max_sessions=4)
    store.commit(("b", "s"), [1, 2], [3], 0)
    for i in range(10):
        store.commit(("a", f"flood-{i}"), [i], [i], 0)
    assert store.history(("b", "s")) == [1, 2, 3] and len(store) == 4
    assert store.history(("a", "flood-9")) == [9, 9] and store.history(("a", "flood-0")) == []
    tokens = SessionStore(max_total_tokens=8)
    tokens.commit(("b", "s"), [1, 2], [3], 0)
    for i in range(5):
        tokens.commit(("a", f"big-{i}"), [i] * 3, [i], 0)
    assert tokens.history(("b", "s")) == [1, 2, 3] and tokens.total_tokens <= 8


def test_a_lost_history_is_not_continued_silently() -> None:
    """An evicted or expired session's turn that does not resend its history is `lost`
    (the router answers 409 session_expired); resending the whole history continues; a
    closed session starts fresh; a new commit clears the mark."""
    now = [0.0]
    store = SessionStore(max_sessions=1, idle_ttl_s=100.0, clock=lambda: now[0])
    store.commit("s", [1, 2, 3], [4], 0)
    store.commit("t", [7], [8], 0)  # evicts s
    assert store.history("s") == []
    assert store.lost("s", [5]) and store.lost("s", [1, 2, 3])
    assert not store.lost("s", [1, 2, 3, 4, 5])  # the client resent it all
    assert not store.lost("new", [5])
    now[0] = 500.0  # t idles past the TTL
    assert store.history("t") == [] and store.lost("t", [9])
    store.commit("t", [9], [1], store.version("t"))
    assert not store.lost("t", [9])
    store.close("s")
    assert not store.lost("s", [5])
