"""The agents file loader: what loads, and every refusal naming file, entry and problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import AgentNotFound, ConfigError
from app.tools import agents_file
from app.tools.agents_file import load_registry
from app.tools.base import AgentConfig
from app.tools.registry import ToolRegistry
from tests.unit.registry.support import (
    HERE,
    PING,
    agent_yaml,
    config_error,
    tool_yaml,
    write,
)

# --- loading: the happy paths ------------------------------------------------------------------


def test_example_file_loads() -> None:
    registry = load_registry(None)
    assert set(registry.tools) == {"clock", "lookup_order", "send_email"}
    assert set(registry.agents) == {"echo", "support", "claude-support"}
    assert registry.agent("echo").model == "scripted:echo"
    assert registry.agent("echo").tools == ()
    support = registry.agent("support")
    assert support.model == "scripted:support"
    assert support.max_iterations == 10
    assert support.system
    assert [t.name for t in registry.tools_for(support)] == ["lookup_order", "send_email", "clock"]
    claude = registry.agent("claude-support")
    assert claude.model == "claude-sonnet-4-6"
    assert claude.tools == support.tools
    assert claude.description is not None
    assert "ANTHROPIC_API_KEY" in claude.description
    assert registry.tools["clock"].safe_to_retry
    assert registry.tools["lookup_order"].safe_to_retry
    assert not registry.tools["send_email"].safe_to_retry


def test_contract_example_loads(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        tools:
          get_issue:
            description: Fetch an issue by id
            input_schema: {type: object, properties: {id: {type: string}}, required: [id]}
            safe_to_retry: true
            http: {url: "http://issues.internal/get_issue", timeout_s: 10}
          post_slack:
            description: Post a message to a channel
            input_schema: {type: object, properties: {channel: {type: string}, text: {type: string}}, required: [channel, text]}
            http: {url: "http://slack-proxy.internal/post"}
          clock:
            python: "app.tools.builtin:clock"        # an in-process Python tool
        agents:
          triage:
            model: claude-sonnet-4-6                 # or "scripted:<name>"
            system: You triage incoming issues.
            tools: [get_issue, post_slack]
            max_iterations: 20
        """,  # noqa: E501 - the contract's example, verbatim
    )
    registry = load_registry(path)
    get_issue = registry.tools["get_issue"]
    assert get_issue.safe_to_retry
    assert get_issue.timeout_s is None  # an HTTP tool: its request has the file's timeout_s
    assert registry.tools["clock"].timeout_s == agents_file.PYTHON_TIMEOUT_S  # Python
    assert registry.tools["clock"].description  # the function's docstring
    assert [t.name for t in registry.tools_for(registry.agent("triage"))] == [
        "get_issue",
        "post_slack",
    ]


def test_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"""
        tools:
          remote:
            http: {{url: "https://example.com/t"}}
          documented:
            python: "{HERE}:documented_tool"
          undocumented:
            python: "{HERE}:undocumented_tool"
          object_tool:
            python: "{HERE}:callable_object"
        agents:
          a:
            model: scripted:echo
        """,
    )
    registry = load_registry(path)
    remote = registry.tools["remote"]
    assert remote.description == "remote"
    assert remote.input_schema == {"type": "object", "properties": {}}
    assert not remote.safe_to_retry
    assert not remote.parallel
    assert registry.tools["documented"].description == "Say hello."
    assert registry.tools["undocumented"].description == "undocumented"
    assert registry.tools["object_tool"].description == "A callable object tool."
    agent = registry.agent("a")
    assert agent == AgentConfig(name="a", model="scripted:echo")
    assert (agent.max_iterations, agent.stuck_threshold, agent.max_tool_concurrency) == (20, 3, 5)
    assert (agent.token_budget, agent.max_tokens) == (None, 4096)


def test_all_agent_fields(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        agent_yaml(
            """
            model: m
            system: sys
            description: desc
            max_iterations: 2
            stuck_threshold: 4
            max_tool_concurrency: 1
            token_budget: 1000
            max_tokens: 100
            journal: per_step
            """
        ),
    )
    agent = load_registry(path).agent("a")
    assert agent == AgentConfig(
        name="a",
        model="m",
        system="sys",
        description="desc",
        max_iterations=2,
        stuck_threshold=4,
        max_tool_concurrency=1,
        token_budget=1000,
        max_tokens=100,
    )


def test_agent_not_found() -> None:
    registry = ToolRegistry({}, {})
    with pytest.raises(AgentNotFound):
        registry.agent("nope")
    assert registry.tool("nope") is None


# --- loading: every ConfigError names the file, the entry and the problem ----------------------


def test_unknown_tool_in_agent(tmp_path: Path) -> None:
    message = config_error(
        tmp_path,
        """
        tools:
          post_slack: {http: {url: "http://slack/post"}}
        agents:
          triage: {model: m, tools: [post_slak]}
        """,
    )
    assert f"{tmp_path / 'agents.yaml'}: agent 'triage': unknown tool 'post_slak'" in message


