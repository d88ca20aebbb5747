"""The engine cache's in-process layer: recently used packages in a private temp directory.

Repeated compiles in one process reuse a package from here instead of going
back to the storage back end (docs/engine-cache.md, "The engine cache").  The directory is
deleted with the layer (or at interpreter exit).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

from adstore.integration.errors import ConfigError, UnsafeCacheDir
from adstore.integration.placement.dirs import checked_dir, private_dir

__all__ = ["PackageLRU"]


class PackageLRU:
    """Recently used packages (metadata + a private temp file), bounded by count and bytes.

    The most recent package is always kept (so ``max_entries=0`` keeps one).
    """

    def __init__(self, *, max_entries: int, max_bytes: int, tmp_root: str | None = None) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        # Packages are loaded from here: a directory only this user can write, under parents no one else
        # can rename in (placement.dirs); a ``tmp_root`` that is not such a place is refused.
        made = Path(tempfile.mkdtemp(prefix="adstore-engines-", dir=tmp_root if tmp_root else private_dir()))
        try:
            self.dir = checked_dir(made)
        except UnsafeCacheDir as exc:
            shutil.rmtree(made, ignore_errors=True)
            raise ConfigError("tmp_dir", str(exc)) from exc
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self._items: OrderedDict[str, tuple[dict[str, Any], Path, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, h: str) -> tuple[dict[str, Any], Path] | None:
        with self._lock:
            item = self._items.get(h)
            if item is None:
                return None
            if not item[1].exists():  # removed behind our back: forget it
                del self._items[h]
                return None
            self._items.move_to_end(h)
            return item[0], item[1]

    def new_path(self, suffix: str = ".pt2") -> Path:
        fd, name = tempfile.mkstemp(suffix=suffix, dir=self.dir)
        os.close(fd)
        return Path(name)

    def put(self, h: str, meta: dict[str, Any], path: Path) -> Path:
        """Adopt ``path`` (moved into the private directory) as the package of ``h``."""
        if path.parent != self.dir:
            dest = self.new_path()
            shutil.move(str(path), dest)
            path = dest
        size = path.stat().st_size
        with self._lock:
            old = self._items.pop(h, None)
            if old is not None and old[1] != path:
                old[1].unlink(missing_ok=True)
            self._items[h] = (meta, path, size)
            self._evict_locked()
        return path

    def discard(self, h: str) -> None:
        with self._lock:
            item = self._items.pop(h, None)
        if item is not None:
            item[1].unlink(missing_ok=True)

    def _evict_locked(self) -> None:
        # The newest package always stays: its caller is about to load it.
        while len(self._items) > 1 and (
            len(self._items) > self.max_entries or sum(i[2] for i in self._items.values()) > self.max_bytes
        ):
            _h, (_m, path, _s) = self._items.popitem(last=False)
            path.unlink(missing_ok=True)

    def clear(self) -> None:
        """Forget every package and delete its file (the directory stays)."""
        with self._lock:
            items, self._items = list(self._items.values()), OrderedDict()
        for _meta, path, _size in items:
            path.unlink(missing_ok=True)

    def __contains__(self, h: object) -> bool:
        return h in self._items

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        with self._lock:
            self._items.clear()
        self._finalizer()
