"""The reference pipeline's experts implementation: a grouped GEMM over the routed tokens.

``transformers`` runs a mixture-of-experts block through an *experts
implementation* chosen by name (``config._experts_implementation``).  Its own
choices do not suit a graph exported on the meta device and run on the CPU:

* ``eager`` loops over the experts a batch hits, a data-dependent loop that
  does not export;
* ``batched_mm`` gathers a whole expert weight matrix for every token–expert
  pair: memory grows with tokens x experts per token x expert size (a
  one-layer Mixtral-8x7B forward on 16 tokens copies 15 GB of gate/up
  weights);
* ``grouped_mm`` traces only in bfloat16, and otherwise calls a
  ``transformers::`` operator a restored graph would need transformers
  imported for.

:data:`EXPERTS_IMPLEMENTATION` sorts the token–expert pairs by expert and runs
one :func:`~adstore.integration.reference.ops.grouped_linear` per projection
(``adstore::grouped_linear``: a ``linear`` per expert over exactly its rows).
Every shape is static, so it exports; memory is the routed activations plus
the weights once.  The pairs are ordered, the matmuls made and the results
summed exactly as transformers' ``eager`` loop does (expert, then top-k slot,
then token; ``index_add`` in expert order), so the output is the same bits.

:func:`register` adds it to transformers' experts interface; the model
factory calls it before building a model.
"""

from __future__ import annotations

from typing import Any

import torch

from adstore.integration.reference import ops

__all__ = ["EXPERTS_IMPLEMENTATION", "grouped_experts_forward", "register"]

#: The name the factory sets as ``config._experts_implementation``.
EXPERTS_IMPLEMENTATION = "adstore_grouped"


def grouped_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts block's forward (``self`` is a module transformers' ``use_experts_implementation`` decorated)."""
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError(f"{EXPERTS_IMPLEMENTATION} does not run expert-parallel experts")
    tokens = top_k_index.shape[0]
    # Pair p = slot * tokens + token, stably sorted by expert: within an expert the pairs keep
    # (slot, token) order, the order of ``torch.where(expert_mask[e])`` in the eager loop.
    expert_of_pair = top_k_index.t().reshape(-1)
    sorted_experts, pair = torch.sort(expert_of_pair, stable=True)
    token, slot = pair % tokens, pair // tokens
    experts = torch.arange(self.num_experts, device=sorted_experts.device, dtype=sorted_experts.dtype)
    offsets = torch.searchsorted(sorted_experts, experts, right=True)

    up = self.gate_up_proj if self.has_gate else self.up_proj
    h = ops.grouped_linear(hidden_states[token], _out_in(self, up), offsets)
    if self.has_bias:
        h = h + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[sorted_experts]
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = ops.grouped_linear(h, _out_in(self, self.down_proj), offsets)
    if self.has_bias:
        out = out + self.down_proj_bias[sorted_experts]
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    out = out * top_k_weights[token, slot, None]
    # index_add visits the pairs in order, so each token sums its experts in ascending expert order.
    return torch.zeros_like(hidden_states).index_add(0, token, out.to(hidden_states.dtype))


def _out_in(self: Any, weight: torch.Tensor) -> torch.Tensor:
    """Expert weights as ``(experts, out, in)`` (a transposed layout stores ``(experts, in, out)``)."""
    return weight.transpose(-2, -1) if self.is_transposed else weight


def register() -> str:
    """Add :data:`EXPERTS_IMPLEMENTATION` to transformers' experts interface (idempotent); returns the name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, grouped_experts_forward)
    return EXPERTS_IMPLEMENTATION
