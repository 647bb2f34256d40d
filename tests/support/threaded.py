"""Serve an ASGI app from a background thread of the test process (see app/serving.py)."""

from app.serving import ThreadedServer

__all__ = ["ThreadedServer"]
