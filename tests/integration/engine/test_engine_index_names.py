"""An engine index entry names its engine and component digests with the store's one digest validator."""

from __future__ import annotations

import hashlib

import pytest

from adstore.integration.engine.index import DIGESTED, IndexEntry
from adstore.integration.errors import CorruptEngine

GOOD = hashlib.sha256(b"engine").hexdigest()


def entry(**digests: str) -> bytes:
    return IndexEntry(engine=GOOD, digests={name: GOOD for name in DIGESTED} | digests).to_json()


@pytest.mark.parametrize(
    "bad",
    ["", "../../etc/passwd", GOOD.upper(), GOOD + "\n", GOOD[:-1] + "\uff10", "not a digest"],
    ids=["empty", "path", "upper", "newline", "fullwidth-digit", "text"],
)
def test_a_component_digest_that_is_not_a_digest_is_a_corrupt_entry(bad):
    assert IndexEntry.from_json(entry()).digests["graph"] == GOOD
    with pytest.raises(CorruptEngine):
        IndexEntry.from_json(entry(graph=bad))
