"""A TCP proxy that can cut its connections: what a rank sees when the network to the c10d store
fails (a switch reboots, a NAT forgets an idle connection, the store's host is briefly
unreachable).

The store and its clients are torch's own (``dist.TCPStore``); only the path between them goes
through here, so a cut arrives as a reset socket in the middle of whatever request the client
had in flight (a ``wait`` for rank 0's next message, a reply) and torch raises what it raises
in production (``DistNetworkError``). ``cut()`` resets every open connection; ``refuse`` makes
new ones fail too, for an outage that lasts. ``hold(pattern)`` delays the first request that
names a key (its bytes contain ``pattern``) until released: a client slowed between two of its
requests, at a chosen one.
"""

from __future__ import annotations

import socket
import struct
import threading


class TcpFaultProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self.refuse = False
        self.cuts = 0
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._held: tuple[bytes, threading.Event] | None = None
        self._server = socket.create_server((host, 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="tcp-fault-proxy").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            if self.refuse:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._open += [client, upstream]
            for a, b, outgoing in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, outgoing), daemon=True).start()

    def hold(self, pattern: bytes) -> threading.Event:
        """Hold the first client request whose bytes contain ``pattern`` until the returned
        event is set."""
        release = threading.Event()
        self._held = (pattern, release)
        return release

    def _pipe(self, src: socket.socket, dst: socket.socket, outgoing: bool) -> None:
        try:
            while data := src.recv(65536):
                held = self._held
                if outgoing and held is not None and held[0] in data:
                    self._held = None
                    held[1].wait()
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            _reset(s)

    def cut(self) -> int:
        """Reset every connection open now (both sides); returns how many client connections."""
        with self._lock:
            conns, self._open = self._open, []
        for s in conns:
            _reset(s)
        self.cuts += 1
        return len(conns) // 2

    def close(self) -> None:
        self._server.close()
        self.cut()


def _reset(s: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a peer or a middlebox that lost the connection
    does. The pipe thread blocked reading it is woken first (``shutdown(SHUT_RD)``): a socket
    another thread still reads is not released by ``close``, and no reset would be sent."""
    for step in (lambda: s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)),
                 lambda: s.shutdown(socket.SHUT_RD), s.close):
        try:
            step()
        except OSError:
            pass
