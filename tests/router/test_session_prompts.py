"""A session's chat prompt when the client resends the conversation (`Router.chat_prompt`):
the history's exact ids, then only what is new; a conversation that is not the session's
(edited, cut) is rendered as sent. Router-side only: no node is contacted."""

from __future__ import annotations

from typing import Any

from pdcache.router.config import RouterConfig
from pdcache.router.core import Router
from pdcache.router.nodes import NodeEndpoint
from tests.agent_support import TOOLS, tool_call_text

ASK = {"role": "user", "content": "Weather in Paris, then Rome?"}


def router() -> Router:
    return Router(RouterConfig(nodes=(NodeEndpoint("u0", "unified", "http://127.0.0.1:1"),),
                               page_size=16))


def answered(content: str, city: str, call_id: str) -> dict[str, Any]:
    """The assistant turn as a client sends it back (its tool call re-written as JSON)."""
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": city}}}]}


def test_a_tool_loops_third_turn_is_the_history_and_the_new_tool_result() -> None:
    """From the third turn of a tool loop the turns before the last answer, re-rendered,
    never matched the history (the first answer as the template writes it is not the ids
    the model produced): the whole conversation was appended to the history again."""
    r, session = router(), "loop"
    first = r.chat_prompt(session, [ASK], TOOLS)
    r.sessions.commit(session, first, r.tokenizer.encode(
        "Checking. " + tool_call_text("get_weather", '{"city":"Paris"}')), 0)
    turn2 = [ASK, answered("Checking.", "Paris", "c1"),
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    second = r.chat_prompt(session, turn2, TOOLS)
    history = r.sessions.history(session)
    assert second[: len(history)] == history
    r.sessions.commit(session, second, r.tokenizer.encode(
        "Now Rome. " + tool_call_text("get_weather", '{"city":"Rome"}')),
        r.sessions.version(session))
    turn3 = [*turn2, answered("Now Rome.", "Rome", "c2"),
             {"role": "tool", "tool_call_id": "c2", "content": "rainy"}]
    third = r.chat_prompt(session, turn3, TOOLS)
    history = r.sessions.history(session)
    assert third[: len(history)] == history
    text = r.tokenizer.decode(third[len(history):])
    assert "rainy" in text and "sunny" not in text and "Weather in Paris" not in text


def test_an_edited_question_replaces_its_turn() -> None:
    """The client edits its second question and resends [u1, a1, u2x]: the history's prompt
    matched some prefix of it, so u2x was appended to the whole history, the replaced
    question and its answer staying in the model's context."""
    r, session = router(), "edit"
    u1, a1 = {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}
    first = r.chat_prompt(session, [u1])
    r.sessions.commit(session, first, r.tokenizer.encode("4"), 0)
    second = r.chat_prompt(session, [u1, a1, {"role": "user", "content": "And 3+3?"}])
    r.sessions.commit(session, second, r.tokenizer.encode("6"), r.sessions.version(session))
    edited = [u1, a1, {"role": "user", "content": "Actually, what is 5+5?"}]
    assert r.chat_prompt(session, edited) == r.render_chat(edited, None)
    # only the new message sent (no assistant turn in it): the history, then it
    follow = [{"role": "user", "content": "Why?"}]
    history = r.sessions.history(session)
    assert r.chat_prompt(session, follow)[: len(history)] == history
