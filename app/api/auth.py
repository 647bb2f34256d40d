"""API keys (`API_KEYS=key:tenant[,key:tenant...]`): which tenant a request acts for."""

from __future__ import annotations

import hashlib
import hmac
import re

from starlette.routing import Match, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.problems import problem_response
from app.errors import ConfigError, Unauthorized

# What the store keeps of a tenant's name (session.tenant_id).
TENANT_MAX_LENGTH = 128


class ApiKeys:
    """Configured keys, kept only as SHA-256 digests and compared in constant time."""

    def __init__(self, keys: dict[str, str]) -> None:
        self._digests = [(_digest(key), tenant) for key, tenant in keys.items()]

    @classmethod
    def parse(cls, spec: str) -> ApiKeys:
        """Parse the API_KEYS value; a malformed entry is a ConfigError (without the key)."""
        if not spec.strip():
            raise ConfigError("API_KEYS is set but empty: name key:tenant entries, or unset it")
        keys: dict[str, str] = {}
        for position, entry in enumerate(spec.split(","), start=1):
            key, sep, tenant = (part.strip() for part in entry.rpartition(":"))
            if not sep or not key or not tenant:
                raise ConfigError(f"API_KEYS: entry {position} is not key:tenant")
            if len(tenant) > TENANT_MAX_LENGTH:
                raise ConfigError(
                    f"API_KEYS: entry {position} names a tenant of more than"
                    f" {TENANT_MAX_LENGTH} characters"
                )
            if not re.fullmatch(r"[\x20-\x7e\x80-\xff]+", key):  # a header's bytes, as read
                raise ConfigError(
                    f"API_KEYS: entry {position} has a key with a control character or one"
                    " beyond Latin-1, which no Authorization header can send"
                )
            if key in keys:  # the key is not quoted: it is a secret
                raise ConfigError(f"API_KEYS: entry {position} repeats the key of an earlier one")
            keys[key] = tenant
        return cls(keys)

    @property
    def tenants(self) -> frozenset[str]:
        """The tenants the keys are for."""
        return frozenset(tenant for _, tenant in self._digests)

    def tenant(self, token: str | None) -> str:
        """The tenant of the bearer token (`Authorization: Bearer <key>`), or Unauthorized."""
        if token is None or not token.strip():
            raise Unauthorized("Send Authorization: Bearer <API key>.")
        given = _digest(token.strip())
        found: str | None = None
        for digest, tenant in self._digests:  # no early exit: time does not depend on position
            if hmac.compare_digest(given, digest):
                found = tenant
        if found is None:
            raise Unauthorized("The API key is not valid.")
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class RequireApiKey:
    """A request for a /v1 route names its tenant by its key before anything else reads it: a
    request without a valid key is 401 whatever its body or parameters (no 413 or 422 first,
    and an unknown caller makes the service parse nothing). A path the API does not have, or
    a method a path does not take, is left to the router (404, 405): the routes are public
    in /openapi.json. The tenant is left in the request's state (`request.state.tenant`,
    None while API_KEYS is unset) for `app.api.deps.get_tenant`."""

    def __init__(self, app: ASGIApp, *, keys: ApiKeys | None, router: Router) -> None:
        self.app = app
        self.keys = keys
        self.router = router

    # Positional: ASGI calls it so.
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # noqa: PLR0917
        """Answer 401 for a /v1 request without a valid key; pass the rest on with its tenant."""
        # Without API_KEYS every request acts for no tenant: no route to look up.
        if scope["type"] == "http" and (self.keys is None or self._is_v1_route(scope)):
            try:
                tenant = None if self.keys is None else self.keys.tenant(_bearer_token(scope))
            except Unauthorized as exc:
                await problem_response(exc)(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    def _is_v1_route(self, scope: Scope) -> bool:
        """Whether a /v1 route takes this path and method: the router's own matching, on the
        path without a root_path the server puts in front (uvicorn's --root-path, a mount)."""
        path: str = scope["path"]
        if not path.removeprefix(scope.get("root_path", "")).startswith("/v1/"):
            return False
        return any(route.matches(scope)[0] is Match.FULL for route in self.router.routes)


def _bearer_token(scope: Scope) -> str | None:
    """The credentials of an `Authorization: Bearer <token>` header (the scheme in any case).

    Two Authorization headers are refused: they name no one caller, and a proxy that reads
    the other one would act for another tenant than the service does."""
    values = [value for name, value in scope["headers"] if name == b"authorization"]
    if len(values) > 1:
        raise Unauthorized("Send one Authorization header, not several.")
    if not values:
        return None
    scheme, _, token = values[0].decode("latin-1").strip().partition(" ")
    return token if scheme.lower() == "bearer" else None
