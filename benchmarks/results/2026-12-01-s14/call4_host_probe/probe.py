# host enqueue time vs GPU time of one fwd+bwd step, per capacity (ab_rounds' setup); not committed
import dataclasses, os, sys, time, statistics, torch
sys.path.insert(0, os.getcwd() + "/scripts")
from megamoe.bench.problem import make_problem
from megamoe.bench.providers_ep import close_one_rank_group, one_rank_group
from megamoe.bench.routing_models import make_routing
from megamoe.config import get_preset
from megamoe.distributed import reserve_workspace
from megamoe.functional_ep import moe_experts_ep
dev = torch.device("cuda", 0); torch.cuda.set_device(dev)
group = one_rank_group(dev)
T, E, rounds = 4096, 32, 4
cfg = dataclasses.replace(get_preset("deepseek-v3"), num_experts=E); K = cfg.top_k
reserve_workspace(group, rounds * T)
prob = make_problem("deepseek-v3", cfg, T, make_routing("uniform", cfg, T, 1, seed=100), seed=100, device=dev)
params, dout = prob.grad_inputs(), prob.grad_out_TD
def run(cap):
    out = moe_experts_ep(*prob.args(), group=group, capacity_rows=cap)
    return torch.autograd.grad(out, params, dout)
for name, cap in (("1 round", rounds * T * K), ("unused rounds", T * K), ("rows in all", 8192)):
    for _ in range(3): run(cap)
    torch.cuda.synchronize()
    host, gpu, wall = [], [], []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        torch.cuda.synchronize(); t0 = time.perf_counter(); e0.record()
        g = run(cap); t1 = time.perf_counter(); e1.record(); torch.cuda.synchronize(); t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3); gpu.append(e0.elapsed_time(e1)); wall.append((t2 - t0) * 1e3)
    print(f"{os.environ.get('TAG','')} {name:14s} cap {cap:6d}: host enqueue {statistics.median(host):6.2f} ms, "
          f"events {statistics.median(gpu):6.2f} ms (min {min(gpu):.2f} max {max(gpu):.2f}), wall {statistics.median(wall):6.2f} ms", flush=True)
close_one_rank_group()
