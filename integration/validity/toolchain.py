"""What outside the graph decides an engine's code: inductor settings and the toolchain.

Both are components of the engine hash (docs/engine-cache.md, "The engine cache"):

* the settings that change code generation: the inductor options the caller
  passes, the options the engine cache forces (so the weights stay out of the
  package and refittable), and a digest of the rest of the inductor
  configuration, so a global ``torch._inductor.config`` change is a miss, not
  a stale hit;
* the toolchain: what decides whether built code runs here, and nothing
  else.  Torch's version, commit and C++ ABI, the Python ABI, the C library,
  the C++ compiler (version line and target), the CPU's instruction sets
  (:mod:`~adstore.integration.validity.cpuid`: code is compiled with
  ``-march=native`` and may crash with an illegal instruction on a CPU that
  lacks one) and, with a GPU, the devices' architectures, the CUDA driver
  and the Triton version.  Never the CPU model, kernel- or
  microcode-dependent flags, host names, paths or uids: a fleet of
  near-identical hosts shares its code.  Stored with each engine, so a miss
  in another environment is ``incompatible_env`` naming the field.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import torch

from adstore.integration.errors import CacheKeyError, ConfigError
from adstore.integration.validity.cpuid import cpu_identity
from adstore.integration.validity.envcheck import apply_overrides
from adstore.integration.validity.keys import canonical_json, code_fingerprint, json_digest

__all__ = [
    "REQUIRED_SETTINGS",
    "STORAGE_SETTINGS",
    "codegen_settings",
    "effective_inductor_configs",
    "index_settings",
    "toolchain_identity",
]

#: Options without which an engine cannot be refit: inductor would otherwise inline
#: small weights into the kernels as literals (``always_keep_tensor_constants``) or
#: fold weights into derived constants (``freezing``, runtime constant folding), and
#: a refit would leave the old values in the code — a wrong answer, not a miss.
REQUIRED_SETTINGS: dict[str, Any] = {
    "always_keep_tensor_constants": True,
    "freezing": False,
    "aot_inductor.use_runtime_constant_folding": False,
}

#: Options that keep the weights out of the package (they are refit on load).
STORAGE_SETTINGS: dict[str, Any] = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": None,
}

# Inductor options that are paths or packaging details, not code generation.
# (``aot_inductor.metadata`` is also written back into the global config by every
# AOTI compile in torch 2.13, so including it would make the first compile of a
# process change every later hash.)
_CONFIG_IGNORED = frozenset(
    {
        "aot_inductor.metadata",
        "aot_inductor.output_path",
        "aot_inductor.package",
        "aot_inductor.package_constants_in_so",
        "aot_inductor.package_constants_on_disk_format",
    }
)


@functools.cache
def _known_config_keys() -> frozenset[str]:
    from torch._inductor import config

    return frozenset(config.get_config_copy().keys())


def effective_inductor_configs(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The inductor options an engine is compiled with: the caller's plus the forced ones.

    Raises ConfigError for an unknown option, a value that is not JSON-safe, or an
    option that would bake the weights into the code (the engine could not be refit).
    """
    user = dict(settings or {})
    known = _known_config_keys()
    for key, value in user.items():
        if key not in known:
            raise ConfigError(key, "unknown inductor option in engine settings")
        try:
            canonical_json(value)
        except (TypeError, ValueError, CacheKeyError) as exc:
            raise ConfigError(key, f"engine setting is not JSON-safe: {value!r}") from exc
        forced = {**REQUIRED_SETTINGS, **STORAGE_SETTINGS}
        if key in forced and value != forced[key]:
            raise ConfigError(
                key,
                f"{value!r} is incompatible with the engine cache (needs {forced[key]!r}: "
                "the weights must stay refittable and out of the package)",
            )
    return {**user, **REQUIRED_SETTINGS, **STORAGE_SETTINGS}


