"""The HTTP backend: the Bazel remote-cache protocol over ``http(s)://HOST:PORT/PREFIX``.

``GET``/``PUT``/``HEAD`` ``{prefix}/cas/<sha256>`` for blobs and
``{prefix}/ac/<sha256>`` for records, so bazel-remote, nginx with WebDAV or
any WebDAV server can hold a remote (docs/remote.md, "Setting up a server").  On a WebDAV
server a PUT into a missing collection answers 409; the backend then creates
the collections (``MKCOL``) once and retries.

Why the standard library (``http.client``) and not ``requests``: the tier
must not add a dependency for HTTP; ``http.client`` gives separate connect
and read timeouts (the socket's timeout is switched after connecting),
streams request and response bodies in bounded chunks, and keeps one
keep-alive connection per thread, which is all a cache client needs.

``list`` (``adstore pull --all``) asks a WebDAV server for the members of
``{prefix}/ac/`` (``PROPFIND``, ``Depth: 1``); a server that does not speak
WebDAV (bazel-remote) answers it with an error: ``remote_unsupported``.

``put_if_absent`` sends ``If-None-Match: *``.  Whether that is honoured, and
atomically, is the server's business: wsgidav answers 412 for an existing
object but checks and writes in two steps; bazel-remote ignores the header.
Single-flight confirms a lease by reading it back for that reason.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import logging
import re
import socket
import threading
import urllib.parse
import weakref
from collections.abc import Callable
from typing import Any, BinaryIO
from xml.etree import ElementTree

from ..errors import ConfigError
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
from .errors import NotSupported, RemoteChecksumMismatch, RemoteError, RemoteProtocolError

__all__ = ["HttpBackend"]

log = logging.getLogger(__name__)

#: A Content-Length: ASCII digits only (``str.isdigit`` also takes "²" and "٣", which ``int`` refuses or reads).
_LENGTH = re.compile(r"[0-9]{1,19}", re.ASCII)

#: A WebDAV listing asks for no property: the names (``href``) are all ``list`` needs.
_PROPFIND = b'<?xml version="1.0" encoding="utf-8"?><propfind xmlns="DAV:"><propname/></propfind>'
#: Largest listing read: about 150 bytes a member, so a million records.
_LISTING_LIMIT = 256 << 20

_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
_ERROR_BODY_LIMIT = 64 << 10


def _content_length(resp: http.client.HTTPResponse, *, op: str, target: str) -> int | None:
    """The answer's Content-Length (None without one); RemoteProtocolError unless it is ASCII digits."""
    value = resp.getheader("Content-Length")
    if value is None:
        return None
    if _LENGTH.fullmatch(value.strip()) is None:
        raise RemoteProtocolError(f"Content-Length {value[:40]!r} is not a number", op=op, target=target)
    return int(value)


class _Timeouts:
    """Connect with the connect timeout, then read and write with the read timeout."""

    read_timeout: float
    sock: Any

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self.sock.settimeout(self.read_timeout)


class _HTTP(_Timeouts, http.client.HTTPConnection):
    pass


class _HTTPS(_Timeouts, http.client.HTTPSConnection):
    pass


def _hrefs(body: bytes, path: str) -> list[str]:
    """The digests named by the ``href`` elements of a WebDAV multistatus answer (the collection itself is not one)."""
    try:
        root = ElementTree.fromstring(body)  # expat refuses entity expansion bombs since Python 3.7.1 / expat 2.4
    except ElementTree.ParseError as exc:
        raise RemoteProtocolError(f"unparseable PROPFIND answer: {exc}", op="PROPFIND", target=path) from exc
    found = set()
    for href in root.iter("{DAV:}href"):
        name = urllib.parse.unquote(urllib.parse.urlsplit((href.text or "").strip()).path).rstrip("/").rsplit("/", 1)
        if is_digest(name[-1]):
            found.add(name[-1])
    return sorted(found)


