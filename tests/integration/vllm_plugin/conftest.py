"""A stand-in for vLLM 0.32.0 (no vLLM is installed here): only what the hooks wrap, with vLLM's names and signatures.

``fake_vllm`` writes a package ``vllm`` with vLLM's module names and file
layout and puts it first on ``sys.path``; nothing of it is imported until a
test (or vLLM's own code, as in a real process) imports it.  The real-vLLM
run is ``test_vllm_real.py`` (slow).

* ``vllm.compilation.decorators``: ``_try_load_aot_compiled_fn(model, path)``
  unpickling the artifact and calling its ``finalize_loading`` as vLLM 0.32.0
  does, None on a miss; a decorated class's ``save_aot_compiled_function``
  pickling an artifact that names the cache root (in a string, and in a
  nested pickle);
* ``vllm.compilation.backends``: ``CompilerManager.initialize_cache`` / ``save_to_file``;
* ``vllm.model_executor.models.registry``: ``_LazyRegisteredModel`` with
  vLLM's ``_get_cache_dir``, ``_get_cache_filename``,
  ``_load_modelinfo_from_cache`` and ``_save_modelinfo_to_cache`` (bodies
  as vLLM's), and ``inspect_model_cls`` doing what vLLM's does around
  them, with the subprocess replaced by a count (``INSPECTED``).
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from adstore.integration.vllm import hooks

FAKE = {
    "vllm/__init__.py": "",
    "vllm/envs.py": """
        import os
        def __getattr__(name):
            if name == "VLLM_CACHE_ROOT":
                return os.environ["VLLM_CACHE_ROOT"]
            raise AttributeError(name)
    """,
    "vllm/compilation/__init__.py": "",
    "vllm/compilation/decorators.py": """
        import os
        import pickle

        class Compiled:  # vLLM's own artifact class (VllmSerializableFunction) has finalize_loading
            def finalize_loading(self, vllm_config):
                self.finalized = True

        def _try_load_aot_compiled_fn(model, aot_compilation_path):
            try:
                with open(aot_compilation_path, "rb") as f:
                    loaded = pickle.load(f)
                loaded["compiled_fn"].finalize_loading(None)  # vLLM: loaded_fn._artifacts.compiled_fn.finalize_loading
                return loaded
            except Exception:
                return None

        class Model:  # what _support_torch_compile makes of a model class
            was_aot_compile_fn_loaded_from_disk = False
            def save_aot_compiled_function(self):
                os.makedirs(self._aot_cache_dir, exist_ok=True)
                tmp = f"{self._aot_compilation_path}.{os.getpid()}.tmp"
                root = os.environ["VLLM_CACHE_ROOT"]  # as torch's artifact: paths in strings, a nested pickle
                inner = pickle.dumps({"co_filename": f"{root}/inductor_cache/x.py"}, protocol=5)
                artifact = {"compiled_fn": Compiled(), "repro": f"CACHE_DIR = '{root}/inductor_cache'", "inner": inner}
                with open(tmp, "wb") as f:
                    pickle.dump(artifact, f, protocol=5)
                os.replace(tmp, self._aot_compilation_path)
    """,
    "vllm/compilation/backends.py": """
        import os
        class CompilerManager:
            def __init__(self):
                self.cache = {}
                self.is_cache_updated = False
            def initialize_cache(self, cache_dir, disable_cache=False, prefix=""):
                self.disable_cache, self.cache_dir, self.prefix = disable_cache, cache_dir, prefix
                self.cache_file_path = os.path.join(cache_dir, "vllm_compile_cache.py")
                if not disable_cache and os.path.exists(self.cache_file_path):
                    with open(self.cache_file_path) as f:
                        self.cache = eval(f.read())  # vLLM: ast.literal_eval
            def save_to_file(self):
                if self.disable_cache or not self.is_cache_updated:
                    return
                with open(self.cache_file_path, "w") as f:
                    f.write(repr(self.cache))
    """,
}
FAKE["vllm/model_executor/__init__.py"] = ""
FAKE["vllm/model_executor/models/__init__.py"] = ""
FAKE["vllm/model_executor/models/registry.py"] = """
    import json
    import os
    from dataclasses import asdict, dataclass
    from pathlib import Path

    import vllm.envs as envs

    INSPECTED = []  # vLLM runs a subprocess here: the class names it would have inspected


    @dataclass(frozen=True)
    class _ModelInfo:
        is_text_generation_model: bool
        supports_pp: bool


    @dataclass(frozen=True)
    class _LazyRegisteredModel:
        module_name: str
        class_name: str

        @staticmethod
        def _get_cache_dir() -> Path:
            return Path(envs.VLLM_CACHE_ROOT) / "modelinfos"

        def _get_cache_filename(self) -> str:
            cls_name = f"{self.module_name}-{self.class_name}".replace(".", "-")
            return f"{cls_name}.json"

        def _load_modelinfo_from_cache(self, module_hash):
            try:
                try:
                    with open(self._get_cache_dir() / self._get_cache_filename(), encoding="utf-8") as file:
                        mi_dict = json.load(file)
                except FileNotFoundError:
                    return None
                if mi_dict["hash"] != module_hash:
                    return None
                return _ModelInfo(**mi_dict["modelinfo"])
            except Exception:
                return None

        def _save_modelinfo_to_cache(self, mi, module_hash):
            try:
                cache_dir = self._get_cache_dir()
                cache_dir.mkdir(parents=True, exist_ok=True)
                path = cache_dir / self._get_cache_filename()
                tmp = path.with_name(path.name + ".tmp")  # vLLM: atomic_writer
                tmp.write_text(json.dumps({"hash": module_hash, "modelinfo": asdict(mi)}, indent=2))
                os.replace(tmp, path)
            except Exception:
                pass

        def inspect_model_cls(self, module_hash):  # vLLM hashes the model's source file itself
            mi = self._load_modelinfo_from_cache(module_hash)
            if mi is not None:
                return mi
            INSPECTED.append(self.class_name)
            mi = _ModelInfo(is_text_generation_model=True, supports_pp=self.class_name.startswith("Llama"))
            self._save_modelinfo_to_cache(mi, module_hash)
            return mi
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """The fake vLLM importable as ``vllm`` (nothing imported yet), ``VLLM_CACHE_ROOT`` in ``tmp_path``; gone after."""
    for name, text in FAKE.items():
        path = tmp_path / "fake" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    yield tmp_path / "vllm-cache"
    hooks.uninstall()
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]
