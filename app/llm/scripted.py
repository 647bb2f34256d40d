"""Offline model: `scripted:<name>` runs a deterministic script function instead of an LLM."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from typing_extensions import override

from app.domain import Message, Role, ToolCall, Usage, is_durability_error
from app.llm.base import LLMClient, LLMError, ModelRequest, ModelResponse

PREFIX = "scripted:"
# A script must be a pure function of the request: a resumed session asks again with the
# stored history and has to get the answer it would have got before the crash.
Script = Callable[[ModelRequest], ModelResponse]

_SCRIPTS: dict[str, Script] = {}


def register_script(name: str, *, fn: Script) -> None:
    """Make `fn` answer for model `scripted:<name>` (replaces a script of the same name)."""
    _SCRIPTS[name] = fn


def is_scripted(model: str) -> bool:
    """Whether the model is an offline script's (`scripted:<name>`), not the API's."""
    return model.startswith(PREFIX)


def unknown_script(model: str) -> str | None:
    """Why a `scripted:` model has no built-in script (None when it has, or is not scripted)."""
    if not is_scripted(model) or model.removeprefix(PREFIX) in _SCRIPTS:
        return None
    return _unknown(model, scripts=_SCRIPTS)


def _unknown(model: str, *, scripts: Mapping[str, Script]) -> str:
    return f"unknown scripted model {model!r} (known: {', '.join(sorted(scripts)) or 'none'})"


class ScriptedLLMClient(LLMClient):
    """LLMClient for `scripted:<name>` models; looks scripts up at call time."""

    def __init__(self, scripts: Mapping[str, Script] | None = None) -> None:
        # None: the module's registry, so register_script() after construction still counts.
        self._scripts = scripts

    @override
    async def complete(self, request: ModelRequest) -> ModelResponse:
        """Answer with the named script; unknown names are an invalid_request_error."""
        name = request.model.removeprefix(PREFIX)
        scripts = _SCRIPTS if self._scripts is None else self._scripts
        script = scripts.get(name) if is_scripted(request.model) else None
        if script is None:
            raise LLMError(_unknown(request.model, scripts=scripts), type="invalid_request_error")
        response = script(request)
        if response.usage.total == 0:
            response.usage = _estimate_usage(request, response=response)
        return response

    @override
    async def aclose(self) -> None:
        """Nothing to release."""


def _tokens(text: str) -> int:
    return (len(text) + 3) // 4  # roughly 4 characters a token, like English text


def _calls_text(calls: list[ToolCall]) -> str:
    return json.dumps([call.as_json() for call in calls]) if calls else ""


def _estimate_usage(request: ModelRequest, *, response: ModelResponse) -> Usage:
    prompt = (request.system or "") + "".join(
        m.content + _calls_text(m.tool_calls) for m in request.messages
    )
    return Usage(
        input_tokens=_tokens(prompt),
        output_tokens=_tokens(response.text + _calls_text(response.tool_calls)),
    )


# --- helpers for scripts ---------------------------------------------------------------------


def current_turn(messages: list[Message]) -> tuple[str, list[Message]]:
    """The last user message's text and the messages after it (this turn so far)."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role is Role.USER:
            return messages[index].content, messages[index + 1 :]
    return "", list(messages)


def repaired_before_turn(messages: list[Message]) -> list[Message]:
    """The tool messages directly before the last user message (a resumed turn's repairs)."""
    index = max((i for i, m in enumerate(messages) if m.role is Role.USER), default=0)
    found: list[Message] = []
    while index > 0 and messages[index - 1].role is Role.TOOL:
        index -= 1
        found.insert(0, messages[index])
    return found


def tool_call_id(request: ModelRequest, *, step: int, tool_name: str) -> str:
    """A deterministic id, unique within a session because the history only grows."""
    seed = f"{len(request.messages)}:{step}:{tool_name}"
    return "toolu_" + hashlib.sha256(seed.encode()).hexdigest()[:24]


def final(text: str) -> ModelResponse:
    """A final answer with no tool calls."""
    return ModelResponse(text=text, stop_reason="end_turn")


def ask(text: str, *, calls: list[ToolCall]) -> ModelResponse:
    """An assistant message asking for tool calls."""
    return ModelResponse(text=text, tool_calls=calls, stop_reason="tool_use")


def parse_json(content: str) -> Any:
    """A tool message's JSON content, or None when it is not JSON."""
    try:
        return json.loads(content)
    except ValueError:
        return None


# --- built-in scripts ------------------------------------------------------------------------


def echo_script(request: ModelRequest) -> ModelResponse:
    """Answer "echo: <last user text>"."""
    text, _ = current_turn(request.messages)
    return final(f"echo: {text}")


ORDER_ID = re.compile(r"\b([A-Za-z]{1,4}-\d{1,10})\b")
DEFAULT_ORDER_ID = "A-1001"
CUSTOMER = "customer@example.com"
SLOW_DELAY_S = 15
AGAIN = re.compile(r"\b(again|resend)\b", re.IGNORECASE)


