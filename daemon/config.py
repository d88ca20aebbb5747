"""Typed, frozen configuration of the eviction daemon.

The daemon reads a TOML file (``systemd/adstore.toml`` is the documented
example) and command-line flags; flags win over the file.  Every value is
parsed and checked here, once, so the rest of the daemon works with plain
ints and floats and an invalid setting is a :class:`ConfigError` that names
the field — before the daemon touches the store.

Sizes and durations are parsed by the store's own helpers
(:mod:`adstore.store.fsutil`), so ``"10G"`` means the same to the daemon, the
CLI and a writer's ``max_size``: ``K``, ``M``, ``G``, ``T`` (also written
``KiB``/``KB``…) are powers of 1024; durations are seconds or ``"250ms"``,
``"90s"``, ``"5m"``, ``"2h"``, ``"7d"``, ``"2w"``.  ``min_free`` is bytes, a size string, or a percentage of the
filesystem (``"10%"``).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adstore.store.errors import ConfigError
from adstore.store.units import parse_duration, parse_fraction, parse_min_free, parse_size

__all__ = [
    "DaemonConfig",
    "parse_size",
    "parse_duration",
    "parse_fraction",
    "parse_min_free",
    "LOG_LEVELS",
    "ConfigError",
]

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

def _parse_bool(value: object, *, field: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(field, f"expected true or false, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Everything the daemon needs, validated; build with :meth:`from_config`.

    ``max_size`` and the free-space floor together define the budget (the
    smaller wins).  Enforcement starts when the store grows past
    ``high_watermark`` × budget and evicts least-recently-used entries until
    it is at or below ``low_watermark`` × budget, ``batch_size`` entries per
    write transaction so a reader never waits long and SIGTERM is honoured
    between batches.
    """

    root: Path | None = None
    max_size: int | None = None
    min_free_bytes: int | None = None
    min_free_percent: float | None = None
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    grace_period: float = 3600.0
    max_age: float | None = None
    batch_size: int = 1000
    debounce: float = 0.2
    max_delay: float = 1.0
    fallback_interval: float = 300.0
    sweep_interval: float = 3600.0
    log_level: str = "info"
    watch: bool = True
    source: Path | None = None
    overrides: tuple[tuple[str, Any], ...] = ()

    # Keys accepted in the TOML file and as overrides (flags).
    KEYS = (
        "root", "max_size", "min_free", "high_watermark", "low_watermark", "grace_period",
        "max_age", "batch_size", "debounce", "max_delay", "fallback_interval",
        "sweep_interval", "log_level", "watch",
    )

    def __post_init__(self) -> None:
        if self.max_size is not None and self.max_size <= 0:
            raise ConfigError("max_size", f"must be positive, got {self.max_size}")
        if not self.low_watermark < self.high_watermark:
            raise ConfigError(
                "low_watermark",
                f"must be below high_watermark ({self.low_watermark} >= {self.high_watermark})",
            )
        if not 1 <= self.batch_size <= 1_000_000:
            raise ConfigError("batch_size", f"must be between 1 and 1000000, got {self.batch_size}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.fallback_interval <= 0:
            raise ConfigError("fallback_interval", "must be positive")
        if self.sweep_interval <= 0:
            raise ConfigError("sweep_interval", "must be positive")
        if self.max_delay < self.debounce:
            raise ConfigError("max_delay", f"must be at least debounce ({self.debounce}s)")

    # ---------------------------------------------------------------- factories
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: Path | None = None,
                     overrides: Mapping[str, Any] | None = None) -> DaemonConfig:
        """Parse raw settings (TOML values or flag strings); overrides win over ``data``."""
        merged: dict[str, Any] = {}
        for origin in (data, overrides or {}):
            for name, value in origin.items():
                if name not in cls.KEYS:
                    raise ConfigError(name, f"unknown setting; known settings: {', '.join(cls.KEYS)}")
                if value is not None:
                    merged[name] = value
        kwargs: dict[str, Any] = {}
        if "root" in merged:
            if not isinstance(merged["root"], (str, os.PathLike)) or not str(merged["root"]).strip():
                raise ConfigError("root", f"expected a directory path, got {merged['root']!r}")
            root = Path(os.path.expanduser(str(merged["root"])))
            if not root.is_absolute() and source is not None:
                root = source.parent / root
            kwargs["root"] = root
        if "max_size" in merged:
            size = merged["max_size"]
            kwargs["max_size"] = None if size in ("", "none", 0) else parse_size(size, field="max_size")
        if "min_free" in merged:
            kwargs["min_free_bytes"], kwargs["min_free_percent"] = parse_min_free(merged["min_free"])
        for name in ("high_watermark", "low_watermark"):
            if name in merged:
                kwargs[name] = parse_fraction(merged[name], field=name)
        for name in ("grace_period", "debounce", "max_delay", "fallback_interval", "sweep_interval"):
            if name in merged:
                kwargs[name] = parse_duration(merged[name], field=name)
        if "max_age" in merged:
            age = merged["max_age"]
            kwargs["max_age"] = None if age in ("", "none", 0) else parse_duration(age, field="max_age")
            if kwargs["max_age"] == 0:
                kwargs["max_age"] = None
        if "batch_size" in merged:
            raw = merged["batch_size"]
            try:
                if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                    raise ValueError
                kwargs["batch_size"] = int(raw)
            except (TypeError, ValueError):
                raise ConfigError("batch_size", f"expected a whole number, got {raw!r}") from None
        if "log_level" in merged:
            kwargs["log_level"] = str(merged["log_level"]).strip().lower()
        if "watch" in merged:
            kwargs["watch"] = _parse_bool(merged["watch"], field="watch")
        return cls(source=source, overrides=tuple(sorted((overrides or {}).items())), **kwargs)

    @classmethod
    def from_config(cls, path: str | os.PathLike[str] | None = None, **overrides: Any) -> DaemonConfig:
        """Load ``path`` (TOML; settings at top level or under ``[daemon]``) then apply flag overrides."""
        flags = {k: v for k, v in overrides.items() if v is not None}
        if path is None:
            return cls.from_mapping({}, overrides=flags)
        source = Path(path).absolute()
        try:
            with open(source, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError("config", f"configuration file {source} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{source} is not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError("config", f"cannot read {source}: {exc.strerror or exc}") from None
        section = data.get("daemon", {}) if set(data) <= {"daemon"} else data
        if not isinstance(section, Mapping):
            raise ConfigError("daemon", "expected a [daemon] table")
        return cls.from_mapping(section, source=source, overrides=flags)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> DaemonConfig:
        """``$ADSTORE_CONFIG`` (a TOML path) and ``$ADSTORE_ROOT``, then overrides."""
        env = os.environ if environ is None else environ
        if env.get("ADSTORE_ROOT") and overrides.get("root") is None:
            overrides["root"] = env["ADSTORE_ROOT"]
        return cls.from_config(env.get("ADSTORE_CONFIG") or None, **overrides)

    def reload(self) -> DaemonConfig:
        """Re-read the same file with the same flag overrides (SIGHUP)."""
        return type(self).from_config(self.source, **dict(self.overrides))

    # ---------------------------------------------------------------- budget
    @property
    def has_budget(self) -> bool:
        return self.max_size is not None or self.min_free_bytes is not None or self.min_free_percent is not None

    def min_free_for(self, fs_total: int) -> int | None:
        """The free-space floor in bytes for a filesystem of ``fs_total`` bytes."""
        if self.min_free_percent is not None:
            return int(fs_total * self.min_free_percent / 100.0)
        return self.min_free_bytes

    def budget(self, *, size: int, fs_total: int, fs_free: int) -> int | None:
        """Bytes the store may use now: ``max_size`` capped so the filesystem keeps ``min_free``."""
        limit = self.max_size
        floor = self.min_free_for(fs_total)
        if floor is not None:
            by_free = max(0, size + fs_free - floor)
            limit = by_free if limit is None else min(limit, by_free)
        return limit

    def describe(self) -> dict[str, Any]:
        """JSON-safe view (for ``--json`` output and the daemon's status file)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "overrides":
                continue
            out[f.name] = str(value) if isinstance(value, Path) else value
        return out
