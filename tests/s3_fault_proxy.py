"""A small HTTP proxy for the S3 tests: forwards to the moto server and injects faults.

It sits on 127.0.0.1 between boto3 and moto, so faults arrive the way a real store or network
delivers them (a 503 SlowDown answer, a connection closed before the answer, a body cut off
mid-stream) and every layer of ours and botocore's runs unmodified.

``rule(method, path_and_query, n)`` is called for every request (``n`` counts requests that
matched nothing before, from 1) and returns None to forward it, or an action:
"503" (SlowDown), "drop" (close without answering), "cut" (forward, but close after half of
the response body), "stall:<seconds>" (forward after that long: a slow link or a store that
takes its time), "hold" (forward once ``release`` is set: a request stuck until the test
says so), "500" (InternalError) or "lose" (forward, then close without answering: the request
took effect and its answer was lost, so the client's retry finds its own write there).

An ``emulation`` (``s3_directory_bucket.DirectoryBuckets``) makes moto answer as another kind of
store would: it may answer a request itself (``answer``) or rewrite moto's answer (``rewrite``).
"""

from __future__ import annotations

import http.client
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Mapping, Protocol
from urllib.parse import urlsplit

Rule = Callable[[str, str], "str | None"]

_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>proxy</RequestId></Error>"
)
_INTERNAL_ERROR = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message><RequestId>proxy</RequestId></Error>"
)


class Emulation(Protocol):
    def answer(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> "tuple[int, str, bytes] | None": ...

    def rewrite(self, method: str, path: str, payload: bytes, get: Callable[[str], bytes]) -> bytes: ...


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "content-length"}


class FaultProxy:
    def __init__(self, upstream: str, emulation: Emulation | None = None) -> None:
        parts = urlsplit(upstream)
        self.emulation = emulation
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rule: Rule = lambda method, path: None
        self.injected: list[tuple[str, str, str]] = []  # (action, method, path) of every fault
        self.requests = 0
        self.release = threading.Event()  # "hold": the held requests go on once set
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as botocore expects
            # The status line and headers, then the body, go out in two writes: with Nagle's
            # algorithm the second waited for the client's delayed ACK of the first (40 ms on
            # Linux), every request through the proxy.
            disable_nagle_algorithm = True

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _handle(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                # A client that hung up before its answer was written (a retry gave up, a
                # test ended) is the normal end of a fault; anything else is printed as before.
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        body = _read_body(h)
        with self._lock:
            self.requests += 1
            action = self.rule(h.command, h.path)
            if action:
                self.injected.append((action, h.command, h.path))
        if action in ("503", "500"):
            _send(h, *((503, "Slow Down", _SLOW_DOWN) if action == "503" else (500, "Internal Server Error", _INTERNAL_ERROR)))
            return
        mine = self.emulation.answer(h.command, h.path, h.headers, body) if self.emulation else None
        if mine is not None:
            _send(h, *mine)
            return
        if action == "drop":
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if action and action.startswith("stall:"):
            time.sleep(float(action.split(":", 1)[1]))
        if action == "hold":
            self.release.wait()
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP_BY_HOP}
            conn.request(h.command, h.path, body=body if body or h.command in ("PUT", "POST") else None, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
        finally:
            conn.close()
        if self.emulation is not None and resp.status == 200:
            payload = self.emulation.rewrite(h.command, h.path, payload, self._get)
        if action == "lose":
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP_BY_HOP:
                h.send_header(k, v)
        if h.command == "HEAD":
            h.send_header("Content-Length", resp.getheader("Content-Length", "0"))
            h.end_headers()
            return
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        if action == "cut":
            h.wfile.write(payload[: len(payload) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.wfile.write(payload)

    def _get(self, path: str) -> bytes:
        """moto's answer to a GET of ``path`` (an emulation asking what a store would know)."""
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request("GET", path)
            return conn.getresponse().read()
        finally:
            conn.close()


def _send(h: BaseHTTPRequestHandler, status: int, reason: str, answer: bytes) -> None:
    h.send_response(status, reason)
    h.send_header("Content-Type", "application/xml")
    h.send_header("Content-Length", str(len(answer)))
    h.end_headers()
    h.wfile.write(answer)


def _read_body(h: BaseHTTPRequestHandler) -> bytes:
    if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return bytes(out)
            out += h.rfile.read(size)
            h.rfile.readline()
    length = int(h.headers.get("Content-Length") or 0)
    return h.rfile.read(length) if length else b""
