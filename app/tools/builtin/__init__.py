"""Built-in example tools that work offline; referenced as `app.tools.builtin:<name>`."""

from app.tools.builtin.clock import clock
from app.tools.builtin.orders import lookup_order
from app.tools.builtin.outbox import send_email

__all__ = ["clock", "lookup_order", "send_email"]
