"""What of the CPU decides whether compiled code runs here: its instruction sets, nothing else.

Inductor compiles CPU kernels (and AOTInductor engines) with ``-march=native``
and picks a vector ISA (``cpu_vec_isa.pick_vec_isa``) from what torch's
``cpuinfo`` library reports (``torch.cpu._is_avx512_supported`` and kin) and
``ATEN_CPU_CAPABILITY``; ATen dispatches on ``get_cpu_capability()``.  Code
built for an instruction set this CPU lacks dies with SIGILL, so every
instruction-set extension is part of the key.  Everything else in
``/proc/cpuinfo`` is not: the model string, ``hypervisor``,
``tsc_known_freq``, ``arch_capabilities``, mitigation and power-management
flags change with the kernel, the microcode and the hypervisor, not with
what the code may execute, and keying on them made twins out of a fleet.

The flags kept are every flag of the cpuinfo ``flags``/``Features`` line
except the ones :data:`NOT_ISA` names.  A flag this list does not know (a
newer kernel's) is kept: an unknown flag costs a miss, never a wrong hit.
``toolchain.cpu`` in the engine cache's toolchain fingerprint is
:func:`cpu_identity`; docs/torch-compile.md ("What decides validity") has the
table of which component guards against which failure.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["CPUINFO", "NOT_ISA", "cpu_identity", "isa_flags", "torch_isa"]

#: Where the kernel describes the CPU (a parameter of :func:`isa_flags` so tests can give another).
CPUINFO = Path("/proc/cpuinfo")

#: cpuinfo flags that are not instructions code can use: operating-system and paging features,
#: virtualization (the host's and the guest's), timers, power and thermal management, performance
#: monitoring, memory encryption and enclaves, speculation mitigations (microcode), the kernel's own
#: synthetic flags, and microarchitectural hints (``erms``, ``fsrm``) compilers do not target.  TSX
#: (``hle``, ``rtm``) and MPX are here too: microcode updates and kernels remove them, and neither
#: a compiler nor Inductor emits them without explicit intrinsics.
NOT_ISA: frozenset[str] = frozenset(
    """
    vme de pse msr pae mce apic sep mtrr pge mca pat pse36 pn ds acpi ss ht tm ia64 pbe syscall nx
    pdpe1gb lm dts dtes64 monitor ds_cpl vmx smx est tm2 cid sdbg xtpr pdcm
    pcid dca x2apic tsc_deadline_timer osxsave hypervisor cpuid cpuid_fault constant_tsc nonstop_tsc
    nonstop_tsc_s3 tsc_reliable tsc_known_freq tsc_adjust tsc_scale art rep_good nopl xtopology
    arch_perfmon pebs bts aperfmperf amd_dcm always_running_timer extd_apicid nodeid_msr topoext
    perfctr_core perfctr_nb perfctr_llc bpext ptsc irperf xsaveerptr perfmon_v2 amd_lbr_v2
    amd_lbr_pmc_freeze arch_lbr cqm cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local rdt_a mba
    cat_l3 cat_l2 cdp_l3 cdp_l2 intel_pt pts pln dtherm ida arat epb hwp hwp_notify hwp_act_window
    hwp_epp hwp_pkg_req hwp_highest_perf_change hfi cppc cpb hw_pstate proc_feedback eff_freq_ro
    vmmcall svm extapic cr8_legacy osvw ibs skinit wdt lbrv svm_lock nrip_save vmcb_clean
    flushbyasid decodeassists pausefilter pfthreshold avic v_vmsave_vmload vgif v_spec_ctrl vnmi
    x2avic npt tpr_shadow flexpriority ept vpid ept_ad ept_5level vmx_flexpriority
    smep smap umip la57 pku ospke pks lam fred lkgs wrmsrns ibt user_shstk shstk split_lock_detect
    bus_lock_detect ring3mwait tme pconfig sgx sgx_lc sgx1 sgx2 sgx_edeccssa sme sev sev_es sev_snp
    sme_coherent vm_page_flush debug_swap v_tsc_aux amd_ppin intel_ppin succor smca overflow_recov
    mwaitx invpcid invpcid_single pti kaiser ibrs ibpb stibp ibrs_enhanced ssbd virt_ssbd amd_ssbd
    amd_stibp amd_ibrs amd_ibpb spec_ctrl intel_stibp spec_ctrl_ssbd flush_l1d md_clear
    arch_capabilities core_capabilities tsx_force_abort rrsba_ctrl bhi_ctrl ipred_ctrl psfd amd_psfd
    ibpb_brtype sbpb srso_no retpoline retpoline_amd rsb_ctxsw use_ibpb use_ibrs_fw ibrs_fw
    clear_cpu_buf tsx_ctrl taa_no mds_no hle rtm mpx erms fsrm fsrs fsrc fzrm zero_fcs_fds
    fdp_excptn_only amd_ibrs_same_mode amd_stibp_always_on stibp_always_on ibrs_same_mode
    xcompacted
    evtstrm
    """.split()
)

#: The fields of ``torch.cpu.get_capabilities()`` that are not instruction sets.
_TORCH_NOT_ISA = frozenset({"cpu_name", "architecture", "num_sockets", "num_physical_cores", "num_logical_cores"})


def isa_flags(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's instruction-set flags from ``cpuinfo`` (sorted, space-separated; ``""`` if unreadable)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features", "features"):
                    return " ".join(sorted(set(value.split()) - NOT_ISA))
    except OSError:
        pass
    return ""


def torch_isa() -> str:
    """The instruction sets torch's ``cpuinfo`` library reports (what Inductor and ATen choose from).

    Read from CPUID by torch, not from ``/proc/cpuinfo``: the two are the
    same CPU seen twice, and both are keyed (a hypervisor that masks a
    feature in one only is a miss, never a wrong hit).  Cache sizes and core
    counts are not instruction sets and are left out.
    """
    import torch

    getter = getattr(torch.cpu, "get_capabilities", None)
    if getter is None:
        return ""
    try:
        caps = getter()
    except Exception as exc:  # noqa: BLE001 - recorded as such: a miss at worst
        return f"error: {type(exc).__name__}"
    return " ".join(sorted(k for k, v in caps.items() if v is True and k not in _TORCH_NOT_ISA and "cache" not in k))


def cpu_identity(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """``toolchain.cpu``: the architecture, the ISA flags (kernel's and torch's view) and ATen's capability.

    Inductor's own ISA pick (``pick_vec_isa``) is a function of torch's view,
    the compiler (``toolchain.compiler``) and ``ATEN_CPU_CAPABILITY`` (and
    ``cpp.simdlen``, in Inductor's own key), all recorded here; calling it
    would cost ~1.4 s per process (it compiles probe programs).
    """
    import torch

    return {
        "machine": platform.machine(),
        "isa": isa_flags(cpuinfo),
        "torch_isa": torch_isa(),
        "capability": str(torch.backends.cpu.get_cpu_capability()),
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY", ""),
    }
