"""CUDA-graph capture of forward + backward, the ways users capture it, first thing in a process and after
many eager calls (GPU).

Legend: T tokens, D hidden, F expert FFN, E experts, K top-k, S shared FFN (the shape of the capture that
once failed in a long test process: T 1024, D 2048, F 512, E 16, K 8, S 512).

Proves, each in a fresh spawned process (tests/ep_utils.spawn_ranks), for ``megamoe.functional.moe_experts``
(forward + ``torch.autograd.grad`` in one graph; ``torch.cuda.make_graphed_callables``), the ``MoE`` layer
(forward + ``loss.backward()`` in one graph, aux loss on) and, after the eager calls, the EP path at W = 1
(``megamoe.functional_ep.moe_experts_ep`` on a one-rank group, its workspaces alive):
  * first thing in the process, and after eager calls on the default stream at other shapes (fused,
    layer with training steps of the captured layer itself, EP at two hidden sizes);
  * every replay bitwise equal to eager (output and every gradient) with the routing changed in place
    between replays: as captured, half the experts empty, every (token, slot) on one expert (the
    functional and EP paths take any ids; the layer's routing is moved through its expert bias, which
    can empty half the experts but not put K distinct slots on one expert);
  * no op touches the legacy default stream (stream 0) while capturing.

How the last point is detected. ``torch.cuda.graph`` captures on a stream from torch's pool, which is
non-blocking: a kernel launched on the legacy stream during such a capture is neither captured nor
refused (it runs once, at capture time, and every replay lacks it). Here every capture (also those inside
``make_graphed_callables``) runs on a *blocking* stream made with ``cuStreamCreate(flags=0)``: the legacy
stream synchronises with every blocking stream and may not depend on a capturing one, so any legacy-stream
work during the capture fails it with cudaErrorStreamCaptureImplicit ("operation would make the legacy
stream depend on a capturing blocking stream"). :func:`test_the_detector_catches_legacy_stream_work`
checks that on the machine at hand (a legacy-stream kernel inside the capture is refused on the blocking
stream). A legacy-stream dependency that torch's autograd engine adds also fails: an autograd node tagged
with stream 0 (an ``AccumulateGrad`` node created by an eager call on the default stream and still
referenced, e.g. through ``MoE.last_stats.aux_loss``) makes stream 0 wait on the capturing stream.

Run: python -m pytest tests/test_cuda_graph_gpu.py -q   (skipped without a CUDA GPU; about a minute with a
warm Triton cache)
"""

import contextlib
import ctypes
import warnings

import pytest
import torch

from ep_utils import spawn_ranks

pytestmark = pytest.mark.gpu

T, D, F, E, K, S = 1024, 2048, 512, 16, 8, 512
BF16 = torch.bfloat16


@contextlib.contextmanager
def blocking_capture_stream():
    """Every ``torch.cuda.graph`` capture in the block that names no stream (also the captures inside
    ``make_graphed_callables``) runs on a new blocking stream (module docstring)."""
    lib = ctypes.CDLL("libcuda.so.1")
    torch.empty(1, device="cuda")  # the primary context is current on this thread
    handle = ctypes.c_void_p()
    rc = lib.cuStreamCreate(ctypes.byref(handle), 0)  # CU_STREAM_DEFAULT: synchronises with the legacy stream
    assert rc == 0, f"cuStreamCreate failed with CUresult {rc}"
    old = torch.cuda.graph.default_capture_stream
    torch.cuda.graph.default_capture_stream = torch.cuda.ExternalStream(handle.value)
    try:
        yield
    finally:
        torch.cuda.graph.default_capture_stream = old
        with contextlib.suppress(RuntimeError):  # after a refused capture the error is the caller's to report
            torch.cuda.synchronize()
        lib.cuStreamDestroy_v2(handle)