class HttpBackend(RemoteBackend):
    """A Bazel-protocol HTTP cache (bazel-remote, nginx, a WebDAV server)."""

    conditional_writes = ConditionalWrites.SERVER_DEPENDENT

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        headers: dict[str, str] | None = None,
        ssl_context: Any = None,
        create_collections: bool = True,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("ADSTORE_REMOTE", f"{url!r} is not an http(s)://HOST[:PORT]/PREFIX URL")
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
        self.url = urllib.parse.urlunsplit((parts.scheme, netloc, self._prefix, "", ""))
        self._headers = {"User-Agent": "adstore", **(headers or {})}
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self._headers["Authorization"] = f"Basic {token}"
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._ssl_context = ssl_context
        self._create_collections = create_collections
        self._collections: set[str] = set()
        self._local = threading.local()
        # Weak: a thread's connection goes (and its socket closes) with the thread.
        self._all: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()
        self._lock = threading.Lock()

    # -- connections -----------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._scheme == "https":
                conn = _HTTPS(
                    self._host, self._port, timeout=self._connect_timeout, blocksize=CHUNK, context=self._ssl_context
                )
            else:
                conn = _HTTP(self._host, self._port, timeout=self._connect_timeout, blocksize=CHUNK)
            conn.read_timeout = self._read_timeout
            self._local.conn = conn
            with self._lock:
                self._all.add(conn)
        return conn

    def _cut(self, conn: http.client.HTTPConnection) -> Callable[[], None]:
        """How to cut short the call that uses ``conn``: shut its socket down, so a blocked read returns."""

        def cut() -> None:
            sock = getattr(conn, "sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        return cut

    def _interruptible(self) -> contextlib.AbstractContextManager[None]:
        """The block of one request and its answer: a deadline that passes cuts this thread's connection."""
        return interruptible(self._cut(self._conn()))

    def _drop(self) -> None:
        """Close this thread's connection (after an error or an unread body)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()

    def _path(self, kind: Kind, digest: str) -> str:
        return f"{self._prefix}/{object_name(kind, digest)}"

    def _request(
        self, method: str, path: str, *, body: Body | None = None, headers: dict[str, str] | None = None
    ) -> http.client.HTTPResponse:
        """Send one request; a keep-alive connection the server had closed is retried once."""
        hdrs = {**self._headers, **(headers or {})}
        start = None if body is None or isinstance(body, (bytes, bytearray, memoryview)) else body.tell()
        if body is not None:
            hdrs["Content-Length"] = str(body_size(body))
            hdrs.setdefault("Content-Type", "application/octet-stream")
        for attempt in (0, 1):
            conn = self._conn()
            reused = conn.sock is not None
            try:
                if start is not None:
                    body.seek(start)  # type: ignore[union-attr]
                conn.request(method, path, body=body, headers=hdrs)
                return conn.getresponse()
            except _STALE as exc:
                self._drop()
                if reused and attempt == 0:
                    log.debug("remote %s %s: stale keep-alive connection (%s), retrying once", method, path, exc)
                    continue
                raise transport_error(exc, op=method, target=path) from exc
            except (OSError, http.client.HTTPException) as exc:
                self._drop()
                raise transport_error(exc, op=method, target=path) from exc
        raise AssertionError("unreachable")

    def _finish(self, resp: http.client.HTTPResponse) -> bytes:
        """Read a (small) answer body so the connection can be reused; drop it if too long."""
        try:
            data = resp.read(_ERROR_BODY_LIMIT)
        except (OSError, http.client.HTTPException):
            data = b""
        if not resp.isclosed():
            self._drop()
        return data

    def _call(self, method: str, path: str, *, body: Body | None = None, headers: dict[str, str] | None = None) -> int:
        """A request whose answer is only a status."""
        with self._interruptible():
            resp = self._request(method, path, body=body, headers=headers)
            try:
                self._finish(resp)
            finally:
                resp.close()
        return resp.status

    def _fail(self, status: int, method: str, path: str, reason: str = "") -> RemoteError:
        return status_error(status, reason, op=method, target=path)

    # -- WebDAV collections ------------------------------------------------
    def _mkcols(self, kind: Kind) -> None:
        """Create ``{prefix}`` and ``{prefix}/{kind}`` collections, once per backend.

        A MKCOL that fails is not an error in itself: another host creating
        the same collection at the same moment can make a server answer 500
        (wsgidav does); the PUT retried after it is the judge.
        """
        parts = [p for p in f"{self._prefix}/{kind.value}".split("/") if p]
        for i in range(1, len(parts) + 1):
            path = "/" + "/".join(parts[:i])
            if path in self._collections:
                continue
            status = self._call("MKCOL", path)
            if status in (200, 201, 204, 405):  # 405: it exists
                self._collections.add(path)
            else:
                log.debug("remote MKCOL %s: HTTP %d (a concurrent creator?); retrying the PUT anyway", path, status)

    def _put(self, kind: Kind, digest: str, data: Body, headers: dict[str, str] | None = None) -> int:
        path = self._path(kind, digest)
        start = None if isinstance(data, (bytes, bytearray, memoryview)) else data.tell()
        status = self._call("PUT", path, body=data, headers=headers)
        if status == 409 and self._create_collections:
            self._mkcols(kind)
            if start is not None:
                data.seek(start)  # type: ignore[union-attr]
            status = self._call("PUT", path, body=data, headers=headers)
        return status

    # -- the interface ---------------------------------------------------
    def get_to(self, kind: Kind, digest: str, fileobj: BinaryIO, max_bytes: int) -> int | None:
        with self._interruptible():
            return self._get_to(kind, digest, fileobj, max_bytes)

    def _get_to(self, kind: Kind, digest: str, fileobj: BinaryIO, max_bytes: int) -> int | None:
        path = self._path(kind, digest)
        resp = self._request("GET", path)
        try:
            if resp.status == 404:
                self._finish(resp)
                return None
            if resp.status != 200:
                self._finish(resp)
                raise self._fail(resp.status, "GET", path, resp.reason)
            try:
                length = _content_length(resp, op="GET", target=path)
            except RemoteProtocolError:
                self._drop()
                raise
            if length is not None and length > max_bytes:
                self._drop()
                raise RemoteChecksumMismatch(digest, expected_size=max_bytes, got_size=length, got_digest=None)
            # read1: what the socket has now, up to a chunk (read() would wait for a whole chunk), so
            # bytes reach the sink as they arrive and a cancelled sink stops the download at once.
            read: Callable[[], bytes] = lambda: resp.read1(CHUNK)  # noqa: E731
            try:
                n = copy_limited(iter(read, b""), fileobj, max_bytes=max_bytes, digest=digest)
                if length is not None and n != length:  # read(amt) does not say
                    raise http.client.IncompleteRead(b"", length - n)
                return n
            except (OSError, http.client.HTTPException) as exc:
                self._drop()
                raise transport_error(exc, op="GET", target=path) from exc
            except BaseException:
                self._drop()
                raise
        finally:
            resp.close()

    def put(self, kind: Kind, digest: str, data: Body) -> int:
        size = body_size(data)
        status = self._put(kind, digest, data)
        if status not in (200, 201, 204):
            raise self._fail(status, "PUT", self._path(kind, digest))
        return size

    def head(self, kind: Kind, digest: str) -> int | None:
        path = self._path(kind, digest)
        with self._interruptible():
            resp = self._request("HEAD", path)
            try:
                self._finish(resp)
            finally:
                resp.close()
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise self._fail(resp.status, "HEAD", path, resp.reason)
        length = _content_length(resp, op="HEAD", target=path)
        return 0 if length is None else length

    def put_if_absent(self, kind: Kind, digest: str, data: Body) -> bool:
        status = self._put(kind, digest, data, headers={"If-None-Match": "*"})
        if status == 412:
            return False
        if status not in (200, 201, 204):
            raise self._fail(status, "PUT", self._path(kind, digest))
        return True

    def list_digests(self, kind: Kind) -> list[str]:
        path = f"{self._prefix}/{kind.value}/"
        with self._interruptible():
            resp = self._request("PROPFIND", path, body=_PROPFIND, headers={"Depth": "1", "Content-Type": "text/xml"})
            try:
                if resp.status == 404:
                    self._finish(resp)
                    return []
                if resp.status in (400, 403, 405, 501):  # not a WebDAV server: no listing
                    self._finish(resp)
                    raise NotSupported(self.url, f"listing {kind.value}/ (PROPFIND answered HTTP {resp.status})")
                if resp.status != 207:
                    self._finish(resp)
                    raise self._fail(resp.status, "PROPFIND", path, resp.reason)
                try:
                    body = resp.read(_LISTING_LIMIT + 1)
                except (OSError, http.client.HTTPException) as exc:
                    self._drop()
                    raise transport_error(exc, op="PROPFIND", target=path) from exc
                if not resp.isclosed():
                    self._drop()
            finally:
                resp.close()
        if len(body) > _LISTING_LIMIT:
            raise RemoteProtocolError(f"listing larger than {_LISTING_LIMIT} bytes", op="PROPFIND", target=path)
        return _hrefs(body, path)

    def delete(self, kind: Kind, digest: str) -> None:
        path = self._path(kind, digest)
        status = self._call("DELETE", path)
        if status not in (200, 202, 204, 404):
            raise self._fail(status, "DELETE", path)

    def close(self) -> None:
        with self._lock:
            conns = list(self._all)
            self._all.clear()
        for conn in conns:
            conn.close()
