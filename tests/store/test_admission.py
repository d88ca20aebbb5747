"""Download admission reserves what it admits: another process sees it, a dead process's reservation lapses.

Two ranks restoring at once used to be admitted against the same room and
together overrun the budget.  Here a real spawned process admits a download
and holds it; this process's admission then sees that reservation, until
the holder is killed (pid and start time, as leases) or its reservation
expires on the store's clock.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
from admission_child import admit_and_hold

from adstore.store import ManualClock, OverBudget, Store
from adstore.store.maintenance.reservations import RESERVATION_TTL

CTX = mp.get_context("spawn")
MiB = 1 << 20
LIMIT = 10 * MiB


@pytest.fixture
def holder(tmp_path):
    """A process that admitted 6 MiB of the store's 10 MiB and holds them."""
    Store(tmp_path / "store", max_size=LIMIT).close()
    ready = CTX.Queue()
    proc = CTX.Process(target=admit_and_hold, args=(str(tmp_path / "store"), LIMIT, 6 * MiB, ready), daemon=True)
    proc.start()
    assert ready.get(timeout=120) == "admitted"
    yield proc
    proc.kill()
    proc.join(30)


def test_a_second_admission_sees_the_first_and_a_dead_holder_no_longer_counts(holder, tmp_path):
    with Store(tmp_path / "store", max_size=LIMIT) as store:
        with pytest.raises(OverBudget):
            store.admit(6 * MiB)  # 6 + 6 > 10: the other process holds its 6
        store.admit(3 * MiB).release()  # what is left is still there
        holder.kill()
        holder.join(30)
        with store.admit(6 * MiB):  # the holder died: its reservation lapsed
            with pytest.raises(OverBudget):
                store.admit(6 * MiB)  # this one's own reservation counts in turn
        store.admit(6 * MiB).release()  # released at the end of the block


def test_a_reservation_expires_on_the_store_clock(holder, tmp_path):
    clock = ManualClock()
    with Store(tmp_path / "store", max_size=LIMIT, clock=clock) as store:
        with pytest.raises(OverBudget):
            store.admit(6 * MiB)
        clock.advance(RESERVATION_TTL + 1)  # the holder lives, but its reservation is past its expiry
        store.admit(6 * MiB).release()
