"""Shared helpers for the daemon and CLI tests: real stores, real processes,
and a real sd_notify socket bound by the test (as systemd would)."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from adstore.store import Store

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
UNIT = REPO / "systemd" / "adstore.service"
PROCS = HERE / "procs.py"


def key_for(prefix: str, i: int) -> str:
    """Same keys as ``procs.py write`` produces."""
    return hashlib.sha256(f"{prefix}-{i}".encode()).hexdigest()


class NotifyListener:
    """An AF_UNIX datagram socket standing in for systemd's notify socket."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.05)
        self.messages: list[dict[str, str]] = []

    def poll(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, BlockingIOError):
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append(fields)

    def wait_for(
        self, pred: Callable[[dict[str, str]], bool], timeout: float = 20.0, proc: subprocess.Popen | None = None
    ) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            self.poll()
            for msg in self.messages[seen:]:
                if pred(msg):
                    return msg
            seen = len(self.messages)
            if proc is not None and proc.poll() is not None:
                self.poll()
                for msg in self.messages[seen:]:
                    if pred(msg):
                        return msg
                raise AssertionError(
                    f"daemon exited with {proc.returncode} before the expected message; got {self.messages}"
                )
        raise AssertionError(f"no matching notify message within {timeout}s; got {self.messages}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifyListener]:
    path = tmp_path / "notify.sock"
    address = str(path) if len(str(path)) < 100 else f"@adstore-test-{uuid.uuid4().hex}"
    listener = NotifyListener(address)
    yield listener
    listener.close()


def exec_start_argv() -> list[str]:
    """The unit's ExecStart command line, split like systemd does."""
    for line in UNIT.read_text().splitlines():
        if line.startswith("ExecStart="):
            return shlex.split(line.split("=", 1)[1])
    raise AssertionError("unit has no ExecStart")


def daemon_argv(config: Path, root: Path, *extra: str) -> list[str]:
    """ExecStart with the test's config and root substituted, nothing else changed."""
    argv = exec_start_argv()
    out = []
    it = iter(argv)
    for arg in it:
        out.append(arg)
        if arg == "--config":
            next(it)
            out.append(str(config))
        elif arg == "--root":
            next(it)
            out.append(str(root))
    return out + list(extra)


def write_config(path: Path, **settings: object) -> Path:
    lines = []
    for name, value in settings.items():
        if isinstance(value, str):
            lines.append(f'{name} = "{value}"')
        else:
            lines.append(f"{name} = {value}")
    path.write_text("\n".join(lines) + "\n")
    return path


class DaemonProcess:
    """One ``adstore daemon`` subprocess; stderr goes to a file the test can read."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(
        config: Path,
        root: Path,
        *extra: str,
        notify: NotifyListener | None = None,
        watchdog_usec: int | None = None,
        env: dict[str, str] | None = None,
    ) -> DaemonProcess:
        environ = dict(os.environ)
        environ.pop("NOTIFY_SOCKET", None)
        environ.pop("WATCHDOG_USEC", None)
        environ.pop("WATCHDOG_PID", None)
        if notify is not None:
            environ["NOTIFY_SOCKET"] = notify.address
        if watchdog_usec is not None:
            environ["WATCHDOG_USEC"] = str(watchdog_usec)
        environ.update(env or {})
        d = DaemonProcess(daemon_argv(config, root, *extra), environ, tmp_path / f"daemon-{len(started)}.log")
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


def run_writer(
    root: Path,
    *,
    count: int,
    size: int,
    prefix: str,
    world_size: int = 1,
    delay: float = 0.0,
    grace_period: float = 3600.0,
    wait: bool = True,
) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(PROCS),
            "write",
            str(root),
            "--count",
            str(count),
            "--size",
            str(size),
            "--prefix",
            prefix,
            "--world-size",
            str(world_size),
            "--delay",
            str(delay),
            "--grace-period",
            str(grace_period),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    if wait:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
    return proc


def populate(root: Path, *, count: int, size: int, prefix: str, world_size: int = 1, age: float = 0.0) -> list[str]:
    """Write entries in this process (faster than a subprocess for setup), ``age`` seconds in the past."""
    keys = []
    with Store.open(root, clock=lambda: time.time() - age) as store:
        for i in range(count):
            key = key_for(prefix, i)
            gen = store.new_generation()
            for rank in range(world_size):
                ref = store.put_bytes(os.urandom(size))
                store.publish(
                    key,
                    rank=rank,
                    world_size=world_size,
                    generation=gen,
                    artifacts={"module.pt": ref},
                    namespace="pipeline",
                    components={"model": {"prefix": prefix, "i": i}},
                )
            for rank in range(world_size):
                store.commit(key, rank=rank, generation=gen)
            keys.append(key)
    return keys


def store_size(root: Path) -> int:
    with Store.open(root) as store:
        return store.size()


def wait_until(pred: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> float:
    """Seconds until ``pred()`` held; fails the test on timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if pred():
            return time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs (root only; skipped with the reason otherwise): the kernel says ENOSPC."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs ({res.stderr.strip() or res.returncode}); run as root")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill_to_the_last_byte(path: Path) -> Path:
    """Take every free byte of ``path``'s filesystem with one file (unbuffered: no short write left over)."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
    assert shutil.disk_usage(path).free == 0
    return filler


def run_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m adstore.daemon ARGV`` in a child process (the installed CLI, whatever PATH says)."""
    return subprocess.run(
        [sys.executable, "-m", "adstore.daemon", *argv], capture_output=True, text=True, timeout=timeout
    )
