"""The documentation: generated tables are current, citations resolve, the README stays short and true.

Docstrings and comments cite the docs as ``docs/<page>.md, "<heading>"``; every such citation must name
a page and a heading that exist, and so must the README's links into ``docs/``.  The tables between
``<!-- generated: NAME -->`` markers are remade by ``tests/docs_tables.py``; a stale one fails here
(run ``python tests/docs_tables.py`` to rewrite them).  ``mkdocs build --strict`` (in ``.ci/run``)
checks the links between the pages themselves.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"
sys.path.insert(0, str(REPO / "tests"))

import docs_tables  # noqa: E402

#: ``docs/remote.md`` or ``docs/remote.md, "Trust and keys"`` (the heading may wrap onto a comment line).
CITATION = re.compile(r'docs/([a-z0-9-]+\.md)(?:,\s*(?:#\s*)?"([^"]+)")?')
LINK = re.compile(r"\]\((docs/[a-z0-9-]+\.md)(?:#([a-z0-9-]+))?\)")
SOURCE_DIRS = ("store", "integration", "daemon", "tests")


def _sources() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (REPO / d).rglob("*.py"))


def _headings(page: Path) -> list[str]:
    """A page's headings as text (outside code blocks), without ``#`` and backticks."""
    found, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip().replace("`", ""))
    return found


def _slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) and GitHub give a heading."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_generated_tables_are_current() -> None:
    stale = docs_tables.stale()
    assert not stale, f"stale generated tables {stale}: run `python tests/docs_tables.py`"
    used = {name for page in DOCS.glob("*.md") for name, _, _ in docs_tables.regions(page.read_text())}
    assert used == set(docs_tables.TABLES), "every generated table has a place in the docs"


def test_the_benchmark_tables_say_when_there_are_no_results() -> None:
    """Without ``bench-results/results.json`` (and only then) the tables say it is missing."""
    for name in ("performance", "reliability"):
        missing = "is missing" in docs_tables.render(name)
        assert missing == (not docs_tables.RESULTS.exists()), name
    if docs_tables.RESULTS.exists():
        assert "Measured with `python tests/benchmarks/run_all.py`" in docs_tables.render("performance")


def test_every_citation_names_a_page_and_a_heading_that_exist() -> None:
    headings = {page.name: {" ".join(h.split()) for h in _headings(page)} for page in DOCS.glob("*.md")}
    bad, count = [], 0
    for path in _sources():
        for m in CITATION.finditer(path.read_text()):
            count += 1
            page, heading = m.group(1), m.group(2)
            where = f"{path.relative_to(REPO)}: {m.group(0)!r}"
            if page not in headings:
                bad.append(f"{where}: no page docs/{page}")
            elif heading is not None and " ".join(heading.split()) not in headings[page]:
                bad.append(f"{where}: no such heading in docs/{page}")
    assert count > 100, f"only {count} citations found: is the pattern still right?"
    assert not bad, "\n".join(bad)


def test_no_docstring_cites_a_readme_section() -> None:
    old = re.compile(r"README(?:,\s*\"|'s \"| \"|, Known)")
    hits = [str(p.relative_to(REPO)) for p in _sources() if old.search(p.read_text())]
    assert not hits, f'cite docs/<page>.md, "<heading>" instead: {hits}'


def test_readme_links_into_the_docs_resolve() -> None:
    links = LINK.findall(README.read_text())
    assert len(links) >= 10
    for target, anchor in links:
        page = REPO / target
        assert page.is_file(), target
        if anchor:
            assert anchor in {_slug(h) for h in _headings(page)}, f"{target}#{anchor}"
    assert "(CHANGELOG.md)" in README.read_text() and (REPO / "CHANGELOG.md").is_file()


def test_readme_is_short_and_starts_with_the_two_set_up_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    setup = [line.split("#")[0].strip() for line in lines[2:6] if line.startswith("pip ")]
    assert setup == [
        "pip install torch==2.13.0 && pip install -e '.[demo]' -c requirements-lock.txt && adstore demo",
        "pip install torch==2.13.0 && pip install -e '.[test]' -c requirements-lock.txt && python -m pytest",
    ]
    ci = (REPO / ".ci" / "run").read_text()
    assert setup[1] in ci, ".ci/run runs the README's test command verbatim"


def test_every_environment_variable_is_documented() -> None:
    code = [f for d in ("store", "integration", "daemon") for f in (REPO / d).rglob("*.py")]
    names = {n for f in code for n in re.findall(r"ADSTORE_[A-Z_]*[A-Z]", f.read_text())}
    table = (DOCS / "configuration.md").read_text()
    missing = sorted(n for n in names if not re.search(rf"`{n}`", table))
    assert names and not missing, f'add to docs/configuration.md, "Environment variables": {missing}'


def test_nothing_refers_outside_the_repository() -> None:
    # Written as a pattern so that this file does not name those places itself.
    outside = re.compile(r"DESIGN\.md|\.\./shar[e]d|/wor[k]/|shar[e]d folder|seed[s]/")
    texts = [README, REPO / "CHANGELOG.md", REPO / "mkdocs.yml", *DOCS.glob("*.md")]
    for path in texts:
        found = outside.search(path.read_text())
        assert found is None, f"{path.name} refers to {found.group()!r}, outside the repository"


def _readme_snippets() -> list[object]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return [
        pytest.param(block, id=f"snippet{i}", marks=[pytest.mark.slow] if "torch" in block else [])
        for i, block in enumerate(blocks)
    ]


@pytest.mark.parametrize("code", _readme_snippets())
def test_readme_snippets_run_as_written(code: str, tmp_path: Path) -> None:
    """Each Python block of the README runs in a fresh process against an empty store (torch ones: slow tier)."""
    env = {**os.environ, "ADSTORE_ROOT": str(tmp_path / "store")}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "each snippet prints what it did"
