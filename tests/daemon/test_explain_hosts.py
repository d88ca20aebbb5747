"""``adstore explain`` across hosts: a missed key against the nearest entry, and ``--host``.

A host that missed journals the key's components (``ADSTORE_MISS_LOG``, set
per session by tests/conftest.py); ``adstore explain KEY`` on a key the store
does not hold finds the stored entry of the namespace sharing most
components and names the difference in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adstore.daemon.cli import main
from adstore.daemon.crosshost import HOST_WIDTH, _field_lines
from adstore.integration.inductor.hostview import missed_components, note_miss
from adstore.store import Store

ISA = "avx avx2 avx512bw avx512f fma sse4_2"
TOOLCHAIN = {"torch": "2.13.0+cpu", "cpu": {"capability": "AVX512", "isa": ISA}, "compiler": {"version": "gcc 12"}}
FX = "inductor_fx_graph"


def components(inductor_key: str, **cpu: str) -> dict:
    return {
        "namespace": FX,
        "inductor_key": inductor_key,
        "torch_key": "t" * 8,
        "toolchain": {**TOOLCHAIN, "cpu": {**TOOLCHAIN["cpu"], **cpu}},
    }


def publish(root: Path, key: str, comps: dict, namespace: str = FX) -> None:
    with Store.open(root) as store:
        ref = store.put_bytes(key.encode())
        gen = store.new_generation()
        store.publish(key, generation=gen, artifacts={"value": ref}, namespace=namespace, components=comps)
        store.commit(key, generation=gen)


def explain(capsys: pytest.CaptureFixture[str], root: Path, *argv: str) -> str:
    assert main(["--root", str(root), "explain", *argv]) == 0
    return capsys.readouterr().out


def test_a_missed_key_is_compared_with_the_nearest_entry_in_one_line(capsys, tmp_path: Path) -> None:
    publish(tmp_path, "a" * 64, components("graph-1"))
    publish(tmp_path, "b" * 64, components("graph-2"))
    publish(tmp_path, "c" * 64, components("graph-1"), namespace="other")
    missed = "e" * 64
    note_miss(missed, components("graph-1", isa="avx avx2 fma sse4_2"))
    out = explain(capsys, tmp_path, missed[:16])
    assert out.strip().count("\n") == 0, out
    assert out.startswith("eeeeeeeeeeee: not in the store; nearest entry aaaaaaaaaaaa differs in")
    assert "toolchain.cpu.isa (missing here: avx512bw avx512f)" in out
    data = json.loads(explain(capsys, tmp_path, "--json", missed))
    assert data["in_store"] is False and data["nearest"] == "a" * 64
    assert [d["path"] for d in data["differences"]] == ["toolchain.cpu.isa"]


def test_a_key_neither_stored_nor_missed_is_unknown(capsys, tmp_path: Path) -> None:
    publish(tmp_path, "a" * 64, components("graph-1"))
    assert main(["--root", str(tmp_path), "explain", "f" * 64]) != 0
    assert missed_components("f" * 64) is None


def test_the_miss_journal_is_rotated_and_still_found(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "misses.jsonl"
    monkeypatch.setenv("ADSTORE_MISS_LOG", str(log))
    monkeypatch.setattr("adstore.integration.inductor.hostview.MISS_LOG_BYTES", 4096)
    note_miss("1" * 64, components("first"))
    for i in range(20):
        note_miss(f"{i:064x}", components(f"g{i}"))
    assert log.with_name("misses.jsonl.1").exists() and log.stat().st_size <= 4096
    assert missed_components(f"{19:064x}")["components"]["inductor_key"] == "g19"


def test_host_prints_this_hosts_key_components_and_the_cli_imports_no_torch_without_it(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    code = (
        "import sys\n"
        "from adstore.daemon.cli import main\n"
        f"main(['--root', {str(tmp_path / 'store')!r}, 'ls'])\n"
        "assert 'torch' not in sys.modules, 'the CLI imported torch'\n"
        f"sys.exit(main(['--root', {str(tmp_path / 'store')!r}, 'explain', '--host', '--json']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert {"toolchain", "torch_key", "paths", "user", "toolchain_entry"} <= set(data)
    assert data["toolchain"]["cpu"]["isa"] and "model" not in data["toolchain"]["cpu"]
    assert data["paths"]["prefix"] == sys.prefix and data["user"]["uid"] >= 0


def test_misses_lists_the_last_missed_keys_each_against_its_nearest_entry(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ADSTORE_MISS_LOG", str(tmp_path / "misses.jsonl"))
    publish(tmp_path / "store", "a" * 64, components("graph-1"))
    note_miss("1" * 64, components("graph-1", capability="AVX2"))
    note_miss("2" * 64, components("graph-1", isa="avx avx2"))
    note_miss("2" * 64, components("graph-1", isa="avx avx2"))  # the same key twice: listed once
    note_miss("a" * 64, components("graph-1"))  # missed then, stored since
    lines = explain(capsys, tmp_path / "store", "--misses").splitlines()
    assert lines[0] == (
        "aaaaaaaaaaaa: missed, stored here since, and namespace inductor_fx_graph holds no other entry to compare with"
    )
    assert lines[1].startswith(
        "222222222222: not in the store; nearest entry aaaaaaaaaaaa differs in toolchain.cpu.isa"
    )
    assert 'toolchain.cpu.capability (entry "AVX512", here "AVX2")' in lines[2] and len(lines) == 3
    assert len(json.loads(explain(capsys, tmp_path / "store", "--json", "--misses", "1"))["misses"]) == 1


def test_misses_names_the_isa_before_the_inductor_key_it_changed(capsys, tmp_path: Path, monkeypatch) -> None:
    """Tried as a user: another CPU capability changes Inductor's own key too, and the line blamed
    ``inductor_key`` first (alphabetical).  The cause comes first; the digest is said to follow from it."""
    monkeypatch.setenv("ADSTORE_MISS_LOG", str(tmp_path / "misses.jsonl"))
    publish(tmp_path / "store", "a" * 64, components("graph-avx512"))
    note_miss("1" * 64, components("graph-avx2", capability="AVX2"))
    (line,) = explain(capsys, tmp_path / "store", "--misses").splitlines()
    head = "111111111111: not in the store; nearest entry aaaaaaaaaaaa differs in toolchain.cpu.capability"
    assert line.startswith(f'{head} (entry "AVX512", here "AVX2")'), line
    assert line.endswith("inductor_key (a digest that differs with them)"), line
    publish(tmp_path / "store", "b" * 64, components("graph-avx2", capability="AVX2"))
    out = explain(capsys, tmp_path / "store", "a" * 64, "b" * 64)
    assert "differing: toolchain, inductor_key" in out, out


def test_an_inductor_entry_shows_the_paths_its_files_were_built_under(capsys, tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        ref = store.put_bytes(b"graph")
        paths = {"torch": "/opt/venv/lib/python3.11/site-packages/torch", "python_include": "/usr/include/python3.11"}
        store.save("a" * 64, {"value": ref}, namespace=FX, components=components("g"), meta={"paths": paths})
    out = explain(capsys, tmp_path, "a" * 64)
    assert "kernels: torch = /opt/venv/lib/python3.11/site-packages/torch" in out


def test_a_miss_this_host_compiled_since_is_compared_with_the_builders_entry(capsys, tmp_path, monkeypatch) -> None:
    """A new host misses, compiles and saves the key itself: the line still names why it missed.

    Tried as a user: the host's own entry is in its store right after the run, so ``--misses`` said only
    "stored since"; with the builder's entries pulled in (``adstore pull --namespace``) it names the field.
    """
    monkeypatch.setenv("ADSTORE_MISS_LOG", str(tmp_path / "misses.jsonl"))
    here = components("graph-1", capability="AVX2", aten_cpu_capability_env="avx2")
    note_miss("e" * 64, here)
    publish(tmp_path / "store", "e" * 64, here)  # this host's own compile, saved after the miss
    publish(tmp_path / "store", "b" * 64, components("graph-1", capability="AVX512", aten_cpu_capability_env=""))
    line = explain(capsys, tmp_path / "store", "--misses").strip()
    assert line.startswith("eeeeeeeeeeee: missed, stored here since; nearest entry bbbbbbbbbbbb differs in"), line
    assert 'toolchain.cpu.capability (entry "AVX512", here "AVX2")' in line
    data = json.loads(explain(capsys, tmp_path / "store", "--json", "--misses"))["misses"][0]
    assert data["in_store"] is True and data["nearest"] == "b" * 64


def test_host_prints_every_flag_so_two_hosts_diff_line_by_line() -> None:
    """``--host`` is run on two hosts and compared: a flag past the line's width must not be cut off."""
    flags = " ".join(f"flag{i:03d}" for i in range(80)) + " avx512f"
    lines = _field_lines("toolchain.cpu.isa", flags)
    assert lines[0].startswith("  toolchain.cpu.isa = flag000") and len(lines) > 1
    assert all(len(line) <= HOST_WIDTH for line in lines) and "…" not in "".join(lines)
    assert " ".join(" ".join(lines).split()[2:]) == flags
    assert _field_lines("torch_key", "d" * 64) == [f'  torch_key = "{"d" * 64}"']


