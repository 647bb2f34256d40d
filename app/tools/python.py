"""Python tools: an async callable named by `module.path:attr` in the agents file."""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, cast

from app.tools.base import ToolHandler


class TargetError(Exception):
    """A python target cannot be used; the message says why (without file or tool name)."""


def load_python_handler(target: str) -> ToolHandler:
    """Import `module.path:attr` and check it is an async callable taking (arguments, ctx)."""
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise TargetError(f"python target {target!r} must look like 'module.path:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # any failure of configured code at import
        raise TargetError(
            f"python target {target!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise TargetError(
                f"python target {target!r}: {module_name!r} has no attribute {attr_path!r}"
            ) from exc
    if not _is_async_callable(obj):
        raise TargetError(f"python target {target!r} is not an async callable")
    try:
        inspect.signature(obj).bind(None, None)
    except TypeError as exc:
        raise TargetError(f"python target {target!r} must accept (arguments, ctx): {exc}") from exc
    except ValueError:
        pass  # no introspectable signature (some builtins): trust the configuration
    return cast(ToolHandler, obj)


def description_of(handler: object) -> str | None:
    """The first line of the handler's docstring, if it has one (a partial's: its function's)."""
    doc = inspect.getdoc(handler.func if isinstance(handler, functools.partial) else handler)
    if not doc:
        return None
    first = doc.strip().splitlines()[0].strip()
    return first or None


def _is_async_callable(obj: object) -> bool:
    if inspect.iscoroutinefunction(obj):
        return True
    # A callable object whose __call__ is `async def` (but not a class: calling a class
    # constructs an instance, it does not return an awaitable).
    call = getattr(obj, "__call__", None)  # noqa: B004 - we need __call__ itself, not callable()
    return not inspect.isclass(obj) and inspect.iscoroutinefunction(call)
