"""The toolchain entry's headers across install paths: merged on save, chosen on restore, a miss named.

Inductor names its precompiled header after the header's command line and
preprocessed text, which hold the include and library paths of torch and
Python (``__FILE__`` in torch's headers puts them in the header's bytes too).
Kernels are named relative to the install roots while adstore is enabled
(:mod:`adstore.integration.validity.roots`), but the header cannot be: the same venv at another path
(``/opt/venv`` on one host, ``/home/me/venv`` on another) needs another
header when it builds a kernel.  This module makes that cheap and visible:

* :func:`merge` keeps one header per header name in the one toolchain entry,
  at most :data:`HEADER_CAP`, newest first, each with the paths it was built
  under (``meta["headers"]``), so two install paths sharing a store or a
  remote do not replace each other's 150 MB header on every run;
* :func:`choose` places only the headers built under this host's paths
  (:data:`KEYED_PATHS`), and when there are none says which path differs,
  in one log line (:func:`explain_paths`) and in ``adstore explain --host``;
* an FX-graph entry records the paths its kernels were built under, so a
  hit of an entry whose kernels are named after those paths (saved where
  :mod:`adstore.integration.validity.roots` could not rename them) on a host with other paths says so in
  the same line.

An entry written before headers carried their paths is placed whole, as before.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import sysconfig
from collections.abc import Mapping
from typing import Any

__all__ = [
    "HEADER_CAP",
    "KEYED_PATHS",
    "choose",
    "explain_paths",
    "header_of",
    "install_paths",
    "keyed_paths",
    "merge",
    "path_differences",
]

logger = logging.getLogger(__name__)

#: Header names one toolchain entry keeps (each about 150 MB with its ``.gch``).
HEADER_CAP = 4
#: The paths Inductor's compiler command line holds (``-I``/``-L``): a difference changes its header's name.
KEYED_PATHS = ("torch", "python_include", "python_lib")


@functools.cache
def keyed_paths() -> dict[str, str]:
    """The :data:`KEYED_PATHS` of this process (once: they do not change while it runs)."""
    import torch

    return {
        "torch": os.path.dirname(os.path.abspath(torch.__file__)),
        "python_include": str(sysconfig.get_paths().get("include", "")),
        "python_lib": str(sysconfig.get_config_var("LIBDIR") or ""),
    }


def install_paths() -> dict[str, str]:
    """Where this process's torch and Python live, and Inductor's directories (its cache and header directories)."""
    paths = {**keyed_paths(), "prefix": sys.prefix}
    try:
        from torch._inductor import codecache
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        paths["inductor_cache_dir"] = str(cache_dir())
        paths["header_dir"] = str(getattr(codecache, "_HEADER_DIR", ""))
    except Exception as exc:  # noqa: BLE001 - informational only
        paths["inductor_cache_dir"] = f"error: {type(exc).__name__}"
    return paths


def header_of(artifact: str) -> str | None:
    """The header an artifact belongs to (``pch.X.h`` and ``pch.X.h.gch`` both give ``X.h``); None for others."""
    if not artifact.startswith("pch."):
        return None
    name = artifact[len("pch.") :]
    return name[: -len(".gch")] if name.endswith(".gch") else name


def path_differences(builder: Mapping[str, Any], here: Mapping[str, Any]) -> list[str]:
    """The keyed paths that differ: ``"torch: /a (builder) vs /b (here)"`` each."""
    return [
        f"{name}: {builder.get(name, '<absent>')} (builder) vs {here.get(name, '<absent>')} (here)"
        for name in KEYED_PATHS
        if builder.get(name) != here.get(name)
    ]


def merge(
    old_artifacts: Mapping[str, Any] | None,
    old_meta: Mapping[str, Any] | None,
    new_artifacts: Mapping[str, Any],
    here: Mapping[str, Any],
    cap: int = HEADER_CAP,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The toolchain entry's artifacts and meta after this process's save.

    Other artifacts (the ISA probes) are the union, this process's winning
    on a name both have.  Headers: this process's (with ``here``'s paths),
    then the stored ones it does not have, newest first, cut at ``cap``
    header names; the cut headers' files go.  ``old_meta``'s other fields stay.
    """
    old_artifacts, old_meta = dict(old_artifacts or {}), dict(old_meta or {})
    recorded = {h["name"]: h for h in old_meta.get("headers", []) if isinstance(h, dict) and "name" in h}
    mine = list(dict.fromkeys(h for a in new_artifacts if (h := header_of(a)) is not None))
    theirs = list(dict.fromkeys(h for a in old_artifacts if (h := header_of(a)) is not None and h not in mine))
    theirs.sort(key=lambda h: list(recorded).index(h) if h in recorded else len(recorded))
    kept = (mine + theirs)[: max(cap, len(mine))]
    artifacts = {a: r for a, r in old_artifacts.items() if header_of(a) is None or header_of(a) in kept}
    artifacts.update(new_artifacts)
    headers = [{"name": h, "paths": dict(here)} for h in mine]
    headers += [recorded.get(h, {"name": h, "paths": {}}) for h in kept if h not in mine]
    meta = {**old_meta, "headers": headers}
    return artifacts, meta


def choose(
    artifacts: Mapping[str, Any], meta: Mapping[str, Any], here: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The artifacts to place on this host, and the differing paths when no stored header fits it.

    A header is placed when its builder's :data:`KEYED_PATHS` equal this
    host's; another one would never be used (Inductor names the header it
    wants after those paths) and costs 150 MB of copying.  With none
    fitting, the differences are those of the newest header.
    """
    recorded = [h for h in meta.get("headers", []) if isinstance(h, dict) and isinstance(h.get("paths"), dict)]
    if not recorded:  # an entry written before headers carried their paths: place everything
        return dict(artifacts), []
    fits = {h["name"] for h in recorded if not path_differences(h["paths"], here)}
    chosen = {a: r for a, r in artifacts.items() if header_of(a) is None or header_of(a) in fits}
    has_headers = any(header_of(a) is not None for a in artifacts)
    return chosen, ([] if fits or not has_headers else path_differences(recorded[0]["paths"], here))


_told: set[str] = set()


def explain_paths(differences: list[str], store: Any = None, what: str = "its precompiled header and kernels") -> None:
    """Say once per process that Inductor builds ``what`` here because a path differs."""
    if not differences:
        return
    if store is not None:
        try:
            store.count({"inductor.install_path_differs": 1})
        except Exception:  # noqa: BLE001 - counting is best effort; the line below still says why
            pass
    line = "; ".join(differences)
    if line in _told:
        return
    _told.add(line)
    logger.warning(
        "adstore: Inductor builds %s again on this host: the stored ones "
        "were built under another install path (%s); Inductor's names for them hold these paths "
        '(docs/torch-compile.md, "Install paths")',
        what,
        line,
    )
