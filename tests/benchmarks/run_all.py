"""Run every benchmark and publish one results file, and the docs' tables made from it.

    python tests/benchmarks/run_all.py [--quick] [--only store,daemon] [--timeout 3600] [--table-only]

Runs each ``tests/benchmarks/bench_*.py`` in its own process (from the
repository root, so every benchmark writes ``bench-results/<name>.json``),
streams its output, then reads the JSON files it wrote and writes

* ``bench-results/results.json`` (kept in the repository) — machine info (CPU
  model from ``/proc/cpuinfo``, ``nproc``, RAM, torch/python/kernel versions,
  git commit, date), each benchmark's command, exit code, wall time and full
  figures, the table rows below as data, and a copy of the reliability
  figures the test suite keeps (``bench-results/faults.json``, ``stress.json``);
* the generated tables of ``docs/performance.md`` (benchmark, adstore figure,
  baseline measured in the same run, ratio, target, met?) and
  ``docs/reliability.md``, through ``tests/docs_tables.py``;
* ``bench-results/RESULTS.md`` — the same tables in one file.

``--quick`` passes each benchmark its smaller settings (``--quick`` where it
has one, fewer entries/repeats/idle seconds otherwise): minutes instead of
most of an hour, with figures that are indicative only (the table says so).

Every benchmark's rows come from a small extractor that knows its JSON; a
benchmark without one (a new ``bench_*.py``) still gets a row per ratio it
reports, so the runner never has to be edited for the table to be complete.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT = REPO / "bench-results"

sys.path.insert(0, str(HERE.parent))
import docs_tables  # noqa: E402  (tests/docs_tables.py: the docs' tables, made from results.json)

#: Smaller settings per benchmark for ``--quick`` (a benchmark with its own ``--quick`` gets that).
QUICK_ARGS: dict[str, list[str]] = {
    "bench_daemon": ["--entries", "10000", "--idle-seconds", "10", "--trials", "3", "--unique-blobs", "1000"],
    "bench_snapshot": ["--layers", "8", "--repeat", "3"],
    "bench_engine": ["--hidden", "256"],
    "bench_pipeline": ["--layers", "8"],
    "bench_restart": ["--quick"],
    "bench_inductor": ["--quick"],
    "bench_aot_compile": ["--quick"],
    "bench_vllm": ["--quick"],
    "bench_fleet": ["--repeat", "1"],
    "bench_run": ["--quick"],
    "bench_programs": ["--quick"],
    "bench_zoo": ["--quick"],
}

#: Where a benchmark writes its figures, when the file is not named after the script.
JSON_NAMES: dict[str, list[str]] = {
    "bench_store": ["store.json"],
    "bench_daemon": ["daemon.json"],
    "bench_engine": ["engine.json"],
    "bench_snapshot": ["bench_snapshot.json", "snapshot.json"],
    "bench_pipeline": ["bench_pipeline.json", "pipeline.json"],
    "bench_restart": ["restart.json"],
    "bench_remote": ["remote.json"],
    "bench_compression": ["compression.json"],
    "bench_scale": ["scale.json"],
    "bench_inductor": ["inductor.json"],
    "bench_aot_compile": ["aot_compile.json"],
    "bench_vllm": ["vllm.json"],
    "bench_fleet": ["fleet.json"],
    "bench_run": ["run.json"],
    "bench_programs": ["programs.json"],
    "bench_flight": ["flight.json"],
    "bench_zoo": ["zoo.json"],
}

Row = dict[str, Any]


# --------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
        info["cpu_model"] = models[0] if models else platform.processor() or "unknown"
        info["cpu_threads_total"] = len(models) or os.cpu_count()
        flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
        info["cpu_avx512"] = " avx512f" in flags
    except OSError:
        info["cpu_model"] = platform.processor() or "unknown"
    try:
        info["nproc"] = int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout)
    except (OSError, subprocess.CalledProcessError, ValueError):
        info["nproc"] = len(os.sched_getaffinity(0))
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        info["ram_gib"] = round(int(meminfo["MemTotal"].split()[0]) / 1024 / 1024, 1)
    except (OSError, KeyError, ValueError):
        info["ram_gib"] = None
    info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    info["python"] = platform.python_version()
    info["kernel"] = platform.release()
    try:
        info["torch"] = (
            subprocess.run(
                [sys.executable, "-c", "import torch; print(torch.__version__)"],
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.TimeoutExpired):
        info["torch"] = None
    try:
        info["git_commit"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except OSError:
        info["git_commit"] = None
    return info


# --------------------------------------------------------------------------- running

#: ``bench_*.py`` modules that are helpers of the benchmarks, not benchmarks.
HELPERS = frozenset({"bench_results"})


def discover(only: set[str] | None) -> list[Path]:
    benches = sorted(b for b in HERE.glob("bench_*.py") if b.stem not in HELPERS)
    if only:
        benches = [b for b in benches if b.stem in only or b.stem.removeprefix("bench_") in only]
    return benches


def quick_args(bench: Path) -> list[str]:
    if bench.stem in QUICK_ARGS:
        return QUICK_ARGS[bench.stem]
    try:
        help_text = subprocess.run(
            [sys.executable, str(bench), "--help"], capture_output=True, text=True, cwd=REPO, timeout=120
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ["--quick"] if "--quick" in help_text else []


def _json_candidates(bench: Path) -> list[Path]:
    names = JSON_NAMES.get(bench.stem, []) + [f"{bench.stem}.json", f"{bench.stem.removeprefix('bench_')}.json"]
    return [OUT / n for n in dict.fromkeys(names)]


def run_one(bench: Path, *, quick: bool, timeout: float) -> dict[str, Any]:
    argv = [sys.executable, str(bench.relative_to(REPO))] + (quick_args(bench) if quick else [])
    OUT.mkdir(exist_ok=True)
    (OUT / "logs").mkdir(exist_ok=True)
    before = {p: p.stat().st_mtime for p in OUT.glob("*.json")}
    log_path = OUT / "logs" / f"{bench.stem}.log"
    print(f"\n=== {bench.stem}: {' '.join(argv)}", flush=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = -9
    seconds = time.monotonic() - start
    written = [
        p
        for p in OUT.glob("*.json")
        if p.stat().st_mtime > before.get(p, 0.0) and p.name not in ("results.json", "faults.json", "stress.json")
    ]
    data: Any = None
    source = None
    for cand in _json_candidates(bench) + written:
        if cand in written or (rc == 0 and cand.exists() and cand.stat().st_mtime >= start - 1):
            try:
                data = json.loads(cand.read_text())
                source = cand.name
                break
            except (OSError, ValueError):
                continue
    if rc != 0:
        print(f"!!! {bench.stem} exited with {rc} after {seconds:.0f}s (log: {log_path})", flush=True)
    return {
        "argv": argv,
        "returncode": rc,
        "seconds": round(seconds, 1),
        "json_file": source,
        "figures": data,
        "json_written": _mtime(OUT / source) if source else None,
        "log": str(log_path.relative_to(REPO)),
    }


def _mtime(path: Path) -> str | None:
    try:
        return _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.UTC).isoformat(timespec="seconds")
    except OSError:
        return None


# --------------------------------------------------------------------------- table rows


def _get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            raise KeyError("/".join(path))
        d = d[p]
    return d


def _us(x: float) -> str:
    return f"{x:.1f} µs" if x < 1000 else f"{x / 1000:.2f} ms"


def _s(x: float) -> str:
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def _signed(x: float) -> str:
    """``+ 0.42 s`` or ``- 85.8 ms``: a difference."""
    return f"{'+' if x >= 0 else '-'} {_s(abs(x))}"


def row(
    bench: str,
    name: str,
    figure: str,
    baseline: str,
    ratio: float | str | None,
    target: str = "",
    met: bool | None = None,
    note: str = "",
) -> Row:
    return {
        "benchmark": bench,
        "name": name,
        "adstore": figure,
        "baseline": baseline,
        "ratio": ratio,
        "target": target,
        "met": met,
        "note": note,
    }


def rows_store(d: dict) -> list[Row]:
    s, lk, c = d["small"], d["lookup"], d["concurrent"]
    out = [
        row(
            "store",
            "small get p50 (4 KiB)",
            _us(s["get_p50_us"]),
            f"diskcache {_us(s['dc_get_p50_us'])}",
            s["dc_get_p50_us"] / s["get_p50_us"],
            "≥ 3× faster than diskcache",
            s["dc_get_p50_us"] / s["get_p50_us"] >= 3,
        ),
        row(
            "store",
            "small put p50 (4 KiB)",
            _us(s["put_p50_us"]),
            f"diskcache {_us(s['dc_put_p50_us'])}",
            s["dc_put_p50_us"] / s["put_p50_us"],
        ),
        row(
            "store",
            "lookup p50",
            _us(lk["lookup_p50_us"]),
            f"diskcache get {_us(lk['dc_lookup_p50_us'])}",
            lk["dc_lookup_p50_us"] / lk["lookup_p50_us"],
            "< 20 µs",
            lk["lookup_p50_us"] < 20,
        ),
        row(
            "store",
            "lookup p99",
            _us(lk["lookup_p99_us"]),
            f"diskcache get {_us(lk['dc_lookup_p99_us'])}",
            lk["dc_lookup_p99_us"] / lk["lookup_p99_us"],
        ),
    ]
    for key in ("1mib", "big"):
        if key not in d:
            continue
        t = d[key]
        label = f"{t['size_mib']:.0f} MiB"
        out += [
            row(
                "store",
                f"verified get {label}",
                f"{t['get_verified_mib_s']:.0f} MiB/s",
                f"read+sha256 floor {t['floor_read_hash_mib_s']:.0f} MiB/s",
                t["get_vs_floor"],
                "≤ 1.5× the floor's time",
                t["get_vs_floor"] <= 1.5,
            ),
            row(
                "store",
                f"put {label}",
                f"{t['put_mib_s']:.0f} MiB/s",
                f"file copy {t['floor_copy_mib_s']:.0f} MiB/s",
                t["put_vs_floor"],
                "",
                None,
                "ratio = adstore time / copy time",
            ),
            row(
                "store",
                f"re-put {label} (already stored)",
                _s(t["reput_s"]),
                f"hash only {_s(t['hash_only_s'])}",
                t["reput_vs_hash"],
                "≤ 1.2× hashing alone",
                t["reput_vs_hash"] <= 1.2,
            ),
        ]
    out.append(
        row(
            "store",
            f"lookups, {d.get('procs', 8)} reader processes",
            f"{c['adstore']['ops_per_s']:.0f}/s (p99 {_us(c['adstore']['p99_us'])})",
            f"diskcache {c['diskcache']['ops_per_s']:.0f}/s (p99 {_us(c['diskcache']['p99_us'])})",
            c["throughput_ratio"],
        )
    )
    return out


def rows_daemon(d: dict) -> list[Row]:
    out = []
    if "crossing" in d:
        c = d["crossing"]
        out.append(
            row(
                "daemon",
                "write crossing high watermark → under low watermark",
                f"median {_s(c['latency_median_s'])}, max {_s(c['latency_max_s'])}",
                f"eviction work alone {_s(c['baseline_eviction_work_s'])}",
                c.get("ratio_latency_to_work"),
                "< 2 s",
                c["latency_max_s"] < 2.0,
            )
        )
    if "idle" in d:
        i = d["idle"]
        out.append(
            row(
                "daemon",
                f"idle CPU over {i.get('seconds', 0):.0f} s",
                f"{i['daemon_cpu_percent']:.4f}% (RSS {i.get('daemon_rss_mib', 0):.0f} MiB)",
                f"1 s polling loop {i['baseline_polling_cpu_percent']:.3f}%",
                i.get("ratio_daemon_to_polling"),
                "< 0.1%",
                i["daemon_cpu_percent"] < 0.1,
            )
        )
    if "bulk" in d:
        b = d["bulk"]
        n = b["entries"]
        out.append(
            row(
                "daemon",
                f"evict {n} entries in batches of {b.get('batch_size')}",
                f"{_s(b['evict_s'])} ({b.get('evict_entries_per_s') or 0:.0f}/s)",
                f"diskcache cull {_s(b['baseline_diskcache_cull_s'])}",
                b.get("ratio_evict_to_diskcache"),
                "100k in < 10 s",
                (b["evict_s"] < 10.0 and b.get("left", 0) == 0) if n >= 100_000 else None,
                "" if n >= 100_000 else "target is for 100k entries: run without --quick",
            )
        )
        out.append(
            row(
                "daemon",
                f"`adstore stats` on {n} entries",
                _s(b["stats_s"]),
                f"python start-up {_s(b['baseline_python_startup_s'])}",
                b.get("ratio_stats_to_python_startup"),
            )
        )
    return out


def rows_snapshot(d: dict) -> list[Row]:
    a, f = d["adstore"], d["floor"]
    alts = {k: d[k] for k in ("export", "pickler_module", "pickler_graph_module") if isinstance(d.get(k), dict)}
    label = f"{d.get('layers')}-layer transformer, {d.get('nodes')} nodes"
    out = [
        row(
            "snapshot",
            f"decode ({label})",
            _s(a["decode_s"]),
            f"floor (rebuild from decoded list) {_s(f['decode_s'])}",
            a["decode_s"] / f["decode_s"],
            "≤ 1.5× floor",
            a["decode_s"] / f["decode_s"] <= 1.5,
        )
    ]
    for name, alt in alts.items():
        dec = alt.get("decode_module_s", alt.get("decode_s"))
        if dec is None:
            continue
        what = "torch.export.load + .module()" if name == "export" else f"GraphPickler ({name.split('_', 1)[1]})"
        out.append(
            row(
                "snapshot",
                f"decode vs {what}",
                _s(a["decode_s"]),
                _s(dec),
                dec / a["decode_s"],
                "faster than both alternatives",
                a["decode_s"] < dec,
            )
        )
        if "bytes" in alt:
            out.append(
                row(
                    "snapshot",
                    f"payload bytes vs {what}",
                    f"{a['bytes']:,} B",
                    f"{alt['bytes']:,} B",
                    alt["bytes"] / a["bytes"],
                    "",
                    None,
                    "export includes weights" if name == "export" else "",
                )
            )
    for name in ("export", "pickler_module", "pickler_graph_module"):
        if isinstance(d.get(name), dict) and "error" in d[name]:
            out.append(row("snapshot", f"{name}", "-", f"failed: {d[name]['error'][:60]}", None))
    out.append(row("snapshot", f"encode ({label})", _s(a["encode_s"]), "", None))
    return out


def rows_engine(d: dict) -> list[Row]:
    s, r, b = d["seconds"], d["ratios"], d["bytes"]
    cold = s.get("compile_miss_cold_total", s.get("compile_miss_total"))
    out = [
        row(
            "engine",
            "hit from store + refit",
            _s(s["hit_from_store_total"]),
            f"cold compile {_s(cold)}",
            r.get("cold_compile_over_store_hit", r.get("compile_over_store_hit")),
            "",
            None,
            "ratio = compile time / hit time",
        )
    ]
    if "compile_miss_warm_total" in s:
        out.append(
            row(
                "engine",
                "hit from store + refit (vs warm compile)",
                _s(s["hit_from_store_total"]),
                f"compile with warm inductor caches {_s(s['compile_miss_warm_total'])}",
                r.get("warm_compile_over_store_hit"),
            )
        )
    if "next_process_hit_total" in s:
        out.append(
            row(
                "engine",
                "next process: compile() call, engine cached",
                _s(s["next_process_hit_compile_call"]),
                f"next process recompiles {_s(s['next_process_recompile_compile_call'])}",
                r.get("next_process_recompile_over_hit_call"),
            )
        )
    out.append(
        row(
            "engine",
            "hit from memory + refit",
            _s(s["hit_from_memory_total"]),
            f"cold compile {_s(cold)}",
            r.get("cold_compile_over_memory_hit", r.get("compile_over_memory_hit")),
        )
    )
    out.append(
        row(
            "engine",
            "engine bytes stored (no weights)",
            f"{b['package_without_weights']:,} B",
            f"package with weights {b['package_with_weights']:,} B",
            r.get("bytes_with_weights_over_without"),
        )
    )
    return out


def rows_pipeline(d: dict) -> list[Row]:
    r = d["ratios"]
    m = d.get("model", {})
    label = f"{m.get('arch', '?')}, {m.get('layers', '?')} layers, hidden {m.get('hidden', '?')}"
    speed = r["restore_speedup_vs_prefix"]
    overhead = r["save_overhead_fraction_of_cold"]
    return [
        row(
            "pipeline",
            f"warm restore vs the prefix it replaces ({label})",
            _s(d["restore_s"]),
            f"prefix {_s(d['prefix_s'])}",
            speed,
            "≥ 20× faster",
            speed >= 20,
        ),
        row(
            "pipeline",
            "warm run vs cold run (whole pipeline)",
            _s(d["warm_s"]),
            f"cold {_s(d['cold_s'])}",
            r.get("warm_speedup_vs_cold"),
        ),
        row(
            "pipeline",
            "save overhead on a miss",
            f"{_s(d['save_s'])} ({overhead * 100:.1f}% of cold)",
            f"pipeline without cache {_s(d['baseline_nocache_s'])}",
            overhead,
            "< 10% of the cold run",
            overhead < 0.10,
            "ratio = overhead / cold time",
        ),
        row(
            "pipeline",
            "outputs warm == cold == no cache",
            str(d.get("outputs_match")),
            "",
            None,
            "bit-identical",
            bool(d.get("outputs_match")),
        ),
    ]


def _imports(info: dict | None) -> str:
    if not info:
        return ""
    return "warm process imports " + ", ".join(
        f"{k}: {'yes' if info.get(k) else 'no'}" for k in ("transformers", "dynamo")
    )


def rows_restart(d: dict) -> list[Row]:
    floor = d["floor_s"]
    out = [row("restart", "floor: fresh process, `import torch`", _s(floor), "", None)]
    for name, m in d.get("models", {}).items():
        above, cold_above = m["warm_s"] - floor, m["cold_s"] - floor
        ratio = m.get("above_floor_ratio")
        out.append(
            row(
                "restart",
                f"pipeline warm restart ({name}), start to first output",
                f"{_s(m['warm_s'])} (floor + {_s(above)})",
                f"cold restart {_s(m['cold_s'])}",
                m.get("speedup"),
                "≤ floor + 0.5 s",
                above <= 0.5,
                _imports(m.get("warm_imports")),
            )
        )
        out.append(
            row(
                "restart",
                f"pipeline time above the floor ({name})",
                _s(above),
                f"cold {_s(cold_above)}",
                ratio,
                "≥ 4× less",
                ratio is not None and ratio >= 4,
                "ratio = cold time above floor / warm time above floor",
            )
        )
    out.extend(_rows_compile_stage(d.get("compile", {})))
    if "engine" in d:
        e = d["engine"]
        out.append(
            row(
                "restart",
                "engine cache warm restart (MLP), start to first output",
                f"{_s(e['warm_s'])} (floor + {_s(e['warm_above_floor_s'])})",
                f"cold restart (compile) {_s(e['cold_s'])}",
                e.get("speedup"),
            )
        )
    return out


def _rows_compile_stage(sections: dict) -> list[Row]:
    """bench_restart's compile-stage rows: warm and new-host restarts per model and backend."""
    out = []
    for tag, c in sections.items():
        floor, warm, host, ratio = c["floor_s"], c["warm_s"], c["new_host_s"], c.get("above_floor_ratio")
        same = (
            f"outputs bit-identical: {'yes' if c['outputs_bit_identical'] else 'NO'}; "
            f"vs eager {c['max_abs_diff_vs_eager']:.1e}"
        )
        if c["backend"] == "aoti":
            out.append(
                row(
                    "restart",
                    f"compile stage warm restart ({tag})",
                    f"{_s(warm)} (floor + {_s(warm - floor)})",
                    f"cold restart {_s(c['cold_s'])}",
                    ratio,
                    "≤ floor + 0.5 s, ≥ 10× less above the floor",
                    warm - floor <= 0.5 and ratio is not None and ratio >= 10,
                    same,
                )
            )
            out.append(
                row(
                    "restart",
                    f"compile stage new host from the HTTP remote ({tag})",
                    f"{_s(host)} (floor + {_s(host - floor)})",
                    f"cold restart {_s(c['cold_s'])}",
                    c["cold_s"] / host,
                    "≤ floor + 1.0 s",
                    host - floor <= 1.0,
                )
            )
        else:
            above = c.get("warm_above_floor_and_imports_s")
            if above is not None:
                imports = warm - floor - above
                out.append(
                    row(
                        "restart",
                        f"compile stage warm restart ({tag})",
                        f"{_s(warm)} (floor + imports + {_s(above)})",
                        f"floor + Dynamo/Inductor import {_s(floor + imports)}",
                        None,
                        "≤ floor + Dynamo/Inductor import + 1.0 s",
                        above <= 1.0,
                        same,
                    )
                )
            out.append(
                row(
                    "restart",
                    f"compile stage new host from the HTTP remote ({tag})",
                    _s(host),
                    f"local warm restart {_s(warm)}",
                    c["new_host_over_warm"],
                    "≤ 1.3× local warm",
                    c["new_host_over_warm"] <= 1.3,
                    f"cold restart {_s(c['cold_s'])}; {same}",
                )
            )
    return out


