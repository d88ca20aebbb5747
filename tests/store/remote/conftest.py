"""Fixtures of the remote-tier tests: session servers, fresh remotes, keys.

The S3 and WebDAV servers start once per session (separate processes on
127.0.0.1, killed at teardown); each test gets its own prefix on them, so
tests never see each other's objects.  ``private_server`` starts a server a
test may kill or stop.
"""

from __future__ import annotations

import os
import uuid

import boto3
import pytest
from remote_servers import BUCKET, S3_ENV, start_moto, start_webdav

from adstore.store.remote import MemoryBackend, Signer, TrustedKeys, generate_keypair, open_remote


@pytest.fixture(scope="session")
def s3_env(tmp_path_factory):
    """boto3's standard environment pointing at a session moto server."""
    saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL"]}
    server = start_moto(tmp_path_factory.mktemp("moto"))
    os.environ.update(S3_ENV)
    os.environ["AWS_ENDPOINT_URL"] = server.endpoint
    boto3.session.Session().client("s3").create_bucket(Bucket=BUCKET)
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def dav_server(tmp_path_factory):
    server = start_webdav(tmp_path_factory.mktemp("dav"))
    yield server
    server.stop()


@pytest.fixture
def s3_url(s3_env):
    return f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def http_url(dav_server):
    return f"{dav_server.endpoint}/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def memory_url():
    return f"memory://t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["s3", "http", "memory"])
def remote_url(request):
    """One URL per backend: the contract suite runs against each."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture(scope="session")
def keypair():
    return generate_keypair()


@pytest.fixture
def signer(keypair):
    return Signer.from_pem(keypair.private_pem)


@pytest.fixture
def trusted(keypair):
    return TrustedKeys.from_pem(keypair.public_pem)


@pytest.fixture
def writer(remote_url, signer, trusted):
    """A read-write Remote (signing and trusting the session key) on each backend."""
    r = open_remote(remote_url, mode="read-write", timeout=5, connect_timeout=2, signer=signer, trusted=trusted)
    yield r
    r.close()


@pytest.fixture
def memory():
    return MemoryBackend()


@pytest.fixture
def private_server(tmp_path, monkeypatch):
    """``private_server("s3" | "http")``: a server of the test's own, stopped at teardown."""
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    started = []

    def start(kind: str):
        server = start_moto(tmp_path) if kind == "s3" else start_webdav(tmp_path)
        started.append(server)
        if kind == "s3":
            boto3.session.Session().client("s3", endpoint_url=server.endpoint, **_creds()).create_bucket(Bucket=BUCKET)
        return server

    yield start
    for server in started:
        server.stop()


def _creds() -> dict[str, str]:
    return {
        "aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
        "region_name": S3_ENV["AWS_DEFAULT_REGION"],
    }
