"""Service configuration; the only module that reads the environment."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from dotenv import load_dotenv
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Environment variables as named in CONTRACT.md §5."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore")

    database_url: str = "sqlite:///agent_runner.db"
    agents_file: Path | None = None
    api_keys: SecretStr | None = None
    failpoints: str | None = None

    anthropic_max_retries: int = Field(default=2, ge=0, le=10)
    anthropic_timeout_s: float = Field(default=600.0, gt=0)
    database_pool_size: int = Field(default=10, ge=1)
    # PostgreSQL session ownership: the lock connection's heartbeat, and how long a holder may
    # miss it before another runner takes its sessions over (services/ownership.py).
    session_heartbeat_s: float = Field(default=0.5, gt=0)
    session_takeover_after_s: float = Field(default=3.0, gt=0)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    log_format: Literal["json", "text"] = "json"
    # On SIGTERM: stop taking runs, give runs in progress this long to finish, then exit.
    shutdown_grace_s: float = Field(default=30.0, ge=0)

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_in_any_case(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


def load_env_file() -> None:
    """Put the variables of `.env` (in the working directory) into the environment, where
    it does not set them already, so that what reads the environment itself sees them too:
    the anthropic SDK (ANTHROPIC_API_KEY, ANTHROPIC_BASE_URL) and the example tools."""
    load_dotenv(Path(".env"), override=False)
