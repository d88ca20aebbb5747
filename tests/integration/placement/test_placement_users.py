"""Other users on one machine, for real (setpriv, uids 1001 and 1002, umask 002).

* A normal user with umask 002 (Debian's and Ubuntu's default): torch and
  vLLM make their directories 0775.  A second "host" of the same user hits
  Inductor's entries, builds nothing and runs no ISA probe, and vLLM tree
  restores succeed.
* Another local user made torch's default cache directory first (a
  world-writable ``TMPDIR`` and ``torchinductor_$USER`` of theirs): the
  victim's compile works, and none of the files found there is stored.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from other_users import user_argv  # tests/other_users.py

from adstore.store import Store

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv (other uids)"
)

HERE = Path(__file__).resolve().parent
INDUCTOR_TESTS = HERE.parent / "inductor"
VLLM_TESTS = HERE.parent / "vllm_plugin"
VICTIM, ATTACKER = 1001, 1002


@pytest.fixture
def base():
    """A directory every test uid can reach (pytest's own is root's alone)."""
    made = Path(tempfile.mkdtemp(prefix="adstore-users-", dir="/tmp"))
    os.chmod(made, 0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


def _home(base: Path, name: str, uid: int) -> Path:
    home = base / name
    home.mkdir(mode=0o775)
    os.chown(home, uid, uid)
    return home


def as_user(uid: int, code: str, env: dict[str, str], *, base: Path, umask: int = 0o022) -> dict:
    """Run ``code`` (which prints one JSON line last) as ``uid`` with ``umask``; its result.

    In a mount namespace where every user reaches this interpreter
    (tests/other_users.py): a probe subprocess of Inductor's runs
    ``sys.executable`` as the other user too.
    """
    child = [sys.executable, "-c", f"import os; os.umask({umask:#o})\n{code}"]
    argv = user_argv(uid, child, steps=[], stash=base / "python-stash")
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": env.get("HOME", "/nonexistent"), **env}
    done = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compile(uid: int, env: dict[str, str], *, base: Path, umask: int) -> dict:
    code = (
        f"import json, sys; sys.path.insert(0, {str(INDUCTOR_TESTS)!r})\n"
        "from inductor_hosts import compile_host\n"
        f"print(json.dumps(compile_host({env!r}, True, 1024)))\n"
    )
    return as_user(uid, code, {"USER": f"u{uid}", "LOGNAME": f"u{uid}"}, base=base, umask=umask)


def _artifacts(root: Path) -> dict[str, set[str]]:
    with Store.open(root) as store:
        return {
            e.namespace: {n for m in store.manifests(e.key) for n in m.artifacts}
            for e in store.entries()
            if e.namespace.startswith("inductor_")
        }


@pytest.mark.slow
def test_a_user_with_umask_002_hits_inductor_entries_without_a_build_or_a_probe(base):
    user = _home(base, "user", VICTIM)
    store = str(user / "store")

    def host(name: str) -> dict[str, str]:
        return {
            "ADSTORE_ROOT": store,
            "TORCHINDUCTOR_CACHE_DIR": str(user / name / "inductor"),
            "TMPDIR": str(user / name / "tmp"),
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
        }

    for name in ("a", "b"):
        for sub in ("inductor", "tmp"):
            as_user(
                VICTIM,
                f"import os, json; os.makedirs({str(user / name / sub)!r}); print(1)",
                {},
                base=base,
                umask=0o002,
            )
    a = _compile(VICTIM, host("a"), base=base, umask=0o002)
    assert a["enabled"] and a["failopen"] == {} and a["builds"], a
    assert (Path(host("a")["TORCHINDUCTOR_CACHE_DIR"]).stat().st_mode & 0o777) == 0o775  # umask 002's directories
    b = _compile(VICTIM, host("b"), base=base, umask=0o002)
    assert b["failopen"] == {}, b["failopen"]
    assert b["builds"] == [] and b["probes"] == 0, (b["builds"], b["probes"])
    assert b["inductor"].get("fxgraph_cache_hit") == 1 and b["output"] == a["output"]


@pytest.mark.slow
def test_files_in_a_cache_directory_another_user_made_first_are_never_stored(base):
    hostile = _home(base, "hostile", ATTACKER)  # the attacker's TMPDIR, open to everyone
    os.chmod(hostile, 0o777)
    planted = hostile / f"torchinductor_u{VICTIM}"  # torch's default cache directory, made first by the attacker
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    os.chown(planted, ATTACKER, ATTACKER)
    victim = _home(base, "victim", VICTIM)
    env = {"ADSTORE_ROOT": str(victim / "store"), "TMPDIR": str(hostile), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    got = _compile(VICTIM, env, base=base, umask=0o022)
    assert got["enabled"] and got["inductor"].get("fxgraph_cache_miss") == 1 and got["builds"], got
    assert list(planted.rglob("*.so")), "torch compiled into the attacker's directory"
    assert got["failopen"].get("unsafe_root", 0) >= 1, got["failopen"]
    assert any("not stored" in w for w in got["warnings"]), got["warnings"]
    held = _artifacts(victim / "store")
    assert held.get("inductor_fx_graph") == {"value"}, held  # the graph's value, none of the attacker's files
    assert not any(n.startswith(("cache.", "pch.")) for names in held.values() for n in names), held


TREE_CODE = r"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from vllm_tree_workers import TREE, make_tree, snapshot
from adstore.integration.vllm import trees
from adstore.store import Store
home = Path({home!r})
source = home / "cache" / "torch_compile_cache" / "h" / "rank_0_0" / "backbone"
source.parent.mkdir(parents=True)
make_tree(source)
for d in [source, *(p for p in source.rglob("*") if p.is_dir() and p.name != "locks")]:
    os.chmod(d, 0o775)  # as vLLM makes them under umask 002
target = home / "other" / "torch_compile_cache" / "h" / "rank_0_0" / "backbone"
target.parent.mkdir(parents=True)
with Store.open(home / "store") as store:
    captured = trees.capture(store, source=source, anchors={{}}, **TREE)
    restored = trees.restore(store, target=target, anchors={{}}, **TREE)
same = {{k: v[1] for k, v in snapshot(source).items()}} == {{k: v[1] for k, v in snapshot(target).items()}}
print(json.dumps([captured.reason, restored.reason, restored.detail, same, oct(target.parent.stat().st_mode & 0o777)]))
"""


def test_a_user_with_umask_002_captures_and_restores_vllm_trees(base):
    home = _home(base, "vllm", VICTIM)
    code = TREE_CODE.format(tests=str(VLLM_TESTS), home=str(home))
    captured, restored, detail, same, parent_mode = as_user(VICTIM, code, {}, base=base, umask=0o002)
    assert (captured, restored) == ("captured", "restored"), detail
    assert same and parent_mode == "0o755"  # the 0775 parent of this user's, tightened
