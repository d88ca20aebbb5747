"""Configuration of the remote tier and the factory that opens one from a URL.

``RemoteConfig.from_env()`` reads (when called, never at import)::

    ADSTORE_REMOTE                  s3://BUCKET/PREFIX, http(s)://HOST:PORT/PREFIX, memory://NAME
    ADSTORE_REMOTE_MODE             read (default) | read-write
    ADSTORE_SIGNING_KEY             PKCS#8 PEM private key file (writers)
    ADSTORE_TRUSTED_KEYS            PEM public keys: a file or a directory (readers)
    ADSTORE_REMOTE_TIMEOUT          read timeout: how long one socket read may stall (default 10s)
    ADSTORE_REMOTE_CONNECT_TIMEOUT  connect timeout (default 2s)
    ADSTORE_REMOTE_DEADLINE         how long one call may take in all, whatever the server sends (default 30s)
    ADSTORE_REMOTE_MIN_THROUGHPUT   a blob also gets its size at this rate, a size per second (default 1M)
    ADSTORE_REMOTE_COOLDOWN         how long an open circuit stays open at first (default 30s)

:func:`open_remote` maps a URL scheme to a backend; :func:`register_scheme`
adds a user's backend for another service (docs/remote.md, "URLs and modes").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..units import parse_duration, parse_size
from .backend import RemoteBackend
from .breaker import DEFAULT_COOLDOWN, CircuitBreaker
from .client import DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT, Remote
from .deadline import DEFAULT_DEADLINE, DEFAULT_MIN_THROUGHPUT, Limits
from .memory import MemoryBackend
from .outcomes import Mode
from .signing import Signer, TrustedKeys

__all__ = ["RemoteConfig", "open_remote", "register_scheme", "parse_mode", "BackendFactory"]

#: ``factory(url, *, connect_timeout, read_timeout, **options) -> RemoteBackend``
BackendFactory = Callable[..., RemoteBackend]

_MEMORY: dict[str, MemoryBackend] = {}
_MEMORY_LOCK = threading.Lock()


def _memory(url: str, **_: Any) -> MemoryBackend:
    """``memory://NAME``: one shared in-process backend per name (tests, examples)."""
    with _MEMORY_LOCK:
        return _MEMORY.setdefault(url, MemoryBackend(url=url))


def _s3(url: str, **options: Any) -> RemoteBackend:
    from .s3 import S3Backend

    return S3Backend(url, **options)


def _http(url: str, **options: Any) -> RemoteBackend:
    from .httpcache import HttpBackend

    return HttpBackend(url, **options)


_SCHEMES: dict[str, BackendFactory] = {"s3": _s3, "http": _http, "https": _http, "memory": _memory}


def register_scheme(scheme: str, factory: BackendFactory) -> None:
    """Open ``scheme://...`` URLs with ``factory`` (a user's backend for another service)."""
    _SCHEMES[scheme.lower()] = factory


def parse_mode(value: object) -> Mode:
    text = str(value).strip().lower().replace("_", "-")
    try:
        return Mode(text)
    except ValueError:
        raise ConfigError("ADSTORE_REMOTE_MODE", f"{value!r} is neither 'read' nor 'read-write'") from None


