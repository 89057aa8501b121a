"""One HTTP request under a hard deadline: the only place that talks to a socket for ``endpoints``.

Why not urllib (or httpx, which is installed as a dependency of a dependency): both bound each socket operation,
not the request. A server that trickles its answer one byte at a time resets a per-read timeout with every byte,
so a "3 s" request ran past 60 s. Here the deadline covers connect, send, the first byte and the whole body: the
socket's timeout is what is left of it, and a watchdog timer shuts the socket down when it passes, which wakes any
read blocked inside ``http.client`` (a status line or header that trickles, too). A body larger than
``max_bytes`` is refused as it arrives, before it fills memory.

Proxies: a loopback server is reached directly; any other host goes through the environment's proxy
(``http_proxy``/``https_proxy``/``no_proxy``, as urllib reads them) when one is set.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from email.message import Message


class DeadlineExceeded(Exception):
    """The request did not complete (connect, send, first byte, whole body) before its deadline."""


class ConnectionFailed(Exception):
    """The connection could not be made, or was dropped or reset before the answer was complete."""


class BodyTooLarge(Exception):
    """The answer is larger than the caller accepts."""


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Message
    body: bytes


def is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def request(method: str, url: str, body: bytes | None, headers: dict[str, str], *, deadline: float,
            max_bytes: int) -> Reply:
    """``method url`` with ``body``; the whole reply read before ``deadline`` (``time.monotonic()``) or
    ``DeadlineExceeded``. Any HTTP status is a ``Reply``; transport failures are ``ConnectionFailed``."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded("no time left")
    conn, target = _connection(url, remaining)
    cut = threading.Event()
    watchdog = threading.Timer(remaining, _shut_down, (conn, cut))
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request(method, target, body=body, headers=headers)
        response = conn.getresponse()
        length = response.getheader("Content-Length", "")
        if length.strip().isdigit() and int(length) > max_bytes:
            raise BodyTooLarge(f"it announced {int(length)} bytes")
        chunks, size = [], 0
        while chunk := response.read1(65536):
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge("it kept coming")
            chunks.append(chunk)
            if time.monotonic() >= deadline:
                raise DeadlineExceeded("the body was still arriving")
        if cut.is_set():  # the watchdog's shutdown ends a read with an empty chunk, which looks like the end
            raise DeadlineExceeded("the body was still arriving")
        if response.length:  # bytes still owed under Content-Length: the server hung up part way
            raise ConnectionFailed(f"the connection closed {response.length} bytes before the end of the answer")
        return Reply(response.status, response.headers, b"".join(chunks))
    except (OSError, http.client.HTTPException) as exc:
        if cut.is_set() or isinstance(exc, TimeoutError) or time.monotonic() >= deadline:
            raise DeadlineExceeded("no complete answer") from None
        raise ConnectionFailed(f"{type(exc).__name__}: {exc}".rstrip(": ")) from None
    finally:
        watchdog.cancel()
        conn.close()


def _shut_down(conn: http.client.HTTPConnection, cut: threading.Event) -> None:
    """The watchdog: wake whatever read or write is blocked on ``conn``'s socket."""
    cut.set()
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the request's own thread


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    """A connection for ``url`` (not yet connected) and the request target to send on it."""
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    https = parts.scheme == "https"
    cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
    extra = {"context": ssl.create_default_context()} if https else {}
    proxy = None if is_loopback(url) or urllib.request.proxy_bypass(parts.hostname or "") else \
        urllib.request.getproxies().get(parts.scheme)
    if not proxy:
        return cls(parts.hostname, parts.port, timeout=timeout_s, **extra), path
    p = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
    if https:  # a CONNECT tunnel through the proxy, TLS to the server inside it
        conn = cls(p.hostname, p.port or 8080, timeout=timeout_s, **extra)
        conn.set_tunnel(parts.hostname, parts.port)
        return conn, path
    return http.client.HTTPConnection(p.hostname, p.port or 8080, timeout=timeout_s), url
