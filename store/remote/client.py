"""The public layer of the remote tier: one guarded door to a backend.

Every call to the server passes through :meth:`Remote._call`, the one place
that validates the digest, refuses writes in read mode (so a read-only
client never writes, whatever layer asks), consults the circuit breaker and
counts.  Every public method returns an :class:`Outcome` and never raises,
so a remote that is down, slow, lying or misconfigured becomes a miss with a
reason, never a failed pipeline (docs/remote.md, "Failure costs").
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..codec import Encoding
from ..errors import AdstoreError, ConfigError
from ..reasons import Reason
from . import transfer
from .addresses import Kind, object_name, record_address
from .backend import DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT, RemoteBackend, transport_error
from .breaker import CircuitBreaker
from .calls import run_bounded
from .deadline import Deadline, Limits
from .errors import ReadOnlyRemote, RemoteChecksumMismatch, RemoteError, RemoteUnavailable, UntrustedRecord
from .outcomes import Mode, Outcome
from .signing import Signer, TrustedKeys, Verified

__all__ = ["Remote", "DEFAULT_CONNECT_TIMEOUT", "DEFAULT_READ_TIMEOUT", "MAX_ENVELOPE_BYTES"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Largest signed envelope (an ``ac`` object) a reader downloads: a remote record lists digests,
#: never blob bytes, so it is far smaller than a local record file (``records.format.MAX_RECORD_BYTES``,
#: which also carries the inline blobs of its rank).
MAX_ENVELOPE_BYTES = 16 << 20


class Remote:
    """A remote behind a mode, a circuit breaker, counters, signatures and verification."""

    def __init__(
        self,
        backend: RemoteBackend,
        *,
        mode: Mode | str = Mode.READ,
        signer: Signer | None = None,
        trusted: TrustedKeys | None = None,
        breaker: CircuitBreaker | None = None,
        max_envelope_bytes: int = MAX_ENVELOPE_BYTES,
        limits: Limits | None = None,
    ) -> None:
        self.backend = backend
        self.limits = limits if limits is not None else Limits()
        self.mode = Mode(mode)
        self.signer = signer
        self.trusted = trusted
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.max_envelope_bytes = max_envelope_bytes
        self._counters: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.backend.url

    @property
    def writable(self) -> bool:
        return self.mode is Mode.READ_WRITE

    def __repr__(self) -> str:
        return f"Remote({self.url!r}, mode={self.mode.value!r})"

    def close(self) -> None:
        self.backend.close()

    # -- counters --------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + n

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot of every counter (calls, errors by reason, bytes, blobs, records, uploads, leases)."""
        with self._lock:
            return dict(self._counters)

    # -- the one door ----------------------------------------------------
    def _call(
        self,
        op: str,
        kind: Kind,
        digest: str,
        fn: Callable[[], T],
        *,
        listing: bool = False,
        write: bool = False,
        deadline: Deadline | None = None,
        on_expire: Callable[[], None] | None = None,
    ) -> T:
        """Run one backend call: validate, enforce the mode, ask the breaker, bound its time, count.

        ``deadline`` defaults to the limit of one small call; past it the
        call is :class:`RemoteTimeout` (it opens the circuit like any
        timeout), ``on_expire`` runs and the call is cut short
        (``calls.run_bounded``).  A socket timeout the backend let through
        is the call's own ``remote_timeout``, with its own message.
        ``listing``: a call about every object of ``kind`` (``digest`` is ignored).
        """
        target = f"{Kind(kind).value}/" if listing else object_name(kind, digest)
        if write and self.mode is not Mode.READ_WRITE:
            raise ReadOnlyRemote(op, target)
        try:
            self.breaker.before(op, target)
        except RemoteUnavailable:
            self.count("fast_fails")
            raise
        self.count(f"calls.{op}")
        try:
            try:
                result = run_bounded(
                    fn,
                    deadline if deadline is not None else self.limits.start(),
                    op=op,
                    target=target,
                    on_expire=on_expire,
                )
            except TimeoutError as exc:  # not a RemoteError: a backend's socket timed out on its own
                raise transport_error(exc, op=op, target=target) from exc
        except RemoteUnavailable as exc:
            if self.breaker.failure(exc):
                self.count("breaker_opened")
                log.warning(
                    "remote %s unavailable (%s); not asking it again for %.1fs",
                    self.url,
                    exc,
                    self.breaker.snapshot()["retry_after"],
                )
            raise
        except BaseException:
            self.breaker.success()  # the server answered (or the failure was ours)
            raise
        self.breaker.success()
        return result

    def refusal(self) -> Reason | None:
        """Why a call now would fail at once without reaching the server (the circuit is open), else None."""
        return self.breaker.refusal()

    def _guard(self, op: str, fn: Callable[[], Outcome[T]]) -> Outcome[T]:
        """Turn every failure of ``fn`` into an outcome with a reason; time it."""
        start = time.perf_counter()
        try:
            out = fn()
        except AdstoreError as exc:
            reason = str(exc.reason)
            self.count(f"errors.{reason}")
            level = logging.DEBUG if getattr(exc, "retry_after", None) is not None else logging.INFO
            log.log(level, "remote %s %s: %s", self.url, op, exc)
            return Outcome(reason=reason, error=exc, seconds=time.perf_counter() - start)
        except Exception as exc:  # a bug must not fail a pipeline either
            self.count(f"errors.{Reason.REMOTE_ERROR}")
            log.error("remote %s %s failed unexpectedly: %s: %s", self.url, op, type(exc).__name__, exc)
            log.debug("remote %s %s failure", self.url, op, exc_info=True)  # a bug: its traceback for whoever debugs
            error = RemoteError(f"{type(exc).__name__}: {exc}", op=op)
            return Outcome(reason=str(Reason.REMOTE_ERROR), error=error, seconds=time.perf_counter() - start)
        return dataclasses.replace(out, seconds=time.perf_counter() - start)

    # -- objects ---------------------------------------------------------
    def get(self, kind: Kind | str, digest: str) -> Outcome[bytes]:
        """The object (None if absent).  A ``cas`` object is returned only if it hashes to ``digest``."""
        k = Kind(kind)

        def run() -> Outcome[bytes]:
            limit = self.max_envelope_bytes if k is Kind.AC else 1 << 62
            buf = io.BytesIO()
            n = self._call("get", k, digest, lambda: self.backend.get_to(k, digest, buf, limit))
            if n is None:
                return Outcome(value=None)
            self.count("bytes_down", n)
            data = buf.getvalue()
            if k is Kind.CAS:
                got = hashlib.sha256(data).hexdigest()
                if got != digest:
                    self.count("checksum_rejected")
                    raise RemoteChecksumMismatch(digest, expected_size=None, got_size=n, got_digest=got)
            return Outcome(value=data, nbytes=n)

        return self._guard("get", run)

    def head(self, kind: Kind | str, digest: str) -> Outcome[int]:
        """The object's size (None if absent)."""
        k = Kind(kind)
        return self._guard(
            "head", lambda: Outcome(value=self._call("head", k, digest, lambda: self.backend.head(k, digest)))
        )

    def put(self, kind: Kind | str, digest: str, data: bytes) -> Outcome[int]:
        """Store (or replace) an object; the bytes sent."""
        k = Kind(kind)

        def run() -> Outcome[int]:
            n = self._call("put", k, digest, lambda: self.backend.put(k, digest, data), write=True)
            self.count("bytes_up", n)
            return Outcome(value=n, nbytes=n)

        return self._guard("put", run)

    def put_if_absent(self, kind: Kind | str, digest: str, data: bytes) -> Outcome[bool]:
        """Create an object only if absent: True if this call created it (reason
        ``remote_unsupported`` on a backend without conditional writes)."""
        k = Kind(kind)

        def run() -> Outcome[bool]:
            created = self._call(
                "put_if_absent", k, digest, lambda: self.backend.put_if_absent(k, digest, data), write=True
            )
            return Outcome(value=created, nbytes=len(data) if created else 0)

        return self._guard("put_if_absent", run)

    def delete(self, kind: Kind | str, digest: str) -> Outcome[None]:
        k = Kind(kind)

        def run() -> Outcome[None]:
            self._call("delete", k, digest, lambda: self.backend.delete(k, digest), write=True)
            return Outcome()

        return self._guard("delete", run)

    # -- blobs (transfer.py) ---------------------------------------------
    def fetch_blob(self, digest: str, size: int, *, dest: str | Path, fsync: bool = False) -> Outcome[Path]:
        """Download a blob into the new file ``dest``, verified, within its deadline (:func:`transfer.fetch_blob`)."""
        return self._guard("fetch_blob", lambda: transfer.fetch_blob(self, digest, size, dest=Path(dest), fsync=fsync))

    def push_blob(
        self, digest: str, size: int, source: str | Path | bytes, *, kind: Kind | str = Kind.CAS
    ) -> Outcome[int]:
        """Upload a blob (``zcas``: its compressed file) unless the remote has it (HEAD first); the bytes sent."""
        return self._guard("push_blob", lambda: transfer.push_blob(self, digest, size, source, kind=Kind(kind)))

    def pull_blobs(
        self,
        refs: Iterable[tuple[str, int]],
        *,
        sink: transfer.BlobSink,
        stored: Mapping[str, tuple[Encoding, int]] | None = None,
        deadline: Deadline | None = None,
    ) -> Outcome[int]:
        """Stream every blob ``sink`` (a Store) lacks into it, after admitting their total; all or a failed outcome.

        ``stored``: the blobs that travel compressed (a record's), and their files' sizes.
        """
        return self._guard(
            "pull_blobs", lambda: transfer.pull_blobs(self, refs, sink=sink, stored=stored, deadline=deadline)
        )

    # -- records ---------------------------------------------------------
    def fetch_record(self, key: str, rank: int = 0) -> Outcome[Verified]:
        """This rank's record, if signed by a trusted key and really about ``key`` and ``rank``.

        Reasons: ``absent`` (no record), ``untrusted_remote`` (see
        :meth:`TrustedKeys.open`, or a signed record copied to another key's
        address), and the transport reasons.
        """

        def run() -> Outcome[Verified]:
            got = self.get(Kind.AC, record_address(key, rank))
            if got.reason == Reason.REMOTE_CHECKSUM:  # past max_envelope_bytes: not a record we wrote
                self.count("untrusted")
                raise UntrustedRecord(
                    f"larger than {self.max_envelope_bytes} bytes", target=f"ac/{record_address(key, rank)}"
                )
            if not got.ok:
                return got  # type: ignore[return-value]
            if got.value is None:
                self.count("records_absent")
                return Outcome(reason=str(Reason.ABSENT), nbytes=got.nbytes)
            verified = self._verify(got.value, key, rank)
            self.count("records_down")
            return Outcome(value=verified, nbytes=got.nbytes)

        return self._guard("fetch_record", run)

    def _verify(self, raw: bytes, key: str, rank: int) -> Verified:
        target = f"ac/{record_address(key, rank)}"
        try:
            if self.trusted is None or not len(self.trusted):
                raise UntrustedRecord("no trusted keys are configured (ADSTORE_TRUSTED_KEYS)", target=target)
            verified = self.trusted.open(raw, target=target)
            if verified.payload.get("key") != key or verified.payload.get("rank") != rank:
                raise UntrustedRecord(
                    f"signed for key {verified.payload.get('key')!r} rank "
                    f"{verified.payload.get('rank')!r}, found at the address of "
                    f"{key!r} rank {rank}",
                    key_id=verified.key_id,
                    target=target,
                )
        except UntrustedRecord as exc:
            self.count("untrusted")
            log.warning("remote %s: %s", self.url, exc)
            raise
        return verified

    def list_records(self) -> Outcome[list[Verified]]:
        """Every record on the remote signed by a trusted key and found at its own address (``adstore pull --all``).

        The backend lists ``ac/`` (``RemoteBackend.list_digests``; ``remote_unsupported`` where it cannot),
        then each object is read and checked as :meth:`fetch_record` checks one: what is not such a record
        (a build lease, an unsigned or untrusted record, one copied to another address) is skipped and
        counted ``records_skipped``.  The listing is only a list of names: nothing in it is trusted.
        """

        def run() -> Outcome[list[Verified]]:
            if self.trusted is None or not len(self.trusted):
                raise UntrustedRecord("no trusted keys are configured (ADSTORE_TRUSTED_KEYS)", target="ac/")
            trusted = self.trusted
            digests = self._call(
                "list",
                Kind.AC,
                "",
                lambda: self.backend.list_digests(Kind.AC),
                listing=True,
                deadline=self.limits.start(1 << 26),
            )
            found: list[Verified] = []
            nbytes = 0
            for digest in digests:
                got = self.get(Kind.AC, digest)
                if not got.ok:
                    if got.reason == Reason.REMOTE_CHECKSUM:  # past max_envelope_bytes: not a record we wrote
                        self.count("records_skipped")
                        continue
                    return Outcome(reason=got.reason, error=got.error, nbytes=nbytes)
                nbytes += got.nbytes
                if got.value is None:
                    continue  # removed since the listing (a lease released)
                try:
                    verified = trusted.open(got.value, target=f"ac/{digest}")
                except UntrustedRecord:
                    self.count("records_skipped")
                    continue
                key, rank = verified.payload.get("key"), verified.payload.get("rank")
                if not isinstance(key, str) or type(rank) is not int or record_address(key, rank) != digest:
                    self.count("records_skipped")  # a lease, or a record found at another record's address
                    continue
                found.append(verified)
            return Outcome(value=found, nbytes=nbytes)

        return self._guard("list_records", run)

    def push_record(self, key: str, rank: int, payload: Mapping[str, Any]) -> Outcome[int]:
        """Sign and upload this rank's record (``key`` and ``rank`` are added to the payload)."""

        def run() -> Outcome[int]:
            if self.signer is None:
                raise ConfigError("ADSTORE_SIGNING_KEY", "a writer needs a signing key to publish records")
            for field, want in (("key", key), ("rank", rank)):
                if field in payload and payload[field] != want:
                    raise ConfigError("payload", f"{field} {payload[field]!r} differs from {want!r}")
            envelope = self.signer.seal({**payload, "key": key, "rank": rank})
            sent = self.put(Kind.AC, record_address(key, rank), envelope)
            if sent.ok:
                self.count("records_up")
            return sent

        return self._guard("push_record", run)

    def publish(
        self,
        key: str,
        rank: int,
        payload: Mapping[str, Any],
        refs: Iterable[tuple[str, int]],
        *,
        source: transfer.BlobSource,
    ) -> Outcome[int]:
        """Upload the blobs the remote lacks, then the record last; the bytes sent.

        The record goes up only after every blob did, so a reader never sees
        a record whose blobs are missing (unless the server evicts them later).
        """
        return self._guard("publish", lambda: transfer.publish(self, key, rank, payload, refs, source=source))

    def plan_publish(
        self, refs: Iterable[tuple[str, int]], *, source: transfer.BlobSource
    ) -> Outcome[list[tuple[str, int, bool]]]:
        """What :meth:`publish` would send (HEADs only, nothing written): (digest, bytes, the remote has it) each."""
        return self._guard("plan_publish", lambda: Outcome(value=transfer.plan_publish(self, refs, source=source)))

    # -- operations ------------------------------------------------------
    def probe(self) -> Outcome[float]:
        """Is the remote reachable? A HEAD of a fixed name; the value is the round trip in seconds."""
        out = self.head(Kind.AC, hashlib.sha256(b"adstore:probe").hexdigest())
        return Outcome(
            value=out.seconds if out.ok else None,
            reason=out.reason,
            error=out.error,
            nbytes=out.nbytes,
            seconds=out.seconds,
        )

    def status(self) -> dict[str, Any]:
        """URL, mode, conditional writes, breaker, keys and counters (for ``adstore remote``)."""
        return {
            "url": self.url,
            "mode": self.mode.value,
            "conditional_writes": self.backend.conditional_writes.value,
            "transfer": str(self.backend.transfer),
            "breaker": self.breaker.snapshot(),
            "signing_key": self.signer.key_id if self.signer else None,
            "trusted_keys": self.trusted.key_ids if self.trusted else [],
            "counters": self.counters,
        }
