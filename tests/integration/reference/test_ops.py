"""The reference pipeline's custom ops: fake kernels agree with the real ones.

Inductor checks the sizes and strides a fake (meta) kernel promises against
what the real kernel returns, so each op is run through ``torch.library.opcheck``
on every input layout the pattern rewrites match: contiguous, transposed
(``view(b, s, h, d).transpose(1, 2)`` as attention produces it), chunks of a
fused projection, mixed dtypes.
"""

from __future__ import annotations

import pytest
import torch

from adstore.integration.reference import ops

_B, _S, _H, _D = 2, 8, 2, 32


def _transposed(*shape: int) -> torch.Tensor:
    b, h, s, d = shape
    return torch.randn(b, s, h, d).transpose(1, 2)


ROPE_CASES = {
    "contiguous": lambda: (torch.randn(_B, _H, _S, _D), torch.randn(_B, 1, _S, _D), torch.randn(_B, 1, _S, _D)),
    "transposed": lambda: (_transposed(_B, _H, _S, _D), torch.randn(_B, 1, _S, _D), torch.randn(_B, 1, _S, _D)),
    "cos_2d": lambda: (_transposed(_B, _H, _S, _D), torch.randn(_S, _D), torch.randn(_S, _D)),
    "bf16_x_f32_cos": lambda: (
        _transposed(_B, _H, _S, _D).bfloat16(),
        torch.randn(_B, 1, _S, _D),
        torch.randn(_B, 1, _S, _D),
    ),
}
RMS_CASES = {
    "contiguous": lambda: (torch.randn(_B, _S, 64), torch.randn(64), 1e-6, 0.0),
    "transposed": lambda: (torch.randn(_B, 64, _S).transpose(1, 2), torch.randn(64), 1e-6, 0.0),
    "offset": lambda: (_transposed(_B, _H, _S, _D), torch.randn(_D), 1e-6, 1.0),
    "bf16_x_f32_w": lambda: (torch.randn(_B, _S, 64).bfloat16(), torch.randn(64), 1e-5, 0.0),
}
SILU_CASES = {
    "contiguous": lambda: (torch.randn(_B, _S, 64), torch.randn(_B, _S, 64)),
    "fused_chunks": lambda: tuple(torch.randn(_B, _S, 128).chunk(2, dim=-1)),
    "transposed": lambda: (torch.randn(_B, 64, _S).transpose(1, 2), torch.randn(_B, _S, 64)),
}


def _check(op, args):
    torch.library.opcheck(op, args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    real = op(*args)
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_fake_matches_real(case):
    _check(torch.ops.adstore.rope.default, ROPE_CASES[case]())


@pytest.mark.parametrize("case", sorted(RMS_CASES))
def test_rms_norm_fake_matches_real(case):
    _check(torch.ops.adstore.rms_norm.default, RMS_CASES[case]())


@pytest.mark.parametrize("case", sorted(SILU_CASES))
def test_silu_mul_fake_matches_real(case):
    _check(torch.ops.adstore.silu_mul.default, SILU_CASES[case]())


@pytest.mark.parametrize(
    "x", [torch.randn(_B, _S, 64), torch.randn(_B, 64, _S).transpose(1, 2)], ids=["contiguous", "transposed"]
)
def test_collective_fakes_match_real_without_a_process_group(x):
    _check(torch.ops.adstore.all_reduce.default, (x,))
    _check(torch.ops.adstore.all_gather.default, (x, 2, 1))


def _offsets(*counts: int) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0)


GROUPED_CASES = {
    "contiguous": lambda: (torch.randn(10, 32), torch.randn(4, 48, 32), _offsets(3, 0, 5, 2)),
    "transposed_weight": lambda: (torch.randn(10, 32), torch.randn(4, 32, 48).transpose(-2, -1), _offsets(1, 4, 4, 1)),
    "int32_offsets": lambda: (torch.randn(6, 32), torch.randn(3, 16, 32), _offsets(2, 2, 2).int()),
    "bf16": lambda: (torch.randn(7, 32).bfloat16(), torch.randn(2, 16, 32).bfloat16(), _offsets(0, 7)),
    "no_rows": lambda: (torch.randn(0, 32), torch.randn(2, 16, 32), _offsets(0, 0)),
}


@pytest.mark.parametrize("case", sorted(GROUPED_CASES))
def test_grouped_linear_fake_matches_real(case):
    _check(torch.ops.adstore.grouped_linear.default, GROUPED_CASES[case]())


@pytest.mark.parametrize("case", sorted(GROUPED_CASES))
def test_grouped_linear_is_one_linear_per_group_bit_for_bit(case):
    x, w, offsets = GROUPED_CASES[case]()
    out = ops.grouped_linear(x, w, offsets)
    bounds = [0, *offsets.tolist()]
    for g in range(w.shape[0]):
        rows = slice(bounds[g], bounds[g + 1])
        assert torch.equal(out[rows], torch.nn.functional.linear(x[rows], w[g]))


def test_grouped_linear_rejects_bad_offsets_and_shapes():
    x, w = torch.randn(6, 32), torch.randn(3, 16, 32)
    for offsets in (_offsets(4, -1, 3), _offsets(2, 2, 3), torch.tensor([2, 1, 6])):
        with pytest.raises(ValueError, match="offsets must rise"):
            ops.grouped_linear(x, w, offsets)
    with pytest.raises(RuntimeError, match="3 offsets for 2 groups"):
        ops.grouped_linear(x, w[:2], _offsets(2, 2, 2))
    with pytest.raises(RuntimeError, match="width"):
        ops.grouped_linear(torch.randn(6, 8), w, _offsets(2, 2, 2))
    with pytest.raises(RuntimeError, match="integers"):
        ops.grouped_linear(x, w, _offsets(2, 2, 2).float())
    with pytest.raises(RuntimeError, match="needs x"):
        ops.grouped_linear(x[None], w, _offsets(2, 2, 2))
    # Rows past the last offset (no group claims them) are zero, never uninitialised memory.
    out = ops.grouped_linear(x, w, _offsets(2, 1, 1))
    assert torch.equal(out[4:], torch.zeros(2, 16))


def test_every_op_is_checked():
    assert set(ops.OPS) == {"rms_norm", "silu_mul", "rope", "all_reduce", "all_gather", "grouped_linear"}