def rows_remote(d: dict) -> list[Row]:
    out = []
    for name in ("s3", "http"):
        if name not in d:
            continue
        t = d[name]
        for way in ("download", "upload"):
            x = t[way]
            out.append(
                row(
                    "remote",
                    f"{name} blob {way} {t['size_mib']:.0f} MiB",
                    f"{x['adstore_mib_s']:.0f} MiB/s",
                    f"{t['baseline']} {x['baseline_mib_s']:.0f} MiB/s",
                    x["ratio_vs_baseline"],
                    "≥ 0.8×",
                    x["meets_0_8x"],
                    "ratio = adstore throughput / baseline throughput",
                )
            )
    if "repush" in d:
        r = d["repush"]
        out.append(
            row(
                "remote",
                "re-push an entry the remote has: blob bytes sent",
                str(r["repush_blob_bytes"]),
                f"first push {r['first_push_blob_bytes']:,} B",
                None,
                "0 bytes",
                r["meets_zero_bytes"],
            )
        )
    for name, x in d.get("down", {}).items():
        out.append(
            row(
                "remote",
                f"remote down ({name}): first lookup"
                + (
                    f" (after the client's set-up, {_s(x['client_setup_s'])} once per process)"
                    if x.get("client_setup_s", 0) >= 0.001
                    else ""
                ),
                _s(x["first_call_s"]),
                f"timeout {_s(x['timeout_s'])}",
                None,
                "≤ the timeout",
                x["meets_first_within_timeout"],
            )
        )
        out.append(
            row(
                "remote",
                f"remote down ({name}): later lookups, p50",
                _us(x["later_p50_us"]),
                f"max {_us(x['later_max_us'])}",
                None,
                "< 1 ms (circuit open)",
                x["meets_later_under_1ms"],
            )
        )
    if "pipeline" in d:
        p = d["pipeline"]
        label = f"llama, {p['layers']} layers, hidden {p['hidden']}"
        out.append(
            row(
                "remote",
                f"remote hit into an empty store vs the cold pipeline ({label}), whole processes",
                _s(p["remote_hit_s"]),
                f"cold pipeline {_s(p['cold_s'])}",
                p["speedup"],
                "≥ 10× faster",
                p["meets_10x"],
                f"floor (import torch) {_s(p['floor_s'])}",
            )
        )
        # Every process pays the floor, which caps the whole-process ratio at cold / floor; the work the
        # remote hit replaces is what lies above it.
        hit, cold = p["remote_hit_s"] - p["floor_s"], p["cold_s"] - p["floor_s"]
        if hit > 0 and cold > 0:
            out.append(
                row(
                    "remote",
                    "the same, above the floor (after `import torch`)",
                    _s(hit),
                    f"cold {_s(cold)}",
                    cold / hit,
                    "≥ 10× faster",
                    cold / hit >= 10,
                    f"whole processes cannot pass cold / floor = {p['cold_s'] / p['floor_s']:.1f}×",
                )
            )
        out.append(
            row(
                "remote",
                "cold run that also pushes",
                _s(p["cold_push_s"]),
                f"cold {_s(p['cold_s'])}",
                None,
                "",
                None,
                f"push adds {_s(max(p['push_overhead_s'], 0.0))}",
            )
        )
        out.append(
            row(
                "remote",
                "local hit after the remote hit",
                _s(p["local_hit_s"]),
                f"remote hit {_s(p['remote_hit_s'])}",
                p["remote_hit_s"] / p["local_hit_s"],
                "outputs equal",
                p["outputs_equal"],
            )
        )
    for name, x in d.get("restore", {}).items():
        out.append(
            row(
                "remote",
                f"{name} remote restore {x['size_mib']:.0f} MiB (download + verify + commit)",
                f"{x['restore_mib_s']:.0f} MiB/s",
                f"fetch_blob {x['fetch_blob_mib_s']:.0f} MiB/s",
                x["ratio_vs_fetch_blob"],
                "≥ 0.8×",
                x["meets_0_8x"],
                f"a durable fetch_blob (fsync): {x['fetch_blob_fsync_mib_s']:.0f} MiB/s",
            )
        )
    if "circuit_open" in d:
        c = d["circuit_open"]
        out.append(
            row(
                "remote",
                "lookup of an absent key, circuit open, p50",
                _us(c["p50_us"]),
                f"local miss {_us(c['local_miss_p50_us'])}",
                None,
                "≤ 20 µs",
                c["meets_20us"],
            )
        )
    if "drip" in d:
        x = d["drip"]
        out.append(
            row(
                "remote",
                "lookup against a server sending 1 byte/s",
                _s(x["lookup_s"]),
                f"deadline {_s(x['deadline_s'])}",
                None,
                "a miss within the deadline",
                x["meets_deadline"],
                f"reason {x['reason']}; unbounded it would take {x['unbounded_s']:.0f} s",
            )
        )
    if "pipeline" in d and d["pipeline"].get("bytes_down"):
        p = d["pipeline"]
        out.append(
            row(
                "remote",
                "bytes a remote hit moves (S3, compressed blobs travel as frames)",
                f"{p['bytes_down']:,} B",
                f"entry {p['entry_logical_bytes']:,} B",
                p["transfer_ratio"],
                "≥ 5× fewer",
                p["meets_5x_fewer_bytes"],
            )
        )
    if "race" in d:
        r = d["race"]
        out.append(
            row(
                "remote",
                f"{r['hosts']} simultaneous cold starts of one key",
                f"{r['builds']} build, {r['remote_hits']} remote hits",
                f"wall {_s(r['wall_s'])}",
                None,
                f"1 build, {r['hosts'] - 1} remote hits",
                r["meets_one_build"],
            )
        )
    return out


