"""Persistence: ORM models, engine set-up and repositories."""
