"""Numbers from the wire are ASCII digits: a ``Content-Length: ²`` is a protocol failure of the remote.

``"²".isdigit()`` is true and ``int("²")`` raises: a real server on
127.0.0.1 (``remote_faultserver``) answers with that header, over the Bazel
HTTP protocol and to boto3's S3 client.  The outcome is a clean
``remote_error`` that opens the circuit like any failing server, never an
"unexpected" error log with the circuit left closed.
"""

from __future__ import annotations

import hashlib
import logging

import pytest
from remote_faultserver import FaultServer
from remote_servers import S3_ENV

from adstore.store.remote import RemoteProtocolError, open_remote


@pytest.fixture
def server():
    s = FaultServer(prefix="bucket/p")  # also the path of s3://bucket/p, path-style
    yield s
    s.close()


@pytest.mark.parametrize("op", ["get", "head"])
@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_a_content_length_that_is_not_ascii_digits_is_a_remote_failure(scheme, op, server, monkeypatch, caplog):
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    data = b"not a number of bytes"
    digest = hashlib.sha256(data).hexdigest()
    server.objects[f"cas/{digest}"] = data
    server.fault(f"cas/{digest}", "superscript_length")
    if scheme == "s3":
        r = open_remote("s3://bucket/p", deadline=10, cooldown=60, endpoint_url=f"http://127.0.0.1:{server.port}")
    else:
        r = open_remote(server.url, deadline=10, cooldown=60)
    try:
        with caplog.at_level(logging.DEBUG, logger="adstore"):
            out = r.get("cas", digest) if op == "get" else r.head("cas", digest)
        assert out.reason == "remote_error"
        assert isinstance(out.error, RemoteProtocolError), out.error
        assert r.refusal() is not None  # the circuit opened: a server that garbles answers is a failing server
        assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    finally:
        r.close()
