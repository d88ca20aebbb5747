"""Every name the store accepts has one whole-string rule (``adstore.store.names``), used by every layer.

Property tests over generated names: anything the rule accepts round-trips
through publish, records and lookup; a name with a control character, a
trailing newline or a non-ASCII character is refused everywhere with the
same error (the store, the record parser, the remote addresses, the CLI).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adstore.store import InvalidDigest, InvalidKey, Store
from adstore.store.names import (
    is_digest,
    is_key,
    validate_artifact_name,
    validate_digest,
    validate_generation,
    validate_key,
    validate_namespace,
    validate_rank,
    validate_world_size,
)
from adstore.store.records.format import BadRecord, parse_payload
from adstore.store.remote import object_name

KEY_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:+=@-"
keys = st.builds(lambda first, rest: first + rest, st.sampled_from(KEY_CHARS[:62]), st.text(KEY_CHARS, max_size=199))
#: Characters no name may hold: controls (newline, NUL, DEL...), space, path separators, non-ASCII.
bad_chars = st.one_of(
    st.characters(max_codepoint=31),
    st.sampled_from(["\x7f", " ", "/", "\\", "é", "\u2028", "\ud800"]),
    st.characters(min_codepoint=128),
)
DIGEST = hashlib.sha256(b"x").hexdigest()


def spoiled(name: str, bad: str, where: int) -> str:
    at = where % (len(name) + 1)
    return name[:at] + bad + name[at:]


@given(keys)
def test_every_generated_key_is_accepted(key):
    assert validate_key(key) == key and is_key(key)


@given(keys, bad_chars, st.integers(0, 300))
def test_a_key_with_a_bad_character_anywhere_is_refused_with_the_same_error(key, bad, where):
    name = spoiled(key, bad, where)
    with pytest.raises(InvalidKey, match="1-200 characters"):
        validate_key(name)
    assert not is_key(name)


@pytest.mark.parametrize(
    "check, good", [(validate_namespace, "pipeline"), (validate_artifact_name, "module.pt"), (validate_key, "k")]
)
@given(bad=bad_chars)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_trailing_newlines_and_controls_are_refused_by_every_rule(check, good, bad):
    for name in (good + "\n", good + bad, bad + good):
        with pytest.raises(InvalidKey):
            check(name)


def test_digests_and_numbers_are_exact():
    for bad in (DIGEST + "\n", DIGEST.upper(), DIGEST[:-1], "\n" + DIGEST[1:], 5, None):
        with pytest.raises(InvalidDigest):
            validate_digest(bad)
        assert not is_digest(bad)
        with pytest.raises(InvalidDigest):
            object_name("cas", bad)  # the remote tier's addresses use the same rule
    for bad in (True, 0, -1, 1.0, "1", 1 << 31):
        with pytest.raises(InvalidKey):
            validate_world_size(bad)
    for bad in (True, False, -1, 2, 1.0):
        with pytest.raises(InvalidKey):
            validate_rank(bad, 2)
    for bad in (True, 0, 1 << 63, 1.5):
        with pytest.raises(InvalidKey):
            validate_generation(bad)


def test_the_store_refuses_a_trailing_newline_everywhere(tmp_path):
    with Store(tmp_path / "s") as store:
        ref = store.put_bytes(b"data")
        for kwargs in ({"key": "k\n"}, {"key": "k", "namespace": "ns\n"}):
            key = kwargs.pop("key")
            with pytest.raises(InvalidKey):
                store.publish(key, generation=1, artifacts={"a": ref}, **kwargs)
        with pytest.raises(InvalidKey):
            store.publish("k", generation=1, artifacts={"a\n": ref})
        with pytest.raises(InvalidKey):
            store.publish("k", rank=True, world_size=2, generation=1, artifacts={"a": ref})
        with pytest.raises(InvalidDigest):
            store.get_bytes(ref.digest + "\n")
        for call in (store.lookup, store.entry, store.resolve_key, store.manifests):
            with pytest.raises(InvalidKey):
                call("k\n")
        assert list((tmp_path / "s" / "records").rglob("*\n*")) == []


@pytest.mark.parametrize(
    "field, value",
    [("key", "k\n"), ("namespace", "default\n"), ("rank", True), ("generation", True), ("world_size", 1.0)],
)
def test_the_record_parser_uses_the_same_rules(field, value):
    payload = {
        "format": 1,
        "key": "k",
        "rank": 0,
        "world_size": 1,
        "generation": 7,
        "namespace": "default",
        "components": {},
        "meta": {},
        "artifacts": {"a": [DIGEST, 1]},
    }
    payload[field] = value
    with pytest.raises(BadRecord):
        parse_payload(payload, "test")


def test_the_cli_refuses_a_key_with_a_newline(tmp_path):
    with Store(tmp_path / "s") as store:
        ref = store.put_bytes(b"data")
        store.publish("k", generation=1, artifacts={"a": ref})
        store.commit("k", generation=1)
    out = subprocess.run(
        [sys.executable, "-m", "adstore.daemon", "--root", str(tmp_path / "s"), "rm", "k\n"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode not in (0, 70), out
    assert "invalid key" in out.stderr and "Traceback" not in out.stderr
    with Store(tmp_path / "s") as store:
        assert store.lookup("k").hit  # nothing was removed
