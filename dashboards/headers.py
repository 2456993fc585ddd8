"""Security headers on every response of the dashboard, whatever WSGI server runs it.

The Content-Security-Policy lets scripts come only from the dashboard itself and from the inline
scripts Dash writes into the page (the renderer and the clientside callbacks), named by their
hashes; injected markup therefore cannot run script. Styles may be inline: Dash components and
Plotly set them at run time, and a style cannot run code. Nothing may frame the dashboard
(``frame-ancestors 'none'``, and ``X-Frame-Options`` for browsers that predate it), so a page
elsewhere cannot overlay the sign-in form.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from flask import Flask, Response

__all__ = [
    "content_security_policy",
    "install_security_headers",
    "installed_headers",
    "security_headers",
]

_FIXED: Final[Mapping[str, str]] = {
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def content_security_policy(script_hashes: Iterable[str]) -> str:
    """The policy for pages whose only inline scripts are those with ``script_hashes``."""
    directives = {
        "default-src": ["'self'"],
        "script-src": ["'self'", *script_hashes],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:", "blob:"],
        "font-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'none'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    }
    return "; ".join(f"{name} {' '.join(values)}" for name, values in directives.items())


def security_headers(csp: str) -> dict[str, str]:
    """Every security header a dashboard response carries, with ``csp`` as its policy."""
    return {"Content-Security-Policy": csp, **_FIXED}


def install_security_headers(server: Flask, csp: str) -> None:
    """Add the security headers to every response ``server`` makes, errors included."""
    headers = security_headers(csp)
    server.extensions["infermeter_security_headers"] = headers

    def add(response: Response) -> Response:
        response.headers.update(headers)
        return response

    server.after_request(add)


def installed_headers(server: Flask) -> dict[str, str]:
    """The headers ``install_security_headers`` gave ``server``, for answers its WSGI server
    makes without it (waitress's own 413)."""
    headers: dict[str, str] = server.extensions["infermeter_security_headers"]
    return headers
