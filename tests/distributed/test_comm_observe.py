"""Every kind of ``mpu.comm`` call is counted in ``comm.count()`` and reaches a ``comm.observe`` callback.

Two gloo ranks issue one call of each kind (collectives, async collectives, broadcast, barrier, the
object collectives, pipeline send/receive, the ring exchange) inside one counter and one observer,
and return what was recorded; the parent checks the bytes against the documented formulas. The
gloo ``reduce_scatter_async`` (clone + async all-reduce, so that it has a future) is checked
bit-identical to torch's own reduce-scatter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.mpu import comm
from megatron_sp.testing import run_distributed


def _every_kind(rank: int, world_size: int) -> dict[str, object]:
    n = world_size
    x = torch.arange(64, dtype=torch.float64).reshape(8, 8) + rank  # 512 bytes
    events: list[comm.CommEvent] = []
    out: dict[str, object] = {}
    with comm.count() as c, comm.observe(events.append):
        comm.all_reduce(x.clone(), None)
        comm.all_reduce_async(x.clone(), None).wait()
        comm.all_gather(x, None)
        comm.all_gather_async(x, None).wait()
        comm.reduce_scatter(x, None)
        rs_pending = comm.reduce_scatter_async(x, None)
        out["rs_future"] = rs_pending._event is not None and rs_pending._event.work.get_future() is not None
        rs = rs_pending.wait()
        comm.all_to_all(x, None, 0, 1)
        b = x.clone()
        comm.broadcast(b, 1, None)
        out["broadcast_from_1"] = bool(torch.equal(b, torch.arange(64, dtype=torch.float64).reshape(8, 8) + 1))
        comm.barrier()
        out["objects"] = comm.all_gather_object({"rank": rank})
        out["from_0"] = comm.broadcast_object(f"rank {rank}", 0)
        peer = 1 - rank
        buf = torch.empty_like(x)
        if rank == 0:
            sent = comm.isend(x, peer, None)
            got = comm.irecv(buf, peer, None)
        else:
            got = comm.irecv(buf, peer, None)
            sent = comm.isend(x, peer, None)
        got.wait()
        sent.wait()
        out["p2p_ok"] = bool(torch.equal(buf, torch.arange(64, dtype=torch.float64).reshape(8, 8) + peer))
        comm.ring_exchange_async(x, None).wait()
    theirs = torch.empty(4, 8, dtype=torch.float64)
    dist.reduce_scatter_single(theirs, x.contiguous(), group=None)
    out["rs_bit_identical"] = bool(torch.equal(rs, theirs))
    out["calls"], out["bytes"] = dict(c.calls), dict(c.bytes)
    out["events"] = [(e.op, e.nbytes, e.tensor is not None, e.issued >= e.called) for e in events]
    out["waited"] = all(e.wait_end is not None and e.wait_start <= e.wait_end
                        for e in events if e.work is not None and e.op != "barrier")
    out["n"] = n
    return out


def test_every_kind_is_counted_and_observed() -> None:
    results = run_distributed(_every_kind, 2)
    B = 512.0  # bytes of x
    want_bytes = {
        "all_reduce": 2 * 2 * (1 / 2) * B,  # sync + async
        "all_gather": 2 * (1 / 2) * 2 * B,  # output bytes 2B, sync + async
        "reduce_scatter": 2 * (1 / 2) * B,  # sync + async
        "all_to_all": (1 / 2) * B,
        "broadcast": (1 / 2) * B,
        "barrier": 0.0, "all_gather_object": 0.0, "broadcast_object": 0.0,
        "send": B, "p2p": B,
    }
    want_calls = {"all_reduce": 2, "all_gather": 2, "reduce_scatter": 2, "all_to_all": 1, "broadcast": 1,
                  "barrier": 1, "all_gather_object": 1, "broadcast_object": 1, "send": 1, "p2p": 1}
    for rank, r in enumerate(results):
        assert r["bytes"] == want_bytes, (rank, r["bytes"])
        assert r["calls"] == want_calls, (rank, r["calls"])
        observed: dict[str, float] = {}
        for op, nbytes, _, ordered in r["events"]:
            assert ordered, op
            observed[op] = observed.get(op, 0.0) + nbytes
        assert observed == {**want_bytes, "recv": 0.0}, (rank, observed)  # receives: observed, not counted
        assert r["waited"] and r["rs_future"] and r["rs_bit_identical"], rank
        assert r["broadcast_from_1"] and r["p2p_ok"], rank
        assert r["objects"] == [{"rank": 0}, {"rank": 1}] and r["from_0"] == "rank 0", rank