def rows_compression(d: dict) -> list[Row]:
    out = []
    for label, target, key in (("snapshot", "≥ 5× fewer", "meets_5x"), ("engine", "≥ 2× fewer", "meets_2x")):
        if label in d.get("demo", {}):
            x = d["demo"][label]
            out.append(
                row(
                    "compression",
                    f"the demo's {label} entries: bytes on disk",
                    f"{x['stored_bytes']:,} B",
                    f"content {x['content_bytes']:,} B",
                    x["ratio"],
                    target,
                    x[key],
                )
            )
    for name in ("get_1mib", "get_big"):
        if name in d:
            x = d[name]
            out.append(
                row(
                    "compression",
                    f"verified get {x['size_mib']:.0f} MiB, compressed {x['ratio_on_disk']:.1f}×",
                    f"{x['compressed_get_mib_s']:.0f} MiB/s",
                    f"stored raw {x['raw_get_mib_s']:.0f} MiB/s",
                    x["ratio_vs_raw"],
                    "≥ 0.8×",
                    x["meets_0_8x"],
                )
            )
    if "put_big" in d:
        p = d["put_big"]
        for kind, target, met in (("incompressible", "≥ 0.8×", p["meets_0_8x"]), ("snapshot_like", "", None)):
            x = p[kind]
            out.append(
                row(
                    "compression",
                    f"put {p['size_mib']:.0f} MiB, {kind.replace('_', '-')}",
                    f"{x['put_mib_s']:.0f} MiB/s",
                    f"sha256 + write + fsync {x['floor_mib_s']:.0f} MiB/s",
                    x["ratio_vs_floor"],
                    target,
                    met,
                )
            )
    return out


