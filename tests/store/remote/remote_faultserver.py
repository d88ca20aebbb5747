"""A misbehaving Bazel-protocol HTTP cache on 127.0.0.1, for the remote tier's bound tests.

It serves ``GET``/``HEAD``/``PUT`` of ``{prefix}/cas/<sha256>`` and
``{prefix}/ac/<sha256>`` from memory, and answers the objects given a fault
the way a hostile or broken server would:

* ``drip``: honest headers, then the body one byte every ``interval`` seconds;
* ``drip_headers``: the status line and headers themselves one byte at a time;
* ``long_length``: a ``Content-Length`` larger than the body, then the connection closes;
* ``short_length``: a ``Content-Length`` smaller than the body (the rest is sent anyway);
* ``endless``: a ``Content-Length`` of 100 GB and zeros until the client hangs up;
* ``superscript_length``: ``Content-Length: ²`` (a digit to ``str.isdigit``, not to ``int``), then the body.

Every request is logged (``requests``), so a test can say that no blob was
asked for.  Threads are daemons and sockets time out, so a test cannot hang on it.
"""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time
from dataclasses import dataclass

__all__ = ["FaultServer", "Fault"]


@dataclass(frozen=True)
class Fault:
    mode: str
    interval: float = 0.2
    head: int = 0  # bytes of the body sent at once before the fault begins (drip)


class FaultServer:
    def __init__(self, prefix: str = "fault") -> None:
        self.prefix = prefix
        self.objects: dict[str, bytes] = {}
        self.faults: dict[str, Fault] = {}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30

            def log_message(self, *args: object) -> None:
                pass

            def _name(self) -> str:
                return self.path.split("?")[0].removeprefix(f"/{outer.prefix}/")

            def do_GET(self) -> None:
                outer._serve(self, self._name(), body=True)

            def do_HEAD(self) -> None:
                outer._serve(self, self._name(), body=False)

            def do_PUT(self) -> None:
                name = self._name()
                data = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with outer._lock:
                    outer.requests.append(("PUT", name))
                    outer.objects[name] = data
                self.send_response(201)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_DELETE(self) -> None:
                with outer._lock:
                    outer.requests.append(("DELETE", self._name()))
                    outer.objects.pop(self._name(), None)
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/{self.prefix}"

    def fault(self, name: str, mode: str, interval: float = 0.2, head: int = 0) -> None:
        """Serve ``name`` (``cas/<digest>`` or ``ac/<digest>``) with a fault (after ``head`` honest bytes)."""
        self.faults[name] = Fault(mode, interval, head)

    def asked(self, kind: str, method: str = "GET") -> int:
        """How many ``method`` requests were made for ``kind`` (``cas`` or ``ac``) objects."""
        with self._lock:
            return sum(1 for m, n in self.requests if m == method and n.startswith(f"{kind}/"))

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, h: http.server.BaseHTTPRequestHandler, name: str, *, body: bool) -> None:
        with self._lock:
            self.requests.append(("GET" if body else "HEAD", name))
            data = self.objects.get(name)
        fault = self.faults.get(name)
        if data is None:
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        mode = fault.mode if fault else "pass"
        sock = h.connection
        with contextlib.suppress(OSError):
            if mode == "drip_headers":
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                self._drip(sock, head, fault.interval)  # type: ignore[union-attr]
                sock.sendall(data if body else b"")
                return
            declared = {
                "long_length": len(data) + 1000,
                "short_length": max(0, len(data) - 10),
                "endless": 100 * 10**9,
                "superscript_length": "\u00b2",
            }.get(mode, len(data))
            h.send_response(200)
            h.send_header("Content-Length", str(declared))
            h.end_headers()
            if not body:
                return
            if mode == "drip":
                assert fault is not None
                sock.sendall(data[: fault.head])
                self._drip(sock, data[fault.head :], fault.interval)
            elif mode == "endless":
                zeros = bytes(1 << 16)
                while not self._stop.is_set():
                    sock.sendall(zeros)
            else:
                sock.sendall(data)
            if mode == "long_length":
                sock.shutdown(socket.SHUT_RDWR)
            h.close_connection = mode != "pass"

    def _drip(self, sock: socket.socket, data: bytes, interval: float) -> None:
        for i in range(len(data)):
            if self._stop.is_set():
                return
            sock.sendall(data[i : i + 1])
            time.sleep(interval)
