"""One process of the contract suite: ``python contract_child.py SPEC_JSON``; prints one JSON line.

The spec names the tier, the directory of the model's source, the store
(``ADSTORE_*`` in the environment the suite gave) and a list of calls.  Each
call builds the model (constructor arguments, a global, grad mode, default
dtype, Inductor settings as the call says), serves it through the tier and
compares the answer with eager of that same module.  A call with
``"reuse": true`` changes only what it names and calls the previous call's
served object again (a global changed after the first compile, in the
process that compiled it).  A call with ``"nofile": n`` runs with
``RLIMIT_NOFILE`` lowered to the descriptors open then plus ``n`` (EMFILE
for whatever opens more); a spec with ``"kill_in_save": true`` SIGKILLs the
process at the first file the store renames into place under its root.

Nothing here may raise into the suite but a crash of the tier itself: that is
the fail-open row's finding, reported as ``{"error": ...}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any


def _inputs(spec: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(spec.get("batch", 2), 3, 6, 6, generator=g).to(getattr(torch, spec.get("dtype", "float32")))
    if spec.get("channels_last"):
        x = x.contiguous(memory_format=torch.channels_last)
    bias = spec.get("bias")
    if bias is None:
        return (x,), {}
    if spec.get("bias_as") == "positional":
        return (x, bias), {}
    return (x,), {"bias": bias}


def _first_tensor(out: Any) -> Any:
    """A model's answer as one tensor: itself, or the first tensor of a structured output (transformers')."""
    import torch
    import torch.utils._pytree as pytree

    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return next((leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)), out)


def _digest(t: Any) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def _compare(out: Any, want: Any) -> dict[str, Any]:
    import torch

    if not isinstance(out, torch.Tensor):
        return {"ok": False, "why": f"not a tensor: {type(out).__name__}"}
    if out.dtype != want.dtype or out.shape != want.shape:
        return {"ok": False, "why": f"{out.dtype}{list(out.shape)} where eager gives {want.dtype}{list(want.shape)}"}
    err = float((out.double() - want.double()).abs().max())
    tol = 1e-4 if want.dtype in (torch.float32, torch.float64) else 1e-2
    ok = err <= tol and out.requires_grad == want.requires_grad
    return {"ok": ok, "err": err, "why": "" if ok else f"max error {err:.3g}, requires_grad {out.requires_grad}"}


@contextmanager
def _nofile(margin: int | None) -> Iterator[None]:
    """Exactly ``margin`` free descriptors inside the block (None: as is): EMFILE for whatever opens more.

    ``RLIMIT_NOFILE`` goes just above the highest descriptor open now and
    the free numbers below it are taken by ``/dev/null``, all but ``margin``.
    """
    if margin is None:
        yield
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1 + margin, hard))
    held: list[int] = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    for _ in range(min(margin, len(held))):
        os.close(held.pop())
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _kill_in_save(root: str) -> None:
    """SIGKILL this process when the store first renames a file into place under ``root`` (a save half done)."""
    import signal

    root = os.path.realpath(root)

    def trap(real: Any) -> Any:
        def wrapper(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(dst, (str, os.PathLike)) and os.path.realpath(dst).startswith(root + os.sep):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(src, dst, *args, **kwargs)

        return wrapper

    os.replace, os.rename = trap(os.replace), trap(os.rename)  # type: ignore[assignment]


def _call(tier: Any, call: dict[str, Any], previous: Any) -> tuple[dict[str, Any], Any]:
    import contract_model
    import torch

    contract_model.SCALE = float(call.get("scale", 1.0))
    with ExitStack() as stack:
        stack.enter_context(torch.enable_grad() if call.get("grad") else torch.no_grad())
        default = call.get("default_dtype")
        if default:
            previous_default = torch.get_default_dtype()
            torch.set_default_dtype(getattr(torch, default))
            stack.callback(torch.set_default_dtype, previous_default)
        for name, value in (call.get("inductor") or {}).items():
            stack.enter_context(torch._inductor.config.patch({name: value}))
        knobs = {k: call[k] for k in ("act", "k") if k in call}
        model = contract_model.build(**knobs, dtype=call.get("dtype", "float32"))
        make_inputs = getattr(contract_model, "inputs", _inputs)  # a zoo model brings its own
        args, kwargs = make_inputs({**call, "dtype": call.get("dtype", "float32")})
        want = _first_tensor(model(*args, **kwargs))
        if call.get("reuse"):
            out = _first_tensor(tier.again(previous.handle, args, kwargs))
            served = previous
            report = {"served": previous.served, "compiles": 0, "detail": "reused " + previous.detail}
        else:
            with _nofile(call.get("nofile")):
                served = tier.call(model, args, kwargs, knobs)
            out = _first_tensor(served.output)
            report = {"served": served.served, "compiles": served.compiles, "detail": served.detail}
        report.update(_compare(out, want), digest=_digest(out))
    return report, served


def main(spec: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, spec["model_dir"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tempfile

    tempfile.tempdir = None
    import logging

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("adstore").addHandler(handler)

    import torch
    from inductor_hosts import count_builds
    from tiers import TIERS

    torch.set_num_threads(1)
    builds = count_builds()
    tier = TIERS[spec["tier"]]()
    store = None
    try:
        from adstore.store import Store

        store = Store.from_env()
    except Exception as exc:  # noqa: BLE001 - a tier is given no store: its own fail-open path
        warnings.append(f"no store: {type(exc).__name__}: {exc}")
    tier.setup(store, builds)
    if spec.get("kill_in_save"):
        _kill_in_save(os.environ["ADSTORE_ROOT"])
    calls: list[dict[str, Any]] = []
    previous = None
    for call in spec["calls"]:
        try:
            report, previous = _call(tier, call, previous)
        except Exception as exc:  # noqa: BLE001 - reached the program: the finding
            report = {"ok": False, "served": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            report["trace"] = traceback.format_exc()[-3000:]
        calls.append(report)
    counters: dict[str, int] = {}
    if store is not None:
        store.flush()
        counters = dict(store.stats().counters)
        store.close()
    remotes = sys.modules.get("adstore.integration.coordination.remote")
    for remote, _ in list(getattr(remotes, "_OPEN", {}).values()):  # the pipeline tiers' process-wide clients
        for name, n in remote.counters.items():
            counters[f"remote.{name}"] = counters.get(f"remote.{name}", 0) + n
    return {
        "calls": calls,
        "counters": counters,
        "warnings": warnings[-20:],
        "uid": os.getuid(),
        "builds": builds[-20:],
    }


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    try:
        result = main(spec)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the suite judges
        result = {"fatal": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-4000:]}
    sys.stdout.flush()
    print("CONTRACT-RESULT " + json.dumps(result))