def rows_scale(d: dict) -> list[Row]:
    gib = lambda n: f"{n / (1 << 30):.2f} GiB"  # noqa: E731
    out = []
    for name, c in d.get("cases", {}).items():
        label = f"{name} ({c['parameters_billion']}B params, {c['nodes']} nodes, {c['snapshot_bytes']:,} B snapshot)"
        out.append(
            row(
                "scale",
                f"restore vs the prefix it replaces, {label}",
                _s(c["restore_s"]),
                f"prefix {_s(c['prefix_s'])}",
                c["prefix_over_restore"],
            )
        )
        out.append(
            row(
                "scale",
                f"{name}: restart time above the floor",
                _s(c["warm_above_floor_s"]),
                f"cold {_s(c['cold_above_floor_s'])}",
                c.get("above_floor_ratio"),
                "",
                None,
                f"floor (import torch) {_s(c['floor_s'])}",
            )
        )
        out.append(
            row(
                "scale",
                f"{name}: cold run peak RSS",
                gib(c["cold_peak_rss"]),
                f"warm {gib(c['warm_peak_rss'])}",
                None,
                "< 4 GiB",
                c["meets_cold_rss_under_4gib"],
            )
        )
    if "moe_forward" in d:
        m = d["moe_forward"]
        out.append(
            row(
                "scale",
                "1-layer Mixtral-8x7B forward on 2x8 tokens: peak RSS",
                gib(m["forward_peak_rss"]),
                f"weights {gib(m['weights_bytes'])}",
                m["peak_over_weights"],
                "≤ 1.5× the weights",
                m["meets_within_1_5x_weights"],
                "ratio = peak RSS / weight bytes",
            )
        )
    return out


