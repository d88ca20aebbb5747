"""The S3 backend: ``s3://BUCKET/PREFIX`` through boto3 (imported on the first request).

Endpoint, credentials and region come from boto3's own environment and
config files (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...), so AWS S3, MinIO,
Ceph RGW and other S3-compatible servers work unchanged (docs/remote.md, "Setting
up a server").  Every request has botocore's connect and read timeouts and, by
default, no retry: the circuit breaker above is the retry policy, and a
retry would multiply the time a dead server costs.  Blobs are sent with
their SHA-256 as ``ChecksumSHA256``, so a server that checks it refuses a
body damaged in transit.  Downloads are not checked by botocore (since
1.36 it hashes every body that carries a CRC32 or SHA-256 checksum): the
layer above verifies each blob against its SHA-256 and each record by its
signature, so that second pass over the bytes only cost time (about 15%
of a 64 MiB download) and reported damage as a botocore error instead of
``remote_checksum``.  ``put_if_absent`` is S3's conditional write
(``If-None-Match: *``), atomic on AWS S3 and MinIO; emulators such as moto
check and write in two steps.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import importlib.util
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

from ..codec import Encoding
from ..errors import AdstoreError, ConfigError, MissingExtra
from ..names import is_digest
from .addresses import Kind, object_name
from .backend import (
    CHUNK,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_READ_TIMEOUT,
    Body,
    ConditionalWrites,
    RemoteBackend,
    body_size,
    copy_limited,
    status_error,
    transport_error,
)
from .calls import interruptible
from .errors import NotSupported, RemoteChecksumMismatch, RemoteProtocolError, RemoteRejected, RemoteTimeout

__all__ = ["S3Backend", "parse_s3_url"]

log = logging.getLogger(__name__)

#: Above this a file body goes up as a multipart upload (one PUT takes at most 5 GiB).
DEFAULT_MULTIPART_THRESHOLD = 4 << 30


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` → ``("bucket", "some/prefix")``."""
    if not url.startswith("s3://"):
        raise ConfigError("ADSTORE_REMOTE", f"{url!r} is not an s3:// URL")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise ConfigError("ADSTORE_REMOTE", f"{url!r} names no bucket (s3://BUCKET/PREFIX)")
    return bucket, prefix.strip("/")


def _import_boto3() -> tuple[Any, Any]:
    try:
        import boto3
        import botocore.config
    except ImportError as exc:
        raise MissingExtra("an s3:// remote", "boto3", "remote") from exc
    return boto3, botocore.config


def _make_client(
    *, connect_timeout: float, read_timeout: float, retries: int, max_connections: int, endpoint_url: str | None
) -> Any:
    boto3, config = _import_boto3()
    options: dict[str, Any] = {}
    if "response_checksum_validation" in config.Config.OPTION_DEFAULTS:  # botocore >= 1.36
        options["response_checksum_validation"] = "when_required"  # verified above us (module docstring)
    cfg = config.Config(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"total_max_attempts": retries + 1, "mode": "standard"},
        max_pool_connections=max_connections,
        **options,
    )
    # A session per backend: boto3's default session is not thread-safe to create clients from.
    client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=cfg)
    # botocore sends file bodies with "Expect: 100-continue" and waits up to one second for
    # the "100 Continue": a hung server would cost that second on top of the read timeout.
    import botocore.handlers

    client.meta.events.unregister("before-call.s3", botocore.handlers.add_expect_header)
    return client


def _missing(exc: Any) -> bool:
    """A ClientError that says the object does not exist."""
    err = exc.response.get("Error", {})
    return err.get("Code") in ("404", "NoSuchKey", "NotFound") or _status(exc) == 404


def _status(exc: Any) -> int | None:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


