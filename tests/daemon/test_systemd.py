"""The unit passes systemd-analyze verify and carries the settings the design requires;
the tmpfiles snippet creates a setgid, group-writable store directory."""

from __future__ import annotations

import configparser
import shutil
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "systemd"


def _unit() -> dict[str, list[str]]:
    """Directive -> values (directives may repeat)."""
    out: dict[str, list[str]] = {}
    for line in (SYSTEMD / "adstore.service").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def test_systemd_analyze_verify_passes() -> None:
    exe = shutil.which("systemd-analyze")
    assert exe, "systemd-analyze is required for this test"
    p = subprocess.run([exe, "verify", str(SYSTEMD / "adstore.service")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "adstore.service" not in p.stderr, p.stderr  # no warnings about our unit


def test_unit_settings() -> None:
    u = _unit()
    required = {
        "Type": "notify",
        "Restart": "on-failure",
        "User": "adstore",
        "Group": "adstore",
        "CacheDirectory": "adstore",
        "UMask": "0002",
        "ProtectSystem": "strict",
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "IOSchedulingClass": "idle",
        "CPUSchedulingPolicy": "idle",
        "ReadWritePaths": "/var/cache/adstore",
    }
    for key, value in required.items():
        assert u.get(key) == [value], key
    assert "WatchdogSec" in u and "ExecReload" in u and "DynamicUser" not in u
    assert "ProtectProc" not in u  # leases are checked against other users' processes
    assert int(u["Nice"][0]) > 0
    exec_start = u["ExecStart"][0].split()
    assert exec_start[exec_start.index("--config") + 1] == "/etc/adstore/adstore.toml"
    assert "daemon" in exec_start


def test_example_config_is_toml() -> None:
    import tomllib

    data = tomllib.loads((SYSTEMD / "adstore.toml").read_text())
    assert "max_size" in data


def test_tmpfiles_snippet_creates_a_setgid_group_dir(tmp_path: Path) -> None:
    exe = shutil.which("systemd-tmpfiles")
    assert exe, "systemd-tmpfiles is required for this test"
    text = (SYSTEMD / "adstore.tmpfiles").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("d "))
    assert line.split()[1:5] == ["/var/cache/adstore", "2775", "adstore", "adstore"]
    # The test machine has no adstore user: run the snippet as root:root under --root.
    conf = tmp_path / "adstore.conf"
    conf.write_text(text.replace("adstore adstore", "root root"))
    p = subprocess.run(
        [exe, f"--root={tmp_path / 'fs'}", "--create", str(conf)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    st = (tmp_path / "fs" / "var" / "cache" / "adstore").stat()
    assert stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISGID
    assert stat.S_IMODE(st.st_mode) == 0o2775


def test_unit_parses_as_ini() -> None:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.read_string((SYSTEMD / "adstore.service").read_text())
    assert {"Unit", "Service", "Install"} <= set(cp.sections())
