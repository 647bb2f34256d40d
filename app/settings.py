"""Service configuration; the only module that reads configuration from the environment (but
for the example `send_email` tool's DEMO_OUTBOX, app/tools/builtin/outbox.py; the bench
hands its environment on to the server it starts)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Annotated, Literal

from dotenv import load_dotenv
from dotenv.parser import parse_stream
from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.db.urls import check_database_url
from app.errors import ConfigError
from app.tools.base import DEFAULT_MAX_RESULT_BYTES


def _a_number(value: object) -> object:
    """NaN parses as a float, and would then be refused as out of range ("greater than 0"):
    refuse it as what it is. (inf is taken: no bound.)"""
    try:
        nan = math.isnan(float(value))  # type: ignore[arg-type]  # whatever was set
    except (TypeError, ValueError):
        return value  # refused by the float validator, in its words
    if nan:
        raise ValueError("Input should be a number, not NaN")
    return value


# A time in seconds: a float, not NaN.
Seconds = Annotated[float, BeforeValidator(_a_number)]


class Settings(BaseSettings):
    """Environment variables: CONTRACT.md §5's, as named there, and this service's own (the
    README's Configuration table lists them all)."""

    # `.env` is read into the environment by `load_env_file`, once, for everything.
    model_config = SettingsConfigDict(extra="ignore")

    database_url: str = "sqlite:///agent_runner.db"
    agents_file: Path | None = None
    api_keys: SecretStr | None = None
    failpoints: str | None = None

    anthropic_max_retries: int = Field(default=2, ge=0, le=10)
    anthropic_timeout_s: Seconds = Field(default=600.0, gt=0)
    database_pool_size: int = Field(default=20, ge=1)
    # PostgreSQL session ownership: the lock connection's heartbeat, and how long a holder may
    # miss it before another runner takes its sessions over (services/pg_ownership.py).
    session_heartbeat_s: Seconds = Field(default=0.5, gt=0)
    session_takeover_after_s: Seconds = Field(default=3.0, gt=0)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    log_format: Literal["json", "text"] = "json"
    # On SIGTERM: stop taking runs, give runs in progress this long to finish, then stop them
    # (a tool-call step in flight finishes first) and exit.
    shutdown_grace_s: Seconds = Field(default=30.0, ge=0)
    # How long `serve` waits for a request's head, from a connection's opening or its last
    # answer, before it closes the connection (app/request_head.py).
    request_head_timeout_s: Seconds = Field(default=30.0, gt=0)
    # A tool result longer than this (bytes of its JSON text) is kept truncated.
    tool_result_max_bytes: int = Field(default=DEFAULT_MAX_RESULT_BYTES, ge=1024)

    @model_validator(mode="after")
    def _takeover_spans_missed_heartbeats(self) -> Settings:
        # A holder stops dispatching once its heartbeat is takeover/2 old: that must span
        # a couple of heartbeats, or live holders would refuse their own runs between beats.
        if self.session_takeover_after_s < 4 * self.session_heartbeat_s:
            raise ValueError(
                "SESSION_TAKEOVER_AFTER_S must be at least 4 times SESSION_HEARTBEAT_S"
                f" (it is {self.session_takeover_after_s:g}, the heartbeat"
                f" {self.session_heartbeat_s:g})"
            )
        return self

    @field_validator("database_url")
    @classmethod
    def _usable_database_url(cls, value: str) -> str:
        try:
            return check_database_url(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("agents_file", mode="before")
    @classmethod
    def _names_a_file(cls, value: object) -> object:
        # Empty, it would be read as ".", a folder: say what to do instead.
        if isinstance(value, str) and not value.strip():
            raise ValueError("is set but empty: name a file, or unset it for the examples")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_in_any_case(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


def load_env_file(path: Path = Path(".env")) -> None:
    """Put the variables of `.env` (in the working directory) into the environment, where
    it does not set them already, so that what reads the environment itself sees them too:
    the anthropic SDK (ANTHROPIC_API_KEY, ANTHROPIC_BASE_URL) and the example tools.

    ConfigError for a file that cannot be read, or a line that is not NAME=value: skipped,
    such a line would start the service without it (an API_KEYS line: with no auth)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read: {exc}") from None
    if "\x00" in text:  # no environment variable can hold it
        raise ConfigError(f"{path} holds a NUL character")
    for binding in parse_stream(io.StringIO(text)):
        # A NAME alone (no `=`: `API_KEYS:k1:t1`) sets nothing, as a line that does not
        # parse. Its text may hold a secret: the line is named, not shown.
        if binding.error or (binding.key is not None and binding.value is None):
            raise ConfigError(
                f"{path} line {binding.original.line} is not NAME=value (a quote left open?)"
            )
    load_dotenv(stream=io.StringIO(text), override=False)
