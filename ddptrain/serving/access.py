"""Who may call the server: an API key (vLLM's `--api-key` convention) on every endpoint but
/health, and no unauthenticated server on a non-loopback address unless asked for.

    --api-key KEY | --api-key-file FILE | DDPTRAIN_API_KEY=KEY
        every request but GET /health needs `Authorization: Bearer KEY` (compared in constant
        time), else 401
    --host 0.0.0.0 without a key: refused, unless --allow-unauthenticated (the start-up line says so)
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

API_KEY_ENV = "DDPTRAIN_API_KEY"
OPEN_PATHS = ("/health",)
"""Endpoints answered without a key (load balancers and probes call them)."""


class AccessError(ValueError):
    """The server's access settings do not hold together; the message says which and why."""


def resolve_api_key(api_key: str | None, api_key_file: Path | None) -> str | None:
    """The key from --api-key, else --api-key-file (its first line), else $DDPTRAIN_API_KEY; None: no key."""
    if api_key is not None and api_key_file is not None:
        raise AccessError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        try:
            api_key = Path(api_key_file).expanduser().read_text().strip()
        except OSError as error:
            raise AccessError(f"--api-key-file {api_key_file}: {error.strerror or error}") from None
        if not api_key:
            raise AccessError(f"--api-key-file {api_key_file} is empty")
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not api_key.strip():
        raise AccessError("the API key is empty")
    return api_key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def describe_access(host: str, api_key: str | None, allow_unauthenticated: bool) -> str:
    """The start-up line's words for who may call; AccessError for an open server on a non-loopback address."""
    if api_key is not None:
        return f"API key required (Authorization: Bearer ...) on every endpoint but {', '.join(OPEN_PATHS)}"
    if is_loopback(host):
        return "no API key (loopback only)"
    if not allow_unauthenticated:
        raise AccessError(f"--host {host} is not a loopback address and no API key is set: anyone who can reach it "
                          f"could use the model. Set --api-key, --api-key-file or {API_KEY_ENV}, or pass "
                          "--allow-unauthenticated to serve it open")
    return f"UNAUTHENTICATED on {host} (--allow-unauthenticated): anyone who can reach it can use the model"


class RequireApiKey:
    """ASGI middleware: 401 unless `Authorization: Bearer <key>` (pure ASGI, so streaming and
    disconnect detection pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        message = "a valid API key is required: send Authorization: Bearer <key>"
        response = JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                           "code": 401}}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