def rows_inductor(d: dict) -> list[Row]:
    floor = d["floor_s"]
    out = [
        row(
            "inductor",
            "Dynamo + Inductor import (`torch._dynamo`, `torch._inductor.compile_fx`), fresh process",
            f"{_s(d['dynamo_inductor_import_s'])} (floor + {_s(d['dynamo_inductor_import_above_floor_s'])})",
            f"floor (`import torch`) {_s(floor)}",
            None,
            "",
            None,
            "the floor of any `torch.compile` restart",
        )
    ]
    for name, m in d.get("models", {}).items():
        warm, plain, host = m["local_warm"], m["new_host_plain"], m["new_host_adstore"]
        ratio = m.get("new_host_over_local_warm_above_floor")
        same = f"outputs bit-identical to the cold run: {'yes' if m['outputs_bit_identical'] else 'NO'}"
        if "warm_adstore" in m:  # issue 37: against the compiled floor (eager + the Dynamo/Inductor import)
            cf, hot = m["compiled_floor_s"], m["warm_adstore"]
            out.append(
                row(
                    "inductor",
                    f"plain `torch.compile` with `enable()`, warm local hit ({name}), start to first output",
                    f"{_s(hot['seconds'])} (compiled floor {_signed(m['warm_adstore_over_compiled_floor_s'])})",
                    f"compiled floor {_s(cf)} = eager {_s(m['eager_s'])} + Dynamo/Inductor import",
                    m["warm_adstore_over_compiled_floor_ratio"],
                    "≤ compiled floor + 0.7 s",
                    m["meets_warm_within_0_7s"],
                    f"ratio = warm / compiled floor; cold {_s(m['cold']['seconds'])}; "
                    f"adstore off {_s(warm['seconds'])}; {same}",
                )
            )
            out.append(
                row(
                    "inductor",
                    f"plain `torch.compile` with `enable()`, new host from the signed HTTP remote ({name})",
                    f"{_s(host['seconds'])} (warm {_signed(m['new_host_over_warm_adstore_s'])})",
                    f"warm with `enable()` {_s(hot['seconds'])}",
                    host["seconds"] / hot["seconds"],
                    "≤ warm + 0.5 s",
                    m["meets_new_host_within_0_5s_of_warm"],
                    f"ratio = new host / warm; compiled floor {_signed(m['new_host_over_compiled_floor_s'])}",
                )
            )
        out.append(
            row(
                "inductor",
                f"plain `torch.compile`, new host with adstore from the HTTP remote ({name}), above the floor",
                _s(host["above_floor_s"]),
                f"local warm (adstore off) {_s(warm['above_floor_s'])}",
                ratio,
                "≤ 1.2× local warm",
                m["meets_1_2x_local_warm"],
                f"ratio = new host / local warm, time above the floor; cold {_s(m['cold']['seconds'])}; {same}",
            )
        )
        out.append(
            row(
                "inductor",
                f"plain `torch.compile`, new host: with adstore vs without ({name}), start to first output",
                _s(host["seconds"]),
                f"without adstore {_s(plain['seconds'])}",
                m.get("new_host_plain_over_adstore"),
                "",
                None,
                "ratio = without / with",
            )
        )
        out.append(
            row(
                "inductor",
                f"kernels compiled on a new host with adstore ({name})",
                str(m["new_host_kernels_compiled"]),
                f"without adstore {plain['kernels_compiled']}",
                None,
                "0",
                m["meets_no_kernels_on_new_host"],
                "C++ builds counted in the process (one compile thread); ISA probes and the header apart",
            )
        )
    return out


