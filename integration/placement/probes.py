"""Inductor's vector-ISA probes, answered from the store: one implementation for ``enable()`` and the compile stage.

Inductor decides which vector ISA to compile for by building a probe
library per ISA and extension and loading it in a fresh Python process
(``VecISA.check_build``, from ``pick_vec_isa``): ten of them cost a warm
start over a second.  The answers are the toolchain's: the entries that
record them (the Inductor integration's toolchain entry, the compile
stage's entry) are keyed by the CPU's instruction-set flags and the
compiler, so a recorded answer is the one the probe would give here.

:data:`PROBES` wraps ``check_build`` once per process while anyone needs
it (:meth:`Probes.install`, or the :meth:`Probes.scope` of a stage's
compile or load).  A probe whose key (the ISA, its compiler flags and the
probe's source, hashed) has a recorded answer gets it, without a build or
a subprocess; any other probe waits for the toolchain restore once
(:attr:`Probes.before_unknown`), then runs.  Every answer is recorded, for
the entry to keep (:meth:`Probes.recorded`).  Malformed answers (not a
64-hex key, not a bool) are ignored.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

__all__ = ["PROBES", "Probes", "forget", "valid_answers"]

_PROBE_KEY = re.compile(r"[0-9a-f]{64}")


def valid_answers(known: object) -> dict[str, bool]:
    """The well-formed answers of ``known`` (a 64-hex key to a bool); anything else is dropped."""
    if not isinstance(known, Mapping):
        return {}
    return {k: v for k, v in known.items() if type(k) is str and _PROBE_KEY.fullmatch(k) and type(v) is bool}


class Probes:
    """The process's answers to Inductor's ISA probes and the wrap of ``VecISA.check_build`` that gives them."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._answers: dict[str, bool] = {}
        self._seen: dict[str, bool] = {}
        self._scopes: list[tuple[dict[str, bool], dict[str, bool]]] = []  # (known, seen) of each open scope
        self._users = 0
        self._owner: Any = None
        self._original: Any = None
        #: Called before a probe without a recorded answer runs (the toolchain restore's wait); never raises.
        self.before_unknown: Callable[[], None] | None = None
        #: Probes that ran (a build and a subprocess), this process.
        self.ran = 0

    # -- answers ------------------------------------------------------------------
    def learn(self, known: object) -> int:
        """Take the well-formed answers of ``known`` (a toolchain entry's); how many were taken."""
        answers = valid_answers(known)
        with self._lock:
            self._answers.update(answers)
        return len(answers)

    def recorded(self) -> dict[str, bool]:
        """Every answer this process gave (recorded or probed), for an entry to keep."""
        with self._lock:
            return dict(self._seen)

    def _answer(self, key: str) -> bool | None:
        with self._lock:
            for known, _ in reversed(self._scopes):
                if key in known:
                    return known[key]
            return self._answers.get(key)

    # -- the wrap -----------------------------------------------------------------
    def install(self) -> bool:
        """Wrap ``VecISA.check_build`` (once, however many users); False on a torch without it."""
        with self._lock:
            if self._users == 0:
                from torch._inductor import cpu_vec_isa

                owner = getattr(cpu_vec_isa, "VecISA", None)
                original = owner.__dict__.get("check_build") if owner is not None else None
                if not callable(original):
                    return False
                self._owner, self._original = owner, original
                owner.check_build = self._wrapped()
            self._users += 1
            return True

    def uninstall(self) -> None:
        """Undo one :meth:`install`; the last one puts ``check_build`` back."""
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users == 0 and self._owner is not None:
                self._owner.check_build = self._original
                self._owner = self._original = None

    @contextmanager
    def scope(self, known: object) -> Iterator[dict[str, bool]]:
        """Probes in this block answered from ``known`` first; yields the answers given in the block."""
        frame: tuple[dict[str, bool], dict[str, bool]] = (valid_answers(known), {})
        installed = self.install()
        with self._lock:
            self._scopes.append(frame)
        try:
            yield frame[1]
        finally:
            with self._lock:
                self._scopes.remove(frame)
            if installed:
                self.uninstall()

    def _wrapped(self) -> Callable[[Any, str], bool]:
        probes, original = self, self._original

        def check_build(isa: Any, code: str) -> bool:
            key = hashlib.sha256(f"{isa}\0{isa.build_arch_flags()}\0{code}".encode()).hexdigest()
            answer = probes._answer(key)
            if answer is None and probes.before_unknown is not None:
                probes.before_unknown()  # the toolchain entry may bring it
                answer = probes._answer(key)
            if answer is None:
                answer = bool(original(isa, code))
                with probes._lock:
                    probes.ran += 1
            with probes._lock:
                probes._seen[key] = answer
                for _, seen in probes._scopes:
                    seen[key] = answer
            return answer

        return check_build


#: The process's one instance (Inductor's classes are process-wide too).
PROBES = Probes()


def forget() -> None:
    """Make Inductor pick the vector ISA again (its choice is cached per process), as in a fresh process.

    The compile stage does this before a compile whose files it stores, so
    the probes run (or are answered) inside its block and are recorded.
    Another torch without these caches: nothing to clear.
    """
    from torch._inductor import cpu_vec_isa

    for obj in list(vars(cpu_vec_isa).values()):
        for fn in [obj, *(vars(obj).values() if isinstance(obj, type) else ())]:
            clear = getattr(fn, "cache_clear", None)
            if callable(clear):
                clear()
    # What an earlier probe learnt about extensions (bf16, AMX) changes the flags of the next one,
    # and with them the probes' keys: back to the state of a fresh process.
    for isa in getattr(cpu_vec_isa, "supported_vec_isa_list", ()):
        for name in [n for n in vars(isa) if n.startswith("_is_")]:
            delattr(isa, name)
