"""Typed, frozen configuration of the eviction daemon (docs/configuration.md, "The daemon").

Every daemon setting is declared once, as an attribute of :class:`DaemonConfig`
made with :func:`setting` (its kind, default and help).  That one table,
:data:`SETTINGS`, drives everything else: loading the TOML file, the flags of
``adstore daemon`` and their help, :meth:`DaemonConfig.describe` (the daemon's
status file and ``--json``) and the configuration table of the docs
(:func:`settings_table`).  Adding a setting is one attribute here plus a
(commented) line in ``systemd/adstore.toml``; a test checks both.

Values are parsed and checked here, once, so the rest of the daemon works with
plain ints and floats and an invalid setting is a :class:`ConfigError` naming
the field before the daemon touches the store.  Each source (the file, then
the flags) is checked on its own, so an invalid value in the file is reported
even when a flag overrides it.  Sizes, percentages and durations mean what
:mod:`adstore.store.units` says (``"10G"`` = 10 GiB, ``"10GB"`` = 10**10
bytes, ``"10%"``, ``"90s"``), the same as for the store and the CLI.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from adstore.store import (
    DEFAULT_GRACE_PERIOD,
    Budget,
    ConfigError,
    MinFree,
    format_duration,
    parse_count,
    parse_duration,
    parse_fraction,
    parse_min_free,
    parse_size,
)

__all__ = ["DaemonConfig", "Kind", "Setting", "SETTINGS", "LOG_LEVELS", "setting", "settings_table", "ConfigError"]

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_NONE_WORDS = ("", "none")


# ---------------------------------------------------------------- kinds of values
@dataclasses.dataclass(frozen=True)
class Kind:
    """How one kind of value is read (TOML value or flag text) and written back."""

    metavar: str
    parse: Callable[[object, str], Any]  # raw value, field name -> typed value
    show: Callable[[Any], str] = lambda v: str(v)  # typed value -> TOML text (docs, --help)
    dump: Callable[[Any], Any] = lambda v: v  # typed value -> JSON-safe value


def _none_or(kind: Kind, *, zero_is_none: bool) -> Kind:
    """``kind``, or None for ``"none"``/``""`` (and for 0 when ``zero_is_none``)."""

    def parse(value: object, field: str) -> Any:
        if isinstance(value, str) and value.strip().lower() in _NONE_WORDS:
            return None
        parsed = kind.parse(value, field)
        return None if zero_is_none and parsed == 0 else parsed

    return Kind(
        kind.metavar,
        parse,
        lambda v: "none" if v is None else kind.show(v),
        lambda v: None if v is None else kind.dump(v),
    )


def _path_parser(what: str) -> Callable[[object, str], Path]:
    def parse(value: object, field: str) -> Path:
        if not isinstance(value, (str, os.PathLike)) or not str(value).strip() or "\0" in str(value):
            raise ConfigError(field, f"expected {what}, got {value!r}")
        return Path(os.path.expanduser(str(value)))

    return parse


def _parse_count(value: object, field: str) -> int:
    return parse_count(value, field=field, minimum=-(1 << 63))


def _parse_bool(value: object, field: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(field, f"expected true or false, got {value!r}")


def _parse_url(value: object, field: str) -> str:
    text = str(value).strip() if isinstance(value, str) else ""
    scheme, sep, rest = text.partition("://")
    if not (sep and scheme.isascii() and scheme[:1].isalpha() and scheme.isalnum() and rest) or any(
        c.isspace() or c == "\0" for c in text
    ):
        raise ConfigError(field, f"expected a URL such as s3://BUCKET/PREFIX or http://HOST:PORT/PREFIX, got {value!r}")
    return text


def _parse_remote_mode(value: object, field: str) -> str:
    text = str(value).strip().lower().replace("_", "-")
    if text not in ("read", "read-write"):
        raise ConfigError(field, f'expected "read" or "read-write", got {value!r}')
    return text


def _show_min_free(v: MinFree) -> str:
    return f'"{v.percent:g}%"' if v.percent is not None else str(v.bytes)


PATH = Kind("DIR", _path_parser("a directory path"), lambda v: f'"{v}"', str)
FILE = _none_or(Kind("FILE", _path_parser("a file path"), lambda v: f'"{v}"', str), zero_is_none=False)
SIZE = _none_or(Kind("SIZE", lambda v, f: parse_size(v, field=f)), zero_is_none=True)
MIN_FREE = _none_or(
    Kind(
        "SIZE|PCT",
        lambda v, f: parse_min_free(v, field=f),
        _show_min_free,
        lambda v: f"{v.percent:g}%" if v.percent is not None else v.bytes,
    ),
    zero_is_none=False,
)
FRACTION = Kind("FRACTION", lambda v, f: parse_fraction(v, field=f), lambda v: f"{v:g}")
DURATION = Kind("DURATION", lambda v, f: parse_duration(v, field=f), lambda v: f'"{format_duration(v)}"')
AGE = _none_or(DURATION, zero_is_none=True)
COUNT = Kind("N", _parse_count)
LEVEL = Kind("LEVEL", lambda v, f: str(v).strip().lower(), lambda v: f'"{v}"')
BOOL = Kind("BOOL", _parse_bool, lambda v: "true" if v else "false")
URL = _none_or(Kind("URL", _parse_url, lambda v: f'"{v}"'), zero_is_none=False)
REMOTE_MODE = Kind("MODE", _parse_remote_mode, lambda v: f'"{v}"')


# ---------------------------------------------------------------- the table
@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the configuration table: a TOML key, a flag, a row of the docs' table."""

    name: str
    kind: Kind
    default: Any
    help: str
    check: Callable[[Any], str | None] | None = None  # a problem with a typed value, or None
    shown_default: str | None = None  # the docs' text when the default is not a value

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def default_text(self) -> str:
        return self.shown_default or self.kind.show(self.default)

    def parse(self, value: object) -> Any:
        """A raw value (TOML or flag text) as the typed, checked value."""
        return self.validate(self.kind.parse(value, self.name))

    def validate(self, value: Any) -> Any:
        problem = self.check(value) if self.check is not None and value is not None else None
        if problem:
            raise ConfigError(self.name, f"{problem}, got {value!r}")
        return value


