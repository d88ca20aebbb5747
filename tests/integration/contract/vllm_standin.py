"""A stand-in for vLLM's AOT compile path, for the contract suite's ``vllm_trees`` tier (no vLLM is installed here).

:func:`write` puts a package ``vllm`` in a directory; the tier's child puts
that directory on ``sys.path`` and installs the plugin's hooks
(:mod:`adstore.integration.vllm.hooks`), which wrap what they wrap in a real
vLLM: ``vllm.compilation.decorators._try_load_aot_compiled_fn`` and the
decorated class's ``save_aot_compiled_function``.  The stand-in runs no
model server; it does with one module what vLLM's ``@support_torch_compile``
``__call__`` does:

* **vLLM's hash** (:func:`compute_hash`): as vLLM's, of what decides the
  compiled code and nothing of the call: the source files of the module's
  own classes (vLLM hashes the files Dynamo traced), the model's config
  (the contract model's knobs and its dtype) and torch's version.  A code
  edit or a knob change is another directory, as in vLLM; a module global's
  value, a scalar argument or grad mode are not in it, as in vLLM.
* **the directories**: ``<VLLM_CACHE_ROOT>/torch_compile_cache/torch_aot_compile/<hash>/``
  with ``inductor_cache/`` made (empty) before the load is tried, and
  ``rank_0_0/model``, vLLM's names (``VLLM_CACHE_ROOT`` defaults to
  ``$XDG_CACHE_HOME/vllm`` or ``~/.cache/vllm``, as vLLM's).
* **the compile** (counted in :data:`COMPILES`): ``torch.export`` of the
  module with a dynamic batch dimension (vLLM compiles its token dimension
  dynamic), saved as ``inductor_cache/program.pt2``; ``rank_0_0/model`` is a
  pickle of vLLM's artifact object naming that file by its absolute path,
  so the tree holds the cache root's path as vLLM's pickles do.
* **the load**: ``_try_load_aot_compiled_fn`` unpickles ``model``, calls the
  artifact's ``finalize_loading`` (vLLM 0.32.0 does), which loads the program
  from the path the pickle names; any failure is None and vLLM compiles.  The
  program then runs with the model's own weights (vLLM loads its checkpoint
  into the module at every start; the compiled code reads them from there).
  So the answer of a served call is computed by the restored program, and a
  stale or foreign tree gives its own module's answer, never this one's.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

__all__ = ["SOURCES", "write"]

SOURCES = {
    "vllm/__init__.py": '"""A stand-in for vLLM (tests/integration/contract/vllm_standin.py)."""\n',
    "vllm/envs.py": """
        import os


        def __getattr__(name):
            if name == "VLLM_CACHE_ROOT":  # vLLM's default: $XDG_CACHE_HOME/vllm
                cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
                return os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT") or os.path.join(cache, "vllm"))
            raise AttributeError(name)
    """,
    "vllm/compilation/__init__.py": "",
    "vllm/compilation/decorators.py": """
        import hashlib
        import inspect
        import json
        import os
        import pickle

        import torch

        import vllm.envs as envs

        COMPILES = []  # each compile of this process (vLLM: Dynamo and Inductor)


        def compute_hash(model, config):
            torch_dir = os.path.dirname(torch.__file__)
            files = sorted({inspect.getsourcefile(type(m)) for m in model.modules()} - {None})
            code = {
                os.path.basename(f): hashlib.sha256(open(f, "rb").read()).hexdigest()
                for f in files
                if not f.startswith(torch_dir + os.sep)
            }
            factors = {"code": code, "config": config, "torch": torch.__version__}
            return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:10]


        class Compiled:  # vLLM's artifact (VllmSerializableFunction): finalize_loading makes it callable
            def __init__(self, program_path, fn=None):
                self.program_path, self.fn = program_path, fn

            def __getstate__(self):
                return {"program_path": self.program_path}

            def __setstate__(self, state):
                self.program_path, self.fn = state["program_path"], None

            def finalize_loading(self, vllm_config):
                self.fn = torch.export.load(self.program_path).module()

            def __call__(self, *args):
                return self.fn(*args)


        def _try_load_aot_compiled_fn(model, aot_compilation_path):
            try:
                with open(aot_compilation_path, "rb") as f:
                    loaded = pickle.load(f)
                loaded["compiled_fn"].finalize_loading(None)  # vLLM: loaded_fn._artifacts.compiled_fn.finalize_loading
                return loaded["compiled_fn"]
            except Exception:
                return None


        class SupportTorchCompile:  # what @support_torch_compile makes of a model class
            was_aot_compile_fn_loaded_from_disk = False

            def __init__(self, model, config):
                self.model, self.config, self.compiled = model, config, None

            def __call__(self, *args):
                if self.compiled is None:
                    self.compiled = self._load_or_compile(args)
                return self.compiled(*args)

            def _load_or_compile(self, args):
                cache_dir = os.path.join(
                    envs.VLLM_CACHE_ROOT,
                    "torch_compile_cache",
                    "torch_aot_compile",
                    compute_hash(self.model, self.config),
                )
                inductor_cache = os.path.join(cache_dir, "inductor_cache")
                os.makedirs(inductor_cache, exist_ok=True)
                self._aot_cache_dir = os.path.join(cache_dir, "rank_0_0")
                self._aot_compilation_path = os.path.join(self._aot_cache_dir, "model")
                loaded = _try_load_aot_compiled_fn(self, self._aot_compilation_path)
                if loaded is not None:
                    self.was_aot_compile_fn_loaded_from_disk = True
                    loaded.fn.load_state_dict(self.model.state_dict())  # vLLM: the weights are the model's own
                    return loaded
                COMPILES.append(self._aot_compilation_path)
                batch = torch.export.Dim("batch", min=1, max=1024)
                dynamic = ({0: batch},) + (None,) * (len(args) - 1)
                program = torch.export.export(self.model, args, dynamic_shapes=dynamic)
                path = os.path.join(inductor_cache, "program.pt2")
                torch.export.save(program, path + ".tmp")
                os.replace(path + ".tmp", path)
                self._compiled = Compiled(path, program.module())
                self.save_aot_compiled_function()
                return self._compiled

            def save_aot_compiled_function(self):
                os.makedirs(self._aot_cache_dir, exist_ok=True)
                tmp = f"{self._aot_compilation_path}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    pickle.dump({"compiled_fn": self._compiled}, f, protocol=5)
                os.replace(tmp, self._aot_compilation_path)
    """,
}


def write(directory: Path) -> Path:
    """The package ``vllm`` under ``directory`` (readable by every uid); the directory to put on ``sys.path``."""
    for name, text in SOURCES.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        path.chmod(0o644)
    for sub in [directory, *(p for p in directory.rglob("*") if p.is_dir())]:
        sub.chmod(0o755)
    return directory