def test_tool_listed_twice(tmp_path: Path) -> None:
    message = config_error(
        tmp_path, tool_yaml('http: {url: "http://h/x"}').replace("[x]", "[x, x]")
    )
    assert "agents.yaml: agent 'a': tool 'x' is listed twice" in message


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


def test_a_merged_key_may_be_overridden(tmp_path: Path) -> None:
    # YAML's merge key: the mapping's own keys override merged ones (refused as duplicates).
    text = (
        "tools: {}\nagents:\n  a: &base {model: m, max_iterations: 3}\n"
        "  b: {<<: *base, max_iterations: 5}\n"
    )
    registry = load_registry(write(tmp_path, text))
    assert (registry.agent("a").max_iterations, registry.agent("b").max_iterations) == (3, 5)
    assert registry.agent("b").model == "m"


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


@pytest.mark.parametrize(
    "field",
    ["max_iterations", "stuck_threshold", "max_tool_concurrency", "token_budget", "max_tokens"],
)
def test_agent_limits_must_be_positive(tmp_path: Path, field: str) -> None:
    message = config_error(tmp_path, agent_yaml(f"model: m\n{field}: 0"))
    assert f"agents.yaml: agent 'a': {field}: Input should be greater than or equal to 1" in message


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("system: s", "model: Field required"),
        ('model: ""', "model: String should have at least 1 character"),
        ("model: m\nmax_iterations: 2.5", "max_iterations: Input should be a valid integer"),
        ("model: m\njournal: sometimes", "journal: Input should be 'per_step' or 'per_call'"),
        ("model: m\ntemperature: 0", "temperature: Extra inputs are not permitted"),
        ("model: m\ntools: lookup_order", "tools: Input should be a valid list"),
    ],
)
def test_bad_agent_field(tmp_path: Path, body: str, problem: str) -> None:
    message = config_error(tmp_path, agent_yaml(body))
    assert f"agents.yaml: agent 'a': {problem}" in message


def test_per_call_journal_is_refused(tmp_path: Path) -> None:
    message = config_error(tmp_path, agent_yaml("model: m\njournal: per_call"))
    assert "agents.yaml: agent 'a': per_call journal is not supported yet" in message


@pytest.mark.parametrize("name", ["bad name", "x" * 65, "dots.not.allowed", "é"])
def test_invalid_names(tmp_path: Path, name: str) -> None:
    tool_message = config_error(tmp_path, tool_yaml('http: {url: "http://h"}', name=f'"{name}"'))
    assert f"agents.yaml: tool {name!r}: invalid name" in tool_message
    agent_message = config_error(tmp_path, agent_yaml("model: m", name=f'"{name}"'))
    assert f"agents.yaml: agent {name!r}: invalid name" in agent_message


def test_non_string_name(tmp_path: Path) -> None:
    message = config_error(tmp_path, agent_yaml("model: m", name="123"))
    assert "agents.yaml: agent 123: name must be a string" in message


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("tools: {a: [unclosed\n", "invalid YAML"),
        ("agents:\n  a: {model: m}\n  a: {model: n}\n", "duplicate key 'a'"),
        ("", "expected a mapping with 'tools' and 'agents', got an empty file"),
        ("- a\n- b\n", "expected a mapping with 'tools' and 'agents', got list"),
        ("agents: {}\nmodels: {}\n", "models: Extra inputs are not permitted"),
        ("tools: [a]\n", "tools: Input should be a valid dictionary"),
        # A RecursionError traceback.
        ("tools: " + "[" * 5000 + "]" * 5000 + "\n", "invalid YAML: it nests too deeply to read"),
    ],
)
def test_bad_file(tmp_path: Path, text: str, problem: str) -> None:
    message = config_error(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'agents.yaml'}: ")
    assert problem in message


def test_invalid_yaml_is_one_line_saying_where(tmp_path: Path) -> None:
    message = config_error(tmp_path, "agents:\n  a: {model: m}\n  a: {model: n}\n")
    assert message == (
        f"{tmp_path / 'agents.yaml'}: invalid YAML: while constructing a mapping;"
        " found duplicate key 'a' (line 3, column 3)"
    )


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read the agents file"):
        load_registry(tmp_path / "nope.yaml")


def test_every_problem_is_reported(tmp_path: Path) -> None:
    message = config_error(
        tmp_path,
        """
        tools:
          t1: {description: no target}
        agents:
          a1: {model: m, tools: [missing]}
          a2: {model: m, journal: per_call}
        """,
    )
    lines = message.splitlines()
    assert len(lines) == 3
    assert "tool 't1': exactly one of http or python is required" in lines[0]
    assert "agent 'a1': unknown tool 'missing'" in lines[1]
    assert "agent 'a2': per_call journal is not supported yet" in lines[2]