def rows_fleet(d: dict) -> list[Row]:
    warm = d["local_warm"]["seconds"]
    out = []
    for h in d.get("hosts", {}).values():
        out.append(
            row(
                "fleet",
                f"host {h['label']} ({h['differs_by']}): start to first output, {h['compiler_runs']} compiler runs",
                _s(h["seconds"]),
                f"A's local warm restart {_s(warm)}",
                h["over_local_warm"],
                "≤ 1.3× warm + 0.5 s, 0 compiler runs",
                h["within_goal"],
                f"{d['model']}; ratio = host / A warm; identical output: {'yes' if h['identical'] else 'NO'}",
            )
        )
    return out


def rows_aot_compile(d: dict) -> list[Row]:
    floor = d["compiled_floor_s"]
    same = (
        f"outputs bit-identical to the cold run: {'yes' if d['outputs_bit_identical'] else 'NO'}; "
        f"max |aot - eager| {d['max_abs_diff_vs_eager']:.1e}"
    )
    return [
        row(
            "aot_compile",
            "compiled floor (eager run + Dynamo/Inductor import), Llama 4x256, fresh process",
            _s(floor),
            f"eager run {_s(d['eager_s'])}",
            None,
            "",
            None,
            "the floor of any compiled start",
        ),
        row(
            "aot_compile",
            "`aot_compile` warm restart (Llama 4x256), start to first output, above the compiled floor",
            _s(d["warm_above_compiled_floor_s"]),
            f"cold {_s(d['cold']['seconds'])}",
            d.get("cold_over_warm"),
            "≤ compiled floor + 0.5 s",
            d["meets_warm_within_0_5s"],
            f"ratio = cold / warm, whole processes; {same}",
        ),
        row(
            "aot_compile",
            "`aot_compile` new host from the HTTP remote (Llama 4x256), above the compiled floor",
            _s(d["new_host_above_compiled_floor_s"]),
            f"warm {_s(d['warm']['seconds'])}",
            None,
            "≤ compiled floor + 1.0 s",
            d["meets_new_host_within_1_0s"],
            same,
        ),
        row(
            "aot_compile",
            "`aot_compile` output against eager (Llama 4x256)",
            f"{d['max_abs_diff_vs_eager']:.1e}",
            "eager",
            None,
            "≤ 1e-4, bit-identical to cold",
            d["meets_within_1e_4_of_eager"] and d["outputs_bit_identical"],
            "max absolute difference of the logits",
        ),
    ]


def _wall(m: dict) -> str:
    """The plain wall-time excess over the floor, warm / new host (a run before they were kept: "-")."""
    keys = ("warm_above_compiled_floor_wall_s", "new_host_above_compiled_floor_wall_s")
    return " / ".join(_signed(m[k]) if k in m else "-" for k in keys)


def rows_zoo(d: dict) -> list[Row]:
    """bench_zoo: per zoo model, ``aot_compile``'s warm restart and new host above the compiled floor."""
    out = []
    for name, m in d["models"].items():
        compilers = f"{max(m['warm']['compiles'])}/{max(m['new_host']['compiles'])}"
        calls = "/".join(_s(statistics.median(m[k]["aot_compile_s"])) for k in ("warm", "new_host"))
        eager = m["max_abs_diff_vs_eager"]
        same = (
            f"bit-identical to cold: {'yes' if m['outputs_bit_identical'] else 'NO'}; "
            f"max |aot - eager| {'-' if eager is None else f'{eager:.1e}'}"
        )
        out.append(
            row(
                "zoo",
                f"`aot_compile` {name}: warm restart / new host (HTTP remote), above the compiled floor "
                "(the phases before adstore out)",
                f"{_signed(m['warm_above_compiled_floor_s'])} / {_signed(m['new_host_above_compiled_floor_s'])}",
                f"floor {_s(m['compiled_floor_s'])}; cold {_s(m['cold']['seconds'])}",
                m["cold_over_warm"],
                "≤ + 0.5 s / + 1.0 s, 0 compiler runs",
                m["meets_warm_within_0_5s"] and m["meets_new_host_within_1_0s"],
                f"ratio = cold / warm; wall time above the floor {_wall(m)}; "
                f"the `aot_compile()` call itself warm/new host {calls}; "
                f"compiler runs warm/new host {compilers}; {same}",
            )
        )
    return out


def rows_vllm(d: dict) -> list[Row]:
    warm, plain, host = d["local_warm"], d["new_host_plain"], d["new_host_adstore"]
    same = f"tokens identical in every run: {'yes' if d['tokens_identical'] else 'NO'}"
    floor = d["eager"]["to_output_s"]
    out = [
        row(
            "vllm",
            f"vLLM {d['vllm']} floor: eager start (`enforce_eager`) to first output, tiny Llama, CPU",
            _s(floor),
            "",
            None,
            note="also the compiled floor: vLLM imports Dynamo and Inductor in every process, compiled or not",
        ),
        row(
            "vllm",
            "vLLM cold start to first output (adstore on, pushes to the HTTP remote)",
            _s(d["cold"]["to_output_s"]),
            f"floor {_s(floor)}",
            None,
            note=f"engine init {_s(d['cold']['engine_init_s'])}",
        ),
        row(
            "vllm",
            "vLLM local warm start to first output (adstore off; the host's own caches)",
            _s(warm["to_output_s"]),
            f"floor {_s(floor)}",
            None,
            note=f"engine init {_s(warm['engine_init_s'])}; {_signed(warm['to_output_s'] - floor)} vs the floor",
        ),
    ]
    if "new_host_minus_local_warm_to_output_s" in d:
        over = d["new_host_minus_local_warm_to_output_s"]
        out.append(
            row(
                "vllm",
                "vLLM new host with adstore from the HTTP remote: start to first output",
                f"{_s(host['to_output_s'])} (local warm {_signed(over)})",
                f"local warm {_s(warm['to_output_s'])}",
                d["new_host_over_local_warm_to_output"],
                "≤ local warm + 2 s",
                d["meets_2s_of_local_warm"],
                f"ratio = new host / local warm; without adstore {_s(plain['to_output_s'])}; {same}",
            )
        )
    out += [
        row(
            "vllm",
            "vLLM engine init, new host with adstore from the HTTP remote",
            _s(host["engine_init_s"]),
            f"local warm (adstore off) {_s(warm['engine_init_s'])}",
            d["new_host_over_local_warm_engine_init"],
            "≤ 1.3× local warm",
            d["meets_1_3x_local_warm"],
            f"vLLM's figure; cold {_s(d['cold']['engine_init_s'])}, eager {_s(d['eager']['engine_init_s'])}",
        ),
        row(
            "vllm",
            "vLLM new host: engine init with adstore vs without",
            _s(host["engine_init_s"]),
            f"without adstore {_s(plain['engine_init_s'])}",
            d["new_host_plain_over_adstore_engine_init"],
            "",
            None,
            "ratio = without / with",
        ),
        row(
            "vllm",
            "kernels compiled on a new vLLM host with adstore",
            str(d["new_host_kernels_compiled"]),
            f"without adstore {plain['kernels_compiled']}",
            None,
            "0",
            d["meets_no_kernels_on_new_host"],
            "C++ compiler runs of every process of the run; ISA probes and the header apart",
        ),
    ]
    if "defaults" in d:
        out += rows_vllm_defaults(d["defaults"])
    return out


