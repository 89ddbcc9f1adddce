"""Dispatch (pull) and combine (push) bandwidth per rank, against the NVLink peer-copy rate of the same run.

Run under torchrun on 2 GPUs (needs CUDA; installs nothing):
    torchrun --standalone --nproc-per-node 2 scripts/comm_bench.py [--sweep]

Identity experts (the received rows are pushed straight back), deepseek-v3 and mok-bench rows, T = 4096
tokens per rank, uniform top-k routing, the default capacity (one round). Per preset it reports, slowest
rank, medians over 3 rounds of 5 iterations (after a discarded warm-up pass):
  * dispatch = publish (stage rows, routing plan, "ready") + schedule (wait for every peer's "ready", build
    the receive table) + pull; each part from events (slowest rank per part, so the parts need not add up);
  * combine = push + signal + wait + the owner's fixed-order combine;
  * GB/s over all received rows and over the rows that crossed NVLink (half of them at W = 2), and the
    peer copy rate (``copy_`` of a peer's symmetric buffer, i.e. the copy engines) measured in the same run.
``--sweep`` also times other copy shapes of the dispatch / push kernels (rows per program, columns per
step, warps; module constants of megamoe.ops.ep_comm), checks that each receives bitwise the same rows, and
times the shapes in three interleaved rounds after a discarded warm-up pass (medians over the rounds).
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.distributed as dist
from gemm_sweep import timeit  # scripts/ is on sys.path when this file is run as a script

from megamoe.config import get_preset
from megamoe.distributed import default_capacity_rows, get_workspace, max_rounds, reserve_workspace
from megamoe.kernels import ep_comm as KE
from megamoe.ops import ep_comm as X
from megamoe.ops.combine import combine_fwd

SHAPES = [(16, 256, 4), (32, 256, 4), (16, 512, 4), (32, 512, 8), (8, 1024, 4)]


class _Exchange:
    """One preset's exchange on this rank: the inputs, the buffers and the timed steps (one round)."""

    def __init__(self, ws, x, ids, w, rounds: int):
        self.ws, self.x, self.ids, self.w, self.rounds = ws, x, ids, w, rounds
        self.bufs = X.ExchangeBuffers(ws, default_capacity_rows(ws.spec), backward=False, rounds=rounds)
        self.marks = []

    def dispatch(self) -> None:
        s, p, m = torch.cuda.Event(True), torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        X.publish(self.ws, self.ids, self.x)
        p.record()
        X.build_schedule(self.ws, self.bufs, 10.0)
        m.record()
        for r in range(self.rounds):
            X.dispatch_round(self.ws, self.bufs, r, False)
        self.marks.append((s, p, m))

    def finish(self) -> torch.Tensor:
        for r in range(self.rounds):
            X.push_round(self.ws, self.bufs, r, self.bufs.xr_CD)
        X.signal_done(self.ws)
        X.wait_done(self.ws, 10.0)
        rows, row_of, _ = X.slot_views(self.ws, self.x.shape[0])
        return combine_fwd(rows, row_of, self.w, None, out_dtype=self.x.dtype)

    def timed(self, iters: int = 10) -> list[float]:
        """(dispatch, pull, exchange, publish, schedule) ms medians on this rank."""
        disp, pull, total, pub, sch = [], [], [], [], []
        for _ in range(iters):
            dist.barrier()
            torch.cuda.synchronize()
            self.marks.clear()
            e1, e2 = torch.cuda.Event(True), torch.cuda.Event(True)
            self.dispatch()
            e1.record()
            self.finish()
            e2.record()
            torch.cuda.synchronize()
            s, p, m = self.marks[0]
            pub.append(s.elapsed_time(p))
            sch.append(p.elapsed_time(m))
            disp.append(s.elapsed_time(e1))
            pull.append(m.elapsed_time(e1))
            total.append(s.elapsed_time(e2))
        return [statistics.median(v) for v in (disp, pull, total, pub, sch)]


