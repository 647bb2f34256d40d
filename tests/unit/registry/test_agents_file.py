"""The agents file loader: what loads, and its refusals of agents, names and whole files."""

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
    registry = ToolRegistry({}, agents={})
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


def test_a_merged_key_may_be_overridden(tmp_path: Path) -> None:
    # YAML's merge key: the mapping's own keys override merged ones (refused as duplicates).
    text = (
        "tools: {}\nagents:\n  a: &base {model: m, max_iterations: 3}\n"
        "  b: {<<: *base, max_iterations: 5}\n"
    )
    registry = load_registry(write(tmp_path, text))
    assert (registry.agent("a").max_iterations, registry.agent("b").max_iterations) == (3, 5)
    assert registry.agent("b").model == "m"


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


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (agent_yaml('model: m\nsystem: "hi \\ud800"'), "agents.a.system"),
        (agent_yaml('model: m\ndescription: "\\udfff"'), "agents.a.description"),
        (
            tool_yaml('python: "x:y"\ninput_schema: {properties: {"k\\ud800": {}}}'),
            "tools.x.input_schema.properties.k\\ud800 (its name)",
        ),
    ],
)
def test_a_lone_surrogate_is_refused_naming_where(tmp_path: Path, text: str, where: str) -> None:
    # YAML's "\ud800" escape: the file loaded, then /v1/agents answered 500 and every model
    # call of the agent failed, as the request could not be encoded.
    message = config_error(tmp_path, text)
    assert message == (
        f"{tmp_path / 'agents.yaml'}: {where}: holds a lone surrogate (such as \\ud800),"
        " which UTF-8 cannot encode"
    )


def test_aliases_that_expand_past_the_limit_are_refused(tmp_path: Path) -> None:
    # Nine levels of ten aliases, 600 bytes, are 10^9 values once expanded, and the start had
    # never ended; these six (10^6) had loaded, to be sent with every model call.
    levels = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 6)]
    examples = "".join(f"    - {line}\n" for line in levels)  # data, of any shape
    schema = f"input_schema:\n  type: object\n  examples:\n{examples}"
    text = tool_yaml(f'python: "{HERE}:documented_tool"\n{schema}')
    message = config_error(tmp_path, text)
    assert message == (
        f"{tmp_path / 'agents.yaml'}: over 100,000 values once its aliases are expanded"
        " (or an alias holds itself)"
    )


def test_a_few_aliases_load(tmp_path: Path) -> None:
    text = (
        "tools:\n  x: &tool {python: 'tests.unit.registry.support:documented_tool'}\n"
        "  y: *tool\nagents:\n  a: {model: m, tools: [x, y]}\n"
    )
    assert load_registry(write(tmp_path, text)).agent("a").tools == ("x", "y")


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
