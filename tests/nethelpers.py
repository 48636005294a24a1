"""A tiny HTTP server handler the network tests reach (or must not reach) from a machine."""

from __future__ import annotations

import http.server
from typing import Any


def hello_handler(body: bytes) -> type[http.server.BaseHTTPRequestHandler]:
    """A handler that answers every GET with ``body`` and logs nothing."""

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return Hello
