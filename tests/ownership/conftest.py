"""Real `agent-runner serve` processes on the test's store, stopped however the test left them."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agents import write_agents_file
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import ServerProcess
from tests.support.tool_server import ToolServer


class Servers:
    """Makes servers on one database, fake model and tool server; kills them all at the end."""

    def __init__(
        self, tmp_path: Path, *, database_url: str, model_url: str, tools_url: str
    ) -> None:
        self._tmp_path = tmp_path
        self._database_url = database_url
        self._model_url = model_url
        self._tools_url = tools_url
        self._agents_file = write_agents_file(tmp_path, tools_url)
        self._made: list[ServerProcess] = []

    def add_agent(self, name: str, *, model: str, tools: list[str]) -> None:
        """Add an agent to the agents file of the servers made after this call."""
        with self._agents_file.open("a") as file:
            file.write(f'  {name}:\n    model: "{model}"\n    tools: [{", ".join(tools)}]\n')

    def add_tool(self, name: str, *, python: str) -> None:
        """Add a Python tool (`module:function`) to the agents file of the servers made after
        this call."""
        text = self._agents_file.read_text()
        entry = f'  {name}:\n    python: "{python}"\n'
        self._agents_file.write_text(text.replace("\nagents:\n", f"\n{entry}agents:\n", 1))

    def add_http_tool(self, name: str, *, path: str, parallel: bool = False) -> None:
        """Add an HTTP tool of the ToolServer's `path` (taking an `id`) to the agents file of
        the servers made after this call."""
        text = self._agents_file.read_text()
        entry = (
            f"  {name}:\n"
            "    input_schema: {type: object, properties: {id: {type: string}}, required: [id]}\n"
            f"    parallel: {'true' if parallel else 'false'}\n"
            f'    http: {{url: "{self._tools_url}/{path}"}}\n'
        )
        self._agents_file.write_text(text.replace("\nagents:\n", f"\n{entry}agents:\n", 1))

    def new(
        self, label: str, *, failpoints: str | None = None, env: dict[str, str] | None = None
    ) -> ServerProcess:
        """A server not started yet; its log is `<label>.log` in the test's tmp_path."""
        server = ServerProcess(
            database_url=self._database_url,
            log_path=self._tmp_path / f"{label}.log",
            agents_file=self._agents_file,
            model_url=self._model_url,
            failpoints=failpoints,
            env=env,
        )
        self._made.append(server)
        return server

    def start(
        self, label: str, *, failpoints: str | None = None, env: dict[str, str] | None = None
    ) -> ServerProcess:
        """A started server."""
        return self.new(label, failpoints=failpoints, env=env).start()

    @staticmethod
    def start_all(*servers: ServerProcess) -> None:
        """Start the servers side by side (each start waits for /healthz)."""
        errors: list[BaseException] = []

        def start(server: ServerProcess) -> None:
            try:
                server.start()
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(s,)) for s in servers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Kill every server still running (a stopped one is continued first)."""
        for server in self._made:
            if server.process is not None and server.process.poll() is None:
                server.process.send_signal(signal.SIGCONT)
                server.kill()


@pytest.fixture
def servers(
    tmp_path: Path, database_url: str, fake_model: FakeAnthropic, tool_server: ToolServer
) -> Iterator[Servers]:
    """Servers on the test's database; every one is killed when the test ends."""
    made = Servers(
        tmp_path, database_url=database_url, model_url=fake_model.url, tools_url=tool_server.url
    )
    try:
        yield made
    finally:
        made.close()
        tool_server.release()  # no /slow_post handler stays parked for the next test
