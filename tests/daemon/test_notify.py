"""sd_notify over a real datagram socket (path and abstract), and the watchdog interval."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

from adstore.daemon.notify import Notifier, watchdog_interval


def _recv(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.splitlines())


def test_path_socket(tmp_path: Path) -> None:
    path = tmp_path / "n.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    n = Notifier.from_env({"NOTIFY_SOCKET": str(path)})
    assert n.enabled
    assert n.ready(status="size 1 B")
    assert _recv(sock) == {"READY": "1", "MAINPID": str(os.getpid()), "STATUS": "size 1 B"}
    assert n.watchdog() and _recv(sock) == {"WATCHDOG": "1"}
    assert n.status("multi\nline") and _recv(sock) == {"STATUS": "multi line"}
    assert n.reloading()
    msg = _recv(sock)
    assert msg["RELOADING"] == "1" and int(msg["MONOTONIC_USEC"]) > 0
    assert n.stopping() and _recv(sock) == {"STOPPING": "1"}
    n.close()
    sock.close()


def test_abstract_socket() -> None:
    name = f"adstore-notify-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    n = Notifier(address="@" + name)
    assert n.ready()
    assert _recv(sock)["READY"] == "1"
    sock.close()


def test_no_socket_is_a_no_op_and_a_vanished_socket_is_not_fatal(tmp_path: Path) -> None:
    assert not Notifier.from_env({}).ready()
    gone = Notifier(address=str(tmp_path / "nobody-listens.sock"))
    assert gone.enabled and not gone.watchdog()  # logged, not raised


def test_watchdog_interval() -> None:
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "60000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}) == 0.5
    assert watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval({"WATCHDOG_USEC": "zero"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None


def test_a_full_notify_queue_never_blocks(tmp_path: Path) -> None:

    path = tmp_path / "full.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))  # bound but never read, like a stalled supervisor
    n = Notifier(address=str(path))
    results = [n.status("x" * 200) for _ in range(5000)]  # a blocking send would hang here (pytest-timeout)
    assert results[0] and not all(results)  # the queue filled up and later sends were dropped
    sock.close()