class S3Backend(RemoteBackend):
    """Objects ``PREFIX/cas/<sha256>`` and ``PREFIX/ac/<sha256>`` in one bucket."""

    conditional_writes = ConditionalWrites.ATOMIC
    transfer = Encoding.ZSTD  # objects are the store's own: compressed blobs travel as their files

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        retries: int = 0,
        endpoint_url: str | None = None,
        max_connections: int = 16,
        send_checksums: bool = True,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        client: Any = None,
    ) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.send_checksums = send_checksums
        self.multipart_threshold = multipart_threshold
        if importlib.util.find_spec("boto3") is None:  # refused at open, as a bad URL is; imported on first use
            raise MissingExtra("an s3:// remote", "boto3", "remote")
        self._make = functools.partial(
            _make_client,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries=retries,
            max_connections=max_connections,
            endpoint_url=endpoint_url,
        )
        self._made: Any = client
        self._lock = threading.Lock()

    # -- helpers ---------------------------------------------------------
    @property
    def _client(self) -> Any:
        """boto3's client, made on the first request: a process whose lookups all hit locally
        (a warm restart with a remote configured) never pays boto3's import and client set-up."""
        with self._lock:
            if self._made is None:
                self._made = self._make()
            return self._made

    @property
    def _exc(self) -> Any:
        import botocore.exceptions

        return botocore.exceptions

    @property
    def _parser_error(self) -> Any:
        import botocore.parsers

        return botocore.parsers.ResponseParserError

    def _key(self, kind: Kind, digest: str) -> str:
        name = object_name(kind, digest)
        return f"{self.prefix}/{name}" if self.prefix else name

    @contextlib.contextmanager
    def _translated(self, op: str, key: str) -> Iterator[None]:
        """botocore's exceptions → the remote tier's errors."""
        exc_mod = self._exc
        try:
            yield
        except exc_mod.ClientError as exc:
            err = exc.response.get("Error", {})
            raise status_error(
                _status(exc) or 0, f"{err.get('Code', '')} {err.get('Message', '')}".strip(), op=op, target=key
            ) from exc
        except (exc_mod.ConnectTimeoutError, exc_mod.ReadTimeoutError) as exc:
            raise RemoteTimeout(str(exc), op=op, target=key) from exc
        except (exc_mod.ConnectionError, exc_mod.HTTPClientError, exc_mod.IncompleteReadError) as exc:
            raise transport_error(exc, op=op, target=key) from exc
        except exc_mod.BotoCoreError as exc:  # no credentials, bad parameters: the request cannot be made
            raise RemoteRejected(str(exc), op=op, target=key) from exc
        except OSError as exc:  # a socket error that escaped botocore's wrapping while streaming
            raise transport_error(exc, op=op, target=key) from exc
        except AdstoreError:
            raise
        except (ValueError, self._parser_error) as exc:  # botocore could not parse the answer (Content-Length: ²)
            raise RemoteProtocolError(f"unparseable answer: {exc}", op=op, target=key) from exc

    def _unless_missing(self, call: Any, key: str) -> Any:
        """``call(Bucket=, Key=)``'s answer, or None when S3 says the object does not exist."""
        try:
            return call(Bucket=self.bucket, Key=key)
        except self._exc.ClientError as exc:
            if _missing(exc):
                return None
            raise

    def _checksum(self, kind: Kind, digest: str) -> dict[str, str]:
        if kind is Kind.CAS and self.send_checksums:
            return {"ChecksumSHA256": base64.b64encode(bytes.fromhex(digest)).decode()}
        return {}

    # -- the interface ---------------------------------------------------
    def get_to(self, kind: Kind, digest: str, fileobj: BinaryIO, max_bytes: int) -> int | None:
        key = self._key(kind, digest)
        with self._translated("get", key):
            resp = self._unless_missing(self._client.get_object, key)
            if resp is None:
                return None
            body = resp["Body"]
            try:
                length = resp.get("ContentLength")
                if length is not None and length > max_bytes:
                    raise RemoteChecksumMismatch(digest, expected_size=max_bytes, got_size=length, got_digest=None)
                with interruptible(self._cut(body)):
                    return copy_limited(body.iter_chunks(CHUNK), fileobj, max_bytes=max_bytes, digest=digest)
            finally:
                body.close()

    @staticmethod
    def _cut(body: Any) -> Any:
        """How to cut short the call reading ``body``: shut its socket down (a request still waiting for its
        headers cannot be reached through botocore: its read timeout, at most the deadline, ends it)."""

        def cut() -> None:
            conn = getattr(getattr(body, "_raw_stream", None), "connection", None)
            sock = getattr(conn, "sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        return cut

    def put(self, kind: Kind, digest: str, data: Body) -> int:
        key = self._key(kind, digest)
        size = body_size(data)
        with self._translated("put", key):
            if size > self.multipart_threshold and not isinstance(data, (bytes, bytearray, memoryview)):
                from boto3.s3.transfer import TransferConfig

                self._client.upload_fileobj(
                    data, self.bucket, key, Config=TransferConfig(multipart_threshold=self.multipart_threshold)
                )
            else:
                body = bytes(data) if isinstance(data, (bytearray, memoryview)) else data
                self._client.put_object(
                    Bucket=self.bucket, Key=key, Body=body, ContentLength=size, **self._checksum(kind, digest)
                )
        return size

    def head(self, kind: Kind, digest: str) -> int | None:
        key = self._key(kind, digest)
        with self._translated("head", key):
            resp = self._unless_missing(self._client.head_object, key)
            return None if resp is None else int(resp["ContentLength"])

    def put_if_absent(self, kind: Kind, digest: str, data: Body) -> bool:
        key = self._key(kind, digest)
        size = body_size(data)
        with self._translated("put_if_absent", key):
            try:
                self._client.put_object(
                    Bucket=self.bucket,
                    Key=key,
                    Body=data,
                    ContentLength=size,
                    IfNoneMatch="*",
                    **self._checksum(kind, digest),
                )
            except self._exc.ClientError as exc:
                status = _status(exc)
                if status in (409, 412):  # exists, or a concurrent conditional write won
                    return False
                if status == 501:
                    raise NotSupported(self.url, "put_if_absent (If-None-Match)") from exc
                raise
        return True

    def list_digests(self, kind: Kind) -> list[str]:
        prefix = f"{self.prefix}/{kind.value}/" if self.prefix else f"{kind.value}/"
        found: list[str] = []
        with self._translated("list", prefix):
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", ()):
                    name = str(obj.get("Key", ""))[len(prefix) :]
                    if is_digest(name):
                        found.append(name)
        return sorted(found)

    def delete(self, kind: Kind, digest: str) -> None:
        key = self._key(kind, digest)
        with self._translated("delete", key):
            self._client.delete_object(Bucket=self.bucket, Key=key)

    def close(self) -> None:
        if self._made is not None:  # never made (no request was sent): nothing to close
            with contextlib.suppress(Exception):
                self._made.close()
