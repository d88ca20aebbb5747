"""Tree files that name the cache root or the venv: relocated pickles, loader-neutral kernels, and what stays refused.

Host A captures under its roots; host B restores under others.  The pickles
here have what torch's AOT artifact has: strings starting with a root (long
and short ones), a nested pickle in ``bytes``, frames (protocol 5, large).
"""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

from vllm_tree_workers import TREE

from adstore.integration.vllm import relocate, trees
from adstore.integration.vllm.treefiles import artifact_name

A = {
    "cache_root": "/home/a/.cache/vllm",
    "vllm": "/opt/venv-a/lib/python3.11/site-packages/vllm",
    "sys_prefix": "/opt/venv-a",
}
B = {
    "cache_root": "/srv/b/cache/vllm-root",
    "vllm": "/x/venv/lib/python3.11/site-packages/vllm",
    "sys_prefix": "/x/venv",
}


def _artifact(anchors: dict[str, str]) -> dict[str, object]:
    """What torch's artifact holds that names paths, with ``anchors``' paths (and bulk, so pickle frames it)."""
    inner = {
        "co_filename": f"{anchors['vllm']}/model_executor/models/llama.py",
        "trace": f'  File "{anchors["sys_prefix"]}/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1',
    }
    return {
        "repro": f"os.environ['TORCHINDUCTOR_CACHE_DIR'] = '{anchors['cache_root']}/inductor_cache'\n" + "x" * 300,
        "inner": pickle.dumps(inner, protocol=5),
        "weights": os.urandom(200_000),
        "names": [f"{anchors['vllm']}/_custom_ops.py"] * 3,
        "unrelated": "/home/a/.cache/other/under-no-root",
    }


def _loads(data: bytes) -> dict[str, object]:
    out = pickle.loads(data)
    out["inner"] = pickle.loads(out["inner"])
    return out


def test_a_pickle_names_its_roots_and_gets_another_hosts_paths_back():
    original = pickle.dumps(_artifact(A), protocol=5)
    named = relocate.to_names(original, A)
    assert named is not None and not any(p.encode() in named for p in A.values())
    assert b"${cache_root}/inductor_cache" in named and b"${vllm}/_custom_ops.py" in named
    here = relocate.to_paths(named, B, ["cache_root", "sys_prefix", "vllm"])
    want = _artifact(B)
    want["weights"] = pickle.loads(original)["weights"]
    want["unrelated"] = "/home/a/.cache/other/under-no-root"
    assert _loads(here) == {**want, "inner": pickle.loads(want["inner"])}
    assert _loads(relocate.to_paths(named, A, list(A))) == _loads(original)  # and back home, the same objects


def test_what_cannot_be_rewritten_as_strings_is_not_relocated():
    opaque = pickle.dumps({"blob": b"\x00" + A["cache_root"].encode() + b"/x"}, protocol=5)  # bytes, not a pickle
    assert relocate.to_names(opaque, A) is None
    assert relocate.to_names(b"\x80\x05not a pickle " + A["cache_root"].encode(), A) is None
    prefix = pickle.dumps([A["cache_root"] + "/x", A["cache_root"] + "-other/y"])  # a root's bytes, not its path
    assert relocate.to_names(prefix, A) is None
    two = pickle.dumps(A["cache_root"], protocol=5) * 2  # more than one pickle
    assert relocate.to_names(two, A) is None
    spelled = pickle.dumps([A["cache_root"] + "/x", "${cache_root}"], protocol=5)  # the placeholder already in it
    assert relocate.to_names(spelled, A) is None
    named = relocate.to_names(pickle.dumps(A["cache_root"] + "/x"), A)
    assert relocate.to_paths(named, {"vllm": B["vllm"]}, ["cache_root"]) is None  # a role unknown here


def _elf(sections: dict[str, bytes]) -> bytes:
    """A minimal 64-bit little-endian ELF file with these sections (and ``.shstrtab``), enough for the parser."""
    names = b"\x00" + b"".join(n.encode() + b"\x00" for n in [*sections, ".shstrtab"])
    bodies = [*sections.values(), names]
    offsets, blob = [], b""
    for body in bodies:
        offsets.append(64 + len(blob))
        blob += body
    shoff = 64 + len(blob)
    header = (
        b"\x7fELF\x02\x01\x01"
        + b"\x00" * 9
        + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(bodies) + 1, len(bodies))
    )
    table = b"\x00" * 64
    for i, (name, body) in enumerate(zip([*sections, ".shstrtab"], bodies, strict=True)):
        kind = 6 if name == ".dynamic" else 3 if name.endswith("str") or name == ".shstrtab" else 1
        flags = 2 if name in (".rodata", ".dynstr", ".dynamic") else 0
        table += struct.pack(
            "<IIQQQQIIQQ", names.index(name.encode() + b"\x00"), kind, flags, 0, offsets[i], len(body), 0, 0, 1, 0
        )
    return header + blob + table


