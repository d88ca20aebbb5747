"""Real servers for the remote-tier tests: moto's S3 server and a WebDAV server.

Each runs as its own process on 127.0.0.1 on a free port, from packages the
``test`` extra installs (``moto[server]``, ``wsgidav`` + ``cheroot``), and is
waited for with a bounded timeout:

    python -m moto.server -H 127.0.0.1 -p PORT
    python -m wsgidav.server.server_cli -H 127.0.0.1 -p PORT -r ROOT --auth anonymous --no-config -q
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Server", "free_port", "start_moto", "start_webdav", "S3_ENV", "BUCKET"]

#: What boto3 needs to talk to moto (any credentials do); the endpoint is added per server.
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
READY_TIMEOUT = 30.0
#: The bucket the session's S3 server holds (each test uses its own prefix in it).
BUCKET = "adstore-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    kind: str
    proc: subprocess.Popen
    port: int
    log: Path
    root: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Kill the server (continuing it first if it was stopped), bounded."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _wait_ready(server: Server, path: str) -> Server:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.kind} exited with {server.proc.returncode}: {server.log.read_text()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=1)
            conn.request("GET", path)
            conn.getresponse().read()
            conn.close()
            return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"{server.kind} not ready after {READY_TIMEOUT}s: {server.log.read_text()[-2000:]}")


def _spawn(kind: str, args: list[str], log: Path, port: int, root: Path | None = None) -> Server:
    out = open(log, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **S3_ENV},
    )
    out.close()
    return Server(kind, proc, port, log, root)


def start_moto(workdir: Path) -> Server:
    port = free_port()
    server = _spawn(
        "moto_server", ["moto.server", "-H", "127.0.0.1", "-p", str(port)], workdir / f"moto-{port}.log", port
    )
    return _wait_ready(server, "/moto-api/")


def start_webdav(workdir: Path) -> Server:
    port = free_port()
    root = workdir / f"dav-{port}"
    root.mkdir(parents=True)
    server = _spawn(
        "wsgidav",
        [
            "wsgidav.server.server_cli",
            "-H",
            "127.0.0.1",
            "-p",
            str(port),
            "-r",
            str(root),
            "--auth",
            "anonymous",
            "--no-config",
            "-q",
        ],
        workdir / f"dav-{port}.log",
        port,
        root,
    )
    return _wait_ready(server, "/")