def _capture(fn, warmups: int = 2):
    """torch's recipe: ``warmups`` calls on a side stream, then ``fn`` captured; returns (graph, its result)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def _tensors(seed: int, T_: int = T, D_: int = D, F_: int = F, E_: int = E, K_: int = K, S_: int = S):
    """(x, topk weights, w13, w2, shared w13, shared w2, output gradient) of one shape, bf16 (weights fp32)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda")
    return (r(T_, D_).to(BF16), torch.rand(T_, K_, generator=g, device="cuda") + 0.1,
            (r(E_, 2 * F_, D_) * D_ ** -0.5).to(BF16), (r(E_, D_, F_) * F_ ** -0.5).to(BF16),
            (r(2 * S_, D_) * D_ ** -0.5).to(BF16), (r(D_, S_) * S_ ** -0.5).to(BF16), r(T_, D_).to(BF16))


def _routings(seed: int, T_: int = T, E_: int = E, K_: int = K) -> dict:
    """The routings a replay switches between: random distinct experts per token (the captured one), half the
    experts empty (all ids in the lower half), every (token, slot) on expert 0."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"random": torch.rand(T_, E_, generator=g, device="cuda").topk(K_, dim=1).indices,
            "half_empty": torch.rand(T_, E_ // 2, generator=g, device="cuda").topk(K_, dim=1).indices,
            "one_expert": torch.zeros(T_, K_, dtype=torch.int64, device="cuda")}


def _fused(x, ids, w, w13, w2, s13, s2):
    from megamoe.functional import moe_experts
    return moe_experts(x, ids, w, w13, w2, s13, s2)


def _eager_grads(fn, ids, tensors, go):
    """(out, grads of x, w, w13, w2, s13, s2) eagerly on the current stream, from fresh leaves."""
    leaves = _leaves(tensors)
    out = fn(leaves[0], ids, *leaves[1:])
    return [out.detach()] + list(torch.autograd.grad(out, leaves, go))


def _replays_match(replay, fn, ids_static, routings, tensors, go) -> dict:
    """{routing: replay bitwise equal to eager} with ``ids_static`` set to each routing (random last, so that
    a graph that ignores the ids in place fails on the other two first)."""
    rep = {}
    for name in ("half_empty", "one_expert", "random"):
        ids_static.copy_(routings[name])
        got = replay()
        rep[name] = _same(got, _eager_grads(fn, routings[name], tensors, go))
    return rep


def _functional_grad_graph(fn, seed: int) -> dict:
    """Forward + torch.autograd.grad of every input in one captured graph."""
    *tensors, go = _tensors(seed)
    routings = _routings(seed)
    ids_static = routings["random"].clone()
    leaves = _leaves(tensors)

    def step():
        out = fn(leaves[0], ids_static, *leaves[1:])
        return [out] + list(torch.autograd.grad(out, leaves, go))

    graph, static = _capture(step)

    def replay():
        graph.replay()
        return [t.clone() for t in static]
    return _replays_match(replay, fn, ids_static, routings, tensors, go)


def _graphed_callables(seed: int) -> dict:
    """torch.cuda.make_graphed_callables of the functional entry (forward and backward graphs)."""
    *tensors, go = _tensors(seed)
    routings = _routings(seed)
    ids_static = routings["random"].clone()
    leaves = _leaves(tensors)
    graphed = torch.cuda.make_graphed_callables(lambda *a: _fused(a[0], ids_static, *a[1:]), tuple(leaves))

    def replay():
        out = graphed(*leaves)
        return [out.detach().clone()] + [g.clone() for g in torch.autograd.grad(out, leaves, go)]
    return _replays_match(replay, _fused, ids_static, routings, tensors, go)


def _layer_config():
    from megamoe.config import MoEConfig
    return MoEConfig(D, F, E, K, "sigmoid", routed_scaling_factor=2.5, n_shared_experts=1, seq_aux_loss_coef=1e-3,
                     dtype=BF16)


def _layer_step(moe, x, go):
    out = moe(x)
    ((out.float() * go.float()).sum() + moe.last_stats.aux_loss).backward()
    return out


def _layer_backward_graph(seed: int, eager_steps: int) -> dict:
    """The MoE layer, forward + ``loss.backward()`` (aux loss included) in one graph, after ``eager_steps``
    training steps of the same layer on the default stream at another token count (the user drops their own
    references to those steps' graphs, as torch's capture recipe asks; megamoe must not keep any). Routing
    moved between replays through the expert bias: as captured, half the experts empty."""
    from megamoe import MoE

    moe = MoE(_layer_config(), backend="fused", device="cuda", seed=seed)
    twin = MoE(_layer_config(), backend="fused", device="cuda", seed=seed)  # the eager reference
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(eager_steps):
        x_e = torch.randn(T // 2, D, generator=g, device="cuda").to(BF16).requires_grad_()
        out = _layer_step(moe, x_e, torch.randn(T // 2, D, generator=g, device="cuda").to(BF16))
        moe.update_expert_bias()
        del out, x_e
    x0 = torch.randn(T, D, generator=g, device="cuda").to(BF16)
    go = torch.randn(T, D, generator=g, device="cuda").to(BF16)
    x = x0.clone().requires_grad_()
    biases = {"half_empty": torch.where(torch.arange(E, device="cuda") < E // 2, 10.0, 0.0),
              "random": torch.zeros(E, device="cuda")}
    moe.expert_bias_E.copy_(biases["random"])

    def step():
        moe.zero_grad(set_to_none=True)
        x.grad = None
        return _layer_step(moe, x, go)

    with warnings.catch_warnings(record=True) as seen:  # torch names an AccumulateGrad node on another stream
        warnings.simplefilter("always")
        try:
            graph, static_out = _capture(step)
            error = None
        except RuntimeError as exc:
            error = str(exc)[:2000]
    rep = {"stale_stream_warnings": [str(w.message)[:300] for w in seen if "stream" in str(w.message)]}
    if error is not None:
        return {"error": error, **rep}
    for name in ("half_empty", "random"):
        moe.expert_bias_E.copy_(biases[name])
        twin.expert_bias_E.copy_(biases[name])
        graph.replay()
        twin.zero_grad(set_to_none=True)
        xt = x0.clone().requires_grad_()
        ref = _layer_step(twin, xt, go)
        grads = [p.grad for p in moe.parameters()]
        ref_grads = [p.grad for p in twin.parameters()]
        counts = moe.last_stats.tokens_per_expert_E
        rep[name] = (torch.equal(static_out, ref) and torch.equal(x.grad, xt.grad) and _same(grads, ref_grads)
                     and torch.equal(counts, twin.last_stats.tokens_per_expert_E))
        if name == "half_empty":
            rep["half_empty_really"] = int((counts[E // 2:] == 0).all())
    return rep


def _ep_grad_graph(group, seed: int) -> dict:
    """The EP path at W = 1 (one-rank group), forward + autograd.grad in one graph, its workspace created by
    the warm-up; every replay also bitwise equal to the single-GPU fused path (the EP contract)."""
    from megamoe.functional_ep import moe_experts_ep

    def ep(x, ids, *rest):
        return moe_experts_ep(x, ids, *rest, group=group)
    rep = _functional_grad_graph(ep, seed)
    *tensors, go = _tensors(seed)
    ids = _routings(seed)["one_expert"]
    rep["ep_equals_fused"] = _same(_eager_grads(ep, ids, tensors, go), _eager_grads(_fused, ids, tensors, go))
    return rep


def _first_thing(rank, world) -> dict:
    """A fresh process whose first megamoe calls are the captures' warm-ups (no process group)."""
    with blocking_capture_stream():
        return {"autograd_grad": _functional_grad_graph(_fused, 1), "graphed_callables": _graphed_callables(2),
                "layer_backward": _layer_backward_graph(3, eager_steps=0)}


