"""What the tree tests run in spawned processes (importable by name, so ``spawn`` finds it), and shared helpers."""

from __future__ import annotations

import os
import time
from pathlib import Path

from adstore.integration.vllm import trees
from adstore.store import Store

__all__ = ["TREE", "make_tree", "snapshot", "restore_or_capture"]

TREE = {"kind": "aot", "vllm_hash": "ab" * 32, "rank": "rank_0_0"}


def make_tree(root: Path, anchor: str = "/nowhere/cache") -> Path:
    """A small vLLM-like tree under ``root``: a pickle naming ``anchor``, kernels, nested and empty directories."""
    (root / "rank_0_0").mkdir(parents=True, mode=0o755)
    (root / "inductor_cache" / "fxgraph" / "q5").mkdir(parents=True, mode=0o755)
    (root / "inductor_cache" / "locks").mkdir(mode=0o700)
    (root / "triton_cache").mkdir(mode=0o755)
    (root / "rank_0_0" / "model").write_bytes(b"\x80\x05pickle " + anchor.encode() + b"/x " + os.urandom(70_000))
    (root / "inductor_cache" / "fxgraph" / "q5" / "fq5abc").write_bytes(os.urandom(200_000))
    (root / "inductor_cache" / "k.so").write_bytes(os.urandom(90_000))
    (root / "inductor_cache" / "small.py").write_bytes(b"print('inline-sized')\n")
    os.chmod(root / "inductor_cache" / "k.so", 0o755)
    os.chmod(root / "inductor_cache" / "small.py", 0o600)
    os.chmod(root, 0o755)
    return root


def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path under ``root`` with its permission bits and, for files, its bytes."""
    out: dict[str, tuple[int, bytes | None]] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(root))] = (st.st_mode & 0o7777, path.read_bytes() if path.is_file() else None)
    return out


def restore_or_capture(store_root: str, source: str, target: str, i: int, start_at: float) -> str:
    """Worker ``i``: at ``start_at`` (all together), capture ``source`` (odd ``i``) and restore to ``target``."""
    trees.identity()  # torch's key and the toolchain, computed before the start: the workers then race
    with Store.open(store_root) as store:
        time.sleep(max(0.0, start_at - time.time()))
        said = []
        if i % 2:
            said.append(trees.capture(store, source=Path(source), anchors={}, **TREE).reason)
        said.append(trees.restore(store, target=Path(target), anchors={}, **TREE).reason)
        return ",".join(said)
