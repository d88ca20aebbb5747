"""``aot_compile``: torch's own AOT artifact in the store, loaded by a restart without tracing.

Real compiles in spawned processes ("hosts", ``aot_hosts.aot_host``): a miss
compiles and stores, a hit in a new process loads and builds no kernel, the
live weights run, a call outside the guards goes to ``torch.compile`` and is
logged once.  The key follows the module's code and structure and the
inputs, never the weights (no compile needed).  In the slow run: an
artifact blob owned by an untrusted uid and one with flipped bytes are
misses followed by a compile, and a new host is served by a real WebDAV
remote.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from aot_hosts import Scaled, Small, aot_host, conv_host, normed_host, scaled_host, small_inputs, unsafe_host  # noqa: E402
from inductor_hosts import host_env, on_host  # noqa: E402

from adstore.integration.inductor.aotkey import aot_components  # noqa: E402

IDENTITY = {"torch_key": "t", "toolchain": "c"}


def test_a_miss_compiles_and_stores_a_new_process_loads_it(tmp_path):
    a = on_host(aot_host, host_env(tmp_path, "a"), False)
    assert a["outcome"] == "compiled" and a["reason"] == "absent" and a["equals_eager"], a
    assert a["builds"] and a["failopen"] == {}, a
    b = on_host(aot_host, host_env(tmp_path, "b", root=tmp_path / "a" / "store"))
    assert b["outcome"] == "hit" and b["reason"] is None and b["key"] == a["key"], b
    assert b["builds"] == [], b["builds"]  # no kernel, no ISA probe: all placed or answered from the entry
    assert b["output"] == a["output"], "a hit computes its cold run's bits"
    assert b["live_weights"], "a weight changed in place is what runs"
    assert b["fallbacks_before"] == 0 and b["other_scalar"] and b["fallbacks"] == 2, b
    assert b["failopen"] == {"aot.guard_failed": 1}, b["failopen"]
    assert len([w for w in b["warnings"] if "guard_failed" in w]) == 1, b["warnings"]
    assert b["store"].get("aot.hits") == 1, b["store"]


def _module_from(tmp_path: Path, name: str, body: str) -> type:
    path = tmp_path / f"{name}.py"
    path.write_text("import torch\nfrom torch import nn\n\nclass M(nn.Module):\n" + body)
    spec = importlib.util.spec_from_file_location("aot_changed_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.M


def test_the_key_follows_code_structure_and_inputs_never_the_weights(tmp_path):
    model, x = small_inputs()
    key, components = aot_components(model, (x,), {"bias": 1.0}, IDENTITY)
    assert components["namespace"] == "inductor_aot" and components["module"].endswith("aot_hosts.Small")

    def other(m=model, args=(x,), kwargs=None):
        return aot_components(m, args, {"bias": 1.0} if kwargs is None else kwargs, IDENTITY)[0]

    with torch.no_grad():
        model.lin.weight.mul_(3.0)
    assert other() == key, "weights are not in the key: the live parameters run"
    assert other(args=(torch.randn(5, 8),)) != key  # another shape
    assert other(args=(x.double(),)) != key  # another dtype
    assert other(args=(x.t().contiguous().t(),)) != key  # another stride
    assert other(kwargs={"bias": 2.0}) != key  # another scalar, by value
    assert other(kwargs={}) != key  # the default, not passed
    assert other(m=Small().train()) != key  # training mode
    bigger = Small()
    bigger.lin = torch.nn.Linear(8, 8, bias=False)
    assert other(m=bigger) != key  # structure: a parameter less
    with torch.no_grad():
        assert other() != key  # grad mode
    body = "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(8, 8)\n\n"
    v1 = _module_from(tmp_path, "v1", body + "    def forward(self, x):\n        return self.lin(x)\n")
    v2 = _module_from(tmp_path, "v2", body + "    def forward(self, x):\n        return self.lin(x) * 2\n")
    assert aot_components(v1(), (x,), {}, IDENTITY)[0] != aot_components(v2(), (x,), {}, IDENTITY)[0]
    other_toolchain = {**IDENTITY, "toolchain": "d"}
    assert aot_components(v1(), (x,), {}, IDENTITY)[0] != aot_components(v1(), (x,), {}, other_toolchain)[0]


def test_an_input_with_no_canonical_value_is_compiled_not_stored(tmp_path):
    from adstore.integration.errors import CacheKeyError

    model, x = small_inputs()
    with pytest.raises(CacheKeyError, match="cannot be keyed"):
        aot_components(model, (x,), {"bias": object()}, IDENTITY)


def test_forward_hooks_go_to_torch_compile_without_a_store(tmp_path, monkeypatch):
    from adstore.integration.inductor import FAILOPEN, aot_compile

    monkeypatch.setenv("ADSTORE_ROOT", str(tmp_path / "never"))
    model, x = small_inputs()
    model.register_forward_hook(lambda mod, args, out: out + 1)
    before = FAILOPEN["aot.forward_hook"]
    compiled = aot_compile(model, (x,), {"bias": 1.0})
    assert compiled.outcome == "torch.compile" and compiled.reason == "forward_hook"
    assert FAILOPEN["aot.forward_hook"] == before + 1
    assert not (tmp_path / "never").exists(), "nothing opened for a module it cannot serve"
    with pytest.raises(TypeError, match="nn.Module"):
        aot_compile(lambda t: t, (x,))


def _artifact_blob(root: Path, key: str) -> Path:
    from adstore.integration.inductor.aot import ARTIFACT
    from adstore.store import Store

    with Store.open(root) as store:
        res = store.lookup(key, count=False)
        assert res.hit and res.manifest is not None
        path = store.blob_path(res.manifest.artifacts[ARTIFACT])
    assert path is not None, "the artifact is a blob file (inline_threshold=0)"
    return path


@pytest.mark.slow
def test_an_untrusted_or_damaged_artifact_is_a_miss_and_a_compile(tmp_path):
    root = tmp_path / "a" / "store"
    a = on_host(aot_host, host_env(tmp_path, "a"), False, 0)
    assert a["outcome"] == "compiled", a
    blob = _artifact_blob(root, a["key"])
    import os

    os.chown(blob, 65534, 65534)  # nobody wrote it, as far as this user can trust
    b = on_host(aot_host, host_env(tmp_path, "b", root=root), False, 0)
    assert b["outcome"] == "compiled" and b["reason"] == "untrusted_engine", b
    assert b["builds"] and b["output"] == a["output"] and b["equals_eager"], b
    assert b["failopen"].get("aot.untrusted_engine") == 1, b["failopen"]

    blob = _artifact_blob(root, a["key"])
    os.chown(blob, 0, 0)
    os.chmod(blob, 0o644)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    os.chmod(blob, 0o444)
    c = on_host(aot_host, host_env(tmp_path, "c", root=root), False, 0)
    assert c["outcome"] == "compiled" and c["reason"] == "checksum", c
    assert c["output"] == a["output"], c
    d = on_host(aot_host, host_env(tmp_path, "d", root=root), False, 0)
    assert d["outcome"] == "hit" and d["builds"] == [] and d["output"] == a["output"], d


@pytest.mark.slow
def test_a_new_host_loads_the_artifact_from_a_webdav_remote(tmp_path):
    sys.path.insert(0, str(HERE.parents[1] / "store" / "remote"))
    from remote_servers import start_webdav

    from adstore.store.remote import write_keypair

    server = start_webdav(tmp_path)
    try:
        private, public = write_keypair(tmp_path / "keys")
        url = f"{server.endpoint}/aot"
        writer = {"ADSTORE_REMOTE": url, "ADSTORE_REMOTE_MODE": "read-write", "ADSTORE_SIGNING_KEY": str(private)}
        a = on_host(aot_host, host_env(tmp_path, "a", **writer), False, 0)
        assert a["outcome"] == "compiled" and a["store"].get("remote.records_up", 0) >= 1, a
        reader = {"ADSTORE_REMOTE": url, "ADSTORE_TRUSTED_KEYS": str(public)}
        b = on_host(aot_host, host_env(tmp_path, "b", **reader), False, 0)
    finally:
        server.stop()
    assert b["outcome"] == "hit" and b["builds"] == [] and b["output"] == a["output"], b
    assert b["store"].get("remote.hits", 0) >= 1, b["store"]


_KEY_SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
from aot_hosts import conv_inputs, small_inputs
from adstore.integration.inductor.aotkey import aot_components
identity = {{"torch_key": "t", "toolchain": "c"}}
model, x = small_inputs()
conv, image = conv_inputs()
with torch.no_grad():
    print(aot_components(model, (x,), {{"bias": 1.0}}, identity)[0], aot_components(conv, (image,), {{}}, identity)[0])
"""


