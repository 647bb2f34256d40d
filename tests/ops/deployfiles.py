"""Reading the Dockerfile and docker-compose.yml the way docker does, as far as the tests need."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.ops.helpers import REPO

DOCKERFILE = REPO / "Dockerfile"
COMPOSE_FILE = REPO / "docker-compose.yml"
COMPOSE_SCHEMA = REPO / "tests" / "data" / "compose-spec.json"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON-array (exec) form of the arguments; fails for the shell form."""
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self.args
        return value


def dockerfile_instructions(text: str) -> list[Instruction]:
    """Instructions in order: comments and parser directives dropped, continuations joined."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The build stages, each starting with its FROM."""
    result: list[list[Instruction]] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            result.append([])
        assert result, f"{instruction.keyword} before the first FROM"
        result[-1].append(instruction)
    return result


def env_of(stage: list[Instruction]) -> dict[str, str]:
    """The `ENV key=value ...` settings of a stage, later ones winning."""
    env: dict[str, str] = {}
    for instruction in stage:
        if instruction.keyword != "ENV":
            continue
        words = shlex.split(instruction.args)
        if words and "=" not in words[0]:  # the legacy `ENV key value` form
            env[words[0]] = " ".join(words[1:])
            continue
        for word in words:
            key, _, val = word.partition("=")
            env[key] = val
    return env


def last(stage: list[Instruction], keyword: str) -> Instruction | None:
    """The last instruction of that keyword in the stage (the one that takes effect)."""
    found = [i for i in stage if i.keyword == keyword]
    return found[-1] if found else None


def healthcheck_command(instruction: Instruction) -> list[str]:
    """The exec-form command of `HEALTHCHECK [--options] CMD [...]`."""
    match = re.search(r"\bCMD\s+(\[.*\])\s*$", instruction.args)
    assert match, f"HEALTHCHECK without an exec-form CMD: {instruction.args}"
    return Instruction("CMD", match.group(1)).exec_form()


def with_port(argv: list[str], port: int) -> list[str]:
    """`argv` with the value after `--port` replaced."""
    index = argv.index("--port")
    return [*argv[: index + 1], str(port), *argv[index + 2 :]]


def load_compose() -> dict[str, Any]:
    """docker-compose.yml as data."""
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?err}`, `$$` rules."""

    def replace(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        name = match.group("braced") or match.group("plain")
        op, arg = match.group("op"), match.group("arg") or ""
        present = name in env
        current = env.get(name, "")
        if op is None:
            return current
        empty_counts = op.startswith(":")
        unset = not present or (empty_counts and current == "")
        kind = op[-1]
        if kind == "-":
            return arg if unset else current
        if kind == "+":
            return "" if unset else arg
        if unset:
            raise ValueError(f"required variable {name} is missing: {arg}")
        return current

    return _VARIABLE.sub(replace, value)


def environment(service: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    """A service's `environment` (mapping or list form), interpolated from `env`."""
    raw = service.get("environment") or {}
    pairs: dict[str, str | None] = {}
    if isinstance(raw, list):
        for item in raw:
            key, sep, val = str(item).partition("=")
            pairs[key] = val if sep else None
    else:
        pairs = {str(k): None if v is None else str(v) for k, v in raw.items()}
    result: dict[str, str] = {}
    for key, setting in pairs.items():
        if setting is None:  # `KEY` alone passes the variable through from the host, if set
            if key in env:
                result[key] = env[key]
            continue
        result[key] = interpolate(setting, env)
    return result


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool


def mounts(service: dict[str, Any]) -> list[Mount]:
    """A service's volumes, short (`src:dst[:mode]`) or long syntax."""
    found: list[Mount] = []
    for item in service.get("volumes") or []:
        if isinstance(item, str):
            parts = item.split(":")
            mode = parts[2] if len(parts) > 2 else "rw"
            found.append(Mount(parts[0], parts[1], "ro" in mode.split(",")))
        else:
            found.append(
                Mount(str(item.get("source")), str(item["target"]), bool(item.get("read_only")))
            )
    return found


def published_ports(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host port, container port) pairs of a service's `ports`."""
    pairs: list[tuple[str, str]] = []
    for item in service.get("ports") or []:
        if isinstance(item, dict):
            pairs.append((str(item.get("published", "")), str(item["target"])))
            continue
        spec = str(item).split("/")[0]
        parts = spec.split(":")
        pairs.append((parts[-2] if len(parts) > 1 else "", parts[-1]))
    return pairs


def repo_path(source: str) -> Path:
    """A bind mount's source, relative to the compose file, as a path in the repository."""
    return (COMPOSE_FILE.parent / source).resolve()
