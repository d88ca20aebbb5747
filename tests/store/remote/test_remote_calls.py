"""Bounded calls: a process exits whatever a server does, and a call's own error stays its own.

A real endpoint on 127.0.0.1 that accepts connections and never answers
(``remote_hung``) stands for a hung server; a real child process looks a key
up against it through ``Store.from_env`` and must exit once its lookup gave
up, whether the call it abandoned cannot be reached (S3 waiting for
response headers) or never ends at all (a user's backend with no timeout).  No wall clock is compared: the bound is the
subprocess timeout, far below what the abandoned calls would take.
"""

from __future__ import annotations

import hashlib
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
from remote_faultserver import FaultServer
from remote_hung import HungEndpoint
from remote_servers import S3_ENV

from adstore.store.remote import HttpBackend, Kind, Remote, open_remote

#: Far below what the abandoned calls take (a 600 s read timeout, or forever), far above a process's start.
CHILD_TIMEOUT = 60


@pytest.fixture
def hung():
    endpoint = HungEndpoint()
    yield endpoint
    endpoint.close()


@pytest.mark.parametrize("scheme", ["s3", "blocking"])
def test_a_process_exits_after_its_deadline_whatever_the_server_does(scheme, hung, tmp_path):
    url = {
        "s3": "s3://bucket/prefix",  # waiting for response headers: botocore's socket is out of reach
        "blocking": f"blocking://127.0.0.1:{hung.port}/prefix",  # a call with no timeout that nothing interrupts
    }[scheme]
    env = {
        **os.environ,
        **S3_ENV,
        "AWS_ENDPOINT_URL": hung.endpoint,
        "ADSTORE_REMOTE": url,
        "ADSTORE_REMOTE_DEADLINE": "0.5",
        "ADSTORE_REMOTE_TIMEOUT": "600",  # the socket's own timeout would keep a joined worker for 10 minutes
    }
    child = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("remote_hung.py")), str(tmp_path / "store")],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split()[0] == "remote_timeout", child.stdout


@pytest.mark.parametrize("scheme", ["s3", "http"])
def test_no_socket_wait_outlives_the_deadline(scheme, hung):
    if scheme == "s3":
        r = open_remote("s3://bucket/prefix", timeout=600, connect_timeout=20, deadline=0.5, endpoint_url=hung.endpoint)
    else:
        r = open_remote(f"{hung.endpoint}/prefix", timeout=600, connect_timeout=20, deadline=0.5)
    try:
        if scheme == "s3":
            config = r.backend._client.meta.config
            got = (config.connect_timeout, config.read_timeout)
        else:
            got = (r.backend._connect_timeout, r.backend._read_timeout)
        assert got == (0.5, 0.5)
    finally:
        r.close()


class OwnTimeout(HttpBackend):
    """A real HTTP backend whose HEAD, once answered, fails with a socket timeout of its own."""

    def head(self, kind, digest):
        super().head(kind, digest)  # a real request: this thread's keep-alive connection is open and idle
        self.used = self._local.conn
        raise TimeoutError("the backend's own read timed out")


def test_a_timeout_of_the_call_itself_is_its_own_and_interrupts_nothing():
    server = FaultServer()
    try:
        backend = OwnTimeout(server.url)
        r = Remote(backend)  # a deadline of 30 s
        out = r.head(Kind.AC, hashlib.sha256(b"x").hexdigest())
        assert out.reason == "remote_timeout"
        assert "the backend's own read timed out" in str(out.error)
        assert "deadline" not in str(out.error)
        # Nothing was cut: the connection the call used (and the next call on that thread reuses) is intact.
        readable, _, _ = select.select([backend.used.sock], [], [], 0)
        assert readable == []  # idle and open; a shut-down socket would be readable at once (EOF)
        r.close()
    finally:
        server.close()
