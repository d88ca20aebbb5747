"""adstore.daemon: the eviction daemon, its configuration and the ``adstore`` CLI.

The daemon keeps a store within a disk budget (docs/configuration.md,
"The daemon"); the CLI inspects and maintains a store (docs/cli.md).  Only the
configuration is imported eagerly: the daemon (watchdog) and the CLI load on
first use, and nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from .config import SETTINGS, DaemonConfig, settings_table

__all__ = ["DaemonConfig", "SETTINGS", "settings_table", "Daemon", "main"]


def __getattr__(name: str) -> Any:
    if name == "Daemon":
        from .daemon import Daemon

        return Daemon
    if name == "main":
        from .cli import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
