"""``verify --fix`` on a damaged index: rebuild it, whether the probe or a repair's write finds the damage.

The probe (``index.file.probe_index``) reads every row in a child process,
so damage a read meets is found before anything is written.  A page that
only a write meets (a branch page of the wrong type on the path a repair's
write takes, a damaged free list the probe's walk could not see) surfaces as
:class:`~adstore.store.errors.CorruptRow` from the in-place repair itself.
Either way the answer is the same: move the index aside, rebuild it from the
blob files and the on-disk records (``records.rebuild``), and verify again.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import CorruptRow
from ..records.rebuild import RebuildReport
from .verify import VerifyReport

__all__ = ["verify_or_rebuild"]


def verify_or_rebuild(
    damage: str | None, *, fix: bool, rebuild: Callable[[str], RebuildReport], verify: Callable[[], VerifyReport]
) -> VerifyReport:
    """``verify()``'s report; with ``fix``, the index is rebuilt first when the probe found ``damage``,
    or once, then verified again, when the verify's own repair meets damage (``CorruptRow``)."""
    if damage and not fix:
        return VerifyReport.damaged_index(damage)
    rebuilt = rebuild(damage) if damage else None
    try:
        report = verify()
    except CorruptRow as exc:
        if rebuilt is not None or not fix:
            raise
        damage = str(exc)
        rebuilt = rebuild(damage)
        report = verify()
    if rebuilt is not None:
        report.add_rebuild(damage or "", rebuilt)
    return report
