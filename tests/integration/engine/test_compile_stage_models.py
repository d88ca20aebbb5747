"""Every tuned architecture through the ``aoti`` compile stage: cold, then warm, against one store.

Each one compiles into an AOTInductor engine (with the reference custom ops
inside), is found again from the pipeline's key on the second run, returns
bit-identical outputs, and matches the eager ``transformers`` model within
float tolerance.  None of the eleven is refused.
"""

from __future__ import annotations

import pytest
import torch

from adstore.integration.pipeline.optimizer import InferenceOptimizer
from adstore.integration.reference.checkpoint import read_checkpoint, write_random_checkpoint
from adstore.integration.reference.models import ARCHITECTURES, ModelFactory
from adstore.integration.reference.pipeline import default_transforms

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_aoti_stage_compiles_then_restores_every_tuned_architecture(arch, tmp_path):
    factory = ModelFactory.from_config({"arch": arch})
    checkpoint = write_random_checkpoint(factory.build(), tmp_path / "checkpoint", seed=0)
    transforms = default_transforms(pipeline_cache={"root": str(tmp_path / "store")}, compile={"backend": "aoti"})
    inputs = factory.example_inputs(batch=2, seq=8)
    with torch.no_grad():
        expected = factory.eager_model(read_checkpoint(checkpoint))(*inputs).logits
    runs = []
    for _ in range(2):
        opt = InferenceOptimizer(factory, checkpoint, transforms)
        module = opt()
        with torch.no_grad():
            runs.append(([(str(e.kind), e.reason and str(e.reason), e.detail) for e in opt.events], module(*inputs)))
    (cold_events, cold), (warm_events, warm) = runs
    assert [e[:2] for e in cold_events] == [("miss", "absent"), ("save", None), ("miss", "absent"), ("save", None)]
    assert [e[:2] for e in warm_events] == [("hit", None), ("hit", None)], warm_events
    assert torch.equal(cold, warm)
    torch.testing.assert_close(warm, expected, rtol=1e-4, atol=1e-4)
