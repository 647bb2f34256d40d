"""The `agent-runner` command: serve, migrate."""

from __future__ import annotations

import logging
import sys

import click
import uvicorn
from pydantic import ValidationError

from app.db.migrate import upgrade
from app.errors import ConfigError
from app.main import create_app
from app.settings import Settings

log = logging.getLogger("app.cli")


def _settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        raise click.ClickException(f"invalid environment: {exc}") from exc


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Per-request lines of the HTTP clients would repeat every tool and model call at INFO.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)


@click.group()
def main() -> None:
    """agent-runner: durable LLM agents over REST."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
def serve(host: str, port: int) -> None:
    """Upgrade the schema to the newest migration, then serve."""
    settings = _settings()
    _configure_logging(settings.log_level)
    try:
        app = create_app(settings)
        upgrade(settings.database_url)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    uvicorn.run(app, host=host, port=port, log_config=None, timeout_graceful_shutdown=30)


@main.command()
def migrate() -> None:
    """Upgrade the schema to the newest migration and exit."""
    settings = _settings()
    _configure_logging(settings.log_level)
    try:
        upgrade(settings.database_url)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo("schema is at the newest migration")