def test_a_miss_with_nothing_local_to_compare_is_compared_with_the_remotes_records(
    capsys, tmp_path, monkeypatch
) -> None:
    """The new host's case: the builder's entry is on the remote only; its signed record's components suffice."""
    pytest.importorskip("cryptography")
    from adstore.store import remote_save
    from adstore.store.remote import Signer, open_remote, write_keypair

    private, public = write_keypair(tmp_path / "keys")
    url = f"memory://explain-{tmp_path.name}"
    publish(tmp_path / "builder", "b" * 64, components("graph-1"))
    with Store.open(tmp_path / "builder") as builder:
        remote = open_remote(url, mode="read-write", signer=Signer.from_file(private))
        assert remote_save(builder, remote, "b" * 64, 0).ok
    monkeypatch.setenv("ADSTORE_MISS_LOG", str(tmp_path / "misses.jsonl"))
    here = components("graph-1", capability="AVX2")
    note_miss("e" * 64, here)
    publish(tmp_path / "store", "e" * 64, here)  # compiled here since: nothing else in this store
    monkeypatch.setenv("ADSTORE_REMOTE", url)
    monkeypatch.setenv("ADSTORE_TRUSTED_KEYS", str(public))
    line = explain(capsys, tmp_path / "store", "--misses").strip()
    assert line.startswith("eeeeeeeeeeee: missed, stored here since; nearest entry bbbbbbbbbbbb on the remote"), line
    assert 'toolchain.cpu.capability (entry "AVX512", here "AVX2")' in line
    monkeypatch.delenv("ADSTORE_TRUSTED_KEYS")  # nothing trusted: said so, never compared with
    line = explain(capsys, tmp_path / "store", "--misses").strip()
    assert line.endswith("holds no other entry to compare with (remote not listed: untrusted_remote)"), line
