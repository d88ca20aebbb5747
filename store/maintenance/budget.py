"""The disk budget, persisted in the index so every process sees the same numbers.

The daemon writes the budget it enforces (``Store.set_budget``); ``adstore
stats`` shows it, and a writer without a daemon keeps the store under the
same hard limit with the same grace period (inline eviction, docs/configuration.md,
"The store").  One default grace period serves the store and the daemon.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CorruptRow
from ..index.rows import decode_json, encode_json
from ..units import MinFree

if TYPE_CHECKING:
    from ..index.tables import Txn

__all__ = ["Budget", "DEFAULT_GRACE_PERIOD", "BUDGET", "read_budget"]

log = logging.getLogger(__name__)

#: The budget's key in ``meta``.
BUDGET = b"budget"

#: Entries and unreferenced blobs younger than this are never evicted or swept.
DEFAULT_GRACE_PERIOD = 600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Budget:
    """How much the store may use: ``max_size`` and a free-space floor (the smaller limit wins).

    Enforcement starts above ``high_watermark`` × limit and stops at or below
    ``low_watermark`` × limit; a writer evicts inline only past the limit itself.
    """

    max_size: int | None
    min_free: MinFree | None
    high_watermark: float
    low_watermark: float
    grace_period: float = DEFAULT_GRACE_PERIOD

    def limit(self, *, size: int, fs_total: int, fs_free: int) -> int | None:
        """Bytes the store may use now: ``max_size`` capped so the filesystem keeps ``min_free``."""
        limit = self.max_size
        if self.min_free is not None:
            by_free = max(0, size + fs_free - self.min_free.of(fs_total))
            limit = by_free if limit is None else min(limit, by_free)
        return limit

    def to_dict(self) -> dict[str, Any]:
        mf = self.min_free
        return {
            "max_size": self.max_size,
            "min_free_bytes": mf.bytes if mf is not None else None,
            "min_free_percent": mf.percent if mf is not None else None,
            "high_watermark": self.high_watermark,
            "low_watermark": self.low_watermark,
            "grace_period": self.grace_period,
        }

    def encode(self) -> bytes:
        return encode_json(self.to_dict())

    @classmethod
    def decode(cls, raw: bytes) -> Budget:
        obj = decode_json(raw, "meta", b"budget")
        try:
            b, pct = obj["min_free_bytes"], obj["min_free_percent"]
            return cls(
                max_size=None if obj["max_size"] is None else int(obj["max_size"]),
                min_free=None
                if b is None and pct is None
                else MinFree(None if b is None else int(b), None if pct is None else float(pct)),
                high_watermark=float(obj["high_watermark"]),
                low_watermark=float(obj["low_watermark"]),
                grace_period=float(obj["grace_period"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRow("meta", b"budget", f"bad budget fields ({exc})") from None


def read_budget(t: Txn) -> Budget | None:
    """The budget persisted in ``meta``; None if none was set (or it does not decode: logged)."""
    raw = t.meta(BUDGET)
    if raw is None:
        return None
    try:
        return Budget.decode(raw)
    except CorruptRow as exc:
        log.warning("%s", exc)
        return None
