"""Service configuration; the only module that reads the environment."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
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
    log_level: str = "INFO"