def rows_vllm_defaults(x: dict) -> list[Row]:
    """vLLM at its own settings (AOT compile on), TP=2: local warm and a host with another HOME and cache root."""
    cold, warm, plain_warm = x["d_cold"], x["d_local_warm"], x["d_local_warm_plain"]
    other, plain_other = x["d_other_root"], x["d_other_root_plain"]
    same = f"tokens identical in every run: {'yes' if x['tokens_identical'] else 'NO'}"
    runs = f"median of {x['repeat']}" if x["repeat"] > 1 else "one run"
    return [
        row(
            "vllm",
            f"vLLM defaults (AOT on), TP=2: cold start to first output (adstore on, pushes; {runs})",
            _s(cold["to_output_s"]),
            "",
            None,
            note=f"engine init {_s(cold['engine_init_s'])}; {cold['kernels_compiled']} kernels compiled",
        ),
        row(
            "vllm",
            "vLLM defaults, TP=2: local warm engine init, adstore on (vLLM's own AOT load, finalize_loading supplied)",
            _s(warm["engine_init_s"]),
            f"plugin off {_s(plain_warm['engine_init_s'])}",
            plain_warm["engine_init_s"] / warm["engine_init_s"],
            "both ranks load the AOT artifact",
            x["local_warm_loads_aot"],
            f"ratio = plugin off / on; plugin off: {plain_warm['aot_loaded']} AOT loads, "
            f"{plain_warm['aot_load_failures']} load failures, {plain_warm['kernels_compiled']} kernels compiled",
        ),
        row(
            "vllm",
            "vLLM defaults, TP=2: host with another HOME and VLLM_CACHE_ROOT, adstore from the remote: engine init",
            _s(other["engine_init_s"]),
            f"local warm {_s(warm['engine_init_s'])}",
            x["other_root_over_local_warm_engine_init"],
            "both ranks load the AOT artifact",
            x["other_root_loads_aot"],
            f"without adstore {_s(plain_other['engine_init_s'])}; to output {_s(other['to_output_s'])} "
            f"(local warm {_signed(x['other_root_minus_local_warm_to_output_s'])}); {same}",
        ),
        row(
            "vllm",
            "kernels compiled on a vLLM host with another HOME and VLLM_CACHE_ROOT (defaults, TP=2, adstore)",
            str(x["other_root_kernels_compiled"]),
            f"without adstore {plain_other['kernels_compiled']}",
            None,
            "0",
            x["other_root_kernels_compiled"] == 0,
            "C++ compiler runs of every process of the run; ISA probes and the header apart",
        ),
    ]


def rows_run(d: dict) -> list[Row]:
    """bench_run: what ``ADSTORE_ENABLE=1`` adds to a process start, against the same start without it."""
    out = []
    for key, name in (("pass", "ADSTORE_ENABLE=1: python -c pass"), ("import_torch", "ADSTORE_ENABLE=1: import torch")):
        f = d[key]
        target = "" if f.get("target_seconds") is None else f"+ {_s(f['target_seconds'])} at most"
        out.append(
            row(
                "run",
                name,
                f"{_s(f['on_seconds'])} ({_signed(f['added_seconds'])})",
                f"unset {_s(f['off_seconds'])}",
                f["ratio"],
                target,
                f.get("meets_target"),
                f"median of {f['repeat']} cold starts each way, in turns",
            )
        )
    return out


def rows_programs(d: dict) -> list[Row]:
    """bench_programs: third-party programs through ``adstore run``, cold, warm and on a host at another path."""
    out = []
    for name, f in sorted(d.items()):
        if not isinstance(f, dict):
            continue
        if "skipped" in f:
            out.append(row("programs", f"{name} through `adstore run`", "-", "-", None, "", None, f["skipped"]))
            continue
        cold, warm, host = f["cold"], f["warm"], f["second_host"]
        same = f"identical output: {'yes' if f['identical'] else 'NO'}"
        out += [
            row(
                "programs",
                f"{name} through `adstore run`: warm run (store only), {warm['compiler_runs']} compiler runs",
                _s(warm["seconds"]),
                f"cold {_s(cold['seconds'])}, {cold['compiler_runs']} compiler runs",
                f["cold_over_warm"],
                "0 compiler runs",
                warm["compiler_runs"] == 0,
                f"ratio = cold / warm, whole processes; {same}",
            ),
            row(
                "programs",
                f"{name}: host at another path (venv bind-mounted, seed store), {host['compiler_runs']} compiler runs",
                _s(host["seconds"]),
                f"warm {_s(warm['seconds'])}",
                f["second_host_over_warm"],
                "≤ 1.3× warm + 0.5 s, 0 compiler runs",
                f["meets_goal"],
                f"ratio = host / warm; {same}",
            ),
        ]
    return out


