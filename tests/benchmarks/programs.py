"""Programs nobody here wrote, run unmodified through ``adstore run`` on simulated hosts (issue 41, item 3).

Each program is the source a user of that library would write from its own
documentation, with no adstore import: it is written to a file and started as
``python -m adstore run --root STORE [--seed SEED] -- python prog.py`` (or
``torchrun``), so adstore reaches it only through ``ADSTORE_ENABLE=1`` and
``adstore-enable.pth``.  Its last stdout line is JSON: what it computed
(tokens, trained weights, each rank's output), compared across hosts.

A host is a fresh set of directories (store root, Inductor cache directory,
``TMPDIR``, ``HOME``) and, for the second host, this interpreter and venv
bind-mounted at another path in a private mount namespace
(``other_users.moved_argv``: torch's directory, ``sys.prefix`` and Python's
headers, and so Inductor's command lines, differ), with an empty store whose
seed is the first host's store (read-only): the store a fleet bakes into an
image.  Compiler runs are counted in every process of the run, the program's
Inductor compile workers and ``torchrun``'s ranks included: ``vllm_builds/
sitecustomize.py`` logs each ``g++ … -o TARGET`` (the ``.i`` of the
precompiled header's ``g++ -E`` is a preprocessing, not a compile).

Used by ``tests/integration/test_programs.py`` (slow tier) and
``bench_programs.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BUILDS = HERE / "vllm_builds"  # the sitecustomize that logs compiler runs
sys.path.insert(0, str(HERE.parent))  # tests/: the mount-namespace helpers
from other_users import moved_argv  # noqa: E402

from adstore.store import Store  # noqa: E402

__all__ = ["PROGRAMS", "Program", "Run", "available", "run_program"]

TRANSFORMERS = """\
# transformers' torch.compile recipe: a static KV cache, and the model's forward compiled.
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)
model = LlamaForCausalLM(config).eval()  # random weights: nothing downloaded
prompt = torch.tensor([[1, 17, 42, 7, 99]])
eager = model.generate(prompt, max_new_tokens=12, do_sample=False, cache_implementation="static")
model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
tokens = model.generate(prompt, max_new_tokens=12, do_sample=False, cache_implementation="static")
print(json.dumps({"output": tokens.tolist(), "eager": eager.tolist()}))
"""

LIGHTNING = """\
# Lightning's Trainer fitting a compiled LightningModule on CPU for a few steps.
import json

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


L.seed_everything(0)
data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=16)
model = torch.compile(Regressor())
trainer = L.Trainer(
    accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(model, data)
weights = [p.detach().flatten().tolist() for p in model.parameters()]
print(json.dumps({"output": weights}))
"""

TORCHRUN = """\
# torchrun --nproc-per-node 2, gloo on CPU: every rank compiles the same small model.
import json

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
x = torch.randn(3, 16) + rank
with torch.no_grad():
    y = torch.compile(model)(x)
    right = torch.allclose(y, model(x), atol=1e-5)
outputs = [None] * world
dist.all_gather_object(outputs, {"rank": rank, "y": y.tolist(), "right": right})
if rank == 0:
    print(json.dumps({"output": outputs}))
dist.destroy_process_group()
"""


@dataclass(frozen=True)
class Program:
    """A program's source, the module it needs, and how it is started (``torchrun`` or plain ``python``)."""

    name: str
    source: str
    needs: str
    launcher: tuple[str, ...] = ()  # arguments between the interpreter and the script

    def argv(self, python: str, script: Path) -> list[str]:
        return [python, *self.launcher, str(script)]


PROGRAMS = {
    "transformers": Program("transformers", TRANSFORMERS, "transformers"),
    "lightning": Program("lightning", LIGHTNING, "lightning"),
    "torchrun": Program(
        "torchrun",
        TORCHRUN,
        "torch.distributed",
        ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
    ),
}


@dataclass
class Run:
    """One run of a program on a host: its output, wall time, compiler runs and its store's counters."""

    output: Any
    report: dict[str, Any]
    seconds: float
    compiler_runs: int
    compiler_targets: list[str]
    counters: dict[str, int]
    stderr: str


def available(program: Program) -> bool:
    """Whether the library ``program`` needs is installed (Lightning is in the test extra, may be missing)."""
    return importlib.util.find_spec(program.needs.split(".")[0]) is not None


def host_env(work: Path, host: str) -> dict[str, str]:
    """Host ``host``'s directories under ``work`` (made), as environment variables, and its build log."""
    home = work / host
    for sub in ("tmp", "home", "inductor"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    clean = ("ADSTORE_", "TORCHINDUCTOR_", "PYTHONPATH", "TMPDIR", "HOME")
    env = {k: v for k, v in os.environ.items() if not k.startswith(clean)}
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(home / "inductor"),
        TMPDIR=str(home / "tmp"),
        HOME=str(home / "home"),
        PYTHONPATH=str(BUILDS),
        ADSTORE_BUILDS_LOG=str(home / "builds.log"),
    )
    return env


def run_program(
    program: Program,
    work: Path,
    host: str,
    *,
    store: Path,
    seed: Path | None = None,
    moved: bool = False,
    remote: Mapping[str, str] | None = None,
    timeout: float = 1200,
) -> Run:
    """Run ``program`` on host ``host`` under ``work`` through ``adstore run --root store [--seed seed]``.

    ``remote``: the ``ADSTORE_REMOTE*`` variables (and keys) of a remote this host reads or writes.

    ``moved`` runs it with this interpreter and venv bind-mounted at another
    path (needs root and ``unshare``; ``ValueError`` without).  Compiler runs
    are those of every process of the run.
    """
    env = {**host_env(work, host), **(remote or {})}
    script = (
        work / host / f"{program.name}_program.py"
    )  # not the library's own name: the script's folder is on sys.path
    script.write_text(program.source)
    prefix: list[str] = []
    python = sys.executable
    if moved:
        moved_to = moved_argv(work / host / "elsewhere")
        if moved_to is None:
            raise ValueError("a moved interpreter needs root and unshare -m")
        prefix, python = moved_to
    wrap = [python, "-m", "adstore", "run", "--root", str(store)]
    if seed is not None:
        wrap += ["--seed", str(seed)]
    argv = [*wrap, "--", *program.argv(python, script)]
    log = Path(env["ADSTORE_BUILDS_LOG"])
    log.unlink(missing_ok=True)
    t0 = time.perf_counter()
    done = subprocess.run([*prefix, *argv], env=env, cwd=work / host, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{program.name} on host {host} failed ({done.returncode}):\n{done.stderr[-6000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    logged = log.read_text().splitlines() if log.exists() else []
    targets = [line.split(" ", 1)[1] for line in logged if " " in line]
    compiled = [t for t in targets if not t.endswith(".i")]
    counters: dict[str, int] = {}
    if store.is_dir() and (store / "index").exists():
        with Store.open(store, create=False) as opened:
            counters = dict(opened.stats().counters)
    return Run(report["output"], report, seconds, len(compiled), compiled, counters, done.stderr)