def _slowest(ms: float, dev: torch.device) -> float:
    t = torch.tensor([ms], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _say(s: str) -> None:
    if dist.get_rank() == 0:
        print(s, flush=True)


def _routing_plan_ms(ws, ids, dev: torch.device) -> float:
    """The owner's routing plan alone (scan or sort, as the exchange picks for this size), slowest rank; it
    rewrites the same values into this rank's plan region, which no peer reads now (all passed this exchange)."""
    n = ids.numel()
    before = ws.sorted_N[:n].clone()

    def plan():
        X.routing_plan(ws, ids)

    plan()
    torch.cuda.synchronize()
    if not torch.equal(before, ws.sorted_N[:n]):
        raise AssertionError("routing plan is not reproducible")
    return _slowest(timeit(plan, iters=10, warm=0), dev)


def _time_shapes(name: str, ex: _Exchange, shapes: list, ref_rows: torch.Tensor, nbytes: int, remote: int,
                 peer_gbs: float, dev: torch.device) -> None:
    """Check that every copy shape receives the reference rows, then time the shapes in interleaved rounds."""
    default = (X._BM, X._BD, X._NW)
    R = ref_rows.shape[0]
    for shape in shapes:  # compile every variant and check its rows before any timing
        X._BM, X._BD, X._NW = shape
        ex.dispatch()
        ex.finish()
        torch.cuda.synchronize()
        if not torch.equal(ex.bufs.xr_CD[:R], ref_rows):
            raise AssertionError(f"{name}: copy shape {shape} received different rows")
    ex.timed(iters=5)  # warm-up, discarded (the first timed pass ran slow in the first sweep)
    samples = {shape: [] for shape in shapes}
    for _ in range(3):  # interleaved rounds, so that drift does not favour any one shape
        for shape in shapes:
            X._BM, X._BD, X._NW = shape
            samples[shape].append([_slowest(v, dev) for v in ex.timed(iters=5)])
    for shape in shapes:
        t_disp, t_pull, t_x, t_pub, t_sch = (statistics.median(col) for col in zip(*samples[shape]))
        t_comb = t_x - t_disp
        _say(f"  BM={shape[0]:3d} BD={shape[1]:5d} warps={shape[2]}{' (table)' if shape == default else ''}: "
             f"dispatch {t_disp:.3f} ms ({remote / t_disp / 1e6:.0f} GB/s NVLink, "
             f"{remote / t_disp / 1e6 / peer_gbs:.0%} of peer copy; all rows {nbytes / t_disp / 1e6:.0f} GB/s), "
             f"pull alone {t_pull:.3f} ms ({remote / t_pull / 1e6:.0f} GB/s NVLink, "
             f"{remote / t_pull / 1e6 / peer_gbs:.0%}), combine {t_comb:.3f} ms "
             f"({remote / t_comb / 1e6:.0f} GB/s NVLink, {remote / t_comb / 1e6 / peer_gbs:.0%}), rows bitwise ==; "
             f"dispatch = publish {t_pub:.3f} + schedule (waits for the peers' publish) {t_sch:.3f} + pull")
    X._BM, X._BD, X._NW = default


def _bench_preset(name: str, rank: int, W: int, dev: torch.device, sweep: bool) -> None:
    cfg = get_preset(name)
    D, E, K, T = cfg.hidden_size, cfg.num_experts, cfg.top_k, 4096
    ws = get_workspace(None, num_tokens=T, hidden=D, top_k=K, num_experts=E, dtype=torch.bfloat16, device=dev)
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(T, D, device=dev, generator=g).bfloat16()
    ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, device=dev, generator=g)
    rounds = max_rounds(ws.spec, default_capacity_rows(ws.spec))
    # the timed dispatch pulls every round before the pushes, which reuse one round buffer and row table:
    # right only for one round (W <= 2 at the default capacity)
    if rounds != 1:
        raise SystemExit(f"comm_bench: {rounds} rounds at W = {W}; it measures one-round exchanges (W <= 2)")
    ex = _Exchange(ws, x, ids, w, rounds)
    ex.dispatch()
    out = ex.finish()
    torch.cuda.synchronize()
    ok = torch.allclose(out.float(), w.sum(1, keepdim=True) * x.float(), rtol=2e-2, atol=2e-2)
    R = int(ex.bufs.sched[0].item())
    ref_rows = ex.bufs.xr_CD[:R].clone()
    nbytes = R * D * 2
    L = E // W
    seg = KE.SCHED_SEG
    cnt = ex.bufs.sched[seg:seg + E].view(L, W).sum(0).tolist()
    remote = (R - cnt[rank]) * D * 2  # rows that crossed NVLink; the rest come from this rank's memory
    peer = ws._keepalive.get_buffer((rank + 1) % W, (ws.rows_2TD.numel() * 2,), torch.uint8)
    loc = torch.empty_like(peer)
    peer_gbs = peer.numel() / _slowest(timeit(lambda: loc.copy_(peer), iters=10, warm=3), dev) / 1e6
    t_plan = _routing_plan_ms(ws, ids, dev)
    _say(f"{name}: T={T}/rank, {R} rows received ({remote / nbytes:.0%} over NVLink), "
         f"peer copy {peer_gbs:.0f} GB/s, routing plan {t_plan:.3f} ms, correct={ok}")
    shapes = SHAPES if sweep else [(X._BM, X._BD, X._NW)]
    _time_shapes(name, ex, shapes, ref_rows, nbytes, remote, peer_gbs, dev)


def main() -> None:
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    sweep = "--sweep" in sys.argv
    reserve_workspace(None, 4096)
    for name in ("deepseek-v3", "mok-bench"):
        _bench_preset(name, rank, W, dev, sweep)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