def support_script(request: ModelRequest) -> ModelResponse:
    """Look up the order, email the customer, then report (the `support` example agent)."""
    user_text, turn = current_turn(request.messages)
    order_id = _order_asked_about(request.messages)
    results = {m.tool_name: m for m in turn if m.role is Role.TOOL}
    step = 1 + sum(1 for m in turn if m.role is Role.ASSISTANT)
    # After a crash, the repaired results of the interrupted turn reach the model in the same
    # API message as this turn's text, so they count as this turn's news.
    for result in [*results.values(), *repaired_before_turn(request.messages)]:
        if is_durability_error(result.content):
            about = _order_of_call(request.messages, call_id=result.tool_call_id) or order_id
            return final(_interrupted_report(result, order_id=about, asked=order_id))
    # "Never send the same email twice" (its system prompt): unless asked to send it again.
    if not turn and AGAIN.search(user_text) is None:
        earlier = request.messages[: len(request.messages) - 1]
        sent = _emailed_before(earlier, order_id=order_id)
        if sent is not None:
            return final(_already_emailed_report(sent, order_id=order_id))
    if "send_email" in results:
        return final(_email_report(results["send_email"], order_id=order_id))
    lookup = results.get("lookup_order")
    if lookup is None:
        call = ToolCall(
            tool_call_id(request, step=step, tool_name="lookup_order"),
            "lookup_order",
            {"order_id": order_id},
        )
        return ask(f"Let me look up order {order_id}.", calls=[call])
    if lookup.is_error:
        return final(f"I could not look up order {order_id}: {_error_text(lookup)}")
    slow = re.search(r"\bslow\b", user_text, re.IGNORECASE) is not None
    arguments = {
        "to": CUSTOMER,
        "subject": _subject(order_id),
        "body": _order_summary(order_id, order=parse_json(lookup.content)),
        "delay_s": SLOW_DELAY_S if slow else 0,
    }
    call = ToolCall(
        tool_call_id(request, step=step, tool_name="send_email"), "send_email", arguments
    )
    return ask(f"I found order {order_id}; emailing the customer an update.", calls=[call])


def _order_asked_about(messages: list[Message]) -> str:
    """The order the latest user message names; if it names none ("and now?"), the one an
    earlier turn of the session named, else the default."""
    for message in reversed(messages):
        if message.role is Role.USER and (order_id := _order_in(message.content)):
            return order_id
    return DEFAULT_ORDER_ID


def _order_in(text: str) -> str | None:
    """The order id a text names first, if any."""
    return match.group(1).upper() if (match := ORDER_ID.search(text)) else None


def _emailed_before(messages: list[Message], *, order_id: str) -> Message | None:
    """The result of the latest earlier send_email about this order that went out, or may have
    (a crash cut it off: the durability error), if any."""
    subject = _subject(order_id)
    calls = {c.id: c for m in messages if m.role is Role.ASSISTANT for c in m.tool_calls}
    for message in reversed(messages):
        if message.role is not Role.TOOL or message.tool_name != "send_email":
            continue
        call = calls.get(message.tool_call_id or "")
        if call is None or call.arguments.get("subject") != subject:
            continue
        if not message.is_error or is_durability_error(message.content):
            return message
    return None


def _subject(order_id: str) -> str:
    return f"Your order {order_id}"


def _order_summary(order_id: str, *, order: Any) -> str:
    if not isinstance(order, dict):
        return f"Here is an update on your order {order_id}."
    items = order.get("items") or []
    lines = ", ".join(
        f"{item.get('quantity', 1)} x {item.get('name', '?')}"
        for item in items
        if isinstance(item, dict)
    )
    return (
        f"Hello, your order {order_id} is {order.get('status', 'being processed')}: "
        f"{lines or 'no items'}; total {order.get('total', '?')} {order.get('currency', '')}."
    ).replace(" .", ".")


def _error_text(message: Message) -> str:
    body = parse_json(message.content)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])
    return message.content


def _email_report(result: Message, *, order_id: str) -> str:
    if result.is_error:
        return (
            f"I looked up order {order_id} but could not email the customer: {_error_text(result)}"
        )
    return f"I looked up order {order_id} and emailed {CUSTOMER} an update{_message_id(result)}."


def _already_emailed_report(result: Message, *, order_id: str) -> str:
    if is_durability_error(result.content):
        return (
            f"An earlier email to {CUSTOMER} about order {order_id} may or may not have gone out"
            " (I was interrupted while sending it), and I do not send the same email twice"
            " without checking. Ask me to send it again if it did not go out."
        )
    return (
        f"I already emailed {CUSTOMER} about order {order_id}{_message_id(result)}, and I do"
        " not send the same email twice. Ask me to send it again if it is needed."
    )


def _message_id(result: Message) -> str:
    """ " (message id …)" of a sent email's result, or nothing."""
    body = parse_json(result.content)
    message_id = body.get("message_id") if isinstance(body, dict) else None
    return f" (message id {message_id})" if message_id else ""


def _order_of_call(messages: list[Message], *, call_id: str | None) -> str | None:
    """The order a call was about (lookup_order's order_id, send_email's subject)."""
    for message in messages:
        for call in message.tool_calls:
            if call.id == call_id:
                return _order_in(
                    str(call.arguments.get("order_id") or call.arguments.get("subject", ""))
                )
    return None


def _interrupted_report(result: Message, *, order_id: str, asked: str) -> str:
    """What a call the crash cut off (`order_id`'s) means; `asked`: this turn's order."""
    if result.tool_name == "send_email":
        report = (
            f"I was interrupted while emailing {CUSTOMER} about order {order_id}, so the email "
            "may or may not have been sent. I will not resend it without checking first: "
            "please check the outbox (or ask me to send it again if it did not go out)."
        )
    else:
        report = (
            f"I was interrupted during {result.tool_name} for order {order_id}; it may or may"
            " not have taken effect. I will not repeat it without checking first."
        )
    if asked != order_id:
        report += f" Ask me about order {asked} again and I will look it up."
    return report


register_script("echo", fn=echo_script)
register_script("support", fn=support_script)
