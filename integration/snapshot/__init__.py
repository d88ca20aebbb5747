"""Structural snapshots of pre-weight-loading modules (README, "Snapshots and their safety")."""

from adstore.integration.snapshot.codec import (
    FORMAT,
    HOOKS_ARTIFACT,
    MODULE_ARTIFACT,
    VERSION,
    dump_module,
    load_module,
    summarize,
)

__all__ = ["FORMAT", "HOOKS_ARTIFACT", "MODULE_ARTIFACT", "VERSION", "dump_module", "load_module", "summarize"]
