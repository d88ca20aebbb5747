"""What the admission tests run in a spawned process (importable by name): admit, say so, hold until killed."""

from __future__ import annotations

import time

from adstore.store import Store


def admit_and_hold(root: str, max_size: int, nbytes: int, ready) -> None:
    """Admit a download of ``nbytes`` into the store at ``root`` and hold it, never releasing it."""
    store = Store(root, max_size=max_size)
    store.admit(nbytes)
    ready.put("admitted")
    while True:  # a restore still downloading, until the test kills it
        time.sleep(60)