def codegen_settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """Settings component of the hash: explicit options plus a digest of the global config."""
    from torch._inductor import config

    effective = effective_inductor_configs(settings)
    with config.patch(effective):
        portable = config.save_config_portable()
    rest = {k: v for k, v in portable.items() if k not in _CONFIG_IGNORED}
    try:
        digest = json_digest(rest)
    except (TypeError, ValueError, CacheKeyError):  # an option holding an object (a custom pass): see _object
        digest = hashlib.sha256(json.dumps(rest, sort_keys=True, default=_object).encode()).hexdigest()
    return {
        "options": {k: effective[k] for k in sorted(effective)},
        "inductor_config": digest,
        # Global torch switches that change the kernels inductor picks (TF32 on GPUs).
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def _object(value: Any) -> Any:
    """An Inductor setting's value that is not JSON: a callable (a custom graph pass) by its code, else its repr.

    A pass keyed by its name or repr alone would keep an engine compiled
    with an older version of it; its code (source, closure, attributes) is
    what decides what it does to the graph.
    """
    if callable(value):
        try:
            return {"code": code_fingerprint([value])}
        except Exception:  # noqa: BLE001 - no fingerprint (state with no canonical form): the repr stands in
            pass
    return repr(value)


#: Environment variables Inductor's configuration reads when it is imported.
_CONFIG_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_")


def index_settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The settings an engine index key names, found without importing Inductor.

    The engine hash covers the whole effective Inductor configuration
    (:func:`codegen_settings`), which needs Inductor imported.  A restart
    that only loads an engine must not import it, so the index key names
    what decides that configuration instead: the options given (plus the
    forced ones), the environment variables Inductor reads its defaults
    from, and, when Inductor is already imported in this process, every
    global setting whose value differs from that default.  A process that
    never imported Inductor has no such change.
    """
    user = dict(settings or {})
    for key, value in user.items():
        try:
            canonical_json(value)
        except (TypeError, ValueError, CacheKeyError) as exc:
            raise ConfigError(key, f"engine setting is not JSON-safe: {value!r}") from exc
    options = {**user, **REQUIRED_SETTINGS, **STORAGE_SETTINGS}
    # (paths are not code generation: importing Inductor sets TORCHINDUCTOR_CACHE_DIR itself)
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_CONFIG_ENV_PREFIXES) and not k.endswith("_DIR")}
    return {
        "options": {k: options[k] for k in sorted(options)},
        "env": env,
        "changed": _changed_config(set(options)),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def _changed_config(skip: set[str]) -> dict[str, Any]:
    """Global Inductor settings that differ from their (environment-applied) defaults; {} if not imported."""
    config = sys.modules.get("torch._inductor.config")
    if config is None:
        return {}
    try:
        from torch.utils._config_module import _UNSET_SENTINEL as unset

        out: dict[str, Any] = {}
        for name, entry in config._config.items():
            if name in _CONFIG_IGNORED or name in skip or getattr(entry, "alias", None) is not None:
                continue
            base = entry.default
            for env_value in (entry.env_value_default, entry.env_value_force):
                if env_value is not unset:
                    base = env_value
            value = getattr(config, name)
            if value != base:
                out[name] = value
        return json.loads(json.dumps(out, sort_keys=True, default=_object))
    except Exception as exc:  # noqa: BLE001 - another torch's internals: the full digest stands in (a miss at worst)
        return {"inductor_config": codegen_settings({}).get("inductor_config", f"error: {type(exc).__name__}")}


# --------------------------------------------------------------------------- toolchain


def _compiler_identity() -> dict[str, str]:
    """The C++ compiler Inductor compiles engines with: its name and ``--version`` line.

    Inductor's choice is ``config.cpp.cxx``, whose default is ``$CXX`` or
    ``g++`` (``clang++`` on macOS).  While Inductor is not imported its
    configuration is that default, so the compiler is found the same way
    without importing it: importing Inductor imports dynamo, most of a
    second of a restart that only loads a finished engine.  Once it is
    imported, Inductor itself is asked (a caller may have changed the
    setting).
    """
    asked = "torch._inductor.config" in sys.modules or bool(os.environ.get("TORCH_INDUCTOR_INSTALL_GXX"))
    return _asked_compiler() if asked else _default_compiler()


@functools.cache
def _asked_compiler() -> dict[str, str]:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        cxx = str(get_cpp_compiler())
    except Exception as exc:  # noqa: BLE001 - identity is best effort, recorded as such
        return {"cxx": "unknown", "version": f"error: {type(exc).__name__}"}
    return _compiler_version(cxx)


@functools.cache
def _default_compiler() -> dict[str, str]:
    cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    found = _compiler_version(cxx)
    return found if not found["version"].startswith("error:") else {"cxx": "unknown", "version": found["version"]}


@functools.cache
def _compiler_version(cxx: str) -> dict[str, str]:
    """The compiler's version line and target triple, from one ``cxx -v`` (gcc and clang both print them)."""
    version = target = ""
    try:
        proc = subprocess.run([cxx, "-v"], capture_output=True, text=True, timeout=30, check=False)
        lines = (proc.stderr + proc.stdout).splitlines()
        target = next((ln.partition(":")[2].strip() for ln in lines if ln.startswith("Target:")), "")
        version = next((ln.strip() for ln in lines if " version " in f" {ln} " and "Configured" not in ln), "")
        version = version or (lines[0].strip() if lines else "")
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"error: {type(exc).__name__}"
    return {"cxx": os.path.basename(cxx), "version": version, "target": target}


@functools.cache
def _cpu_identity() -> dict[str, Any]:
    return cpu_identity()


def _cuda_driver() -> str:
    """The CUDA driver version (an engine's kernels need a driver at least as new as the build's)."""
    getter = getattr(torch._C, "_cuda_getDriverVersion", None)
    if getter is not None:
        try:
            return str(getter())
        except Exception as exc:  # noqa: BLE001 - identity is best effort, recorded as such
            return f"error: {type(exc).__name__}"
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001
        return "unknown"


def _gpu_arch(index: int) -> str:
    """A GPU's architecture: ``sm_90`` (CUDA) or the ROCm arch name with its features (``gfx90a:xnack-``)."""
    if getattr(torch.version, "hip", None):
        name = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "")
        if name:
            return str(name)
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def _triton_version() -> str | None:
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        try:
            return f"{dist}-{importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def _observed_toolchain() -> dict[str, Any]:
    gpu = torch.cuda.is_available()
    # GPU code runs on a device of its architecture: the arch, not the device's name or count.
    gpus = sorted({_gpu_arch(i) for i in range(torch.cuda.device_count())}) if gpu else []
    return {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", ""),
        "torch_cxx11_abi": bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", False)),
        "torch_debug": bool(getattr(torch.version, "debug", False)),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "python": f"{sys.implementation.name}-{sys.version_info.major}.{sys.version_info.minor}",
        "python_abi": importlib.machinery.EXTENSION_SUFFIXES[0] if importlib.machinery.EXTENSION_SUFFIXES else "",
        "system": platform.system(),
        # A kernel built against a newer C library needs its symbol versions (dlopen fails otherwise).
        "libc": " ".join(platform.libc_ver()).strip(),
        "compiler": _compiler_identity(),
        "cpu": _cpu_identity(),
        "gpus": gpus,
        # GPU kernels only: Triton writes them, the driver runs them (None on a CPU-only host).
        "cuda_driver": _cuda_driver() if gpu and torch.version.cuda else None,
        "triton": _triton_version() if gpu else None,
    }


def toolchain_identity() -> dict[str, Any]:
    """Everything outside the graph that decides whether a built engine runs here.

    Observed once per process; ``ADSTORE_ENV_OVERRIDES`` may simulate fields
    (``toolchain.cpu.capability``, ``toolchain.gpus``) for tests, marked as
    such (:mod:`adstore.integration.validity.envcheck`).
    """
    return apply_overrides(_observed_toolchain(), "toolchain")
