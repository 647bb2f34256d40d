"""The agents file's tool entries: input schemas, python and http targets, and their fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.tools.agents_file import load_registry
from tests.unit.registry.support import HERE, PING, config_error, tool_yaml, write


@pytest.mark.parametrize(
    "body",
    [
        "description: neither",
        f'http: {{url: "http://h/x"}}\npython: "{HERE}:documented_tool"',
    ],
    ids=["neither", "both"],
)
def test_exactly_one_of_http_or_python(tmp_path: Path, body: str) -> None:
    message = config_error(tmp_path, tool_yaml(body))
    assert "agents.yaml: tool 'x': exactly one of http or python is required" in message


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ("{type: object, properties: {a: {type: 12}}}", "input_schema is not a valid JSON Schema"),
        ("{type: object, required: notalist}", "input_schema is not a valid JSON Schema"),
        ("{type: string}", "input_schema must have type: object"),
        ("{properties: {a: {type: string}}}", "input_schema must have type: object"),
        (
            "{type: object, anyOf: [{required: [a]}, {required: [b]}]}",
            "input_schema must not use anyOf at its top level (the Messages API refuses it",
        ),
        ("[1, 2]", "input_schema: Input should be a valid dictionary"),
        (
            '{type: object, properties: {x: {$ref: "http://127.0.0.1:9/s.json"}}}',
            "input_schema: reference 'http://127.0.0.1:9/s.json' does not point inside the schema",
        ),
        (
            '{type: object, properties: {x: {$ref: "#/$defs/missing"}}}',
            "input_schema: reference '#/$defs/missing' does not point inside the schema",
        ),
        (  # passed the start, then every call failed "Unresolvable"
            '{type: object, properties: {x: {$dynamicRef: "http://example.com/x#meta"}}}',
            "input_schema: reference 'http://example.com/x#meta' does not point inside the schema",
        ),
        (  # every call with an `x` failed with Python's recursion limit
            '{type: object, properties: {x: {$ref: "#/$defs/a"}},'
            ' $defs: {a: {$ref: "#/$defs/b", type: object}, b: {$ref: "#/$defs/a"}}}',
            "input_schema: reference '#/$defs/a' leads back to itself through references only",
        ),
        (  # a RecursionError traceback at start
            "{type: object, properties: "
            + "{a: {type: object, properties: " * 100
            + "{}"
            + "}}" * 100
            + "}",
            "input_schema nests deeper than 64 levels",
        ),
        # YAML that JSON cannot say: the file started, then every run of its agents failed
        # (or GET /v1/agents was a 500).
        *(
            (
                f"{{type: object, properties: {{n: {{type: number, {value}}}}}}}",
                "input_schema must be plain JSON",
            )
            for value in ("maximum: .inf", "minimum: .nan", "default: 2026-12-01", "on: 1")
        ),
        (
            '{type: object, properties: {b: {default: !!binary "gIGC"}}}',
            "input_schema must be plain JSON",
        ),
    ],
)
def test_invalid_input_schema(tmp_path: Path, schema: str, problem: str) -> None:
    message = config_error(
        tmp_path, tool_yaml(f'input_schema: {schema}\nhttp: {{url: "http://h"}}')
    )
    assert f"agents.yaml: tool 'x': {problem}" in message


def test_invalid_schema_message_says_where(tmp_path: Path) -> None:
    body = 'input_schema: {type: object, properties: {a: {type: 12}}}\nhttp: {url: "http://h"}'
    message = config_error(tmp_path, tool_yaml(body))
    assert "12 is not valid under any of the given schemas" in message
    assert "$.properties.a.type" in message


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("no_colon_here", "must look like 'module.path:attr'"),
        ("tests.unit.does_not_exist:tool", "cannot import 'tests.unit.does_not_exist'"),
        (f"{HERE}:missing", f"{HERE!r} has no attribute 'missing'"),
        (f"{HERE}:sync_tool", "is not an async callable"),
        (f"{HERE}:NOT_CALLABLE", "is not an async callable"),
        (f"{HERE}:AsyncCallable", "is not an async callable"),
        (f"{HERE}:one_arg_tool", "must accept (arguments, ctx)"),
    ],
)
def test_bad_python_target(tmp_path: Path, target: str, problem: str) -> None:
    message = config_error(tmp_path, tool_yaml(f'python: "{target}"'))
    assert "agents.yaml: tool 'x': python target" in message
    assert problem in message


def test_references_inside_the_schema_resolve(tmp_path: Path) -> None:
    schema = '{type: object, properties: {x: {$ref: "#/$defs/id"}}, $defs: {id: {type: string}}}'
    registry = load_registry(write(tmp_path, tool_yaml(f"input_schema: {schema}\n{PING}")))
    assert registry.tools["x"].input_schema["$defs"] == {"id": {"type": "string"}}


def test_a_recursive_schema_is_not_a_reference_cycle(tmp_path: Path) -> None:
    # A tree: each node's children are nodes (the root), with a schema in between.
    schema = (
        '{type: object, properties: {children: {type: array, items: {$ref: "#"}},'
        ' next: {$ref: "#/$defs/n"}}, $defs: {n: {$ref: "#/$defs/m"}, m: {$ref: "#"}}}'
    )
    registry = load_registry(write(tmp_path, tool_yaml(f"input_schema: {schema}\n{PING}")))
    assert registry.tools["x"].input_schema["properties"]["children"]["items"] == {"$ref": "#"}


def test_keywords_holding_data_may_hold_ref_keys(tmp_path: Path) -> None:
    # A `$ref` key inside a const, enum, default or examples is data, not a reference.
    schema = (
        '{type: object, properties: {x: {const: {$ref: "#/nope"}, default: {$ref: "#/no"},'
        ' examples: [{$ref: "http://h/x"}], enum: [{$ref: "#/not"}]}}}'
    )
    registry = load_registry(write(tmp_path, tool_yaml(f"input_schema: {schema}\n{PING}")))
    assert registry.tools["x"].input_schema["properties"]["x"]["const"] == {"$ref": "#/nope"}


def test_a_partial_tool_is_described_by_its_function(tmp_path: Path) -> None:
    registry = load_registry(write(tmp_path, tool_yaml(f'python: "{HERE}:partial_tool"')))
    assert registry.tools["x"].description == "Say hello."


def test_a_python_module_exiting_on_import_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(tmp_path))
        message = config_error(tmp_path, tool_yaml('python: "exits_on_import:tool"'))
    assert "cannot import 'exits_on_import': SystemExit: 0" in message


def test_python_target_with_dotted_attribute(tmp_path: Path) -> None:
    registry = load_registry(write(tmp_path, tool_yaml(f'python: "{HERE}:Namespace.ping"')))
    assert registry.tools["x"].description == "Ping."


@pytest.mark.parametrize(
    ("http", "problem"),
    [
        ('{url: "http://h", timeout_s: 0}', "http.timeout_s: Input should be greater than 0"),
        ('{url: "http://h", timeout_s: -1}', "http.timeout_s: Input should be greater than 0"),
        ('{url: "ftp://h/x"}', "http.url 'ftp://h/x' must be an absolute http:// or https:// URL"),
        ('{url: "/relative"}', "http.url '/relative' must be an absolute http:// or https:// URL"),
        ("{timeout_s: 1}", "http.url: Field required"),
        ('{url: "http://h", retries: 3}', "http.retries: Extra inputs are not permitted"),
        (
            '{url: "http://h", headers: {Idempotency-Key: k}}',
            "http.headers must not set Idempotency-Key",
        ),
        (
            '{url: "http://h", headers: {X-N: 1}}',
            "http.headers.X-N: Input should be a valid string",
        ),
        (
            '{url: "http://h", headers: {"X A": v}}',
            "http.headers: 'X A' is not a valid header name",
        ),
        (
            '{url: "http://h", headers: {X-A: "a\\r\\nb"}}',
            "http.headers: the value of 'X-A' must be printable ASCII",
        ),
        (
            '{url: "http://h", headers: {X-A: "é✓"}}',
            "http.headers: the value of 'X-A' must be printable ASCII",
        ),
        # Each of these started, then made every call fail or send its JSON as another type.
        (
            '{url: "http://h", headers: {Content-Length: "5"}}',
            "http.headers must not set Content-Length",
        ),
        (
            '{url: "http://h", headers: {content-type: text/plain}}',
            "http.headers must not set content-type",
        ),
        (
            '{url: "http://h", headers: {Transfer-Encoding: x}}',
            "http.headers must not set Transfer-Encoding",
        ),
        (
            '{url: "http://h", headers: {Accept-Encoding: gzip}}',
            "http.headers must not set Accept-Encoding",
        ),
        # httpx sends a URL's user:password as Authorization, in place of the header's.
        (
            '{url: "http://u:p@h/x", headers: {authorization: "Bearer s"}}',
            "http.url carries a user:password and http.headers sets Authorization",
        ),
        ('{url: "http://h:99999/x"}', "http.url 'http://h:99999/x' has a port outside 1-65535"),
        ('{url: "http://ex ample.com/"}', "http.url 'http://ex ample.com/' has an invalid host"),
    ],
)
def test_bad_http_target(tmp_path: Path, http: str, problem: str) -> None:
    message = config_error(tmp_path, tool_yaml(f"http: {http}"))
    assert f"agents.yaml: tool 'x': {problem}" in message


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("safe_to_retry", '"yes"', "safe_to_retry: Input should be a valid boolean"),
        ("parallel", "1", "parallel: Input should be a valid boolean"),
        ("description", "[a]", "description: Input should be a valid string"),
        ("retries", "3", "retries: Extra inputs are not permitted"),
    ],
)
def test_bad_tool_field(tmp_path: Path, field: str, value: str, problem: str) -> None:
    message = config_error(tmp_path, tool_yaml(f'{field}: {value}\nhttp: {{url: "http://h"}}'))
    assert f"agents.yaml: tool 'x': {problem}" in message
