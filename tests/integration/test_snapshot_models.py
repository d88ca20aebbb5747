"""Transformer architectures from ``transformers`` configs: export, snapshot, restore, same bits."""

from __future__ import annotations

import pytest
import torch

from adstore.integration.snapshot import load_module, summarize

from test_snapshot_support import HF_ARCHS, export_hf, roundtrip, to_meta


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