def _eager_calls_elsewhere(group) -> None:
    """Eager calls on the default stream at other shapes: fused forward + backward, MoE layers training,
    the EP path at W = 1 at two hidden sizes (two workspaces, kept alive by megamoe.distributed)."""
    from megamoe import MoE
    from megamoe.config import MoEConfig
    from megamoe.functional_ep import moe_experts_ep

    for i, shape in enumerate(((300, 256, 128, 16, 4, 128), (77, D, F, E, K, S), (5, 64, 32, 8, 2, 32))):
        T_, D_, _, E_, K_, _ = shape
        *tensors, go = _tensors(10 + i, *shape)
        ids = _routings(10 + i, T_, E_, K_)["random"]
        _eager_grads(_fused, ids, tensors, go)
        if D_ >= 256:  # workspaces for D 256 and D 2048 (the captured shape's: the EP capture reuses it)
            _eager_grads(lambda x, ids_, *rest: moe_experts_ep(x, ids_, *rest, group=group), ids, tensors, go)
    cfg = MoEConfig(256, 128, 16, 4, "sigmoid", n_group=4, topk_group=2, n_shared_experts=1, seq_aux_loss_coef=1e-3)
    layer = MoE(cfg, backend="fused", device="cuda", seed=0)
    for T_ in (64, 200, 31):
        _layer_step(layer, torch.randn(T_, 256, device="cuda").to(BF16).requires_grad_(),
                    torch.randn(T_, 256, device="cuda").to(BF16))
        layer.update_expert_bias()
    torch.cuda.synchronize()


