"""Transformer architectures from ``transformers`` configs: export, snapshot, restore, same bits."""

from __future__ import annotations

import pytest
import torch
from test_snapshot_support import HF_ARCHS, export_hf, roundtrip, to_meta

from adstore.integration.snapshot import load_module, summarize


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_hf_export_roundtrip_bit_identical(arch):
    gm, weights, ids = export_hf(arch)
    ref = gm(input_ids=ids).logits
    code = gm.code
    to_meta(gm)
    # The output pytree spec names a transformers ModelOutput class: it must be allow-listed.
    restored, art = roundtrip(gm, allowed_prefixes=("transformers.",))
    assert restored.code == code
    assert all(p.device.type == "meta" for p in restored.parameters())
    missing, unexpected = restored.load_state_dict(weights, assign=True, strict=True)
    assert not missing and not unexpected
    out = restored(input_ids=ids).logits
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    s = summarize(art)
    assert s["nodes"] == len(gm.graph.nodes) and s["graph_modules"] == 1


def test_hf_output_type_requires_allow_list():
    from adstore.integration.errors import UntrustedTarget

    gm, _, _ = export_hf("qwen2")
    to_meta(gm)
    from adstore.integration.snapshot import dump_module

    art = dump_module(gm)
    with pytest.raises(UntrustedTarget) as exc:
        load_module(art)
    assert "transformers" in exc.value.qualname and exc.value.reason == "untrusted_target"


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_hf_dynamic_sequence_export_roundtrip(arch):
    """A dynamic sequence dimension survives as a symbol: other lengths run bit-identically."""
    from test_snapshot_support import build_hf, real_state
    from torch.export import Dim

    model = build_hf(arch)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    gm = torch.export.export(
        model, (), {"input_ids": ids}, dynamic_shapes={"input_ids": {1: Dim("seq", min=2, max=64)}}
    ).module()
    weights = real_state(gm)
    other = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(3))
    ref = gm(input_ids=other).logits
    code = gm.code
    to_meta(gm)
    restored, art = roundtrip(gm, allowed_prefixes=("transformers.",))
    assert restored.code == code
    assert len(summarize(art)["symbols"]) == 1
    restored.load_state_dict(weights, assign=True)
    assert torch.equal(restored(input_ids=other).logits, ref)
    with pytest.raises(Exception, match="64"):
        restored(input_ids=torch.zeros(2, 65, dtype=torch.long))
