"""The generated regions of the docs: tables made from the code, the survey and the measured results.

A page marks a region with ``<!-- generated: NAME -->`` … ``<!-- end generated -->``; :data:`TABLES`
says how each NAME's text is made, and :func:`rewrite` puts it in place::

    python tests/docs_tables.py            # rewrite every region that is stale
    python tests/docs_tables.py --check    # change nothing; exit 1 naming the stale regions

``tests/daemon/test_docs.py`` fails when a region is stale, and ``tests/benchmarks/run_all.py``
rewrites the performance and reliability regions after a run.  Those two come from
``bench-results/results.json`` (the one results file in the repository); without it they say so.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["TABLES", "DOCS", "RESULTS", "regions", "render", "rewrite", "stale", "main"]

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RESULTS = REPO / "bench-results" / "results.json"
START = re.compile(r"<!-- generated: ([a-z-]+) -->\n")
END = "<!-- end generated -->"

# --------------------------------------------------------------------------- from the code


def exit_codes() -> str:
    """``daemon.cli.EXIT_CODES``, one row per code in the order the table is searched."""
    from adstore.daemon.cli import EXIT_CODES

    own = {
        PermissionError: "any other permission error",
        OSError: "any other OS error",
        KeyboardInterrupt: "interrupted (Ctrl-C)",
        Exception: "an internal error: a bug, which no input should reach (run with `-v` for the traceback)",
    }
    lines = ["| exit | error | when |", "|---|---|---|"]
    for cls, code in EXIT_CODES:
        what = own.get(cls) or _first_line(cls.__doc__)
        lines.append(f"| {code} | `{cls.__name__}` | {what} |")
    return "\n".join(lines) + "\n"


def settings() -> str:
    from adstore.daemon.config import settings_table

    return settings_table()


def metrics() -> str:
    """The metric families ``daemon.metrics`` renders, in its order."""
    from adstore.daemon.metrics import BY_REASON, COUNTERS, GAUGES

    lines = ["| metric | type | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | counter | {help_} |" for _, name, help_, _ in COUNTERS]
    lines += [f"| `{name}{{reason}}` | counter | {help_} |" for _, name, help_ in BY_REASON]
    lines += [f"| `{name}` | gauge | {help_} |" for _, name, help_ in GAUGES]
    lines.append("| `adstore_budget_bytes` | gauge | Bytes the store may use now, when a budget is set. |")
    return "\n".join(lines) + "\n"


def reasons() -> str:
    """Every :class:`~adstore.store.Reason` with the comment beside it in ``store/reasons.py``, by group."""
    source = (REPO / "store" / "reasons.py").read_text()
    body = source[source.index("class Reason") : source.index("REMOTE_REASONS = ")]
    lines = ["| reason | meaning |", "|---|---|"]
    for group, word, meaning in _reason_lines(body):
        if group:
            lines.append(f"| **{group}** | |")
        lines.append(f"| `{word}` | {meaning} |")
    return "\n".join(lines) + "\n"


def _reason_lines(body: str) -> Iterator[tuple[str, str, str]]:
    group = ""
    for line in body.splitlines():
        heading = re.match(r"\s*# -- (.+?) -+$", line)
        if heading:
            group = heading.group(1)
            continue
        member = re.match(r'\s*(?:[A-Z_]+ = )?"([a-z_]+)"\s*# (.+)$', line)
        if member:
            yield group, member.group(1), _md(member.group(2))
            group = ""


def survey() -> str:
    """The survey's verdicts (``integration/reference/survey_results.py``), without importing torch."""
    tree = ast.parse((REPO / "integration" / "reference" / "survey_results.py").read_text())
    data = {
        t.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Name)
    }
    handled: dict[str, list[int]] = data["HANDLED"]
    refused: dict[str, str] = data["REFUSED"]
    total = len(handled) + len(refused)
    releases = ", ".join(
        f"{len(types)} under {release}" for release, types in sorted(data["MEASURED_WITH"].items(), reverse=True)
    )
    lines = [
        f"Surveyed with torch {data['TORCH']} and transformers {data['TRANSFORMERS']} (verdicts measured: "
        f"{releases}): **{len(handled)}** of {total} causal-LM model types handled, **{len(refused)}** refused.",
        "",
        "| rewrite | handled types where it matches (two layers) |",
        "|---|---|",
    ]
    for i, name in enumerate(("match_rms_norm", "match_swiglu", "match_rope")):
        lines.append(f"| `{name}` | {sum(1 for m in handled.values() if m[i])} of {len(handled)} |")
    lines += ["", "Handled: " + ", ".join(f"`{t}`" for t in sorted(handled)) + ".", ""]
    groups: dict[tuple[str, str], list[str]] = {}
    for model_type, why in sorted(refused.items()):
        step, _, error = why.partition(": ")
        groups.setdefault((step, error.partition(":")[0]), []).append(model_type)
    lines += ["| step that failed | error | refused model types |", "|---|---|---|"]
    for (step, error), types in sorted(groups.items()):
        lines.append(f"| {step} | `{error}` | {', '.join(types)} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- from the measured results


def _results() -> dict[str, Any] | None:
    try:
        doc = json.loads(RESULTS.read_text())
    except FileNotFoundError:
        return None
    return doc if isinstance(doc, dict) else None


_MISSING = (
    "No results yet: `bench-results/results.json` is missing. `python tests/benchmarks/run_all.py` "
    "writes it and fills this table.\n"
)


def machine_line(machine: Mapping[str, Any], *, quick: bool = False) -> str:
    """The one sentence that says on what machine and how the figures were produced."""
    load = machine.get("load_average")
    text = (
        f"Measured with `python tests/benchmarks/run_all.py` on {str(machine.get('date', '?'))[:10]}: "
        f"{machine.get('cpu_model')}, {machine.get('nproc')} CPUs available to the run, "
        f"{machine.get('ram_gib')} GiB RAM, load average {', '.join(map(str, load or []))} at the start; "
        f"Python {machine.get('python')}, torch {machine.get('torch')}, Linux {machine.get('kernel')}."
    )
    return text + (" Quick mode (`--quick`): smaller workloads, indicative figures only." if quick else "")


def _ratio(r: Any) -> str:
    if r is None:
        return "–"
    if isinstance(r, (int, float)):
        return f"{r:.2f}×" if r < 100 else f"{r:.0f}×"
    return str(r)


def performance_table(doc: Mapping[str, Any]) -> str:
    """The rows ``run_all.py`` stored, then one line per benchmark: its command, exit code and wall time."""
    lines = [
        machine_line(doc.get("machine", {}), quick=bool(doc.get("quick"))),
        "",
        "| benchmark | measurement | adstore | baseline | ratio | target | met? |",
        "|---|---|---|---|---|---|---|",
    ]
    met = {True: "yes", False: "**no**", None: "–"}
    for r in doc.get("rows", []):
        name = r["name"] + (f" ({r['note']})" if r.get("note") else "")
        lines.append(
            f"| {r['benchmark']} | {_cell(name)} | {_cell(r['adstore'])} | {_cell(r['baseline'])} | "
            f"{_ratio(r['ratio'])} | {r['target'] or '–'} | {met[r['met']]} |"
        )
    lines += ["", "| benchmark | command | exit | wall time | measured (UTC) |", "|---|---|---|---|---|"]
    for name, res in doc.get("benchmarks", {}).items():
        argv = res.get("argv") or []
        cmd = " ".join(["python", *argv[1:]]) if argv else "–"
        when = str(res.get("json_written") or "–").replace("+00:00", "")
        lines.append(f"| {name} | `{cmd}` | {res.get('returncode')} | {res.get('seconds', 0):.0f} s | {when} |")
    return "\n".join(lines) + "\n"


def performance() -> str:
    doc = _results()
    return _MISSING if doc is None else performance_table(doc)


_KILLS = {
    "kill_points_every_tick": "SIGKILL at every I/O step of save → publish → commit → remove → sweep (`-m slow`)",
    "kill_points": "SIGKILL at sampled I/O steps of the same sequence (default run)",
    "eviction_kill_points_every_tick": "SIGKILL at every I/O step of a daemon enforcement pass (`-m slow`)",
    "eviction_kill_points": "SIGKILL at sampled I/O steps of a daemon enforcement pass (default run)",
}


def reliability_rows(faults: Mapping[str, Any], stress: Mapping[str, Any]) -> list[str]:
    """Rows of the reliability table from ``faults.json`` and ``stress.json`` as the tests wrote them."""
    rows = []
    for name, label in _KILLS.items():
        kp = faults.get(name)
        if kp:
            rows.append(f"| {label} | {kp['kill_points']} kill points | {len(kp.get('failures', []))} failures |")
    if faults.get("timed_kills"):
        kills = faults["timed_kills"]["kills"]
        rows.append(f"| writer in a loop SIGKILLed after 0, 7, 14 … ms | {kills} kills | verify clean after each |")
    for name, d in sorted(faults.items()):
        if not name.startswith("damage"):
            continue
        which = name.removeprefix("damage").strip("_").replace("_", " ") or "default run"
        which = "`-m slow`" if which == "slow" else which
        rows.append(
            f"| damage suite, {which}: `{d.get('command', '')}` | {d['cases']} case{'' if d['cases'] == 1 else 's'}, "
            f"{d['hits_after_fix']} hits after `verify --fix` | {d['signal_deaths']} signal deaths, "
            f"{d['exit_70']} exit-70s, {d['raw_lmdb_errors']} raw LMDB errors, {d['wrong_bytes']} wrong bytes |"
        )
    for _name, s in sorted(stress.items()):
        rows.append(
            f"| stress: {s['workers']} processes ({s.get('snapshot_workers', 0)} with snapshots) vs a daemon, "
            f"budget {s['budget_bytes'] // (1 << 20)} MiB, {s['seconds']:.0f} s | {s['ops_per_s']:.0f} ops/s, "
            f"p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms, {s['evictions']} evictions | "
            f"{s['errors']} errors, {s['wrong_reads']} wrong reads |"
        )
    return rows


def reliability() -> str:
    doc = _results()
    if doc is None:
        return _MISSING.replace("fills this table", "copies the test suite's figures into it")
    kept = doc.get("reliability")
    if not isinstance(kept, dict):
        return (
            "No figures yet: `bench-results/results.json` holds no copy of the test suite's figures. "
            "`python tests/benchmarks/run_all.py --table-only` copies them from `bench-results/faults.json` "
            "and `stress.json` and fills this table.\n"
        )
    faults, stress = kept.get("faults") or {}, kept.get("stress") or {}
    machine = doc.get("machine") or {}
    lines = [
        f"Figures the test suite wrote to `bench-results/faults.json` and `stress.json`, collected by "
        f"`python tests/benchmarks/run_all.py` on {str(machine.get('date', '?'))[:10]} "
        f"({machine.get('cpu_model')}, {machine.get('nproc')} CPUs).",
        "",
        "| test | figure | result |",
        "|---|---|---|",
        *reliability_rows(faults, stress),
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- regions


TABLES: dict[str, Callable[[], str]] = {
    "exit-codes": exit_codes,
    "settings": settings,
    "metrics": metrics,
    "reasons": reasons,
    "survey": survey,
    "performance": performance,
    "reliability": reliability,
}


def _first_line(doc: str | None) -> str:
    return _md((doc or "").strip().split("\n\n")[0].replace("\n", " "))


def _md(text: str) -> str:
    """reStructuredText literals as Markdown code, pipes escaped for a table cell."""
    return _cell(text.replace("``", "`"))


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def regions(text: str) -> Iterator[tuple[str, int, int]]:
    """(name, start of the body, end of the body) of each generated region of a page."""
    for m in START.finditer(text):
        end = text.find(END, m.end())
        if end < 0:
            raise ValueError(f"region {m.group(1)!r} has no {END!r}")
        yield m.group(1), m.end(), end


def render(name: str) -> str:
    """The body of region ``name``: its text between two blank lines."""
    return "\n" + TABLES[name]() + "\n"


def _pages(names: set[str] | None) -> Iterator[tuple[Path, str, str]]:
    """(page, its text, its text with every region of ``names`` (all: None) made current)."""
    cache: dict[str, str] = {}
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        out, pos = [], 0
        for name, start, end in regions(text):
            if name not in TABLES:
                raise ValueError(f"{page.name}: unknown generated region {name!r}")
            body = text[start:end]
            if names is None or name in names:
                body = cache.setdefault(name, render(name))
            out += [text[pos:start], body]
            pos = end
        yield page, text, "".join(out) + text[pos:]


def stale(names: set[str] | None = None) -> list[str]:
    """``page: region`` for every region whose text differs from what its generator makes now."""
    found = []
    for page, text, current in _pages(names):
        if text != current:
            now = {n: current[s:e] for n, s, e in regions(current)}
            found += [f"{page.name}: {n}" for n, s, e in regions(text) if text[s:e] != now[n]]
    return found


def rewrite(names: set[str] | None = None) -> list[Path]:
    """Rewrite the regions ``names`` (all: None) of every page; the pages that changed."""
    changed = []
    for page, text, current in _pages(names):
        if text != current:
            page.write_text(current)
            changed.append(page)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a region is stale")
    ap.add_argument("names", nargs="*", help=f"only these regions (default: all): {', '.join(TABLES)}")
    args = ap.parse_args(argv)
    unknown = set(args.names) - set(TABLES)
    if unknown:
        ap.error(f"unknown region(s): {', '.join(sorted(unknown))}")
    names = set(args.names) or None
    if args.check:
        bad = stale(names)
        print("\n".join(f"stale: {b}" for b in bad) or "every generated region is current")
        return 1 if bad else 0
    for page in rewrite(names):
        print(f"rewrote {page.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