def setting(
    kind: Kind,
    default: Any,
    help: str,
    *,
    check: Callable[[Any], str | None] | None = None,
    shown_default: str | None = None,
) -> Any:
    """A :class:`DaemonConfig` attribute that is also a row of :data:`SETTINGS`."""
    row = {"kind": kind, "help": help, "check": check, "shown_default": shown_default}
    return dataclasses.field(default=default, metadata={"setting": row})


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be positive"


def _fraction(v: float) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


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

    root: Path | None = setting(
        PATH,
        None,
        "store root; a relative path is relative to the configuration file",
        shown_default="`$ADSTORE_ROOT`, else `~/.cache/adstore`",
    )
    max_size: int | None = setting(SIZE, None, 'most bytes the store may use (0 or "none": no limit)', check=_positive)
    min_free: MinFree | None = setting(
        MIN_FREE,
        None,
        "free space to keep on the store's filesystem: a size or a percentage of "
        'the filesystem ("10%"); with max_size, the smaller limit wins',
    )
    high_watermark: float = setting(
        FRACTION, 0.95, 'eviction starts above this fraction of the budget (0.95 or "95%")', check=_fraction
    )
    low_watermark: float = setting(
        FRACTION, 0.85, "eviction stops at or below this fraction of the budget (below high_watermark)", check=_fraction
    )
    grace_period: float = setting(
        DURATION,
        DEFAULT_GRACE_PERIOD,
        "entries and unreferenced blobs younger than this are never evicted or swept (the store's default)",
    )
    max_age: float | None = setting(
        AGE, None, 'also evict entries unused for this long, whatever the size (0 or "none": never)'
    )
    batch_size: int = setting(
        COUNT,
        1000,
        "entries evicted per write transaction; SIGTERM waits for the current batch",
        check=lambda v: None if 1 <= v <= 1_000_000 else "must be between 1 and 1000000",
    )
    debounce: float = setting(
        DURATION, 0.2, "filesystem events are coalesced: a check runs once the store was quiet this long"
    )
    max_delay: float = setting(
        DURATION, 1.0, "a check runs at the latest this long after the first event (at least debounce)"
    )
    fallback_interval: float = setting(
        DURATION, 300.0, "a budget check also runs this often, in case filesystem events were missed", check=_positive
    )
    sweep_interval: float = setting(
        DURATION,
        3600.0,
        "orphan sweep (files without rows, stale temp files, abandoned uncommitted "
        "manifests, leases of dead processes) runs this often",
        check=_positive,
    )
    log_level: str = setting(
        LEVEL,
        "info",
        "one of " + ", ".join(LOG_LEVELS),
        check=lambda v: None if v in LOG_LEVELS else f"must be one of {', '.join(LOG_LEVELS)}",
    )
    watch: bool = setting(BOOL, True, "false: no inotify, the fallback timer only")
    metrics_path: Path | None = setting(
        FILE,
        None,
        "write Prometheus metrics here after every pass (node-exporter textfile format, e.g. "
        "/var/lib/prometheus/node-exporter/adstore.prom); relative to the configuration file",
    )
    remote: str | None = setting(
        URL,
        None,
        "the remote tier for `adstore push`, `pull` and `remote` with this file (`--config`, "
        "`$ADSTORE_CONFIG`): s3://BUCKET/PREFIX or http(s)://HOST:PORT/PREFIX; `$ADSTORE_REMOTE` and "
        "`--remote` win",
        shown_default="none (`$ADSTORE_REMOTE`)",
    )
    remote_mode: str = setting(
        REMOTE_MODE,
        "read",
        '"read" or "read-write" (builders) for that remote; `$ADSTORE_REMOTE_MODE` and `--mode` win',
    )
    # Where the settings came from (not settings): reload() reads them again.
    source: Path | None = None
    overrides: tuple[tuple[str, Any], ...] = ()

    KEYS: ClassVar[tuple[str, ...]]  # the settings' names (TOML keys); set below from SETTINGS

    def __post_init__(self) -> None:
        for row in SETTINGS:
            row.validate(getattr(self, row.name))
        if not self.low_watermark < self.high_watermark:
            raise ConfigError(
                "low_watermark", f"must be below high_watermark ({self.low_watermark} >= {self.high_watermark})"
            )
        if self.max_delay < self.debounce:
            raise ConfigError("max_delay", f"must be at least debounce ({self.debounce}s)")

    # ---------------------------------------------------------------- factories
    @classmethod
    def parse_settings(cls, data: Mapping[str, Any], *, source: Path | None = None) -> dict[str, Any]:
        """Typed values of one source's raw settings (None values are left out).

        A relative ``root`` or ``metrics_path`` from a file (``source``) is relative to that file.
        """
        rows = {row.name: row for row in SETTINGS}
        parsed: dict[str, Any] = {}
        for name, value in data.items():
            if name not in rows:
                raise ConfigError(name, f"unknown setting; known settings: {', '.join(rows)}")
            if value is None:
                continue
            parsed[name] = rows[name].parse(value)
        for name in ("root", "metrics_path"):
            path = parsed.get(name)
            if path is not None and not path.is_absolute() and source is not None:
                parsed[name] = source.parent / path
        return parsed

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], *, source: Path | None = None, overrides: Mapping[str, Any] | None = None
    ) -> DaemonConfig:
        """Parse raw settings (TOML values or flag strings); overrides win over ``data``.

        Each is checked on its own first: a bad value in ``data`` is an error
        even when ``overrides`` replaces it.
        """
        flags = {k: v for k, v in (overrides or {}).items() if v is not None}
        kwargs = cls.parse_settings(data, source=source)
        kwargs.update(cls.parse_settings(flags))
        return cls(source=source, overrides=tuple(sorted(flags.items())), **kwargs)

    @classmethod
    def from_config(cls, path: str | os.PathLike[str] | None = None, **overrides: Any) -> DaemonConfig:
        """Load ``path`` (TOML; settings at top level or under ``[daemon]``) then apply flag overrides."""
        if path is None:
            return cls.from_mapping({}, overrides=overrides)
        source = Path(path).absolute()
        try:
            if not stat.S_ISREG(source.stat().st_mode):  # a FIFO would block the read forever
                raise ConfigError("config", f"configuration file {source} is not a regular file")
            with open(source, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError("config", f"configuration file {source} does not exist") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ConfigError("config", f"{source} is not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError("config", f"cannot read {source}: {exc.strerror or exc}") from None
        section = data.get("daemon", {}) if set(data) <= {"daemon"} else data
        if not isinstance(section, Mapping):
            raise ConfigError("daemon", "expected a [daemon] table")
        return cls.from_mapping(section, source=source, overrides=overrides)

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
    def min_free_bytes(self) -> int | None:
        return None if self.min_free is None else self.min_free.bytes

    @property
    def min_free_percent(self) -> float | None:
        return None if self.min_free is None else self.min_free.percent

    @property
    def has_budget(self) -> bool:
        return self.max_size is not None or self.min_free is not None

    def store_budget(self) -> Budget:
        """This budget as the store persists it (``Store.set_budget``) for writers and ``adstore stats``."""
        return Budget(
            max_size=self.max_size,
            min_free=self.min_free,
            high_watermark=self.high_watermark,
            low_watermark=self.low_watermark,
            grace_period=self.grace_period,
        )

    def budget(self, *, size: int, fs_total: int, fs_free: int) -> int | None:
        """Bytes the store may use now: ``max_size`` capped so the filesystem keeps ``min_free``."""
        return self.store_budget().limit(size=size, fs_total=fs_total, fs_free=fs_free)

    def describe(self) -> dict[str, Any]:
        """JSON-safe view (for ``--json`` output and the daemon's status file)."""
        out = {row.name: row.kind.dump(getattr(self, row.name)) for row in SETTINGS}
        out["source"] = None if self.source is None else str(self.source)
        return out


#: The configuration table, in declaration order.
SETTINGS: tuple[Setting, ...] = tuple(
    Setting(name=f.name, default=f.default, **f.metadata["setting"])
    for f in dataclasses.fields(DaemonConfig)
    if "setting" in f.metadata
)
DaemonConfig.KEYS = tuple(row.name for row in SETTINGS)


def settings_table() -> str:
    """The configuration table (markdown) of docs/configuration.md, "The daemon", generated from :data:`SETTINGS`."""
    lines = ["| setting | flag | default | meaning |", "|---|---|---|---|"]
    for row in SETTINGS:
        flag = f"`{row.flag}`" if row.name == "root" else f"`{row.flag} {row.kind.metavar}`"
        flag = flag.replace("|", "\\|")  # a pipe inside a table cell, even in code
        default = row.shown_default or f"`{row.kind.show(row.default)}`"
        lines.append(f"| `{row.name}` | {flag} | {default} | {row.help} |")
    return "\n".join(lines) + "\n"
