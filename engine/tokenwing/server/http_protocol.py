"""uvicorn's HTTP/1.1 protocol (h11), answering in the one JSON error format where uvicorn answers by itself.

A request that h11 cannot parse (a bad request line, a malformed header, a header block past h11's size limit)
never reaches the app: uvicorn writes a plain-text 400 "Invalid HTTP request received." itself. Here it is the
JSON error every other refusal is (issue 41: every error in one format; the app's own faults are JSON 500s
already, app.internal_error). serve.py gives uvicorn this class (`http=`), so the choice does not depend on whether
httptools happens to be installed (uvicorn's "auto" would take it, with its own plain-text 400).
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenwing.server.protocol import RequestError

BAD_REQUEST = "invalid HTTP request: the request line or a header could not be parsed"


class JsonErrorH11Protocol(H11Protocol):
    """H11Protocol whose own 400 (a request h11 cannot parse) is a JSON error."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(RequestError(BAD_REQUEST).body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()  # (as uvicorn's own: h11's state is broken, the connection is not reused)
