"""A TCP endpoint on 127.0.0.1 that accepts connections and never answers, and the lookup a child process runs.

``HungEndpoint`` is the server of the hung-endpoint tests: it accepts every
connection, reads what it is sent and never writes a byte, so a client waits
for response headers until its own timeout.  ``python remote_hung.py ROOT``
is the child: it opens the store ``ROOT`` the way a pipeline does
(``Store.from_env``: ``ADSTORE_REMOTE``, ``ADSTORE_REMOTE_DEADLINE``, ...)
and looks a key up, which asks the remote for its record; ``blocking://``
remotes name a backend whose every call blocks on the endpoint with no
timeout at all, which nothing can interrupt.  It prints the lookup's reason,
how long the lookup took and the time it returned (so a caller can measure
how long the process lived on), then returns: whatever still runs in the
process must not keep it alive.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import urllib.parse
from typing import Any, BinaryIO

__all__ = ["HungEndpoint", "main"]


class HungEndpoint:
    """Accepts connections on 127.0.0.1 and never answers; ``close()`` drops them all."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)  # held open, never read from or written to

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()


def _blocking_backend(url: str, **_: Any) -> Any:
    from adstore.store.remote import RemoteBackend

    class BlockingBackend(RemoteBackend):
        """Every call connects to the endpoint and waits for an answer with no timeout: uninterruptible."""

        def __init__(self) -> None:
            parts = urllib.parse.urlsplit(url)
            self.url = url
            self._addr = (parts.hostname or "127.0.0.1", parts.port or 80)

        def _wait(self) -> None:
            with socket.create_connection(self._addr) as s:
                s.settimeout(None)
                s.recv(1)  # the endpoint never answers

        def get_to(self, kind: Any, digest: str, fileobj: BinaryIO, max_bytes: int) -> int | None:
            self._wait()
            return None

        def put(self, kind: Any, digest: str, data: Any) -> int:
            self._wait()
            return 0

        def head(self, kind: Any, digest: str) -> int | None:
            self._wait()
            return None

        def delete(self, kind: Any, digest: str) -> None:
            self._wait()

    return BlockingBackend()


def main(root: str) -> None:
    from adstore.store import Store
    from adstore.store.remote import register_scheme

    register_scheme("blocking", _blocking_backend)
    with Store.from_env({**os.environ, "ADSTORE_ROOT": root}) as store:
        start = time.monotonic()
        res = store.lookup("k" * 64)
        print(f"{res.reason} {time.monotonic() - start:.3f} {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
