"""Bounds on what a connection can hold, below the app: uvicorn's HTTP protocol (httptools) with a read timeout and a
cap on unread response bytes, and the uvicorn config every server is run with.

- A connection must deliver a request's headers and body within `read_timeout_s` of its opening (or of the request's
  first byte, on a kept-alive connection): a slower one (a trickled header, an idle socket) gets 408 and is closed.
- A client may leave at most about `max_unread_bytes` of a response unread: the socket's send buffer is set to that
  size and so is the server's own buffer's high-water mark. One that stays over it for `send_timeout_s` (it reads
  nothing, or a byte a second) is reset (its unsent bytes dropped by the kernel too), which aborts its request. Other
  streams never wait for it.
- More than `max_connections` open connections get 503 (uvicorn's limit_concurrency); the open-files limit is raised to
  fit them.
"""
import asyncio
import logging
import resource
import socket
import struct

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("servers.connections")
TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
FILES_BESIDE = 256  # open files the process needs beside its connections (model, libraries, logs)


def cancelled(timer: asyncio.TimerHandle | None) -> None:
    """Cancel a timer if there is one; None, to store in its place."""
    if timer is not None:
        timer.cancel()


class BoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the read timeout and the unread-bytes cap (conf/server: read_timeout_s,
    send_timeout_s, max_unread_bytes); everything else is uvicorn's."""

    read_timeout_s: float = 20.0     # s: set per server by bounded_protocol
    send_timeout_s: float = 10.0     # s
    max_unread_bytes: int = 262144   # bytes

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.read_timer = self.send_timer = None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.max_unread_bytes)
        transport.set_write_buffer_limits(high=self.max_unread_bytes)
        self.arm()

    def arm(self) -> None:
        if self.read_timer is None:
            self.read_timer = self.loop.call_later(self.read_timeout_s, self.read_timed_out)

    def disarm(self) -> None:
        self.read_timer = cancelled(self.read_timer)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.arm()  # the next request on a kept-alive connection

    def on_message_complete(self) -> None:
        self.disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        self.resume_writing()
        super().connection_lost(exc)

    def read_timed_out(self) -> None:
        self.read_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(TIMED_OUT)
        self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.send_timer is None:
            self.send_timer = self.loop.call_later(self.send_timeout_s, self.send_timed_out)

    def resume_writing(self) -> None:
        self.send_timer = cancelled(self.send_timer)
        super().resume_writing()

    def send_timed_out(self) -> None:
        self.send_timer = None
        log.warning("dropped %s:%s, a slow reader: over server.max_unread_bytes = %d unread for "
                    "server.send_timeout_s = %g s", *(self.client or ("?", "?")), self.max_unread_bytes,
                    self.send_timeout_s)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset, not a close: the kernel drops the unsent bytes instead of holding them
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()  # connection_lost follows: the request's disconnect aborts it


def bounded_protocol(read_timeout_s: float, send_timeout_s: float, max_unread_bytes: int) -> type[BoundedProtocol]:
    """The protocol class with this server's bounds (uvicorn builds one instance per connection)."""
    return type("Bounded", (BoundedProtocol,), {"read_timeout_s": float(read_timeout_s),
                                                "send_timeout_s": float(send_timeout_s),
                                                "max_unread_bytes": int(max_unread_bytes)})


def open_files_for(connections: int) -> None:
    """Raise this process's soft open-files limit so `connections` sockets fit beside its own files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections + FILES_BESIDE
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < need:
            log.warning("open files are limited to %d (ulimit -Hn): fewer than server.max_connections = %d fit",
                        new, connections)


def uvicorn_config(app, host: str, port: int, *, max_connections: int, read_timeout_s: float, send_timeout_s: float,
                   max_unread_bytes: int, log_level: str = "warning") -> uvicorn.Config:
    """The uvicorn config for one server, with the bounds above (conf/server/<name>.yaml holds each)."""
    open_files_for(max_connections)
    http = bounded_protocol(read_timeout_s, send_timeout_s, max_unread_bytes)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                          limit_concurrency=max_connections, http=http)
