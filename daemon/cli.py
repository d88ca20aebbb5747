"""The ``adstore`` command line: argument parsing and the one error table.

``main(argv)`` never lets a traceback reach the user: every exception is
mapped by :data:`EXIT_CODES` (first matching class wins) to one line on
stderr and an exit code.  ``--root`` and ``--json`` are accepted before or
after the subcommand.  ``-v`` turns on debug logging, which also logs the
traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from adstore.daemon.commands import SORT_CHOICES, Context, cmd_inspect, cmd_ls, cmd_stats
from adstore.daemon.config import SETTINGS
from adstore.daemon.errors import (
    AlreadyRunning,
    AmbiguousKey,
    FeatureUnavailable,
    RemoteFailed,
    StillOverBudget,
    UnknownKey,
    UsageError,
)
from adstore.daemon.explain import cmd_explain
from adstore.daemon.maintenance import cmd_daemon, cmd_demo, cmd_freeze, cmd_gc, cmd_pin, cmd_rm, cmd_unpin, cmd_verify
from adstore.daemon.remote_cmds import (
    add_remote_arguments,
    add_selection_arguments,
    cmd_keygen,
    cmd_pull,
    cmd_push,
    cmd_remote,
)
from adstore.daemon.run import add_run_arguments, cmd_run
from adstore.store import (
    DURATION_HELP,
    SIZE_HELP,
    AccessDenied,
    AdstoreError,
    BlobMissing,
    ChecksumMismatch,
    ConfigError,
    CorruptRow,
    IncompatibleStore,
    InvalidKey,
    NoStore,
    OverBudget,
    ReadOnlyStore,
    Reason,
    StoreError,
    StoreFull,
    UnsafeRoot,
    UnsupportedFilesystem,
    is_disk_full,
    parse_count,
    parse_duration,
    parse_min_free,
    parse_size,
)

__all__ = ["main", "build_parser", "EXIT_CODES", "exit_code_for", "report_error"]

log = logging.getLogger(__name__)

# The one table: error class -> exit code (first match wins; order matters).
# 0 success, 1 a check failed (verify found problems, rm refused an entry),
# 2 usage (argparse uses 2 as well).  No input reaches 70: that is a bug.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (UsageError, 2),
    (ConfigError, 2),
    (UnknownKey, 3),
    (AmbiguousKey, 4),
    (InvalidKey, 3),  # text that cannot be a key (not UTF-8): no entry has it
    (AlreadyRunning, 5),
    (FeatureUnavailable, 6),
    (RemoteFailed, 14),  # push/pull could not transfer some keys (docs/cli.md, "Exit codes")
    (UnsupportedFilesystem, 7),
    (UnsafeRoot, 7),
    (IncompatibleStore, 7),
    (OverBudget, 8),
    (StillOverBudget, 8),
    (StoreFull, 8),
    (ChecksumMismatch, 9),
    (BlobMissing, 9),
    (CorruptRow, 9),
    (AccessDenied, 11),
    (ReadOnlyStore, 15),  # a write asked of a read-only store (a read-only mount, a seed store)
    (NoStore, 13),
    (StoreError, 10),
    (AdstoreError, 10),
    (PermissionError, 11),
    (OSError, 12),
    (KeyboardInterrupt, 130),
    (Exception, 70),  # a bug: EX_SOFTWARE
)


def exit_code_for(exc: BaseException) -> int:
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return 70


_MAX_MESSAGE = 400  # a 10k-character key must not become a 10k-character error line


def _message(exc: BaseException) -> str:
    """One line for ``exc``: the error's own text, an OS error's reason and file, or "internal error"."""
    if isinstance(exc, KeyboardInterrupt):
        text = "interrupted"
    elif isinstance(exc, AdstoreError):
        text = str(exc)
    elif isinstance(exc, OSError):
        where = f" {exc.filename}" if exc.filename else ""
        text = f"{exc.strerror or exc}{':' if where else ''}{where}"
    else:
        text = f"internal error: {type(exc).__name__}: {exc} (run with -v for details)"
    text = " ".join(text.split())
    if len(text) > _MAX_MESSAGE:
        text = f"{text[: _MAX_MESSAGE // 2]} … {text[-_MAX_MESSAGE // 4 :]}"
    return text


def _reason(exc: BaseException) -> str:
    if isinstance(exc, AdstoreError):
        return str(exc.reason)
    if isinstance(exc, PermissionError):
        return str(Reason.PERMISSION_DENIED)
    if isinstance(exc, OSError):
        return str(Reason.DISK_FULL if is_disk_full(exc) else Reason.IO_ERROR)
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else str(Reason.ERROR)


def report_error(exc: BaseException, *, where: str, json_out: bool) -> int:
    """The one place an error becomes output and an exit code, for every command.

    One line on stderr; with ``--json`` also one object on stdout,
    ``{"error": {"reason", "message", "exit_code"}}`` plus the error's
    ``details`` when it carries them (docs/cli.md, "JSON output and errors").
    """
    code = exit_code_for(exc)
    message = _message(exc)
    sys.stderr.write(f"{where}: error: {message}\n")
    if json_out:
        body: dict[str, Any] = {"reason": _reason(exc), "message": message, "exit_code": code}
        details = getattr(exc, "details", None)
        if isinstance(details, dict):
            body["details"] = details
        sys.stdout.write(json.dumps({"error": body}, sort_keys=True, default=str) + "\n")
        sys.stdout.flush()
    return code


def _argtype(parse: Callable[..., Any]) -> Callable[[str], Any]:
    """An argparse ``type=`` from a units parser: a ConfigError becomes a usage error."""

    def convert(text: str) -> Any:
        try:
            return parse(text, field="value")
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(exc.why) from None

    return convert


_size = _argtype(parse_size)
_duration = _argtype(parse_duration)


_positive_int = _argtype(functools.partial(parse_count, minimum=1))
_rank = _argtype(parse_count)


def _min_free_flag(text: str, *, field: str) -> str | int:
    """A percentage stays text (the store reads it against its filesystem); a size is bytes."""
    floor = parse_min_free(text, field=field)
    return f"{floor.percent:g}%" if floor.percent is not None else int(floor.bytes or 0)


_min_free = _argtype(_min_free_flag)


def _at_most(limit: int) -> type[argparse.Action]:
    """``nargs="+"`` with an upper bound: more values is a usage error (exit 2)."""

    class AtMost(argparse.Action):
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: Any,
            option_string: str | None = None,
        ) -> None:
            if len(values) > limit:
                raise argparse.ArgumentError(self, f"takes at most {limit} values, got {len(values)}")
            setattr(namespace, self.dest, values)

    return AtMost


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (and exit 2) like every other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)", prog=self.prog)


def _version() -> str:
    try:
        return importlib.metadata.version("adstore")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


_UNITS = f"SIZE: {SIZE_HELP}; PCT: a percentage of the filesystem (10%); DURATION: {DURATION_HELP}."
_KEYS = "cache key or unambiguous prefix"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a value given after the subcommand must not be reset by the default.
    common.add_argument(
        "--root",
        type=Path,
        default=argparse.SUPPRESS,
        metavar="DIR",
        help="store root (default: $ADSTORE_ROOT or ~/.cache/adstore)",
    )
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    parser = _Parser(
        prog="adstore",
        parents=[common],
        epilog=_UNITS,
        description="Content-addressed artifact store for model-compilation pipelines.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="print the version and exit"
    )
    sub = parser.add_subparsers(
        dest="command",
        metavar="COMMAND",
        parser_class=_Parser,
        help="one of the commands below; `adstore COMMAND --help` for its flags",
    )
    sub.required = True

    def add(name: str, func: Callable[..., int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_, description=help_, epilog=_UNITS)
        p.set_defaults(func=func)
        return p

    p = add("stats", cmd_stats, "summary of the store, like `ccache -s`")
    p.add_argument("--config", type=Path, metavar="FILE", help="daemon config: its root (unless --root) and its budget")
    p.add_argument(
        "--prometheus", action="store_true", help="print Prometheus metrics (the daemon's metrics_path file) instead"
    )
    p.add_argument(
        "--zero", "-z", action="store_true", help="set the counters (hits, misses, saves…) to 0, like `ccache -z`"
    )

    p = add("ls", cmd_ls, "list entries")
    p.add_argument(
        "--sort", choices=SORT_CHOICES, default="last_access", help="sort key (default: last_access, most recent first)"
    )
    p.add_argument("--reverse", "-r", action="store_true", help="reverse the sort order")
    p.add_argument("--namespace", "-n", help="only this namespace (pipeline, engine, …)")
    p.add_argument("--match", metavar="PREFIX", help="only keys starting with PREFIX")
    p.add_argument("--pinned", action="store_true", help="only pinned entries")
    p.add_argument(
        "--unused-for", type=_duration, metavar="DURATION", help="only entries not used for DURATION (e.g. 7d)"
    )
    p.add_argument("--min-size", type=_size, metavar="SIZE", help="only entries of at least SIZE")
    p.add_argument("--limit", "-l", type=_positive_int, metavar="N", help="show at most N entries")

    p = add("inspect", cmd_inspect, "show an entry: per-rank manifests, artifacts, snapshot summary")
    p.add_argument("key", help=_KEYS)
    p.add_argument("--no-summary", action="store_true", help="do not summarize snapshots (avoids importing torch)")

    p = add("explain", cmd_explain, "show an entry's key components, which differ between two, or this host's")
    p.add_argument(
        "keys",
        nargs="*",
        action=_at_most(2),
        metavar="KEY",
        help=f"one or two keys: {_KEYS}; a key not in the store is compared with the nearest entry",
    )
    p.add_argument(
        "--host",
        action="store_true",
        help="this host's key components: toolchain, torch key, paths, user (imports torch)",
    )
    p.add_argument(
        "--misses",
        type=_positive_int,
        nargs="?",
        const=5,
        metavar="N",
        help="the last N keys this user's processes missed, each against its nearest entry (default 5)",
    )

    p = add("verify", cmd_verify, "rehash blobs and check every invariant")
    p.add_argument("--fix", action="store_true", help="repair what can be repaired")

    p = add("gc", cmd_gc, "evict entries over a budget and sweep orphans (plan first)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--max-size", type=_size, metavar="SIZE", help="evict LRU entries down to SIZE")
    p.add_argument(
        "--min-free",
        type=_min_free,
        metavar="SIZE|PCT",
        help="evict until the filesystem has this much free (bytes or e.g. 10%%)",
    )
    p.add_argument("--older-than", type=_duration, metavar="DURATION", help="evict entries unused for DURATION")
    p.add_argument(
        "--grace-period",
        type=_duration,
        metavar="DURATION",
        help="spare entries and blobs younger than this (default: the config's, else the store's)",
    )
    p.add_argument("--no-sweep", action="store_true", help="do not sweep orphans")
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=1000,
        metavar="N",
        help="entries evicted per write transaction (default 1000)",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="daemon config: its root (unless --root), and the limits not given as flags",
    )

    for name, func, help_ in (
        ("rm", cmd_rm, "remove entries (all ranks)"),
        ("pin", cmd_pin, "keep entries whatever the budget"),
        ("unpin", cmd_unpin, "let entries be evicted again"),
    ):
        p = add(name, func, help_)
        p.add_argument("keys", nargs="+", metavar="KEY", help=_KEYS)
        if name == "rm":
            p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")

    add("freeze", cmd_freeze, "mark the store frozen where it is built: read-only, and lock-free on a read-only mount")

    p = add("daemon", cmd_daemon, "run the eviction daemon (systemd Type=notify)")
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML configuration (flags override it)")
    p.add_argument("--once", action="store_true", help="run one enforcement pass and a sweep, then exit")
    for row in SETTINGS:
        if row.name == "root":  # --root is common to every command
            continue
        # Strings, parsed and checked by DaemonConfig: flags and the file give the same errors.
        p.add_argument(
            row.flag,
            dest=row.name,
            metavar=row.kind.metavar,
            help=f"{row.help} (default: {row.default_text()})".replace("%", "%%"),
        )

    p = add("push", cmd_push, "upload committed entries to the remote tier (blobs it lacks, then signed records)")
    p.add_argument("keys", nargs="*", metavar="KEY", help=_KEYS)
    add_selection_arguments(p, "push", "every committed entry of the local store")
    add_remote_arguments(p)

    p = add("pull", cmd_pull, "prefetch entries from the remote tier into the local store")
    p.add_argument("keys", nargs="*", metavar="KEY", help="full cache key (the local store may not have it)")
    add_selection_arguments(p, "pull", "every record the remote holds signed by a trusted key (a WebDAV or S3 remote)")
    p.add_argument(
        "--world-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="the entry's world size; every rank is pulled unless --rank (default: 1)",
    )
    p.add_argument("--rank", type=_rank, metavar="N", help="pull only this rank")
    add_remote_arguments(p)

    p = add("remote", cmd_remote, "show the remote tier: URL, mode, reachability, keys, counters")
    p.add_argument("--no-probe", action="store_true", help="do not contact the server")
    add_remote_arguments(p)

    p = add(
        "keygen", cmd_keygen, "write an Ed25519 key pair: NAME.key signs the remote's records, NAME.pub checks them"
    )
    p.add_argument("directory", type=Path, metavar="DIR", help="where to write NAME.key (0600) and NAME.pub")
    p.add_argument("--name", default="adstore", help="the files' stem (default: adstore)")

    p = add("run", cmd_run, "run a program with adstore in every Python process it starts (no edit)")
    add_run_arguments(p)

    p = add("demo", cmd_demo, "build a small model, run the cached pipeline twice, show the speed-up")
    p.add_argument(
        "--arch",
        default="llama",
        help="a tuned architecture (llama, qwen3_5_moe, gemma4, glm4_moe_lite, ...) or any transformers "
        "model type the survey handles (default: llama)",
    )
    p.add_argument("--layers", type=_positive_int, default=4, metavar="N", help="decoder layers (default: 4)")
    p.add_argument("--hidden", type=_positive_int, default=256, metavar="N", help="hidden size (default: 256)")
    p.add_argument(
        "--world-size", type=_positive_int, default=1, metavar="N", help="ranks, one process each (default: 1)"
    )
    p.add_argument(
        "--compile",
        choices=("eager", "aoti", "torch_compile"),
        default="eager",
        help="the compile stage's backend: the graph as is, an AOTInductor engine from the engine cache, "
        "or torch.compile (default: eager)",
    )
    return parser


def _wants_json(argv: Sequence[str]) -> bool:
    """``--json`` among the options (before a ``--``), even when the rest does not parse."""
    options = argv[: list(argv).index("--")] if "--" in argv else argv
    return "--json" in options


def _tolerant_output() -> None:
    """Print undecodable names (non-UTF-8 paths or keys from argv) instead of failing on them."""
    for stream, errors in ((sys.stdout, "surrogateescape"), (sys.stderr, "backslashreplace")):
        try:
            stream.reconfigure(errors=errors)  # type: ignore[union-attr]
        except (AttributeError, ValueError):  # not a text wrapper (tests, pipes already wrapped)
            pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``adstore`` console script; returns the exit code."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    _tolerant_output()
    parser = build_parser()
    try:
        args = parser.parse_args(arguments)
    except SystemExit as exc:  # --help or --version
        return int(exc.code) if isinstance(exc.code, int) else 0
    except UsageError as exc:
        return report_error(exc, where=exc.prog, json_out=_wants_json(arguments))
    verbose = getattr(args, "verbose", False)
    if args.command != "daemon":  # the daemon configures its own logging
        # The store reports what it tolerated (skipped records, quarantines) as warnings.
        logging.basicConfig(
            level=logging.DEBUG if verbose else logging.WARNING,
            format="adstore: %(levelname)s: %(message)s" if not verbose else "%(levelname)s %(name)s: %(message)s",
        )
    ctx = Context(
        root=getattr(args, "root", None),
        json=getattr(args, "json", False),
        grace_period=getattr(args, "grace_period", None),
    )
    try:
        return int(args.func(args, ctx))
    except BrokenPipeError:  # `adstore ls | head`: quiet, and no flush error at exit
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except BaseException as exc:  # noqa: BLE001 - the one place errors become exit codes
        if isinstance(exc, SystemExit):
            raise
        log.debug("command %s failed", args.command, exc_info=True)
        return report_error(exc, where=f"adstore {args.command}", json_out=ctx.json)
    finally:
        try:
            ctx.close()
        except Exception:  # closing must not mask the command's result
            log.debug("closing the store failed", exc_info=True)


if __name__ == "__main__":  # `python -m adstore.daemon.cli` is the command too, never a silent no-op
    sys.exit(main())
