"""A user's own pipeline, written only against the public API (docs/pipeline-cache.md, "Public API").

Used by ``test_public_api.py`` in-process and, through :func:`main`, in
fresh processes: ``main([CKPT, ROOT, OUT])`` runs the cached pipeline once,
loads the weights, and writes the events to ``OUT`` and the output beside it.  Nothing
here is adstore's reference pipeline: a ``transformers`` Llama built from a
config, ``torch.export``, and a hand-written FX pass whose replacement
function lives here and is trusted through ``allowed_prefixes``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

__all__ = ["PREFIX", "Logits", "Scaled", "build", "fuse_swiglu", "main", "rank_main", "scaled_linear", "swiglu"]

#: What the snapshot may name from this module (the pass's function, the wrapper class).
PREFIX = __name__
VOCAB, SEQ = 128, 8
CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


class Logits(nn.Module):
    """Returns only the logits, so the exported graph outputs a plain tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


class Scaled(nn.Module):
    """A user-defined wrapper holding a child module (cached through ``allowed_prefixes``)."""

    def __init__(self, inner: nn.Module, scale: float) -> None:
        super().__init__()
        self.inner = inner
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The fused replacement of ``silu(gate) * up`` (the same arithmetic, so outputs stay bit-identical)."""
    return torch.nn.functional.silu(gate) * up


def fuse_swiglu(gm: fx.GraphModule) -> int:
    """The user's FX pass: ``aten.mul(aten.silu(a), b)`` -> ``swiglu(a, b)``; returns the count."""
    silu, mul = torch.ops.aten.silu.default, torch.ops.aten.mul.Tensor
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not mul:
            continue
        first = node.args[0]
        if isinstance(first, fx.Node) and first.target is silu and len(first.users) == 1:
            with gm.graph.inserting_before(node):
                fused = gm.graph.call_function(swiglu, (first.args[0], node.args[1]))
            fused.meta = dict(node.meta)
            node.replace_all_uses_with(fused)
            gm.graph.erase_node(node)
            gm.graph.erase_node(first)
            count += 1
    gm.graph.lint()
    gm.recompile()
    return count


def example_ids() -> torch.Tensor:
    return torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB


def hf_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return Logits(LlamaForCausalLM(LlamaConfig(**CONFIG))).eval()


def write_checkpoint(directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    state = {k: torch.randn_like(v) * 0.1 for k, v in hf_model().state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    return directory


def build() -> nn.Module:
    """The pre-weight-loading module: export, the user's pass, parameters to meta (buffers stay real)."""
    ep = torch.export.export(hf_model(), (example_ids(),), strict=False)
    gm = ep.module()
    assert fuse_swiglu(gm) == CONFIG["num_hidden_layers"]
    for mod in gm.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=False)
    return gm


def load_weights(module: nn.Module, checkpoint: Path) -> nn.Module:
    from safetensors.torch import load_file

    module.load_state_dict(load_file(str(checkpoint / "model.safetensors")), strict=True, assign=True)
    return module


def key(checkpoint: Path) -> dict[str, Any]:
    from adstore.integration import checkpoint_fingerprint

    return {
        "model": {"arch": "LlamaForCausalLM", "config": CONFIG},
        "checkpoint": checkpoint_fingerprint(checkpoint),
        "prefix": [{"name": "export", "seq": SEQ}, {"name": "fuse_swiglu"}],
    }


def run(checkpoint: Path, root: Path) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    from adstore.integration import cached_prefix

    result = cached_prefix(key(checkpoint), build, root=root, allowed_prefixes=[PREFIX], code=[fuse_swiglu])
    module = load_weights(result.module, checkpoint)
    with torch.no_grad():
        out = module(example_ids())
    return out, [e.to_dict() for e in result.events]


def run_compiled(checkpoint: Path, root: Path) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """The cached prefix, the weights, then the compile step keyed by the prefix's key (an AOTInductor engine)."""
    from adstore.integration import cached_prefix

    result = cached_prefix(key(checkpoint), build, root=root, allowed_prefixes=[PREFIX], code=[fuse_swiglu])
    module = load_weights(result.module, checkpoint)
    compiled = result.compile(module, (example_ids(),), key={"weights": "model.safetensors"}, code=[load_weights])
    with torch.no_grad():
        out = compiled.module(example_ids())
    return out, [e.to_dict() for e in result.events + compiled.events]


def main(argv: list[str]) -> int:
    """``CKPT ROOT OUT [compile]``: the pipeline once (with the compile step if asked); events and output to OUT."""
    import sys

    checkpoint, root, out_path = map(Path, argv[:3])
    out, events = (run_compiled if argv[3:] == ["compile"] else run)(checkpoint, root)
    torch.save(out, out_path.with_suffix(".pt"))
    imported = {name: name in sys.modules for name in ("torch._dynamo", "torch._inductor", "transformers")}
    out_path.write_text(json.dumps(events))
    out_path.with_suffix(".imports").write_text(json.dumps(imported))
    return 0


def scaled_linear() -> nn.Module:
    """A small user wrapper around a meta ``nn.Linear`` (pre-weight-loading)."""
    with torch.device("meta"):
        return Scaled(nn.Linear(4, 4), 2.0)


def rank_main(rank: int, world_size: int, port: int, root: str, out_dir: str) -> None:
    """One rank (a spawned process) of ``cached_prefix`` under a gloo process group; events to ``out_dir``."""
    import os

    import torch.distributed as dist

    from adstore.integration import cached_prefix

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = cached_prefix(
            {"model": "scaled-linear", "topology": {"tp": world_size}},
            scaled_linear,
            root=root,
            allowed_prefixes=[PREFIX],
        )
        assert isinstance(result.module, Scaled)
        events = [e.to_dict() for e in result.events]
        Path(out_dir, f"{rank}.json").write_text(json.dumps(events))
        dist.barrier()
    finally:
        dist.destroy_process_group()