def open_remote(
    url: str,
    *,
    mode: Mode | str = Mode.READ,
    timeout: float = DEFAULT_READ_TIMEOUT,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    cooldown: float = DEFAULT_COOLDOWN,
    deadline: float = DEFAULT_DEADLINE,
    min_throughput: float = DEFAULT_MIN_THROUGHPUT,
    signer: Signer | None = None,
    trusted: TrustedKeys | None = None,
    **backend_options: Any,
) -> Remote:
    """A :class:`Remote` for ``url``; ``backend_options`` go to the backend's constructor."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    factory = _SCHEMES.get(scheme)
    if factory is None:
        raise ConfigError(
            "ADSTORE_REMOTE", f"{url!r}: unknown scheme (use one of {', '.join(sorted(s + '://' for s in _SCHEMES))})"
        )
    if timeout <= 0 or connect_timeout <= 0:
        raise ConfigError("ADSTORE_REMOTE_TIMEOUT", "timeouts must be positive")
    if deadline <= 0:
        raise ConfigError("ADSTORE_REMOTE_DEADLINE", "the deadline must be positive")
    if min_throughput <= 0:
        raise ConfigError("ADSTORE_REMOTE_MIN_THROUGHPUT", "the minimum throughput must be positive")
    if scheme == "memory":
        backend = factory(url)
    else:
        # No socket wait outlives the deadline of the call it serves: a worker the caller gave up on
        # (one nothing can interrupt, such as S3 waiting for response headers) ends soon after it.
        backend = factory(
            url, connect_timeout=min(connect_timeout, deadline), read_timeout=min(timeout, deadline), **backend_options
        )
    return Remote(
        backend,
        mode=parse_mode(mode),
        signer=signer,
        trusted=trusted,
        breaker=CircuitBreaker(cooldown=cooldown, max_cooldown=max(cooldown, 10 * cooldown)),
        limits=Limits(deadline=deadline, min_throughput=min_throughput),
    )


@dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """Where the remote is and how to use it; ``url=None`` means no remote tier."""

    url: str | None = None
    mode: Mode = Mode.READ
    signing_key: Path | None = None
    trusted_keys: Path | None = None
    timeout: float = DEFAULT_READ_TIMEOUT
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    cooldown: float = DEFAULT_COOLDOWN
    deadline: float = DEFAULT_DEADLINE
    min_throughput: float = DEFAULT_MIN_THROUGHPUT
    backend_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> RemoteConfig:
        """The configuration ``ADSTORE_REMOTE*`` and the key variables describe; ``overrides`` win."""
        env = os.environ if environ is None else environ

        def duration(name: str, default: float) -> float:
            raw = env.get(name, "").strip()
            return parse_duration(raw, field=name) if raw else default

        def rate(name: str, default: float) -> float:
            raw = env.get(name, "").strip()
            return float(parse_size(raw.removesuffix("/s"), field=name)) if raw else default

        settings: dict[str, Any] = {
            "url": env.get("ADSTORE_REMOTE", "").strip() or None,
            "mode": parse_mode(env.get("ADSTORE_REMOTE_MODE", "").strip() or Mode.READ),
            "signing_key": Path(env["ADSTORE_SIGNING_KEY"]) if env.get("ADSTORE_SIGNING_KEY") else None,
            "trusted_keys": Path(env["ADSTORE_TRUSTED_KEYS"]) if env.get("ADSTORE_TRUSTED_KEYS") else None,
            "timeout": duration("ADSTORE_REMOTE_TIMEOUT", DEFAULT_READ_TIMEOUT),
            "connect_timeout": duration("ADSTORE_REMOTE_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT),
            "cooldown": duration("ADSTORE_REMOTE_COOLDOWN", DEFAULT_COOLDOWN),
            "deadline": duration("ADSTORE_REMOTE_DEADLINE", DEFAULT_DEADLINE),
            "min_throughput": rate("ADSTORE_REMOTE_MIN_THROUGHPUT", DEFAULT_MIN_THROUGHPUT),
        }
        settings.update(overrides)
        if "mode" in overrides:
            settings["mode"] = parse_mode(overrides["mode"])
        return cls(**settings)

    def open(self) -> Remote | None:
        """Load the keys and open the remote; None when no remote is configured.

        Raises ConfigError for an unknown scheme or an unreadable key file:
        a misconfiguration is reported once at startup, not as misses.
        """
        if not self.url:
            return None
        signer = Signer.from_file(self.signing_key) if self.signing_key else None
        trusted = TrustedKeys.load(self.trusted_keys) if self.trusted_keys else None
        return open_remote(
            self.url,
            mode=self.mode,
            timeout=self.timeout,
            connect_timeout=self.connect_timeout,
            cooldown=self.cooldown,
            deadline=self.deadline,
            min_throughput=self.min_throughput,
            signer=signer,
            trusted=trusted,
            **dict(self.backend_options),
        )

    def describe(self) -> dict[str, Any]:
        """The settings as JSON-able values (``adstore remote``)."""
        return {
            "url": self.url,
            "mode": self.mode.value,
            "signing_key": str(self.signing_key) if self.signing_key else None,
            "trusted_keys": str(self.trusted_keys) if self.trusted_keys else None,
            "timeout": self.timeout,
            "connect_timeout": self.connect_timeout,
            "cooldown": self.cooldown,
            "deadline": self.deadline,
            "min_throughput": self.min_throughput,
        }
