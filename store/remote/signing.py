"""Signed records: what a reader checks before it trusts anything a remote says.

A remote is written by other hosts, so a per-key record is restored only if
it is signed by a key the reader trusts (docs/remote.md, "Trust and keys").  The
envelope is canonical JSON::

    {"format": "adstore.record", "version": 1, "key_id": "<hex>",
     "payload": {...}, "signature": "<base64>"}

The Ed25519 signature covers the canonical bytes of every field but the
signature itself, so the payload (key, rank, generation, every digest and
size, components, the payload's own format version: whatever the store puts
in it), the envelope version and the key id are all signed.  The key id is
the SHA-256 of the public key's SubjectPublicKeyInfo DER.  Keys are PEM
files: a PKCS#8 private key for writers (``ADSTORE_SIGNING_KEY``), one or more
SubjectPublicKeyInfo public keys, concatenated in a file or one per file in a
directory, for readers (``ADSTORE_TRUSTED_KEYS``).  ``cryptography`` is
imported only when a key is loaded or made.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MissingExtra
from ..fsutil import atomic_write
from .errors import UntrustedRecord

__all__ = [
    "ENVELOPE_FORMAT",
    "ENVELOPE_VERSION",
    "canonical_json",
    "KeyPair",
    "generate_keypair",
    "write_keypair",
    "Signer",
    "TrustedKeys",
    "Verified",
]

log = logging.getLogger(__name__)

ENVELOPE_FORMAT = "adstore.record"
ENVELOPE_VERSION = 1
_SIGNED_FIELDS = ("format", "version", "key_id", "payload")
_PUBLIC_PEM = re.compile(rb"-----BEGIN PUBLIC KEY-----.+?-----END PUBLIC KEY-----", re.DOTALL)


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no spaces, ASCII, no NaN: the same value always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _crypto() -> Any:
    """The ``cryptography`` modules the tier uses (imported on first use)."""
    try:
        from cryptography import exceptions
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise MissingExtra("signed records (a remote's keys)", "cryptography", "remote") from exc
    return exceptions, serialization, ed25519


def _key_id(public_key: Any) -> str:
    _, serialization, _ = _crypto()
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A fresh Ed25519 key pair as PEM: PKCS#8 private key, SubjectPublicKeyInfo public key."""

    private_pem: bytes
    public_pem: bytes
    key_id: str


def generate_keypair() -> KeyPair:
    """A new Ed25519 key pair (tests, docs, a first setup)."""
    _, serialization, ed25519 = _crypto()
    private = ed25519.Ed25519PrivateKey.generate()
    public = private.public_key()
    return KeyPair(
        private_pem=private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        public_pem=public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
        key_id=_key_id(public),
    )


def write_keypair(directory: str | os.PathLike[str], *, name: str = "adstore") -> tuple[Path, Path]:
    """Write ``<name>.key`` (mode 0600) and ``<name>.pub`` into ``directory``; returns both paths."""
    pair = generate_keypair()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    private = atomic_write(out / f"{name}.key", pair.private_pem, mode=0o600)
    public = atomic_write(out / f"{name}.pub", pair.public_pem, mode=0o644)
    return private, public


class Signer:
    """Seals payloads with one Ed25519 private key (a writer's ``ADSTORE_SIGNING_KEY``)."""

    def __init__(self, private_key: Any) -> None:
        _, _, ed25519 = _crypto()
        if not isinstance(private_key, ed25519.Ed25519PrivateKey):
            raise ConfigError(
                "ADSTORE_SIGNING_KEY", f"expected an Ed25519 private key, got {type(private_key).__name__}"
            )
        self._key = private_key
        self.key_id = _key_id(private_key.public_key())

    @classmethod
    def from_pem(cls, data: bytes, *, source: str = "ADSTORE_SIGNING_KEY") -> Signer:
        _, serialization, _ = _crypto()
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(source, f"not an unencrypted PKCS#8 PEM private key ({exc})") from None
        return cls(key)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Signer:
        p = Path(path)
        try:
            data = p.read_bytes()
            if p.stat().st_mode & 0o077:
                log.warning("signing key %s is readable by other users (chmod 600 it)", p)
        except OSError as exc:
            raise ConfigError("ADSTORE_SIGNING_KEY", f"cannot read {p}: {exc.strerror}") from None
        return cls.from_pem(data, source=f"ADSTORE_SIGNING_KEY ({p})")

    def public_pem(self) -> bytes:
        _, serialization, _ = _crypto()
        pem: bytes = self._key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return pem

    def seal(self, payload: Mapping[str, Any]) -> bytes:
        """The signed envelope of ``payload`` (a JSON-able dict), as bytes to upload."""
        signed = {
            "format": ENVELOPE_FORMAT,
            "version": ENVELOPE_VERSION,
            "key_id": self.key_id,
            "payload": dict(payload),
        }
        signature = self._key.sign(canonical_json(signed))
        return canonical_json({**signed, "signature": base64.b64encode(signature).decode()})


