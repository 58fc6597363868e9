"""One JSON call over HTTP with the standard library, for mx's engine attach helpers
(:mod:`mx.dynamo`, :mod:`mx.sglang`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def call(method: str, url: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
    """``(status, body)``: the body parsed as JSON whatever its content type (Dynamo's system
    server answers JSON as ``text/plain``), else its text; an HTTP error status is returned,
    not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def url_problem(url: Any) -> str | None:
    """Why ``url`` is not an ``http(s)://host:port`` base URL (a str naming the defect), or
    ``None`` when it is one. A path, query or fragment is allowed (a base URL behind a proxy);
    the host must be present and the port, when given, in 1..65535."""
    import urllib.parse

    if not isinstance(url, str):
        return f"must be a str, got {type(url).__name__}"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"must be an http(s) URL, got {url!r}"
    try:
        port = parts.port
    except ValueError:
        return f"has a port that is not a number in 0..65535: {url!r}"
    if not parts.hostname:
        return f"names no host: {url!r}"
    if port == 0:
        return f"has port 0: {url!r}"
    return None
