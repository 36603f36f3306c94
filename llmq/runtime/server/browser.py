"""Refusing what a web page could make the user's browser send to a server on the user's machine.

A page on any site can POST to http://127.0.0.1:PORT without asking first, as long as the request looks like a form
(Content-Type text/plain, a form type, or none); it cannot read the answer, unless it re-points its own host name at
127.0.0.1 (DNS rebinding), after which the browser thinks the server is the page's own site. A server with no API
key on a loopback address is what that reaches, so there (and wherever `--allowed-hosts` is given) `BrowserGuard`
refuses, before any route runs:
- a Host header that names none of the allowed hosts (403): a rebound page's requests name the attacker's host;
- an Origin header whose host is none of them (403): a cross-site page's request says where it comes from;
- a POST whose Content-Type is not application/json (415): a browser sends that type only after a CORS pre-flight,
  which this server never grants.
Ports are not compared, so a forwarded port (`ssh -L 9000:localhost:8000`) still works.
"""

from __future__ import annotations

import ipaddress
import json

from .protocol import error_body

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def allowed_hosts(bind: str, api_key: str | None, given: str | None) -> frozenset[str] | None:
    """The host names requests may name for `llmq serve --host BIND [--api-key] [--allowed-hosts GIVEN]`; None for
    no checks. GIVEN: comma-separated names (the loopback names stay allowed), or '*' for none; by default the
    loopback names and BIND on a loopback bind without a key, no checks elsewhere."""
    if given is not None:
        names = {n.strip().lower().strip("[]") for n in given.split(",") if n.strip()}
        return None if "*" in names else frozenset(names | LOOPBACK_NAMES)
    if api_key or not _loopback(bind):
        return None
    return LOOPBACK_NAMES | {bind.lower().strip("[]")}


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def host_name(authority: str) -> str:
    """'Example.com:8000' -> 'example.com', '[::1]:8000' -> '::1', '127.0.0.1' -> '127.0.0.1'."""
    a = authority.strip().lower()
    if a.startswith("["):
        return a[1:a.find("]")] if "]" in a else a
    return a.rsplit(":", 1)[0] if a.count(":") == 1 else a


class BrowserGuard:
    """ASGI middleware: the three refusals of the module docstring, for hosts `allowed`."""

    def __init__(self, app, allowed: frozenset[str]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        refusal = self.refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            return await self.app(scope, receive, send)
        status, message, code = refusal
        body = json.dumps(error_body(message, code=code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def refusal(self, scope) -> tuple[int, str, str] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if host is not None and host_name(host) not in self.allowed:
            return 403, f"this server does not answer to Host {host[:100]!r} (see --allowed-hosts)", "host_not_allowed"
        origin = headers.get("origin")
        if origin is not None:
            scheme, sep, rest = origin.partition("://")
            if not sep or scheme.lower() not in ("http", "https") or host_name(rest.split("/")[0]) not in self.allowed:
                return 403, f"cross-origin requests are refused (Origin {origin[:100]!r}; see --allowed-hosts)", \
                    "cross_origin"
        if scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                return 415, f"the request body must be application/json, not {ctype[:100] or 'untyped'}", \
                    "unsupported_media_type"
        return None
