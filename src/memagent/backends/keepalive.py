"""An ``httpx`` transport on the standard library's ``http.client``: one kept-alive connection per thread and
server.

Measured on this project's 2-core machine (benchmarks/scale.py, docs/results/scale.md): 128 threads posting
8 KB chat requests through ``httpx.Client``'s own connection pool cost about 6 ms of CPU per request (its pool
is scanned under a lock for every request); through this transport about 0.5 ms, and the wall time at 128
requests in flight stays within 1.3x of the server's latency. A thread keeps its connection to each server
for its next request (connection reuse, no pool to search); a thread's connections close when it ends. A kept
connection that the server closed while idle is found before the request is sent (or as it goes out) and
reopened at no cost; a request already sent is never sent again here (the backend's retries decide). Failures
are raised as the ``httpx`` exceptions the backend classifies (``ConnectError``, ``ConnectTimeout``,
``ReadTimeout``, ``RemoteProtocolError``).
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
import weakref

import httpx

_RESET = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle connection's socket is readable: the server closed it (or sent what no request asked
    for), so it must not carry the next request."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class _ThreadConnections(dict):
    """One thread's connections by server; closed when the thread ends and its thread-local storage goes."""

    def __del__(self):
        for conn in self.values():
            conn.close()


class KeepAliveTransport(httpx.BaseTransport):
    """Per-thread persistent connections (see the module docstring).

    Args:
        timeout_s: seconds to connect and to wait for each read (``None``: the request's own timeout).
    """

    def __init__(self, timeout_s: float | None = None):
        self.timeout_s = timeout_s
        self._local = threading.local()
        # weak: a thread's connections live in its thread-local dict, so when the thread ends (a backend's request
        # pool is made per batch) they are freed and their sockets closed, instead of piling up until close()
        self._all: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()
        self._lock = threading.Lock()

    def _connection(self, url: httpx.URL, timeout_s: float | None, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = _ThreadConnections()
        key = (url.scheme, url.host, url.port)
        conn = conns.get(key)
        if conn is not None and not fresh and conn.sock is not None and _closed_by_peer(conn.sock):
            fresh = True  # the server closed it while idle: a new one, before anything is sent
        if conn is not None and not fresh:
            conn.timeout = timeout_s
            if conn.sock is not None:
                conn.sock.settimeout(timeout_s)
            return conn, True
        if conn is not None:
            self._drop(conn)
        cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = conns[key] = cls(url.host, url.port, timeout=timeout_s)
        with self._lock:
            self._all.add(conn)
        return conn, False

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        with self._lock:
            self._all.discard(conn)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` on this thread's connection to its server and read the whole answer."""
        timeout = request.extensions.get("timeout") or {}
        timeout_s = self.timeout_s if self.timeout_s is not None else timeout.get("read")
        body = request.read()
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers.raw}
        path = request.url.raw_path.decode("ascii")
        for fresh in (False, True):
            conn, reused = self._connection(request.url, timeout_s, fresh)
            sent = False
            try:
                conn.request(request.method, path, body=body, headers=headers)
                sent = True
                resp = conn.getresponse()
                data = resp.read()
            except _RESET as e:
                self._drop(conn)
                if reused and not sent:  # closed while idle, found as the request went out: reopen it, once
                    continue
                # once sent, the server may have taken the request: not sent again here, so a request goes out
                # at most 1 + max_retries times (the backend's retries decide)
                raise httpx.RemoteProtocolError(f"{type(e).__name__}: {e}", request=request) from e
            except ConnectionRefusedError as e:
                self._drop(conn)
                raise httpx.ConnectError(f"connection refused ({e})", request=request) from e
            except (socket.timeout, TimeoutError) as e:
                kind = httpx.ReadTimeout if conn.sock is not None else httpx.ConnectTimeout
                self._drop(conn)
                raise kind(f"timed out after {timeout_s} s", request=request) from e
            except (OSError, http.client.HTTPException) as e:
                self._drop(conn)
                gone = httpx.ConnectError if not reused else httpx.ReadError
                raise gone(f"{type(e).__name__}: {e}", request=request) from e
            if resp.will_close:
                self._drop(conn)
            return httpx.Response(resp.status, headers=resp.getheaders(), content=data,
                                  extensions={"http_version": b"HTTP/1.1"})
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close every connection of every thread."""
        with self._lock:
            conns, self._all = list(self._all), weakref.WeakSet()
        for c in conns:
            c.close()
