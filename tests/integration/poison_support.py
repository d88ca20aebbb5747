"""What the poisoned-entry tests share: the sentinel a payload would create, and the attacker's tools.

An attacker with write access to a shared store publishes and commits
hostile bytes under the victim's key (``publish``), pickles that call
anything on load (``Reduce``), and the victim's CLI reads them too
(``run_cli``).  A test module imports ``sentinel_fixture`` to use the
``sentinel`` fixture (named apart, so that the tests' ``sentinel`` arguments
do not shadow an import).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from adstore.store import Store

__all__ = ["Reduce", "publish", "run_cli", "sentinel_fixture"]


@pytest.fixture(name="sentinel")
def sentinel_fixture(tmp_path):
    """The file each payload would create: the test fails if it exists when the test ends."""
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a poisoned entry executed code"


def publish(root, key: str, artifacts: dict[str, bytes], *, namespace: str = "pipeline", world_size: int = 1):
    """What an attacker with group write access does: a normal, committed save under the victim's key."""
    with Store.open(root) as store:
        gen = store.new_generation()
        refs = {name: store.put_bytes(data) for name, data in artifacts.items()}
        store.publish(key, generation=gen, artifacts=refs, namespace=namespace, world_size=world_size)
        store.commit(key, generation=gen)
        assert store.lookup(key, count=False).hit  # the store itself serves it: only the cache can refuse
        return gen


class Reduce:
    """Pickles as a call of ``fn(*args)``: what a hostile pickle runs when it is loaded."""

    def __init__(self, fn, args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def run_cli(root, *args: str) -> subprocess.CompletedProcess:
    """``adstore --root ROOT ARGS`` in a real CLI process, as the victim would run it."""
    return subprocess.run(
        [sys.executable, "-m", "adstore.daemon", "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