@dataclass(frozen=True, slots=True)
class Verified:
    """A record whose signature checked out: its payload and who signed it."""

    payload: dict[str, Any]
    key_id: str


class TrustedKeys:
    """The public keys a reader trusts, by key id (a reader's ``ADSTORE_TRUSTED_KEYS``)."""

    def __init__(self, keys: Iterable[Any] = ()) -> None:
        _, _, ed25519 = _crypto()
        self._keys: dict[str, Any] = {}
        for key in keys:
            if not isinstance(key, ed25519.Ed25519PublicKey):
                raise ConfigError("ADSTORE_TRUSTED_KEYS", f"expected Ed25519 public keys, got {type(key).__name__}")
            self._keys[_key_id(key)] = key

    @classmethod
    def from_pem(cls, data: bytes, *, source: str = "ADSTORE_TRUSTED_KEYS") -> TrustedKeys:
        """Every PUBLIC KEY block of ``data`` (concatenated PEM)."""
        return cls(cls._parse(data, source))

    @staticmethod
    def _parse(data: bytes, source: str) -> list[Any]:
        _, serialization, _ = _crypto()
        keys = []
        for block in _PUBLIC_PEM.findall(data):
            try:
                keys.append(serialization.load_pem_public_key(block))
            except (ValueError, TypeError) as exc:
                raise ConfigError("ADSTORE_TRUSTED_KEYS", f"{source}: a bad public key ({exc})") from None
        return keys

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TrustedKeys:
        """A file of concatenated public keys, or a directory of such files."""
        p = Path(path)
        try:
            files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")) if p.is_dir() else [p]
            keys = []
            for f in files:
                found = cls._parse(f.read_bytes(), str(f))
                if not found and p.is_dir():
                    log.warning("trusted keys: %s holds no PUBLIC KEY block; skipped", f)
                keys.extend(found)
        except OSError as exc:
            raise ConfigError("ADSTORE_TRUSTED_KEYS", f"cannot read {exc.filename or p}: {exc.strerror}") from None
        if not keys:
            raise ConfigError("ADSTORE_TRUSTED_KEYS", f"{p} holds no SubjectPublicKeyInfo PEM public key")
        return cls(keys)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def open(self, raw: bytes, *, target: str = "") -> Verified:
        """Check an envelope; its payload if a trusted key signed exactly these bytes.

        Raises UntrustedRecord (reason ``untrusted_remote``) for anything else:
        undecodable, another format or version, unsigned, an unknown key, a
        bad signature (forged, tampered or re-signed by an untrusted key).
        """

        def refuse(why: str, key_id: str | None = None) -> UntrustedRecord:
            return UntrustedRecord(why, key_id=key_id, target=target)

        try:
            env = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise refuse("not JSON") from None
        if not isinstance(env, dict) or env.get("format") != ENVELOPE_FORMAT:
            raise refuse("not an adstore record envelope")
        if env.get("version") != ENVELOPE_VERSION:
            raise refuse(f"envelope version {env.get('version')!r}, this adstore reads {ENVELOPE_VERSION}")
        if "signature" not in env:
            raise refuse("unsigned")
        if set(env) != {*_SIGNED_FIELDS, "signature"}:
            raise refuse(f"unexpected fields {sorted(set(env) - {*_SIGNED_FIELDS, 'signature'})}")
        key_id, payload = env["key_id"], env["payload"]
        if not isinstance(key_id, str) or not isinstance(payload, dict):
            raise refuse("malformed envelope")
        key = self._keys.get(key_id)
        if key is None:
            raise refuse(f"signed by a key that is not trusted ({key_id[:16]})", key_id)
        try:
            signature = base64.b64decode(env["signature"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise refuse("malformed signature", key_id) from None
        exceptions, _, _ = _crypto()
        try:
            key.verify(signature, canonical_json({f: env[f] for f in _SIGNED_FIELDS}))
        except (exceptions.InvalidSignature, ValueError):
            raise refuse("bad signature: forged or tampered", key_id) from None
        return Verified(payload=payload, key_id=key_id)
