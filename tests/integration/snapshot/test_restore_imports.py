"""A static snapshot restores and runs in a fresh process without importing ``torch._dynamo``.

Importing dynamo is most of a second of a restart.  The restored graph must
still be everything it was: ``meta["val"]`` are FakeTensors whose mode works
(it initialises on first use, importing dynamo only then), export's input
checks hold, and the custom ops of the reference pipeline run.  Each case runs
in a fresh interpreter, since this process imported dynamo long ago.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SAVE = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from adstore.integration import dump_module
    from adstore.integration.reference import ops  # custom ops in the graph

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.w = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            h = torch.ops.adstore.rms_norm.default(self.lin(x), self.w, 1e-6, 0.0)
            return torch.ops.adstore.silu_mul.default(h, h)

    torch.manual_seed(0)
    x = torch.randn(3, 8)
    gm = torch.export.export(Net().eval(), (x,)).module()
    out = Path(sys.argv[1])
    torch.save({"x": x, "y": gm(x), "state": gm.state_dict()}, out / "ref.pt")
    for name, p in list(gm.named_parameters()):  # snapshots hold the module before its weights
        mod, _, leaf = name.rpartition(".")
        setattr(gm.get_submodule(mod), leaf, torch.nn.Parameter(p.detach().to("meta"), p.requires_grad))
    for name, data in dump_module(gm).items():
        (out / name).write_bytes(data)
""")

_LOAD = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from adstore.integration import load_module

    d = Path(sys.argv[1])
    ref = torch.load(d / "ref.pt")
    gm = load_module({p.name: p.read_bytes() for p in d.iterdir() if p.name != "ref.pt"})
    gm.load_state_dict(ref["state"], assign=True)
    y = gm(ref["x"])
    report = {"equal": bool(torch.equal(y, ref["y"])), "dynamo_after_run": "torch._dynamo" in sys.modules}
    try:
        gm(torch.randn(3, 9))
        report["bad_shape"] = "accepted"
    except Exception as exc:
        report["bad_shape"] = type(exc).__name__
    vals = [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._guards import detect_fake_mode
    mode = detect_fake_mode(vals)
    report["fake"] = all(isinstance(v, FakeTensor) for v in vals) and mode is not None
    report["initialised_before_use"] = mode.initialised
    report["dynamo_before_use"] = "torch._dynamo" in sys.modules
    # first real use of the mode: fake propagation through the restored graph
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    with mode:
        fx = mode.from_tensor(ref["x"])
    FakeTensorProp(gm, mode=mode).propagate(fx)
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0].meta["val"]
    report["propagated"] = [list(out.shape), str(out.dtype), str(out.device)]
    report["initialised_after_use"] = mode.initialised
    print(json.dumps(report))
""")


def _py(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("static-snapshot")
    proc = _py(_SAVE, str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_a_static_snapshot_runs_without_dynamo_and_its_fake_mode_works_on_first_use(saved):
    proc = _py(_LOAD, str(saved))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["equal"] and report["fake"]
    assert report["dynamo_after_run"] is False and report["dynamo_before_use"] is False
    assert report["bad_shape"] == "RuntimeError"  # export's input check still runs
    assert report["initialised_before_use"] is False and report["initialised_after_use"] is True
    assert report["propagated"] == [[3, 8], "torch.float32", "cpu"]
