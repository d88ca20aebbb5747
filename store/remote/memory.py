"""An in-memory backend: the contract's reference and the unit tests' remote.

It keeps objects in a dict under a lock (so ``put_if_absent`` is atomic), logs
every operation in :attr:`MemoryBackend.ops` so tests can say "no PUT was
sent", and can be made to fail every call (:attr:`MemoryBackend.fail`) to
drive the layers above through an outage without a network (docs/remote.md,
"Failure costs").
"""

from __future__ import annotations

import threading
from typing import BinaryIO

from ..codec import Encoding
from ..names import is_digest
from .addresses import Kind, object_name
from .backend import CHUNK, Body, ConditionalWrites, RemoteBackend, copy_limited
from .errors import RemoteError

__all__ = ["MemoryBackend"]


def _as_bytes(data: Body) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    return data.read()


class MemoryBackend(RemoteBackend):
    """Objects in a dict; ``ops`` lists ``(operation, "kind/digest")`` in call order."""

    conditional_writes = ConditionalWrites.ATOMIC

    def __init__(self, *, url: str = "memory://", transfer: Encoding = Encoding.ZSTD) -> None:
        self.url = url
        self.transfer = transfer  # like S3 by default; RAW to stand in for a Bazel HTTP cache
        self.objects: dict[str, bytes] = {}
        self.ops: list[tuple[str, str]] = []
        #: When set, every call raises this error (a simulated outage).
        self.fail: RemoteError | None = None
        self._lock = threading.Lock()

    def _enter(self, op: str, kind: Kind, digest: str) -> str:
        name = object_name(kind, digest)
        with self._lock:
            self.ops.append((op, name))
        if self.fail is not None:
            raise self.fail
        return name

    def get_to(self, kind: Kind, digest: str, fileobj: BinaryIO, max_bytes: int) -> int | None:
        name = self._enter("get", kind, digest)
        with self._lock:
            data = self.objects.get(name)
        if data is None:
            return None
        view = memoryview(data)
        return copy_limited(
            (view[i : i + CHUNK] for i in range(0, len(view), CHUNK)), fileobj, max_bytes=max_bytes, digest=digest
        )

    def put(self, kind: Kind, digest: str, data: Body) -> int:
        name = self._enter("put", kind, digest)
        raw = _as_bytes(data)
        with self._lock:
            self.objects[name] = raw
        return len(raw)

    def head(self, kind: Kind, digest: str) -> int | None:
        name = self._enter("head", kind, digest)
        with self._lock:
            data = self.objects.get(name)
        return None if data is None else len(data)

    def put_if_absent(self, kind: Kind, digest: str, data: Body) -> bool:
        name = self._enter("put_if_absent", kind, digest)
        raw = _as_bytes(data)
        with self._lock:
            if name in self.objects:
                return False
            self.objects[name] = raw
        return True

    def list_digests(self, kind: Kind) -> list[str]:
        with self._lock:
            self.ops.append(("list", f"{kind.value}/"))
            names = list(self.objects)
        if self.fail is not None:
            raise self.fail
        prefix = f"{kind.value}/"
        return sorted(n[len(prefix) :] for n in names if n.startswith(prefix) and is_digest(n[len(prefix) :]))

    def delete(self, kind: Kind, digest: str) -> None:
        name = self._enter("delete", kind, digest)
        with self._lock:
            self.objects.pop(name, None)

    def writes(self) -> list[tuple[str, str]]:
        """The logged operations that would change the remote."""
        with self._lock:
            return [op for op in self.ops if op[0] in ("put", "put_if_absent", "delete")]
