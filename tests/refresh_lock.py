"""Refresh ``requirements-lock.txt``, the locked test environment, only when the suite passes on it.

``python tests/refresh_lock.py`` installs the newest releases the project's
ranges admit (every extra the tests, the demo and the docs use) into a new
virtual environment, runs the README's test suite there, and rewrites the lock
from what that environment holds only if the suite passed; then it prints what
changed.  torch stays at the lock's release: the README installs that CPU build
first, and a new torch is a change of its own.

The library's own requirements in ``pyproject.toml`` stay ranges (users install
adstore next to their own torch and transformers); the lock pins what the tests
and the demo run with, so a release of a dependency cannot turn a fresh
machine's test run red without a change here (docs/operations.md, "Dependencies").
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["LOCK", "diff", "main", "parse"]

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements-lock.txt"
EXTRAS = "test,demo,docs"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#+]+)")  # a local label (+cpu) is dropped
_HEADER = """\
# The locked test environment: every package the test, demo and docs extras install, at the
# releases the suite last passed with.  Installed as constraints by the README's two commands
# and .ci/run; refreshed only by `python tests/refresh_lock.py` (docs/operations.md, "Dependencies").
"""


def parse(text: str) -> dict[str, str]:
    """``name == version`` lines of a lock or of ``pip freeze``, by normalised name."""
    pins = {}
    for line in text.splitlines():
        m = _PIN.match(line.strip())
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def diff(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """One line per package added, removed or moved to another release."""
    lines = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a != b:
            lines.append(f"  {name}: {a or '(none)'} -> {b or '(removed)'}")
    return lines


def _run(cmd: list[str], **kw: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--venv", type=Path, help="where to build the environment (default: a new temporary folder)")
    p.add_argument("--check", action="store_true", help="install and test, print the changes, write nothing")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (default: the README's plain run)")
    args = p.parse_args(argv)
    old = parse(LOCK.read_text()) if LOCK.exists() else {}
    torch = old.get("torch")
    venv = args.venv or Path(tempfile.mkdtemp(prefix="adstore-lock-")) / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    _run([py, "-m", "pip", "install", "-q", f"torch=={torch}" if torch else "torch"])
    _run([py, "-m", "pip", "install", "-q", "-e", f"{REPO}[{EXTRAS}]"])
    tests = subprocess.run([py, "-m", "pytest", "-q", *args.pytest_args], cwd=REPO)
    frozen = subprocess.run(
        [py, "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True, capture_output=True, text=True
    ).stdout
    new = {name: version for name, version in parse(frozen).items() if name != "pip"}  # setuptools: torch needs it
    changes = diff(old, new)
    print("\n".join(["changes against the lock:", *changes]) if changes else "the lock is current")
    if tests.returncode != 0:
        print(f"the suite failed (exit {tests.returncode}) on these releases: the lock is left as it was")
        return 1
    if not args.check and changes:
        LOCK.write_text(_HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(new.items())))
        print(f"wrote {LOCK.relative_to(REPO)}: commit it with the suite's result")
    return 0


if __name__ == "__main__":
    sys.exit(main())
