"""The offline scripted model and its built-in `echo` and `support` scripts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.domain import Message, ToolCall, ToolResult, Usage, durability_error
from app.llm.base import LLMError, ModelRequest, ModelResponse
from app.llm.scripted import ScriptedLLMClient, register_script
from app.tools.agents_file import load_registry
from app.tools.base import ToolContext
from app.tools.builtin.orders import fake_order


def request(messages: list[Message], *, model: str = "scripted:support") -> ModelRequest:
    return ModelRequest(model=model, system="sys", messages=messages, tools=[], max_tokens=100)


async def complete(messages: list[Message], *, model: str = "scripted:support") -> ModelResponse:
    client = ScriptedLLMClient()
    try:
        return await client.complete(request(messages, model=model))
    finally:
        await client.aclose()


# --- the client --------------------------------------------------------------------------------


async def test_echo() -> None:
    history = [Message.user("first"), Message.assistant("echo: first"), Message.user("hi there")]
    response = await complete(history, model="scripted:echo")
    assert response.text == "echo: hi there"
    assert response.tool_calls == []
    assert response.stop_reason == "end_turn"
    assert response.usage.output_tokens == pytest.approx(len("echo: hi there") / 4, abs=1)
    prompt_chars = len("sys") + sum(len(m.content) for m in history)
    assert response.usage.input_tokens == pytest.approx(prompt_chars / 4, abs=1)


@pytest.mark.parametrize("model", ["scripted:nope", "claude-sonnet-4-6", "scripted:"])
async def test_unknown_model(model: str) -> None:
    with pytest.raises(LLMError) as info:
        await complete([Message.user("x")], model=model)
    assert info.value.type == "invalid_request_error"
    assert not info.value.retryable
    assert "unknown scripted model" in info.value.message
    assert model in info.value.message


async def test_register_script_and_own_usage() -> None:
    def fixed(req: ModelRequest) -> ModelResponse:
        return ModelResponse(text="fixed", usage=Usage(7, 3), stop_reason="end_turn")

    register_script("test-fixed-usage", fn=fixed)
    response = await complete([Message.user("x")], model="scripted:test-fixed-usage")
    assert (response.text, response.usage) == ("fixed", Usage(7, 3))


async def test_explicit_script_table_replaces_the_builtins() -> None:
    client = ScriptedLLMClient({"only": lambda req: ModelResponse(text="only")})
    response = await client.complete(request([Message.user("x")], model="scripted:only"))
    assert response.text == "only"
    assert response.usage.total > 0
    with pytest.raises(LLMError):
        await client.complete(request([Message.user("x")], model="scripted:echo"))


# --- the support script ------------------------------------------------------------------------

CTX = ToolContext(session_id="s", run_id="r", tool_call_id="unused")


async def run_turn(
    history: list[Message], text: str, outbox: Path, monkeypatch: pytest.MonkeyPatch
) -> list[ModelResponse]:
    """Drive the support script through one turn against the real example tools."""
    monkeypatch.setenv("DEMO_OUTBOX", str(outbox))
    registry = load_registry(None)
    allowed = registry.agent("support").tools
    history.append(Message.user(text))
    responses = []
    try:
        for _ in range(5):
            response = await complete(history)
            responses.append(response)
            history.append(Message.assistant(response.text, tool_calls=response.tool_calls))
            if not response.tool_calls:
                return responses
            for call in response.tool_calls:
                ctx = ToolContext("s", "r", call.id)
                result = await registry.execute(call, ctx=ctx, allowed=allowed)
                history.append(Message.tool(result))
    finally:
        await registry.aclose()
    raise AssertionError("support script did not finish")


async def test_support_happy_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    history: list[Message] = []
    outbox = tmp_path / "outbox.jsonl"
    lookup, email, report = await run_turn(
        history, "Where is my order b-2002?", outbox, monkeypatch
    )

    [lookup_call] = lookup.tool_calls
    assert (lookup_call.name, lookup_call.arguments) == ("lookup_order", {"order_id": "B-2002"})
    assert lookup.stop_reason == "tool_use"
    assert lookup.text

    [email_call] = email.tool_calls
    assert email_call.name == "send_email"
    order = fake_order("B-2002")
    assert email_call.arguments["to"] == "customer@example.com"
    assert email_call.arguments["subject"] == "Your order B-2002"
    assert email_call.arguments["delay_s"] == 0
    assert order["status"] in email_call.arguments["body"]
    assert str(order["total"]) in email_call.arguments["body"]

    assert report.tool_calls == []
    sent = json.loads(history[-2].content)
    assert sent["message_id"] in report.text
    assert "B-2002" in report.text
    [record] = [json.loads(line) for line in outbox.read_text().splitlines()]
    assert record["tool_call_id"] == email_call.id


async def test_support_default_order_and_slow(tmp_path: Path) -> None:
    first = await complete([Message.user("hello, please go slow")])
    assert first.tool_calls[0].arguments == {"order_id": "A-1001"}
    history = [
        Message.user("hello, please go slow"),
        Message.assistant(first.text, tool_calls=first.tool_calls),
        Message.tool(ToolResult.ok(first.tool_calls[0], value=fake_order("A-1001"))),
    ]
    second = await complete(history)
    assert second.tool_calls[0].arguments["delay_s"] == 15


def email_cut_off(order_id: str, *, asked: str) -> list[Message]:
    """A turn `asked` about the order: looked up, then its email cut off by a crash (the
    repair's durability error)."""
    lookup = ToolCall("toolu_0", "lookup_order", {"order_id": order_id})
    email = ToolCall("toolu_1", "send_email", {"to": "c", "subject": f"Your order {order_id}"})
    return [
        Message.user(asked),
        Message.assistant("", tool_calls=[lookup]),
        Message.tool(ToolResult.ok(lookup, value=fake_order(order_id))),
        Message.assistant("", tool_calls=[email]),
        Message.tool(durability_error("send_email", tool_call_id="toolu_1")),
    ]


async def test_support_reports_a_durability_error() -> None:
    response = await complete(email_cut_off("A-7", asked="order A-7 please"))
    assert response.tool_calls == []
    assert "may or may not have been sent" in response.text
    assert "will not resend it without checking" in response.text


async def test_support_reports_tool_errors() -> None:
    lookup = ToolCall("toolu_0", "lookup_order", {"order_id": "A-7"})
    failed_lookup = [
        Message.user("order A-7"),
        Message.assistant("", tool_calls=[lookup]),
        Message.tool(ToolResult.error(lookup, message="order service down")),
    ]
    response = await complete(failed_lookup)
    assert response.tool_calls == []
    assert response.text == "I could not look up order A-7: order service down"

    email = ToolCall("toolu_1", "send_email", {})
    failed_email = [
        *failed_lookup[:2],
        Message.tool(ToolResult.ok(lookup, value=fake_order("A-7"))),
        Message.assistant("", tool_calls=[email]),
        Message.tool(ToolResult.error(email, message="smtp refused")),
    ]
    response = await complete(failed_email)
    assert response.tool_calls == []
    assert "could not email the customer: smtp refused" in response.text


async def test_support_is_deterministic_with_unique_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    history: list[Message] = []
    outbox = tmp_path / "outbox.jsonl"
    first_turn = await run_turn(history, "order A-1", outbox, monkeypatch)
    second_turn = await run_turn(history, "order A-1 again", outbox, monkeypatch)
    ids = [c.id for r in first_turn + second_turn for c in r.tool_calls]
    assert len(ids) == 4
    assert len(set(ids)) == 4
    assert all(i.startswith("toolu_") for i in ids)

    # Asking again with the same history gives the same answer (what resume relies on).
    prefix = history[:1]
    assert await complete(prefix) == await complete(list(prefix))
    assert (await complete(prefix)).tool_calls == first_turn[0].tool_calls


async def test_support_does_not_resend_an_email_a_crash_cut_off_in_a_later_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The README's crash demo: the email got the durability error, and the next turn about
    # the same order must not send it again either (it did: only a successful send counted).
    history = [
        *email_cut_off("A-1001", asked="Where is order A-1001?"),
        Message.assistant("I was interrupted while emailing."),
    ]
    outbox = tmp_path / "outbox.jsonl"

    [later] = await run_turn(history, "Any news on order A-1001?", outbox, monkeypatch)
    assert later.tool_calls == []
    assert "may or may not have gone out" in later.text
    again = await run_turn(history, "Send the A-1001 email again", outbox, monkeypatch)
    assert [c.name for r in again for c in r.tool_calls].count("send_email") == 1
    assert len(outbox.read_text().splitlines()) == 1
    # Now it went out: the latest send counts, not the uncertain one before it.
    [after] = await run_turn(history, "Any news on order A-1001?", outbox, monkeypatch)
    assert after.tool_calls == [] and "already emailed" in after.text


async def test_support_takes_a_turn_naming_no_order_as_about_the_sessions_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The README's `run` example: "and now?" after a turn about A-1002 is about A-1002 (it
    # was taken for the default order, A-1001, which it then emailed about).
    history: list[Message] = []
    outbox = tmp_path / "outbox.jsonl"
    await run_turn(history, "Where is order A-1002?", outbox, monkeypatch)

    [follow_up] = await run_turn(history, "and now?", outbox, monkeypatch)
    assert follow_up.tool_calls == []
    assert "already emailed customer@example.com about order A-1002" in follow_up.text
    assert len(outbox.read_text().splitlines()) == 1
    first = (await run_turn([], "and now?", outbox, monkeypatch))[0]
    assert first.tool_calls[0].arguments == {"order_id": "A-1001"}  # a new session: the default


async def test_support_does_not_send_the_same_email_twice_unless_asked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its system prompt says never to send the same email twice: a later turn about the same
    # order (a resubmission after a crash, say) reports the email already sent.
    history: list[Message] = []
    outbox = tmp_path / "outbox.jsonl"
    await run_turn(history, "Where is order A-5?", outbox, monkeypatch)
    sent = json.loads(history[-2].content)  # send_email's result, before the report

    [repeat] = await run_turn(history, "Where is order A-5?", outbox, monkeypatch)
    assert repeat.tool_calls == []
    assert "already emailed" in repeat.text and sent["message_id"] in repeat.text
    assert len(outbox.read_text().splitlines()) == 1

    other = await run_turn(history, "And order A-6?", outbox, monkeypatch)
    again = await run_turn(history, "Please send the A-5 email again", outbox, monkeypatch)
    assert [c.name for r in other + again for c in r.tool_calls].count("send_email") == 2
    assert len(outbox.read_text().splitlines()) == 3


async def test_support_names_the_order_of_the_call_a_crash_cut_off() -> None:
    # The crash cut off the email about A-7; the resubmission asks about A-8. The report is
    # about A-7's email (it named A-8's), and says A-8 is still to be asked about.
    history = email_cut_off("A-7", asked="Where is order A-7? (slow)")
    response = await complete([*history, Message.user("and order A-8?")])
    assert response.tool_calls == []
    assert "interrupted while emailing customer@example.com about order A-7" in response.text
    assert "Ask me about order A-8 again" in response.text