def test_a_kernel_that_names_a_root_only_where_the_loader_never_looks_is_neutral():
    root = A["cache_root"].encode()
    debug = _elf(
        {".rodata": b"msg " + root + b"/k.cpp\x00", ".debug_str": root + b"/k.cpp\x00", ".dynstr": b"libc.so.6\x00"}
    )
    assert relocate.loader_neutral(debug, [root])
    runpath = _elf({".dynstr": b"libc.so.6\x00" + root + b"/lib\x00", ".debug_str": b"k.cpp\x00"})
    assert not relocate.loader_neutral(runpath, [root])  # RUNPATH: the loader would look under host A's path
    assert not relocate.loader_neutral(b"\x7fELF\x01\x01" + b"\x00" * 80 + root, [root])  # 32-bit: not judged
    assert not relocate.loader_neutral(b"plain " + root, [root])


def test_a_tree_captured_under_one_root_restores_under_another(store, tmp_path):
    source = tmp_path / "src"
    (source / "rank_0_0").mkdir(parents=True)
    (source / "inductor_cache").mkdir()
    (source / "rank_0_0" / "model").write_bytes(pickle.dumps(_artifact(A), protocol=5))
    (source / "inductor_cache" / "k.so").write_bytes(_elf({".debug_str": A["cache_root"].encode() + b"/k.cpp\x00"}))
    captured = trees.capture(store, source=source, anchors=A, **TREE)
    assert captured.captured, captured
    key, components = trees.tree_key(**TREE)
    meta = store.lookup(key).manifest.meta
    assert meta["relocated"] == {"rank_0_0/model": ["cache_root", "sys_prefix", "vllm"]} and meta["anchors"] == {}
    assert components["paths"] == trees.PATHS and components["vllm_build"] == trees.vllm_build()
    restored = trees.restore(store, target=tmp_path / "b", anchors=B, **TREE)
    assert restored.reason == "restored", restored
    got = _loads((tmp_path / "b" / "rank_0_0" / "model").read_bytes())
    assert got["repro"].startswith(f"os.environ['TORCHINDUCTOR_CACHE_DIR'] = '{B['cache_root']}/inductor_cache'")
    assert got["inner"]["co_filename"] == f"{B['vllm']}/model_executor/models/llama.py"
    assert (tmp_path / "b" / "inductor_cache" / "k.so").read_bytes() == (
        source / "inductor_cache" / "k.so"
    ).read_bytes()
    assert not [p.name for p in tmp_path.iterdir() if ".adstore-" in p.name]


def test_a_file_that_embeds_a_root_opaquely_still_refuses_the_tree_and_names_the_path(store, tmp_path):
    source = tmp_path / "src"
    (source / "rank_0_0").mkdir(parents=True)
    (source / "rank_0_0" / "model").write_bytes(pickle.dumps(_artifact(A), protocol=5))
    (source / "rank_0_0" / "blob").write_bytes(b"\x00\x01" + A["cache_root"].encode() + b"/x")
    assert trees.capture(store, source=source, anchors=A, **TREE).captured
    outcome = trees.restore(store, target=tmp_path / "b", anchors=B, **TREE)
    assert (
        outcome.reason == "incompatible_env"
        and f"absolute path {A['cache_root']} (cache_root) differs" in outcome.detail
    )
    assert not (tmp_path / "b").exists()
    assert trees.restore(store, target=tmp_path / "a", anchors=A, **TREE).reason == "restored"  # same root: fine


def test_another_vllm_build_is_another_key(monkeypatch):
    key, _ = trees.tree_key(**TREE)
    monkeypatch.setattr(trees, "vllm_build", lambda: "another-build")
    assert trees.tree_key(**TREE)[0] != key


def test_a_relocated_entry_whose_meta_names_a_file_it_lacks_is_refused(store, tmp_path):
    key, components = trees.tree_key(**TREE)
    ref = store.put_bytes(pickle.dumps("${cache_root}/x"))
    meta = {"tree": 2, "files": {"model": 0o644}, "dirs": {}, "anchors": {}, "root_mode": 0o755}
    for relocated in ({"other": ["cache_root"]}, {"model": ["../x"]}, {"model": []}):
        store.save(
            key,
            {artifact_name("model"): ref},
            namespace=trees.NAMESPACE,
            components=components,
            meta={**meta, "relocated": relocated},
        )
        assert trees.restore(store, target=tmp_path / "out", anchors=B, **TREE).reason == "corrupt_tree"
    assert not Path(tmp_path / "out").exists()
