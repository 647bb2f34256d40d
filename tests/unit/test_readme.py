"""The README's examples are what the code takes."""

from __future__ import annotations

import re
from pathlib import Path

from app.settings import Settings
from app.tools.agents_file import load_registry

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_agents_file_example_loads(tmp_path: Path) -> None:
    example = re.search(r"## The agents file\n\n```yaml\n(.*?)```", README.read_text(), re.S)
    assert example is not None, "the README has no agents file example"
    path = tmp_path / "agents.yaml"
    path.write_text(example.group(1))
    registry = load_registry(path)
    triage = registry.agent("triage")
    assert triage.tools == ("get_issue", "post_slack")
    assert triage.description


def test_every_variable_of_the_configuration_table_is_a_setting() -> None:
    section = README.read_text().split("## Configuration\n", 1)[1].lstrip("\n")
    table = section.split("\n\n", 1)[0]
    names = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)`(?:, `([A-Z][A-Z0-9_]+)`)?", table, re.M))
    names = {name for pair in names for name in pair if name}
    read_by_the_sdk = {"ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"}
    settings = {name.upper() for name in Settings.model_fields}
    assert names - read_by_the_sdk == settings