def test_the_key_is_the_same_in_every_process_and_directory():
    import os
    import subprocess

    keys = set()
    # Another working directory (Dynamo's debug_dir_root follows it) and another string hashing (sets in
    # Dynamo's configuration iterate in another order, and so does the repr of the frozenset constant in
    # _ConvNd.__init__'s code): the same keys.
    for seed, cwd in (("1", HERE), ("2", HERE.parent), ("3", HERE)):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        script = _KEY_SCRIPT.format(here=str(HERE))
        proc = subprocess.run(
            [sys.executable, "-c", script], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        keys.add(proc.stdout.strip().splitlines()[-1])
    assert len(keys) == 1, keys


def test_code_constants_are_encoded_canonically_never_by_repr():
    from adstore.integration.inductor.aotcode import code_digest, const_bytes

    names = [f"name{i}" for i in range(40)]
    assert const_bytes(frozenset(names)) == const_bytes(frozenset(reversed(names)))
    assert const_bytes(0.1) != const_bytes(0.1 + 2**-56) and const_bytes(0.0) != const_bytes(-0.0)
    assert const_bytes((1, (2, b"x"))) != const_bytes((1, (2, "x")))
    assert const_bytes(("ab", "c")) != const_bytes(("a", "bc"))

    def f():
        return {"a", "b"}, 1.5

    def g():
        return {"a", "b"}, 1.25

    assert code_digest(f.__code__) != code_digest(g.__code__)
    assert code_digest(f.__code__) == code_digest(f.__code__.replace(co_filename="elsewhere.py", co_firstlineno=99))


def test_a_conv_sequential_compiled_under_one_hash_seed_is_a_hit_under_others(tmp_path, monkeypatch):
    """nn.Sequential (torch's own forward, traced through a wrapper holding the bound method) with a
    convolution and batch norm: stored, and a hit under other hash seeds with no compiler run."""
    import json

    journal = tmp_path / "misses.jsonl"
    root = tmp_path / "a" / "store"
    monkeypatch.setenv("PYTHONHASHSEED", "1")  # the spawned hosts' interpreters start with it
    a = on_host(conv_host, host_env(tmp_path, "a", ADSTORE_MISS_LOG=str(journal)))
    assert a["seed"] == "1" and a["outcome"] == "compiled" and a["reason"] == "absent" and a["equals_eager"], a
    assert a["future_warnings"] == [], a["future_warnings"]  # no config patch of ours warns
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [r["key"] for r in records] == [a["key"]], "the miss is journalled for adstore explain"
    assert records[0]["components"]["namespace"] == "inductor_aot"
    for seed in ("2", "3"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        b = on_host(conv_host, host_env(tmp_path, f"b{seed}", root=root))
        assert b["seed"] == seed and b["outcome"] == "hit" and b["key"] == a["key"], b
        assert b["builds"] == [] and b["output"] == a["output"] and b["fallbacks"] == 0, b
        assert b["failopen"] == {} and b["future_warnings"] == [], b


def test_a_function_attribute_global_or_closure_value_is_in_the_key(tmp_path):
    import aot_hosts

    from adstore.integration.errors import CacheKeyError

    x = torch.randn(4, 8)

    def key(m):
        return aot_components(m, (x,), {}, IDENTITY)[0]

    tanh = key(Scaled(torch.tanh))
    assert key(Scaled(torch.tanh)) == tanh
    assert key(Scaled(torch.sigmoid)) != tanh, "a builtin by its import name"
    assert key(Scaled(lambda t: t * 2)) != key(Scaled(lambda t: t * 3)), "a lambda by its code"

    def scaled_by(k):
        return lambda t: t * k

    assert key(Scaled(scaled_by(2))) != key(Scaled(scaled_by(3))), "a closure cell by its value"
    assert key(Scaled(scaled_by(2))) == key(Scaled(scaled_by(2)))

    class Counter:
        def __call__(self, t):
            return t

    with pytest.raises(CacheKeyError, match="cannot be keyed"):
        key(Scaled(Counter()))  # a callable known only by its type: not served from the store
    old = aot_hosts.SCALE
    try:
        aot_hosts.SCALE = 3.0
        assert key(Scaled(torch.tanh)) != tanh, "a global forward reads, by value"
    finally:
        aot_hosts.SCALE = old


def test_a_rebound_global_or_attribute_is_never_answered_from_the_artifact(tmp_path):
    r = on_host(scaled_host, host_env(tmp_path, "a"))
    assert r["outcome"] == "compiled" and r["first"] < 1e-6, r
    assert r["global_changed"] < 1e-6, r  # torch.compile serves it, as for the eager module with SCALE = 3
    outcome, error, fallbacks = r["again"]
    assert outcome == "hit" and error < 1e-6 and fallbacks == 0, r
    error, fallbacks = r["act_changed"]
    assert error < 1e-6 and fallbacks == 1, r
    assert r["failopen"].get("aot.global_changed") == 2, r["failopen"]


def test_a_repointed_aot_entry_is_an_unsealed_miss(tmp_path):
    """A group member re-points one key's rows at another entry's artifact: the seal refuses it."""
    import dataclasses

    from adstore.integration.inductor import aot
    from adstore.integration.inductor.aotartifact import pack
    from adstore.integration.inductor.entries import InductorEntries
    from adstore.integration.placement.rule import trusted_uids
    from adstore.store import Store

    key_a, key_b = "a" * 64, "b" * 64
    with Store.open(tmp_path / "store") as store:
        for key, word in ((key_a, b"A"), (key_b, b"B")):
            ref = store.put_bytes(pack({"closure": [], "imports": {}}, word * 100_000))
            store.save(key, {aot.ARTIFACT: ref}, namespace=aot.NAMESPACE, trusted=trusted_uids())
        victim = store.lookup(key_a).manifest
        other = store.lookup(key_b).manifest
        store._tables.write(lambda t: t.put_manifest(dataclasses.replace(victim, artifacts=dict(other.artifacts))))
        entries = InductorEntries(store, trusted=trusted_uids(), owns_store=False)
        loaded, reason = aot._load(entries, key_a, {"namespace": aot.NAMESPACE}, Small())
        assert loaded is None and reason == "unsealed_entry", reason


def test_an_unsafe_tmpdir_is_a_reason_and_torch_compile_never_an_exception(tmp_path):
    unsafe = tmp_path / "shared-tmp"
    unsafe.mkdir()
    unsafe.chmod(0o777)  # world-writable without the sticky bit: anyone may rename into it
    r = on_host(unsafe_host, {**host_env(tmp_path, "a"), "TMPDIR": str(unsafe)})
    assert r["outcome"] == "torch.compile", r  # every call goes to torch.compile, as without adstore
    assert r["reason"] not in (None, "absent") and r["failopen"] == {f"aot.{r['reason']}": 1}, r


PRIMED_CHILD = """
import json, sys
import torch
import torch._inductor.codecache as codecache
from adstore.integration.validity import torchkey

if sys.argv[1] == "record":  # the host's first process: records the key torch computes
    primed = torchkey.prime()
    primed.thread.join()
    print(json.dumps({"status": primed.status}))
    raise SystemExit
hashed = []
build = codecache.build_code_hash
codecache.build_code_hash = lambda *a, **k: hashed.append(1) or build(*a, **k)
sys.path.insert(0, sys.argv[2])
from aot_hosts import small_inputs
from adstore.integration.inductor import aot_compile

model, x = small_inputs()
compiled = aot_compile(model, (x,), {"bias": object()})  # no canonical input: keyed (torch's key asked), not compiled
print(json.dumps({"outcome": compiled.outcome, "reason": compiled.reason, "hashed": len(hashed)}))
"""


def test_a_restart_gets_torchs_key_from_the_host_record_not_by_hashing_torch(tmp_path):
    """Every aot_compile key holds torch's source key: a restart reads it from the host's record (about 0.6 s
    of hashing torch's files otherwise, more than the rest of a warm load)."""
    import json
    import os
    import subprocess

    env = {**os.environ, **host_env(tmp_path, "a")}

    def child(*argv: str) -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", PRIMED_CHILD, *argv], env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert child("record") == {"status": "recording"}
    got = child("restart", str(HERE))
    assert got == {"outcome": "torch.compile", "reason": "key_error", "hashed": 0}, got


@pytest.mark.slow
def test_a_module_torch_cannot_store_is_said_once_and_served_through_enable(tmp_path):
    """torch refuses to write an artifact whose code reads a global nn.Module: the first process says so
    and keeps a note; the next ones serve the module through enable()'s caches (one compile in all, then
    none), never an aot_compile capture per process."""
    root = tmp_path / "a" / "store"
    a = on_host(normed_host, host_env(tmp_path, "a"))
    assert a["outcome"] == "compiled" and a["reason"] == "unstorable_module" and a["equals_eager"], a
    assert len(a["warnings"]) == 1 and not a["enabled"], a
    b = on_host(normed_host, host_env(tmp_path, "b", root=root))
    assert b["outcome"] == "torch.compile" and b["reason"] == "unstorable_module" and b["equals_eager"], b
    assert b["enabled"] and len(b["warnings"]) == 1 and b["builds"], b  # compiled once more, through enable()
    c = on_host(normed_host, host_env(tmp_path, "c", root=root))
    assert c["outcome"] == "torch.compile" and c["enabled"] and c["equals_eager"], c
    assert c["builds"] == [], c["builds"]  # graphs and kernels from the store: no compiler run
    assert c["failopen"] == {"aot.unstorable_module": 1}, c["failopen"]
