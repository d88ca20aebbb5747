"""The toolchain fingerprint keys what decides whether code runs here, and nothing else (issue: a fleet is not twins).

Near-identical hosts (bare metal and a VM, another kernel, another CPU model
string with the same instruction sets) must compute the same fingerprint, so
they share every engine, compile-stage artifact, Inductor entry and vLLM tree;
a host whose instruction sets really differ must not.  Engines, the compile
stage (through the engine index), Inductor entries and vLLM trees all key on
this one fingerprint (the last test).  ``/proc/cpuinfo`` is
given as an edited copy: to :func:`isa_flags` directly, and to a real child
process through a mount namespace (``unshare -m`` and a bind mount, as root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adstore.integration.validity.cpuid import CPUINFO, NOT_ISA, cpu_identity, isa_flags

pytest.importorskip("torch")

#: Flags a VM shows and bare metal does not, and ones a kernel or microcode update changes.
VOLATILE = ("hypervisor", "tsc_known_freq", "arch_capabilities", "md_clear", "constant_tsc", "rtm", "hle")

FINGERPRINT = (
    "import json\n"
    "from adstore.integration.validity.toolchain import toolchain_identity\n"
    "from adstore.integration.validity.keys import json_digest\n"
    "print(json.dumps({'toolchain': toolchain_identity(), 'digest': json_digest(toolchain_identity())}))\n"
)


def edited(src: Path, dst: Path, *, drop: tuple[str, ...] = (), add: tuple[str, ...] = (), model: str = "") -> Path:
    """A copy of ``src`` (cpuinfo) with flags dropped or added on every processor, and another model name."""
    out = []
    for line in src.read_text().splitlines():
        key, sep, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = [f for f in value.split() if f not in drop] + list(add)
            line = f"{key}{sep} {' '.join(flags)}"
        elif key.strip() == "model name" and model:
            line = f"{key}{sep} {model}"
        out.append(line)
    dst.write_text("\n".join(out) + "\n")
    return dst


def an_isa_flag() -> str:
    """An instruction-set flag this CPU has (an AVX-512 one where there is one)."""
    flags = isa_flags().split()
    for wanted in ("avx512f", "avx2", "sse4_2", "asimd", "fp"):
        if wanted in flags:
            return wanted
    assert flags, "no cpuinfo flags on this host"
    return flags[-1]


@pytest.fixture
def cpuinfo(tmp_path):
    if not CPUINFO.exists():
        pytest.skip("no /proc/cpuinfo")
    return tmp_path


def test_a_vm_and_bare_metal_with_the_same_isa_have_the_same_cpu_fingerprint(cpuinfo):
    vm = edited(CPUINFO, cpuinfo / "vm", add=VOLATILE, model="Intel(R) Xeon(R) Processor")
    metal = edited(CPUINFO, cpuinfo / "metal", drop=VOLATILE, model="Another CPU @ 2.10GHz")
    assert isa_flags(vm) == isa_flags(metal) != ""
    assert cpu_identity(vm) == cpu_identity(metal)
    assert not set(isa_flags(vm).split()) & NOT_ISA
    assert "model" not in cpu_identity(vm)


def test_a_missing_instruction_set_or_an_unknown_flag_changes_it(cpuinfo):
    flag = an_isa_flag()
    assert isa_flags(edited(CPUINFO, cpuinfo / "less", drop=(flag,))) != isa_flags(CPUINFO)
    # A flag no list knows (a newer kernel's, or a new instruction set) is kept: a miss, never a wrong hit.
    assert "new_isa_x" in isa_flags(edited(CPUINFO, cpuinfo / "more", add=("new_isa_x",))).split()


def test_an_unreadable_cpuinfo_is_no_flags(tmp_path):
    assert isa_flags(tmp_path / "absent") == ""


def fingerprint(env: dict[str, str] | None = None, prefix: list[str] | None = None) -> dict:
    """The toolchain record and its digest, computed by a fresh child process."""
    cmd = [*(prefix or []), sys.executable, "-c", FINGERPRINT]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, check=False, env={**os.environ, **(env or {})}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_another_aten_cpu_capability_is_another_fingerprint():
    here = fingerprint({"ATEN_CPU_CAPABILITY": ""})
    default = fingerprint({"ATEN_CPU_CAPABILITY": "default"})
    assert default["toolchain"]["cpu"]["capability"] == "DEFAULT"
    assert default["digest"] != here["digest"]


def _namespace() -> list[str] | None:
    """``unshare -m`` with private propagation, if this process may (root, and the kernel allows it)."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        return None
    probe = subprocess.run([unshare, "-m", "--propagation", "private", "true"], capture_output=True, check=False)
    return [unshare, "-m", "--propagation", "private"] if probe.returncode == 0 else None


def on_cpu(cpuinfo: Path, env: dict[str, str] | None = None) -> dict:
    """The fingerprint a child computes with ``cpuinfo`` bind-mounted over /proc/cpuinfo (its own namespace)."""
    ns = _namespace()
    if ns is None:
        pytest.skip("needs root and mount namespaces (unshare -m)")
    # The shell mounts in the new namespace, then becomes the child: the parent's /proc/cpuinfo is untouched.
    prefix = [*ns, "sh", "-c", f'mount --bind "{cpuinfo}" /proc/cpuinfo && exec "$@"', "sh"]
    return fingerprint(env, prefix)


def test_a_host_whose_cpuinfo_lacks_hypervisor_shares_every_key(cpuinfo):
    here = fingerprint()
    metal = on_cpu(edited(CPUINFO, cpuinfo / "metal", drop=VOLATILE, model="Another CPU @ 2.10GHz"))
    assert metal["digest"] == here["digest"]


def test_a_host_without_an_instruction_set_misses(cpuinfo):
    here = fingerprint()
    flag = an_isa_flag()
    less = on_cpu(edited(CPUINFO, cpuinfo / "less", drop=(flag,)))
    assert less["digest"] != here["digest"]
    assert flag in here["toolchain"]["cpu"]["isa"].split() and flag not in less["toolchain"]["cpu"]["isa"].split()


def test_engines_inductor_entries_and_vllm_trees_all_key_on_this_fingerprint():
    from adstore.integration.inductor.entries import InductorEntries
    from adstore.integration.validity.toolchain import toolchain_identity
    from adstore.integration.vllm import trees

    entries = InductorEntries(None, trusted=frozenset(), owns_store=False)
    _, components = entries.key("inductor_fx_graph", "k")
    assert components["toolchain"] == toolchain_identity()  # the record itself: explain names the field
    assert trees.tree_key(kind="k", vllm_hash="h", rank="0")[1]["toolchain"] == toolchain_identity()