def rows_flight(d: dict) -> list[Row]:
    lone, t, k = d["lone"], d["together"], d["kill"]
    n = d["hosts"]
    return [
        row(
            "flight",
            "lone cold start (torch.compile of a small MLP, S3 remote): import to output",
            _s(lone["wall_s"]),
            f"{lone['builds']} C++ builds",
            None,
            "",
            None,
            d["model"],
        ),
        row(
            "flight",
            f"{n} hosts started together: C++ builds in all",
            str(t["total_builds"]),
            f"lone host {lone['builds']}",
            d["together_builds_over_lone"],
            "≤ 1.25×",
            d["together_builds_over_lone"] <= 1.25,
            f"FX graphs compiled: {t['total_fx_compiles']}; identical output: {'yes' if t['identical'] else 'NO'}",
        ),
        row(
            "flight",
            f"{n} hosts started together: slowest host, import to output",
            _s(t["slowest_s"]),
            f"lone {_s(lone['wall_s'])}",
            d["together_slowest_over_lone"],
            "≤ 2×",
            d["together_slowest_over_lone"] <= 2,
            "",
        ),
        row(
            "flight",
            f"{n} hosts, the builder SIGKILLed {d['kill_after_s']:g} s in (lease TTL {d['ttl_s']:g} s): slowest other",
            _s(k["slowest_s"]),
            f"lone {_s(lone['wall_s'])}",
            d["kill_slowest_over_lone"],
            "≤ 3×",
            d["kill_within_goal"],
            f"identical output: {'yes' if k['identical'] else 'NO'}; FX graphs compiled {k['total_fx_compiles']}",
        ),
    ]


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(_flatten(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
    return out


def rows_generic(bench: str, d: Any, *, skip: bool = False) -> list[Row]:
    """One row per reported ratio (and target flag) for a benchmark without an extractor."""
    out = []
    for k, v in _flatten(d).items():
        leaf = k.rsplit(".", 1)[-1]
        if (
            isinstance(v, (int, float))
            and not isinstance(v, bool)
            and ("ratio" in leaf or "_over_" in leaf or "_vs_" in leaf or "speedup" in leaf)
        ):
            out.append(row(bench, k, "-", "-", float(v)))
        elif leaf.startswith("meets") and isinstance(v, bool) and not skip:
            out.append(row(bench, k, "-", "-", None, "see benchmark", v))
    return out


EXTRACTORS: dict[str, Callable[[dict], list[Row]]] = {
    "bench_store": rows_store,
    "bench_daemon": rows_daemon,
    "bench_snapshot": rows_snapshot,
    "bench_engine": rows_engine,
    "bench_pipeline": rows_pipeline,
    "bench_restart": rows_restart,
    "bench_remote": rows_remote,
    "bench_compression": rows_compression,
    "bench_scale": rows_scale,
    "bench_inductor": rows_inductor,
    "bench_aot_compile": rows_aot_compile,
    "bench_vllm": rows_vllm,
    "bench_fleet": rows_fleet,
    "bench_run": rows_run,
    "bench_programs": rows_programs,
    "bench_flight": rows_flight,
    "bench_zoo": rows_zoo,
}


def table_rows(name: str, result: dict[str, Any]) -> list[Row]:
    data = result.get("figures")
    short = name.removeprefix("bench_")
    if result["returncode"] != 0 and not data:
        return [
            row(
                short,
                "(benchmark failed)",
                "-",
                "-",
                None,
                "",
                False,
                f"exit {result['returncode']}, see {result['log']}",
            )
        ]
    if not isinstance(data, dict):
        return [row(short, "(no JSON figures found)", "-", "-", None, "", None, f"see {result['log']}")]
    extractor = EXTRACTORS.get(name)
    if extractor is not None:
        try:
            return extractor(data)
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            rows = rows_generic(short, data)
            return rows + [
                row(
                    short,
                    "(table extractor out of date)",
                    "-",
                    "-",
                    None,
                    "",
                    None,
                    f"missing {exc}; generic rows shown",
                )
            ]
    return rows_generic(short, data) or [row(short, "(no ratios reported)", "-", "-", None)]


# --------------------------------------------------------------------------- reliability figures (from tests)


def reliability_figures(previous: dict[str, Any]) -> dict[str, Any] | None:
    """The test suite's tallies (``faults.json``, ``stress.json``) as they are now, kept in ``results.json``.

    The tests rewrite those two files on every run, so the documented figures are the copy taken
    here; a file that is absent keeps the copy of the last run.
    """
    kept = dict(previous.get("reliability") or {})
    for name in ("faults", "stress"):
        path = OUT / f"{name}.json"
        try:
            kept[name] = json.loads(path.read_text())
            kept[f"{name}_written"] = _mtime(path)
        except (OSError, ValueError):
            continue
    return kept or None


# --------------------------------------------------------------------------- output


def write_markdown(doc: dict[str, Any]) -> str:
    """``bench-results/RESULTS.md``: the tables of docs/performance.md and docs/reliability.md, made alike."""
    lines = ["# adstore benchmark results", "", docs_tables.performance_table(doc)]
    kept = doc.get("reliability") or {}
    rel = docs_tables.reliability_rows(kept.get("faults") or {}, kept.get("stress") or {})
    if rel:
        lines += ["## Reliability (figures kept by the test suite)", "", "| test | figure | result |", "|---|---|---|"]
        lines += rel
    return "\n".join(lines) + "\n"


def _portable(argv: list[str]) -> list[str]:
    """A benchmark's command as anyone can run it from the repository root (no interpreter path)."""
    return ["python", *argv[1:]] if argv else argv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller workloads (minutes, indicative figures)")
    ap.add_argument("--only", default="", help="comma-separated benchmark names (store,daemon,...)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per benchmark")
    ap.add_argument(
        "--table-only",
        action="store_true",
        help="do not run anything: rebuild results.json, RESULTS.md and the docs' tables from the JSON already there",
    )
    args = ap.parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()} or None
    machine = machine_info()
    results: dict[str, dict] = {}
    previous: dict[str, Any] = {}
    try:
        previous = json.loads((OUT / "results.json").read_text())
    except (OSError, ValueError):
        previous = {}
    if args.table_only:
        machine = previous.get("machine", machine)  # the table describes the machine of the run
    for bench in discover(only):
        if args.table_only:
            cands = [c for c in _json_candidates(bench) if c.exists()]
            prev = previous.get("benchmarks", {}).get(bench.stem, {})
            results[bench.stem] = {
                "argv": prev.get("argv", [sys.executable, str(bench.relative_to(REPO))]),
                "returncode": prev.get("returncode", 0),
                "seconds": prev.get("seconds", 0.0),
                "json_file": cands[0].name if cands else prev.get("json_file"),
                # a results.json copied without the benchmarks' own files keeps the figures it holds
                "figures": json.loads(cands[0].read_text()) if cands else prev.get("figures"),
                "json_written": _mtime(cands[0]) if cands else prev.get("json_written"),
                "log": f"bench-results/logs/{bench.stem}.log",
            }
            args.quick = bool(previous.get("quick", args.quick))
        else:
            results[bench.stem] = run_one(bench, quick=args.quick, timeout=args.timeout)
    if only:  # a partial run (or table) updates its benchmarks and keeps the others
        before = previous.get("benchmarks", {})
        results = {**{k: v for k, v in before.items() if k not in results}, **results}
        results = dict(sorted(results.items()))
    rows: list[Row] = []
    for name, res in results.items():
        res["argv"] = _portable(res.get("argv") or [])
        res["rows"] = table_rows(name, res)
        rows += res["rows"]
    OUT.mkdir(exist_ok=True)
    doc = {"machine": machine, "quick": args.quick, "benchmarks": results, "rows": rows}
    doc["reliability"] = reliability_figures(previous)
    (OUT / "results.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md = write_markdown(doc)
    (OUT / "RESULTS.md").write_text(md)
    print("\n" + md)
    print(f"wrote {OUT / 'results.json'} and {OUT / 'RESULTS.md'}")
    for page in docs_tables.rewrite({"performance", "reliability"}):
        print(f"rewrote {page.relative_to(REPO)}")
    failed = [n for n, r in results.items() if r["returncode"] != 0]
    if failed:
        print(f"benchmarks that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
