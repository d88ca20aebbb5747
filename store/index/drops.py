"""What a write transaction dropped that has files under ``records/``: manifests and pins.

The index layer notes them (``Txn.drops``) and knows nothing more of record
files; once the transaction committed, the store's ``Tables.after_commit``
(``records.obsolete``) retires their records.
"""

from __future__ import annotations

__all__ = ["Drops", "COMMITTED_RECORD", "PENDING_RECORD", "BOTH_RECORDS"]

#: Which record files a dropped manifest may have: the committed one, the pending one (bits).
COMMITTED_RECORD, PENDING_RECORD = 1, 2
BOTH_RECORDS = COMMITTED_RECORD | PENDING_RECORD


class Drops:
    """What a write transaction dropped that has files under ``records/``: manifests and pins."""

    __slots__ = ("manifests", "pins")

    def __init__(self) -> None:
        self.manifests: list[tuple[bytes, int]] = []  # (manifest key, which record files)
        self.pins: list[bytes] = []  # entry keys that were pinned

    def __bool__(self) -> bool:
        return bool(self.manifests or self.pins)