def _after_eager(rank, world) -> dict:
    """Many eager calls first (EP workspaces alive), then the same captures, the EP one, and the layer after
    eager training steps of its own."""
    import torch.distributed as dist

    group = dist.group.WORLD
    _eager_calls_elsewhere(group)
    with blocking_capture_stream():
        rep = {"autograd_grad": _functional_grad_graph(_fused, 1), "graphed_callables": _graphed_callables(2),
               "ep_autograd_grad": _ep_grad_graph(group, 4)}
        rep["layer_backward"] = _layer_backward_graph(3, eager_steps=3)  # last: a refused capture ends the process
    return rep


def _check(rep: dict) -> None:
    for case, res in rep.items():
        assert "error" not in res, f"{case}: {res}"
        bad = {k: v for k, v in res.items() if k != "stale_stream_warnings" and not v}
        assert not bad, f"{case}: replay differs from eager for {sorted(bad)}; {res}"


def test_capture_first_thing_in_a_process():
    _check(spawn_ranks(_first_thing, 1, timeout=600)[0])


def test_capture_after_many_eager_calls_with_ep_workspaces_alive():
    _check(spawn_ranks(_after_eager, 1, cuda=True, timeout=600)[0])


def _legacy_kernel_in_capture(rank, world, blocking: bool) -> str:
    """Capture a graph in which one kernel goes to the legacy stream; 'captured' or the error text."""
    x = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    try:
        with blocking_capture_stream() if blocking else contextlib.nullcontext(), torch.cuda.graph(graph):
            x.add_(1)
            with torch.cuda.stream(torch.cuda.default_stream()):
                x.add_(1)  # the legacy default stream, inside the capture
        return "captured"
    except RuntimeError as exc:  # the launch's error, then capture_end's: report the whole chain
        chain = []
        while exc is not None:
            chain.append(str(exc))
            exc = exc.__context__
        return "error: " + " <- ".join(chain)


def test_the_detector_catches_legacy_stream_work():
    """On a blocking capture stream a kernel on the legacy stream fails the capture (so the captures above
    would fail if any megamoe op touched it); on torch's own (non-blocking) capture stream it is not refused,
    which is why the tests above do not use it."""
    blocking = spawn_ranks(_legacy_kernel_in_capture, 1, True, timeout=300)[0]
    assert blocking.startswith("error") and "legacy stream" in blocking, blocking
    plain = spawn_ranks(_legacy_kernel_in_capture, 1, False, timeout=300)[0]
    print(f"torch's own capture stream with a legacy-stream kernel inside: {plain[:300]}")
