"""Domain value types: orphaned_calls, the durability-error shape, ToolResult constructors."""

from __future__ import annotations

import json

import pytest

from app.domain import (
    Message,
    Role,
    ToolCall,
    ToolResult,
    durability_error,
    orphaned_calls,
)

A = ToolCall("toolu_a", "lookup", {"id": "A-1"})
B = ToolCall("toolu_b", "charge", {"amount": 5})
C = ToolCall("toolu_c", "lookup", {"id": "C-3"})


def answer(call: ToolCall) -> Message:
    return Message.tool(ToolResult.ok(call, value={"ok": True}))


# --- orphaned_calls ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "history",
    [
        pytest.param([], id="empty"),
        pytest.param([Message.user("hi")], id="user-only"),
        pytest.param([Message.user("hi"), Message.assistant("hello")], id="no-tool-calls"),
        pytest.param(
            [Message.user("hi"), Message.assistant("", tool_calls=[A, B]), answer(A), answer(B)],
            id="all-answered",
        ),
        pytest.param(
            [
                Message.user("hi"),
                Message.assistant("", tool_calls=[A]),
                answer(A),
                Message.assistant("done"),
            ],
            id="answered-then-final",
        ),
        pytest.param(
            [
                Message.user("hi"),
                Message.assistant("", tool_calls=[A]),
                answer(A),
                Message.assistant("", tool_calls=[B]),
                answer(B),
            ],
            id="two-steps-answered",
        ),
        pytest.param(
            [Message.user("hi"), Message.assistant("", tool_calls=[A, B]), answer(B), answer(A)],
            id="answered-out-of-order",
        ),
    ],
)
def test_orphaned_calls_finds_nothing_when_every_call_has_a_result(history: list[Message]) -> None:
    assert orphaned_calls(history) == (-1, [])


def test_orphaned_calls_returns_every_call_of_an_unanswered_step_in_call_order() -> None:
    history = [Message.user("hi"), Message.assistant("", tool_calls=[A, B, C])]
    assert orphaned_calls(history) == (1, [A, B, C])


def test_orphaned_calls_returns_only_the_missing_calls_of_a_partly_answered_step() -> None:
    history = [Message.user("hi"), Message.assistant("", tool_calls=[A, B, C]), answer(B)]
    assert orphaned_calls(history) == (1, [A, C])


def test_orphaned_calls_looks_at_the_last_step_that_asked_for_tools() -> None:
    history = [
        Message.user("one"),
        Message.assistant("", tool_calls=[A]),
        answer(A),
        Message.assistant("first answer"),
        Message.user("two"),
        Message.assistant("", tool_calls=[B, C]),
        answer(C),
    ]
    assert orphaned_calls(history) == (5, [B])


def test_orphaned_calls_finds_the_step_behind_a_later_text_only_message() -> None:
    history = [Message.user("hi"), Message.assistant("", tool_calls=[A]), Message.assistant("text")]
    assert orphaned_calls(history) == (1, [A])


def test_orphaned_calls_ignores_results_stored_before_the_step() -> None:
    # A result with the same id from before the assistant message does not answer it.
    history = [answer(A), Message.user("hi"), Message.assistant("", tool_calls=[A])]
    assert orphaned_calls(history) == (2, [A])


def test_orphaned_calls_ignores_user_messages_and_foreign_results() -> None:
    other = ToolCall("toolu_x", "lookup", {})
    history = [
        Message.user("hi"),
        Message.assistant("", tool_calls=[A]),
        answer(other),
        Message.user("?"),
    ]
    assert orphaned_calls(history) == (1, [A])


# --- durability_error ----------------------------------------------------------------------------


def test_durability_error_has_the_contract_shape() -> None:
    result = durability_error("send_email", tool_call_id="toolu_42")
    body = json.loads(result.content)
    assert set(body) == {"error", "kind", "toolName", "toolCallId"}
    assert body["kind"] == "tool-durability-error"
    assert body["toolName"] == "send_email"
    assert body["toolCallId"] == "toolu_42"
    error = body["error"]
    assert "send_email" in error
    assert "toolu_42" in error
    assert "may or may not have taken effect" in error
    assert "check before repeating" in error
    assert result.is_error
    assert result.tool_name == "send_email"
    assert result.tool_call_id == "toolu_42"


def test_durability_error_survives_as_an_error_tool_message() -> None:
    message = Message.tool(durability_error("charge", tool_call_id="toolu_b"))
    assert message.role is Role.TOOL
    assert message.is_error
    assert message.tool_call_id == "toolu_b"
    assert message.tool_name == "charge"
    assert json.loads(message.content)["kind"] == "tool-durability-error"


# --- ToolResult ----------------------------------------------------------------------------------


def test_tool_result_ok_stores_compact_json_of_the_value() -> None:
    result = ToolResult.ok(A, value={"id": "A-1", "items": [1, 2], "note": None})
    assert result == ToolResult("toolu_a", "lookup", '{"id":"A-1","items":[1,2],"note":null}')
    assert not result.is_error


@pytest.mark.parametrize("value", [None, 3, "text", [1, "two"], {"nested": {"x": 1.5}}])
def test_tool_result_ok_round_trips_any_json_value(value: object) -> None:
    assert json.loads(ToolResult.ok(A, value=value).content) == value


def test_tool_result_error_wraps_the_message() -> None:
    result = ToolResult.error(B, message='bad "input"\nline two')
    assert result.is_error
    assert result.tool_call_id == "toolu_b"
    assert result.tool_name == "charge"
    assert json.loads(result.content) == {"error": 'bad "input"\nline two'}


def test_tool_message_copies_the_result() -> None:
    message = Message.tool(ToolResult.ok(C, value=[1]))
    assert message == Message(
        Role.TOOL, "[1]", tool_call_id="toolu_c", tool_name="lookup", is_error=False
    )
