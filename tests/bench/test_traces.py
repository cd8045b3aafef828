"""Trace parsers: each fixture format round-trips into the normalised sessions-of-turns form."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdcache.bench.traces import (
    Blocks,
    Session,
    Turn,
    limit_requests,
    load_trace,
    parse_bailian,
    parse_mooncake,
    parse_sessions,
    parse_sharegpt,
    parse_synthetic_spec,
    rescale_blocks,
    synthetic_trace,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
MOONCAKE_REAL = Path(__file__).resolve().parents[2].parent / "shared/data/mooncake-fast25/synthetic_trace.jsonl"


def test_mooncake_rows_become_single_turn_sessions() -> None:
    trace = parse_mooncake(FIXTURES / "mooncake_small.jsonl")
    assert trace.block_size == 512 and not trace.multi_turn
    expected = [
        Turn("r0", "r0", 0, (Blocks((0, 1, 2), 1100),), 12, arrival_s=0.0),
        Turn("r1", "r1", 0, (Blocks((0, 1), 1024),), 7, arrival_s=0.25),
        Turn("r2", "r2", 0, (Blocks((3,), 300),), 3, arrival_s=1.5),
        Turn("r3", "r3", 0, (Blocks((0, 1, 2, 4), 1600),), 20, arrival_s=1.5),
    ]
    assert list(trace.turns()) == expected
    assert all(not t.dependent for t in trace.turns())


def test_mooncake_rejects_too_few_blocks(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1,
                               "hash_ids": [0]}) + "\n")
    with pytest.raises(ValueError, match="cover fewer than input_length=600"):
        parse_mooncake(bad)


def test_mooncake_ties_keep_the_file_order(tmp_path: Path) -> None:
    """Ties in time were broken on the session id as a string ("r10" < "r9"): the request
    order changed, and --max-requests kept r10 over r9."""
    rows = tmp_path / "ties.jsonl"
    rows.write_text("".join(json.dumps({"timestamp": 0 if i < 9 else 5, "input_length": 4,
                                        "output_length": 1, "hash_ids": [i]}) + "\n"
                            for i in range(11)))
    trace = parse_mooncake(rows, block_size=4)
    assert [s.session_id for s in trace.sessions] == [f"r{i}" for i in range(11)]
    assert [t.request_id for t in limit_requests(trace, 10).turns()][-1] == "r9"


@pytest.mark.parametrize("row", [{"timestamp": 0, "input_length": 4, "output_length": 1,
                                  "hash_ids": None}, None])
def test_a_mooncake_row_of_wrong_types_names_its_row(tmp_path: Path, row: object) -> None:
    """A null (or a null field) was a raw TypeError traceback with no location."""
    bad = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}
    bad.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:row 1"):
        parse_mooncake(bad, block_size=4)


def test_bailian_follows_parent_chains_into_sessions() -> None:
    trace = parse_bailian(FIXTURES / "bailian_small.jsonl")
    assert trace.block_size == 16
    assert [s.session_id for s in trace.sessions] == ["10", "11"]
    conv = trace.sessions[0]
    assert [t.request_id for t in conv.turns] == ["10", "12", "13"]
    assert [t.turn for t in conv.turns] == [0, 1, 2]
    assert [t.parent_id for t in conv.turns] == [None, "10", "12"]
    assert conv.turns[2] == Turn("13", "10", 2, (Blocks((0, 1, 2, 3, 6, 7), 81),), 2,
                                 arrival_s=9.0, parent_id="12")
    # rows cover their full context: replayed as self-contained prompts at their own times
    assert not any(t.with_history or t.dependent for t in trace.turns())
    assert trace.sessions[1].turns == (Turn("11", "11", 0, (Blocks((5,), 16),), 4,
                                            arrival_s=1.0),)


def test_sessions_jsonl_accumulates_history_with_delays() -> None:
    trace = parse_sessions(FIXTURES / "sessions_small.jsonl", block_size=8)
    assert [s.session_id for s in trace.sessions] == ["b", "a"]  # b starts at 50 ms, a at 100
    a, b = trace.sessions[1], trace.sessions[0]
    # rows without hash_ids get fresh ids above the largest id in the file (7), in file order
    assert a.turns == (
        Turn("a/0", "a", 0, (Blocks((1, 2), 10),), 6, arrival_s=0.1, with_history=True),
        Turn("a/1", "a", 1, (Blocks((10,), 5),), 4, delay_s=2.0, parent_id="a/0",
             with_history=True),
    )
    assert b.turns == (
        Turn("b/0", "b", 0, (Blocks((8, 9), 9),), 3, arrival_s=0.05, with_history=True),
        Turn("b/1", "b", 1, (Blocks((7,), 3),), 1, delay_s=0.5, parent_id="b/0",
             with_history=True),
    )
    assert [t.dependent for t in a.turns] == [False, True]


def test_sharegpt_pairs_questions_with_answers() -> None:
    trace = parse_sharegpt(FIXTURES / "sharegpt_small.json", block_size=4, bytes_per_token=4.0)
    assert [s.session_id for s in trace.sessions] == ["conv_a", "conv_b"]  # unanswered dropped
    conv_a = trace.sessions[0].turns
    q0 = "Be brief.\nWhat is a KV cache?"  # system prompt merged into the first question
    a0 = "Keys and values of past tokens, kept so they are not recomputed."
    assert conv_a[0].input_len == math.ceil(len(q0) / 4)
    assert conv_a[0].output_len == math.ceil(len(a0) / 4)
    assert conv_a[1].input_len == math.ceil(len("Why page it?") / 4)
    assert conv_a[1].parent_id == "conv_a/0" and conv_a[1].dependent
    (only,) = trace.sessions[1].turns
    assert only.input_len == math.ceil(len("héllo wörld".encode()) / 4)  # UTF-8 bytes
    ids = [i for t in trace.turns() for b in t.inputs for i in b.ids]
    assert len(ids) == len(set(ids)), "every text gets its own blocks"


def test_synthetic_shares_the_system_prompt_and_is_seeded() -> None:
    spec = parse_synthetic_spec("sessions=3,turns=4,system=100,user=20,tool=30,answer=10,"
                                "think=0.5,stagger=2,block=16,dist=lognormal,seed=7")
    trace = synthetic_trace(spec)
    assert trace.num_requests == 12 and trace.multi_turn
    system = {s.turns[0].inputs[0] for s in trace.sessions}
    assert system == {Blocks(tuple(range(7)), 100)}  # ceil(100/16) = 7 shared blocks
    assert [s.start_s for s in trace.sessions] == [0.0, 2.0, 4.0]
    later = [t for t in trace.turns() if t.turn > 0]
    assert all(t.dependent and len(t.inputs) == 1 for t in later)
    assert len({t.input_len for t in later}) > 1, "lognormal lengths vary"
    assert synthetic_trace(spec) == trace
    assert synthetic_trace(parse_synthetic_spec("sessions=3,turns=4,system=100,user=20,"
                                                "tool=30,dist=lognormal,seed=8")) != trace
    private = [i for t in trace.turns() for b in t.inputs[-1:] for i in b.ids if t.turn > 0]
    assert len(private) == len(set(private)), "tool results are private to their turn"


def test_synthetic_constant_lengths_exact() -> None:
    trace = load_trace("synthetic:sessions=2,turns=3,system_prompt=64,user=8,tool_result=24,"
                       "answer=5")
    assert [t.input_len for t in trace.sessions[0].turns] == [72, 24, 24]
    assert {t.output_len for t in trace.turns()} == {5}


@pytest.mark.parametrize("spec, message", [
    ("nosuch:/x", "expected FORMAT:PATH"),
    ("mooncake:/does/not/exist.jsonl", "trace file not found"),
    ("synthetic:sessions=2,bogus=1", "bad item 'bogus=1'"),
    ("synthetic:dist=zipf", "unknown distribution 'zipf'"),
])
def test_bad_specs_are_clear_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_trace(spec)


def test_limit_requests_keeps_whole_sessions_in_order() -> None:
    trace = load_trace("synthetic:sessions=3,turns=4,system_prompt=16")
    cut = limit_requests(trace, 6)
    assert [len(s.turns) for s in cut.sessions] == [4, 2]
    assert cut.sessions[0] == trace.sessions[0]


def test_rescale_blocks_scales_lengths_and_keeps_ids() -> None:
    trace = parse_mooncake(FIXTURES / "mooncake_small.jsonl")
    small = rescale_blocks(trace, 16)
    # 1100 = 2*512 + 76 -> 2*16 + ceil(76/32); 1024 = 2 full blocks -> 32;
    # 300 -> ceil(300/32); 1600 = 3*512 + 64 -> 3*16 + 64/32
    assert [t.input_len for t in small.turns()] == [35, 32, 10, 3 * 16 + 2]
    assert [t.inputs[0].ids for t in small.turns()] == [t.inputs[0].ids for t in trace.turns()]
    assert small.block_size == 16


@pytest.mark.skipif(not MOONCAKE_REAL.is_file(), reason="Mooncake FAST'25 trace not present")
def test_real_mooncake_trace_parses(tmp_path: Path) -> None:
    head = tmp_path / "head.jsonl"
    lines = MOONCAKE_REAL.read_text().splitlines()[:400]
    head.write_text("\n".join(lines) + "\n")
    trace = parse_mooncake(head)
    rows = [json.loads(line) for line in lines]
    assert trace.num_requests == 400
    by_id = {t.request_id: t for t in trace.turns()}
    for i, row in enumerate(rows):
        turn = by_id[f"r{i}"]
        assert turn.inputs == (Blocks(tuple(row["hash_ids"]), row["input_length"]),)
        assert len(row["hash_ids"]) == math.ceil(row["input_length"] / 512)
        assert turn.arrival_s == row["timestamp"] / 1000
    starts = [s.start_s for s in trace.sessions]
    assert starts == sorted(starts)


def test_sessions_are_sorted_by_start() -> None:
    trace = parse_bailian(FIXTURES / "bailian_small.jsonl")
    assert all(isinstance(s, Session) for s in trace.sessions)
    assert [s.start_s for s in trace.sessions] == sorted(s.start_s for s in trace.sessions)
