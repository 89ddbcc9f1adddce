# cProfile of the host side of EP fwd+bwd steps (not committed)
import cProfile, dataclasses, pstats, sys, torch
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
cap = int(sys.argv[1]) if len(sys.argv) > 1 else T * K
def run():
    out = moe_experts_ep(*prob.args(), group=group, capacity_rows=cap)
    return torch.autograd.grad(out, params, dout)
for _ in range(3): run()
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(10):
    run(); torch.cuda.synchronize()
pr.disable()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(28)
st.sort_stats("cumulative").print_stats(45)
close_one_rank_group()
