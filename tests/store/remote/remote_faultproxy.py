"""A fault-injecting TCP proxy on 127.0.0.1 for the remote-tier fault tests.

Modes, chosen per connection when it is accepted (``set_mode`` also closes
the connections already open, so clients reconnect into the new mode):

* ``pass``  — forward both ways, recording what the client sent;
* ``reset`` — read the request, then close with RST (ECONNRESET);
* ``stall`` — accept and read, never answer (a hung server: read timeouts);
* ``503``   — answer every request ``503 Service Unavailable``;
* ``cut``   — forward, but drop the connection after 64 KiB of answer (a body cut short);
* ``flip``  — forward, but invert one byte of the answer at 64 KiB (a body damaged in transit, same length);
* ``drip``  — forward, but send the answer one byte every 50 ms (a server too slow for any deadline).

Threads are daemons and every socket has a timeout, so a test cannot hang on it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

__all__ = ["FaultProxy"]


class FaultProxy:
    def __init__(self, upstream_port: int, *, mode: str = "pass") -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.mode = mode
        self.sent = bytearray()  # every byte a client sent, in pass mode
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def saw(self, text: bytes) -> bool:
        with self._lock:
            return text in self.sent

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        self._close_conns()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._close_conns()

    def _close_conns(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.close()

    def _track(self, s: socket.socket) -> socket.socket:
        with self._lock:
            self._conns.append(s)
        return s

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            client.settimeout(30)
            threading.Thread(target=self._serve, args=(self._track(client), self.mode), daemon=True).start()

    def _serve(self, client: socket.socket, mode: str) -> None:
        try:
            if mode in ("pass", "cut", "flip", "drip"):
                upstream = self._track(socket.create_connection(self.upstream, timeout=30))
                limit = 64 << 10 if mode == "cut" else None
                flip = 64 << 10 if mode == "flip" else None
                threading.Thread(
                    target=self._pump, args=(upstream, client, False, limit, flip, mode == "drip"), daemon=True
                ).start()
                self._pump(client, upstream, True)
            elif mode == "reset":
                client.recv(65536)
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
            elif mode == "stall":
                while not self._stop.is_set() and client.recv(65536):
                    pass
            elif mode == "503":
                while True:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        chunk = client.recv(65536)
                        if not chunk:
                            return
                        head += chunk
                    client.sendall(
                        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    )
                    client.close()
                    return
        except OSError:
            pass

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        record: bool,
        limit: int | None = None,
        flip: int | None = None,
        drip: bool = False,
    ) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if limit is not None:
                    data = data[:limit]
                    limit -= len(data)
                    if not data:
                        break
                if flip is not None:
                    if flip < len(data):
                        data = data[:flip] + bytes([data[flip] ^ 0xFF]) + data[flip + 1 :]
                        flip = None
                    else:
                        flip -= len(data)
                if record:
                    with self._lock:
                        self.sent += data
                if drip:
                    for i in range(len(data)):
                        if self._stop.is_set():
                            return
                        dst.sendall(data[i : i + 1])
                        time.sleep(0.05)
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
