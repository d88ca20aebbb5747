"""Rank agreement helpers over a real gloo process group (2 spawned processes)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from adstore.integration.coordination import dist as agree
from adstore.integration.reference.demo import run_ranks


def _agreement_worker(rank, world_size, port, job, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    used = []
    if job.get("as_if_nccl"):
        # The default group is gloo here (no GPU), but agreement is told its backend takes
        # no CPU tensors, as NCCL's does not: it must build and use a gloo side group.
        agree._cpu_capable = lambda backend: False
        real = dist.all_reduce

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            used.append(group)
            return real(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = all_reduce
    try:
        topo = agree.topology()
        result = {
            "rank": rank,
            "topology": (topo.rank, topo.world_size),
            "all_true_mixed": agree.all_true(rank == 0),
            "all_true_all": agree.all_true(True),
            "agree_same": agree.agree_int(7),
            "agree_diff": agree.agree_int(rank),
            "agree_none": agree.agree_int(None if rank == 1 else 3),
            "broadcast": agree.broadcast_int(100 + rank),
        }
        result["used_groups"] = ["default" if g is None else dist.get_backend(g) for g in used]
        result["one_side_group"] = len({id(g) for g in used}) == 1
        queue.put(result)
        agree.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("as_if_nccl", [False, True], ids=["default_group", "gloo_side_group"])
def test_agreement_over_gloo(as_if_nccl):
    results = run_ranks({"as_if_nccl": as_if_nccl}, 2, target=_agreement_worker, timeout=300)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        if as_if_nccl:
            # all_true twice, agree_int three times (one collective each), all on one side group
            assert r["used_groups"] == ["gloo"] * 5 and r["one_side_group"], r["used_groups"]
        assert "error" not in r
        assert r["topology"] == (r["rank"], 2)
        assert r["all_true_mixed"] is False
        assert r["all_true_all"] is True
        assert r["agree_same"] == 7
        assert r["agree_diff"] is None
        assert r["agree_none"] is None
        assert r["broadcast"] == 100


@pytest.mark.parametrize(
    "backend, capable",
    [("gloo", True), ("nccl", False), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl", False), ("mpi", True)],
)
def test_backends_that_take_cpu_tensors(backend, capable):
    assert agree._cpu_capable(backend) is capable


def test_helpers_are_local_without_a_process_group():
    assert not agree.is_distributed()
    assert agree.topology() == agree.Topology(0, 1)
    assert agree.topology(1, 2) == agree.Topology(1, 2)
    assert agree.all_true(True) and not agree.all_true(False)
    assert agree.agree_int(5) == 5 and agree.agree_int(None) is None
    assert agree.broadcast_int(9) == 9
    agree.barrier()
