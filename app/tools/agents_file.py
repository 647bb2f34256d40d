"""The agents file (CONTRACT §5): YAML read strictly, built into a ToolRegistry.

Once the file's shape is valid, the first problem of each tool and agent entry is reported,
all at once, as one ConfigError (a file of the wrong shape is refused for that alone). Once it
is all valid, `serve` refuses agents on a `scripted:` model it has no script for, all at once
too (app/main.py: other callers bring scripts of their own).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from app.domain import is_plain_json, nests_deeper_than
from app.errors import ConfigError
from app.tools.base import DEFAULT_MAX_RESULT_BYTES, AgentConfig, Tool, ToolHandler
from app.tools.http import HttpToolHandler, SharedHttpClient
from app.tools.python import TargetError, description_of, load_python_handler
from app.tools.registry import ToolRegistry

# Agent names appear in URLs and tool names must satisfy the Anthropic API's tool-name rule.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
DEFAULT_INPUT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}
BUILTIN_AGENTS_FILE = "agents/examples.yaml"
# RFC 9110 field names (tokens) and the values httpx can send (no CR, LF or NUL).
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")
# Headers an HTTP tool's request gets from the runner, never from the file.
RUNNERS_HEADERS = frozenset(
    {"idempotency-key", "content-type", "content-length", "transfer-encoding", "accept-encoding"}
)
# A host httpx has parsed: a name (IDNA-encoded), an IPv4 address, or an IPv6 one.
HOST = re.compile(r"[A-Za-z0-9._-]+|[0-9A-Fa-f:.]+(%[A-Za-z0-9._~-]+)?")
# How deep an input_schema may nest (objects and arrays).
MAX_SCHEMA_DEPTH = 64
# Values in the file once its aliases are expanded: nine levels of ten aliases in 600 bytes
# expand to 10^9, and loading them never ended.
MAX_FILE_VALUES = 100_000
# How long a python tool may take unless its entry sets timeout_s.
PYTHON_TIMEOUT_S = 60.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class HttpTarget(_Strict):
    url: str
    timeout_s: float = Field(default=10.0, gt=0)
    headers: dict[str, str] | None = None


class ToolEntry(_Strict):
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    safe_to_retry: bool = False
    parallel: bool = False
    http: HttpTarget | None = None
    python: str | None = None
    timeout_s: float | None = Field(default=None, gt=0)  # python tools; http has its own


_AGENT_DEFAULTS = AgentConfig(name="", model="")  # the defaults live on AgentConfig


class AgentEntry(_Strict):
    model: str = Field(min_length=1)
    system: str | None = None
    description: str | None = None
    tools: list[str] = Field(default_factory=list)
    max_iterations: int = Field(default=_AGENT_DEFAULTS.max_iterations, ge=1)
    stuck_threshold: int = Field(default=_AGENT_DEFAULTS.stuck_threshold, ge=1)
    max_tool_concurrency: int = Field(default=_AGENT_DEFAULTS.max_tool_concurrency, ge=1)
    token_budget: int | None = Field(default=_AGENT_DEFAULTS.token_budget, ge=1)
    max_tokens: int = Field(default=_AGENT_DEFAULTS.max_tokens, ge=1)
    journal: Literal["per_step", "per_call"] = "per_step"


class AgentsFile(_Strict):
    tools: dict[str, ToolEntry] = Field(default_factory=dict)
    agents: dict[str, AgentEntry] = Field(default_factory=dict)


def _bad_ref(schema: dict[str, Any]) -> str | None:
    """What is wrong with the schema's references, if anything: one that does not point
    inside it, or one that leads back to itself through nothing but references (no value
    could ever be validated: each call would fail with Python's recursion limit)."""
    resolver = Registry().resolver_with_root(DRAFT202012.create_resource(schema))
    for ref in _refs(schema):
        seen: set[int] = set()
        target: Any = ref
        at = resolver
        while isinstance(target, str):
            try:
                resolved = at.lookup(target)
            except Unresolvable:
                return (
                    f"reference {target!r} does not point inside the schema"
                    " (references to other documents are not fetched)"
                )
            if id(resolved.contents) in seen:
                return f"reference {ref!r} leads back to itself through references only"
            seen.add(id(resolved.contents))
            contents, at = resolved.contents, resolved.resolver
            target = contents.get("$ref") if isinstance(contents, dict) else None
    return None


def _refs(value: Any) -> list[str]:
    """The references of a schema: `$ref` and `$dynamicRef`, outside the keywords whose
    values are data, not schemas (a `const` may well hold an object with a `$ref` key)."""
    if isinstance(value, dict):
        own = [value[key] for key in _REF_KEYWORDS if isinstance(value.get(key), str)]
        children = (child for key, child in value.items() if key not in _DATA_KEYWORDS)
        return own + [ref for child in children for ref in _refs(child)]
    if isinstance(value, list):
        return [ref for child in value for ref in _refs(child)]
    return []


_REF_KEYWORDS = ("$ref", "$dynamicRef")
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def load_registry(
    path: Path | None, *, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
) -> ToolRegistry:
    """Load the agents file at `path` (None: the built-in examples); raises ConfigError.
    Tool results past `max_result_bytes` are kept truncated."""
    if path is None:
        label = "examples.yaml"
        text = resources.files("app").joinpath(BUILTIN_AGENTS_FILE).read_text(encoding="utf-8")
    else:
        label = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{label}: cannot read the agents file: {exc}") from exc
    return parse_registry(text, label=label, max_result_bytes=max_result_bytes)


def parse_registry(
    text: str, *, label: str, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
) -> ToolRegistry:
    """Build a registry from agents-file YAML; `label` names the file in error messages."""
    spec = _parse_file(text, label=label)
    problems: list[str] = []
    http = SharedHttpClient(max_body_bytes=max_result_bytes)
    tools: dict[str, Tool] = {}
    for name, entry in spec.tools.items():
        try:
            tools[name] = _build_tool(name, entry=entry, http=http)
        except _Problem as exc:
            problems.append(f"{label}: tool {name!r}: {exc}")
    agents: dict[str, AgentConfig] = {}
    for name, agent_entry in spec.agents.items():
        try:
            agents[name] = _build_agent(name, entry=agent_entry, tools=spec.tools)
        except _Problem as exc:
            problems.append(f"{label}: agent {name!r}: {exc}")
    if problems:
        raise ConfigError("\n".join(problems))
    return ToolRegistry(tools, agents=agents, http=http, max_result_bytes=max_result_bytes)


class _Problem(Exception):
    """One thing wrong with a tool or agent entry; the caller prefixes file and name."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of silently keeping the last one."""


# Positional: PyYAML calls constructors so.
def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:  # noqa: PLR0917
    # The mapping's own keys only: a key merged in with `<<` is one the mapping may override.
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable key: construct_mapping reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _parse_file(text: str, *, label: str) -> AgentsFile:
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        raise ConfigError(f"{label}: invalid YAML: {_yaml_problem(exc)}") from exc
    except RecursionError as exc:
        raise ConfigError(f"{label}: invalid YAML: it nests too deeply to read") from exc
    if not isinstance(raw, dict):
        found = "an empty file" if raw is None else type(raw).__name__
        raise ConfigError(f"{label}: expected a mapping with 'tools' and 'agents', got {found}")
    _check_values(raw, label=label)
    try:
        return AgentsFile.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("\n".join(_describe(label, err=err) for err in exc.errors())) from exc


def _check_values(raw: dict[Any, Any], *, label: str) -> None:
    """Every value of the file, aliases expanded, counted up to MAX_FILE_VALUES; and every
    string sendable as UTF-8. YAML's "\\ud800" is a lone surrogate, which the file's check
    let through and which then failed /v1/agents (a 500) and every model call of its agent."""
    count = 0
    pending: list[tuple[object, str]] = [(raw, "")]
    while pending:
        value, where = pending.pop()
        count += 1
        if count > MAX_FILE_VALUES:
            raise ConfigError(
                f"{label}: over {MAX_FILE_VALUES:,} values once its aliases are expanded"
                " (or an alias holds itself)"
            )
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                shown = where.encode(errors="backslashreplace").decode()
                raise ConfigError(
                    f"{label}: {shown or 'a key'}: holds a lone surrogate (such as \\ud800),"
                    " which UTF-8 cannot encode"
                ) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                inner = f"{where}.{key}" if where else str(key)
                pending.extend(((key, f"{inner} (its name)"), (item, inner)))
        elif isinstance(value, list):
            pending.extend((item, f"{where}[{i}]") for i, item in enumerate(value))


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line: what is wrong and where (it quotes the lines around)."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return " ".join(str(exc).split())
    parts = [part for part in (exc.context, exc.problem) if part]
    mark = exc.problem_mark or exc.context_mark
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return "; ".join(parts) + where


def _describe(label: str, *, err: Any) -> str:
    """One pydantic error as `<file>: tool 'x': http.timeout_s: <message>`."""
    loc: list[Any] = list(err["loc"])
    owner = ""
    if len(loc) >= 2 and loc[0] in ("tools", "agents"):
        kind = "tool" if loc[0] == "tools" else "agent"
        owner = f"{kind} {loc[1]!r}: "
        loc = loc[2:]
        if loc == ["[key]"]:
            return f"{label}: {owner}name must be a string"
    where = ".".join(str(part) for part in loc)
    return f"{label}: {owner}{where + ': ' if where else ''}{err['msg']}"


def _build_tool(name: str, *, entry: ToolEntry, http: SharedHttpClient) -> Tool:
    _check_name(name)
    if (entry.http is None) == (entry.python is None):
        raise _Problem("exactly one of http or python is required")
    schema = _check_schema(entry.input_schema)
    handler: ToolHandler
    if entry.http is not None:
        handler = _http_handler(entry.http, http=http)
        default_description = None
        if entry.timeout_s is not None:
            raise _Problem("timeout_s is for python tools; an http tool sets http.timeout_s")
        timeout_s = None  # the handler bounds its own exchange
    else:
        assert entry.python is not None  # the exactly-one check above
        try:
            handler = load_python_handler(entry.python)
        except TargetError as exc:
            raise _Problem(str(exc)) from exc
        default_description = description_of(handler)
        timeout_s = entry.timeout_s or PYTHON_TIMEOUT_S
    return Tool(
        name=name,
        description=entry.description or default_description or name,
        input_schema=schema,
        handler=handler,
        safe_to_retry=entry.safe_to_retry,
        parallel=entry.parallel,
        timeout_s=timeout_s,
    )


def _check_name(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise _Problem("invalid name: use 1-64 characters of A-Z a-z 0-9 _ -")


def _check_schema(schema: dict[str, Any] | None) -> dict[str, Any]:
    if schema is None:
        return dict(DEFAULT_INPUT_SCHEMA)
    # Deeper, it could not be checked (Python's recursion limit) nor listed by /v1/agents.
    if nests_deeper_than(schema, levels=MAX_SCHEMA_DEPTH):
        raise _Problem(f"input_schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    # YAML says more than JSON (.inf, dates, !!binary): the schema is sent to the model as JSON.
    if not is_plain_json(schema):
        raise _Problem(
            "input_schema must be plain JSON: maps with string keys (quote a key such as"
            " on, yes or 2024, which YAML reads as another type), lists, strings, finite"
            " numbers, booleans and null (not .inf or .nan, a date, or binary)"
        )
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = f" (at {exc.json_path})" if exc.path else ""
        raise _Problem(f"input_schema is not a valid JSON Schema: {exc.message}{where}") from exc
    # The Messages API requires tool input to be an object; anything else is rejected there.
    if schema.get("type") != "object":
        raise _Problem("input_schema must have type: object")
    if combined := sorted({"oneOf", "allOf", "anyOf"} & schema.keys()):
        # The Messages API refuses the whole request that lists such a tool.
        raise _Problem(
            f"input_schema must not use {', '.join(combined)} at its top level (the Messages"
            " API refuses it; inside properties it may)"
        )
    if problem := _bad_ref(schema):
        raise _Problem(f"input_schema: {problem}")
    return schema


def _http_handler(target: HttpTarget, *, http: SharedHttpClient) -> HttpToolHandler:
    try:
        url = httpx.URL(target.url)
    except httpx.InvalidURL as exc:
        raise _Problem(f"http.url {target.url!r} is not a valid URL: {exc}") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise _Problem(f"http.url {target.url!r} must be an absolute http:// or https:// URL")
    if not HOST.fullmatch(url.raw_host.decode("ascii")):
        raise _Problem(f"http.url {target.url!r} has an invalid host")
    if url.port is not None and not 0 < url.port < 65536:
        raise _Problem(f"http.url {target.url!r} has a port outside 1-65535")
    headers = target.headers or {}
    for key in headers:
        if key.lower() in RUNNERS_HEADERS:
            raise _Problem(
                f"http.headers must not set {key}; the runner sets it (the input is sent as"
                " JSON with its own length and a per-call Idempotency-Key, and the answer is"
                " asked for uncompressed, so that its size limit holds)"
            )
    if url.userinfo and any(key.lower() == "authorization" for key in headers):
        # httpx would send the URL's user:password as Authorization in place of the header.
        raise _Problem(
            "http.url carries a user:password and http.headers sets Authorization; both are"
            " the Authorization header: keep one"
        )
    for key, value in headers.items():
        if not HEADER_NAME.fullmatch(key):
            raise _Problem(f"http.headers: {key!r} is not a valid header name")
        if not HEADER_VALUE.fullmatch(value):  # the value may be a secret: not quoted
            raise _Problem(f"http.headers: the value of {key!r} must be printable ASCII")
    return HttpToolHandler(target.url, client=http, timeout_s=target.timeout_s, headers=headers)


def _build_agent(name: str, *, entry: AgentEntry, tools: Mapping[str, ToolEntry]) -> AgentConfig:
    _check_name(name)
    if entry.journal == "per_call":
        raise _Problem("per_call journal is not supported yet; use journal: per_step")
    seen: set[str] = set()
    for tool_name in entry.tools:
        if tool_name not in tools:
            raise _Problem(f"unknown tool {tool_name!r}")
        if tool_name in seen:
            raise _Problem(f"tool {tool_name!r} is listed twice")
        seen.add(tool_name)
    return AgentConfig(
        name=name,
        model=entry.model,
        system=entry.system,
        tools=tuple(entry.tools),
        max_iterations=entry.max_iterations,
        stuck_threshold=entry.stuck_threshold,
        max_tool_concurrency=entry.max_tool_concurrency,
        token_budget=entry.token_budget,
        max_tokens=entry.max_tokens,
        description=entry.description,
    )
