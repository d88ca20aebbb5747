"""Signed records: only a trusted key's exact bytes are restored.

Unsigned, forged, tampered, untrusted-key, re-signed, wrong-version and
misplaced records are all ``untrusted_remote`` misses, through the public
layer as well as the envelope check.
"""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adstore.store import ConfigError
from adstore.store.remote import (
    Kind,
    MemoryBackend,
    Remote,
    Signer,
    TrustedKeys,
    UntrustedRecord,
    generate_keypair,
    record_address,
)
from adstore.store.remote.signing import canonical_json

PAYLOAD = {
    "key": "k",
    "rank": 0,
    "generation": 7,
    "format": 3,
    "components": {"model": {"layers": 24}},
    "artifacts": {"module.pt": ["ab" * 32, 1234]},
    "created": 1712345678.25,
}


def tamper(raw: bytes, fn) -> bytes:
    env = json.loads(raw)
    fn(env)
    return canonical_json(env)


def test_sign_and_verify(signer, trusted):
    v = trusted.open(signer.seal(PAYLOAD))
    assert v.payload == PAYLOAD and v.key_id == signer.key_id and signer.key_id in trusted


@pytest.mark.parametrize(
    "case",
    [
        "not json",
        "not an envelope",
        "unsigned",
        "wrong version",
        "extra field",
        "tampered payload",
        "tampered key id",
        "bad base64",
        "short signature",
        "payload not a dict",
    ],
)
def test_damaged_envelopes_are_untrusted(signer, trusted, case):
    raw = signer.seal(PAYLOAD)
    bad = {
        "not json": lambda: b"\xff{",
        "not an envelope": lambda: b"[1, 2]",
        "unsigned": lambda: tamper(raw, lambda e: e.pop("signature")),
        "wrong version": lambda: tamper(raw, lambda e: e.update(version=2)),
        "extra field": lambda: tamper(raw, lambda e: e.update(note="unsigned text")),
        "tampered payload": lambda: tamper(raw, lambda e: e["payload"]["artifacts"].update({"x": ["cd" * 32, 1]})),
        "tampered key id": lambda: tamper(raw, lambda e: e.update(key_id="00" * 32)),
        "bad base64": lambda: tamper(raw, lambda e: e.update(signature="!!!")),
        "short signature": lambda: tamper(raw, lambda e: e.update(signature=base64.b64encode(b"x" * 10).decode())),
        "payload not a dict": lambda: tamper(raw, lambda e: e.update(payload=[1])),
    }[case]()
    with pytest.raises(UntrustedRecord) as info:
        trusted.open(bad)
    assert info.value.reason == "untrusted_remote"


def test_forged_and_resigned_records_are_untrusted(signer, trusted):
    mallory = Signer.from_pem(generate_keypair().private_pem)
    with pytest.raises(UntrustedRecord, match="not trusted"):
        trusted.open(mallory.seal(PAYLOAD))  # re-signed by an untrusted key
    forged = tamper(mallory.seal(PAYLOAD), lambda e: e.update(key_id=signer.key_id))
    with pytest.raises(UntrustedRecord, match="bad signature"):
        trusted.open(forged)  # claims a trusted key id, signed by another key


def test_canonical_bytes_survive_a_round_trip(signer, trusted):
    """A re-serialized (reordered, spaced) envelope still verifies: the payload's meaning is what is signed."""
    env = json.loads(signer.seal(PAYLOAD))
    spaced = json.dumps(dict(reversed(list(env.items()))), indent=2).encode()
    assert trusted.open(spaced).payload == PAYLOAD


@settings(max_examples=50, deadline=None)
@given(
    payload=st.dictionaries(
        st.text(max_size=8),
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers()
            | st.floats(allow_nan=False, allow_infinity=False)
            | st.text(max_size=20),
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
            max_leaves=20,
        ),
        max_size=6,
    )
)
def test_any_json_payload_round_trips(payload):
    pair = generate_keypair()
    signer, trusted = Signer.from_pem(pair.private_pem), TrustedKeys.from_pem(pair.public_pem)
    assert trusted.open(signer.seal(payload)).payload == payload


def test_trusted_keys_from_concatenated_file_and_directory(tmp_path):
    pairs = [generate_keypair() for _ in range(3)]
    bundle = tmp_path / "trusted.pem"
    bundle.write_bytes(b"# fleet keys\n" + b"".join(p.public_pem for p in pairs))
    assert TrustedKeys.load(bundle).key_ids == sorted(p.key_id for p in pairs)
    d = tmp_path / "dir"
    d.mkdir()
    for i, p in enumerate(pairs):
        (d / f"{i}.pub").write_bytes(p.public_pem)
    (d / "README").write_text("not a key")
    assert len(TrustedKeys.load(d)) == 3
    empty = tmp_path / "empty.pem"
    empty.write_bytes(pairs[0].private_pem)  # a private key is not a trusted public key
    with pytest.raises(ConfigError):
        TrustedKeys.load(empty)
    broken = tmp_path / "broken.pem"
    broken.write_bytes(b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    with pytest.raises(ConfigError):
        TrustedKeys.load(broken)


def test_non_ed25519_keys_are_refused():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    with pytest.raises(ConfigError):
        Signer.from_pem(pem)
    with pytest.raises(ConfigError):
        TrustedKeys.from_pem(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )


# -- through the public layer ------------------------------------------------------
@pytest.fixture
def pair(signer, trusted):
    memory = MemoryBackend()
    return memory, Remote(memory, mode="read-write", signer=signer), Remote(memory, trusted=trusted)


def test_fetch_record_reasons(pair, signer):
    memory, writer, reader = pair
    assert reader.fetch_record("k", 0).reason == "absent"
    assert writer.push_record("k", 0, PAYLOAD).ok
    assert reader.fetch_record("k", 0).value.payload == PAYLOAD
    address = record_address("k", 0)
    memory.put(Kind.AC, address, json.dumps({"format": "adstore.record", "version": 1, "payload": PAYLOAD}).encode())
    assert reader.fetch_record("k", 0).reason == "untrusted_remote"  # unsigned
    memory.put(Kind.AC, address, Signer.from_pem(generate_keypair().private_pem).seal(PAYLOAD))
    assert reader.fetch_record("k", 0).reason == "untrusted_remote"  # untrusted key
    assert Remote(memory).fetch_record("k", 0).reason == "untrusted_remote"  # a reader trusting nobody
    assert reader.counters["untrusted"] == 2


def test_a_signed_record_moved_to_another_address_is_untrusted(pair):
    memory, writer, reader = pair
    writer.push_record("k", 0, PAYLOAD)
    good = memory.get(Kind.AC, record_address("k", 0))
    memory.put(Kind.AC, record_address("other", 0), good)
    memory.put(Kind.AC, record_address("k", 1), good)
    assert reader.fetch_record("other", 0).reason == "untrusted_remote"
    assert reader.fetch_record("k", 1).reason == "untrusted_remote"


def test_oversized_records_are_refused(pair):
    memory, writer, reader = pair
    memory.put(Kind.AC, record_address("k", 0), b" " * (reader.max_envelope_bytes + 1))
    assert reader.fetch_record("k", 0).reason == "untrusted_remote"


def test_push_record_needs_a_signing_key_and_a_consistent_payload(pair):
    memory, writer, reader = pair
    assert Remote(memory, mode="read-write").push_record("k", 0, PAYLOAD).reason == "config"
    assert writer.push_record("k", 1, PAYLOAD).reason == "config"  # the payload says rank 0
    assert memory.writes() == []
