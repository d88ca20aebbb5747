"""Rank agreement helpers over a real gloo process group (2 spawned processes)."""

from __future__ import annotations

import os
from datetime import timedelta

from adstore.integration.pipeline import dist as agree
from adstore.integration.reference.demo import run_ranks


def _agreement_worker(rank, world_size, port, job, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        topo = agree.topology()
        queue.put({
            "rank": rank,
            "topology": (topo.rank, topo.world_size),
            "all_true_mixed": agree.all_true(rank == 0),
            "all_true_all": agree.all_true(True),
            "agree_same": agree.agree_int(7),
            "agree_diff": agree.agree_int(rank),
            "agree_none": agree.agree_int(None if rank == 1 else 3),
            "broadcast": agree.broadcast_int(100 + rank),
        })
        agree.barrier()
    finally:
        dist.destroy_process_group()


def test_agreement_over_gloo():
    results = run_ranks({}, 2, target=_agreement_worker, timeout=300)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert "error" not in r
        assert r["topology"] == (r["rank"], 2)
        assert r["all_true_mixed"] is False
        assert r["all_true_all"] is True
        assert r["agree_same"] == 7
        assert r["agree_diff"] is None
        assert r["agree_none"] is None
        assert r["broadcast"] == 100


def test_helpers_are_local_without_a_process_group():
    assert not agree.is_distributed()
    assert agree.topology() == agree.Topology(0, 1)
    assert agree.topology(1, 2) == agree.Topology(1, 2)
    assert agree.all_true(True) and not agree.all_true(False)
    assert agree.agree_int(5) == 5 and agree.agree_int(None) is None
    assert agree.broadcast_int(9) == 9
    agree.barrier()
