"""Helpers for the expert-parallel tests: multi-process launchers, payloads, a Python model of the schedule.

Legend: W ranks, T tokens of a rank, K top-k, D hidden, E global experts, L = E / W, C capacity rows.

* :func:`spawn_ranks` runs ``fn(rank, world, *args)`` in W fresh processes and returns their results
  (a failure in any rank is re-raised with that rank's traceback; a rank that dies or hangs is named within
  a bounded time). ``backend="gloo"`` initialises a gloo process group first; ``cuda=True`` initialises NCCL
  on GPU ``rank``; both use a free port. CPU ranks are forked from a rank host (one spawned process per
  environment, kept for the session: torch and the test module are imported once); CUDA ranks are spawned.
* Ranks sharing GPUs (``MEGAMOE_TEST_EP_SHARED_GPU=1``, :func:`shared_gpu`): ``cuda=True`` puts rank r on
  GPU ``r mod n`` (:func:`rank_device`) over gloo instead of NCCL (NCCL refuses two ranks on one GPU), with
  ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` so symmetric memory maps the peers' pools. The contexts
  of one GPU are time-sliced by the driver: this checks the protocol and the compiled kernels at W > 1 on
  a one-GPU machine (bits, rounds, flags, timeouts), not NVLink or speed.
* :func:`payload_rows` makes token rows that encode (source rank, token) in columns 0 and 1, so a
  misrouted row names itself.
* :func:`model_schedule` is the plain-Python statement of the receive order the kernels must produce;
  :func:`split_experts` says which local experts' rows span two receive rounds.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import queue
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from megamoe.distributed import free_port

PG_TIMEOUT_S = 120  # process-group timeout: a lost peer fails a collective in bounded time


def shared_gpu() -> bool:
    """True when ``MEGAMOE_TEST_EP_SHARED_GPU=1``: GPU ranks share the visible GPUs (see the module doc)."""
    flag = os.environ.get("MEGAMOE_TEST_EP_SHARED_GPU", "0")
    if flag not in ("0", "1", ""):
        raise ValueError(f"MEGAMOE_TEST_EP_SHARED_GPU must be 0 or 1, got {flag!r}")
    return flag == "1"


def rank_device(rank: int) -> torch.device:
    """The GPU of ``rank``: ``cuda:rank``, or ``cuda:(rank mod visible GPUs)`` when the ranks share GPUs."""
    return torch.device("cuda", rank % torch.cuda.device_count() if shared_gpu() else rank)


def _entry(fn, rank, world, args, q, port, backend):
    import torch.distributed as dist
    ok = False
    try:
        if backend is not None:
            kw = {}
            if backend == "nccl":
                torch.cuda.set_device(rank_device(rank))
                if shared_gpu():  # NCCL refuses two ranks on one GPU; gloo moves the few setup collectives
                    backend = "gloo"
                    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
                else:
                    kw["device_id"] = rank_device(rank)
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=PG_TIMEOUT_S), **kw)
        res = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(res, buf)  # plain bytes: tensors must not travel as shared-memory handles
        q.put((rank, "ok", buf.getvalue()))
        ok = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        # The report is flushed before any teardown, so a crash in the backend's teardown cannot lose it.
        q.close()
        q.join_thread()
        if dist.is_available() and dist.is_initialized():  # ours, or one that fn made
            if ok:
                dist.barrier()  # no rank closes its connections while a peer still reads from them
            dist.destroy_process_group()


@contextlib.contextmanager
def temp_env(env: dict):
    """The environment variables of ``env`` set for the block, each restored (or removed) after it."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent exits (no orphaned rank outlives a killed run)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _forked_entry(fn, rank, world, args, q, port, backend):
    _die_with_parent()
    _entry(fn, rank, world, args, q, port, backend)


def _collect(procs, q, timeout: float) -> tuple[dict, list[str], list[tuple[int, int]]]:
    """Wait for the W ranks' reports: ({rank: result bytes}, error lines, [(rank, exit code)] of ranks that
    reported, then exited non-zero). A rank seen dead without a report is an error at once; the ranks still
    alive after ``timeout`` (or after an error) are killed."""
    world = len(procs)
    results, errors, reported = {}, [], set()
    deadline = time.monotonic() + timeout
    try:
        while len(reported) < world:
            try:
                rank, status, res = q.get(timeout=0.25)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
                if dead:
                    try:  # a report written just before the exit may still be in the pipe
                        rank, status, res = q.get(timeout=0.5)
                    except queue.Empty:
                        errors += [f"rank {r}: exited with code {procs[r].exitcode} before reporting" for r in dead]
                        break
                elif time.monotonic() > deadline:
                    errors.append(f"ranks {sorted(set(range(world)) - reported)}: no report within {timeout} s")
                    break
                else:
                    continue
            reported.add(rank)
            if status == "ok":
                results[rank] = res
            else:
                errors.append(f"rank {rank}: {res}")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 2)
            if p.is_alive():
                p.kill()
                p.join()
    return results, errors, [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, None)]


def _host_main(conn) -> None:
    """A rank host: serves (fn, world, args, port, backend, timeout) calls from the test process until told to
    stop or the test process goes away. Each call forks W fresh rank processes (what the host imported while
    unpickling earlier calls, torch and the test module above all, is not imported again; what a rank changes
    dies with it) and answers with :func:`_collect`'s result."""
    _die_with_parent()
    ctx = mp.get_context("fork")
    while True:
        try:
            call = conn.recv()
        except EOFError:
            return
        if call is None:
            return
        fn, world, args, port, backend, timeout = call
        q = ctx.Queue()
        procs = [ctx.Process(target=_forked_entry, args=(fn, r, world, args, q, port, backend)) for r in range(world)]
        for p in procs:
            p.start()
        del call, args  # the host keeps no shared-memory tensors of a finished call
        answer = _collect(procs, q, timeout)
        q.close()
        conn.send(answer)


class _RankHost:
    """A spawned host process (:func:`_host_main`) for one environment, and the test process's end of its pipe."""

    def __init__(self, environ: dict):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        with temp_env(environ):  # the host, and every rank it forks, runs in this environment
            self.proc = ctx.Process(target=_host_main, args=(child,), name="megamoe-test-rank-host")
            self.proc.start()
        child.close()

    def call(self, fn, world, args, port, backend, timeout):
        """Run one call; (results, errors, bad exits) as :func:`_collect` gives them. A host that dies or does
        not answer in time is stopped and reported as an error."""
        try:
            self.conn.send((fn, world, args, port, backend, timeout))
            if self.conn.poll(timeout + 60):
                return self.conn.recv()
            why = f"no answer within {timeout + 60} s"
        except (EOFError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        self.stop()
        error = f"ranks {list(range(world))}: the rank host process failed ({why}; exit code {self.proc.exitcode})"
        return {}, [error], []

    def stop(self):
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


_HOSTS: dict[tuple, _RankHost] = {}
MAX_HOSTS = 2  # hosts kept for reuse (one per environment; each holds an imported torch)


def _stop_hosts() -> None:
    while _HOSTS:
        _HOSTS.pop(next(iter(_HOSTS))).stop()


def _host_for(env: dict) -> _RankHost:
    """The rank host of the test process's environment with ``env`` applied, started on first use (the
    oldest host is stopped when more than MAX_HOSTS would run)."""
    environ = {**os.environ, **env}
    key = tuple(sorted((k, v) for k, v in environ.items() if not k.startswith("PYTEST_")))  # pytest's, per test
    host = _HOSTS.get(key)
    if host is not None and not host.proc.is_alive():
        host.stop()
        del _HOSTS[key]
        host = None
    if host is None:
        if not _HOSTS:
            atexit.register(_stop_hosts)  # before multiprocessing's own exit handler, which would wait for them
        while len(_HOSTS) >= MAX_HOSTS:
            _HOSTS.pop(next(iter(_HOSTS))).stop()
        host = _HOSTS[key] = _RankHost(env)
    return host


def spawn_ranks(fn, world: int, *args, cuda: bool = False, backend: str | None = None, timeout: float = 300.0,
                env: dict | None = None):
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes; return [result of rank r].

    ``backend`` ("gloo" or "nccl"; ``cuda=True`` means "nccl" on GPU ``rank``, or gloo on
    :func:`rank_device` when the ranks share GPUs) initialises the default
    process group before ``fn``; a default process group that exists after ``fn`` (ours or fn's own) is
    torn down after the report, behind a barrier. A rank that raises is reported with its
    traceback; a rank that dies without reporting (a signal, ``std::terminate``) is reported with its exit
    code as soon as it is seen dead, not after ``timeout``. What a rank does after its report (process
    group teardown) does not decide the test; a non-zero exit code there is raised as a warning.

    CPU ranks (no ``cuda``) are forked from a rank host (:class:`_RankHost`), one spawned process per
    environment (``env`` applied to this process's environment) that lives for the whole test session, so
    torch and the test module are imported once, not once per rank and call; every rank is still a fresh
    process that starts from the host's imports. CUDA ranks are spawned (a CUDA context does not survive a fork).
    """
    port = free_port()
    if cuda:
        results, errors, bad_exit = _spawn_fresh(fn, world, args, port, "nccl", timeout, env or {})
    else:
        results, errors, bad_exit = _host_for(env or {}).call(fn, world, args, port, backend, timeout)
    if errors:
        raise AssertionError("\n".join(errors))
    if bad_exit:
        warnings.warn(f"ranks reported results, then exited with codes {bad_exit} (process group teardown)",
                      stacklevel=2)
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world)]


def _spawn_fresh(fn, world, args, port, backend, timeout, env):
    """W spawned rank processes, each importing everything anew (the CUDA ranks)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with temp_env(env):  # the children inherit it
        procs = [ctx.Process(target=_entry, args=(fn, r, world, args, q, port, backend)) for r in range(world)]
        for p in procs:
            p.start()
    return _collect(procs, q, timeout)


def ep_inputs(Ts, kind: str, seed: int, dev, *, E: int, D: int, F: int, S: int, K: int, dtype=torch.bfloat16):
    """One EP test case's global inputs, from one generator: (w13 [E, 2F, D], w2 [E, D, F], shared s13
    [2S, D], s2 [D, S], then per rank: xs [T, D], ids [T, K] (``routing(kind)``; "one_rank": every id on rank
    0's E / W experts), routing weights ws [T, K], output gradients gos [T, D])."""
    W = len(Ts)
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * F, D, generator=g) * D ** -0.5).to(dev, dtype)
    w2 = (torch.randn(E, D, F, generator=g) * F ** -0.5).to(dev, dtype)
    s13 = (torch.randn(2 * S, D, generator=g) * D ** -0.5).to(dev, dtype)
    s2 = (torch.randn(D, S, generator=g) * S ** -0.5).to(dev, dtype)
    xs = [torch.randn(T, D, generator=g).to(dev, dtype) for T in Ts]
    if kind == "one_rank":
        ids = [routing("uniform", T, K, E // W, seed, r).to(dev) for r, T in enumerate(Ts)]
    else:
        ids = [routing(kind, T, K, E, seed, r).to(dev) for r, T in enumerate(Ts)]
    ws = [(torch.rand(T, K, generator=g) + 0.1).to(dev) for T in Ts]
    gos = [torch.randn(T, D, generator=g).to(dev, dtype) for T in Ts]
    return w13, w2, s13, s2, xs, ids, ws, gos


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A detached copy that requires grad."""
    return t.detach().clone().requires_grad_(True)


def layout_groups(world: int, ep: int, ep_inner: bool) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, DP groups) of a DP x EP job as rank lists: EP groups of ``ep`` consecutive ranks
    (``ep_inner``: a node's GPUs under torchrun) or strided ones (rank r in EP group r % (world // ep)); each
    DP group holds the ranks with the same EP rank (one per EP group)."""
    R = world // ep
    eps = [list(range(i * ep, (i + 1) * ep)) for i in range(R)] if ep_inner else \
        [list(range(i, world, R)) for i in range(R)]
    return eps, [[g[j] for g in eps] for j in range(ep)]


def payload_rows(rank: int, T: int, D: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """[T, D] rows: column 0 = source rank, column 1 = token index, the rest N(0, 1) from (seed, rank)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(T, D, generator=g)
    x[:, 0] = rank
    x[:, 1] = torch.arange(T, dtype=torch.float32)
    return x.to(dtype)


def model_schedule(ids_per_rank: list[torch.Tensor], rank: int, L: int) -> list[tuple[int, int, int, int]]:
    """Receive rows of ``rank`` in protocol order: [(local expert, source rank, token, slot)], sorted by
    (local expert, global token, slot)."""
    rows = []
    for s, ids in enumerate(ids_per_rank):
        T, K = ids.shape
        for t in range(T):
            for k in range(K):
                e = int(ids[t, k])
                if e // L == rank:
                    rows.append((e % L, s, t, k))
    rows.sort()
    return rows


def expert_counts(ids_all: list[torch.Tensor], rank: int, L: int) -> list[int]:
    """Rows each local expert of ``rank`` receives from all ranks."""
    return [sum(int((ids == rank * L + l).sum()) for ids in ids_all) for l in range(L)]


def offsets_of(counts: list[int]) -> list[int]:
    """Exclusive prefix sum with the total appended: expert e's rows are [off[e], off[e+1])."""
    off = [0]
    for c in counts:
        off.append(off[-1] + c)
    return off


def model_rounds(counts: list[int], C: int, rounds: int) -> list[int]:
    """The round table of the protocol, modelled in plain Python: first receive row of each of the ``rounds``
    rounds, then the end (R when everything fits). A round takes every remaining row if at most C remain,
    else ends at the last expert start within C rows, else (one expert of more than C rows) after C rows."""
    starts, off = [0], offsets_of(counts)
    R = off[-1]
    for _ in range(rounds):
        s = starts[-1]
        if s + C >= R:
            starts.append(R)
            continue
        inside = [o for o in off if s < o <= s + C]
        starts.append(max(inside) if inside else s + C)
    return starts


def check_round_table(starts: list[int], counts: list[int], C: int) -> list[int]:
    """Assert what any round table must be, whatever the model says: every row in the rounds, no round above C
    rows, the used rounds first, two consecutive used rounds above C, a cut inside an expert only when that
    expert has more than C rows, and then a multiple of C rows past its first row. Returns the rounds' sizes."""
    off = offsets_of(counts)
    R = off[-1]
    assert starts[0] == 0 and starts[-1] == R, ("every row in the launched rounds", starts, R)
    sizes = [b - a for a, b in zip(starts, starts[1:])]
    assert all(0 <= n <= C for n in sizes), (sizes, C)
    used = [n for n in sizes if n]
    assert sizes[:len(used)] == used, ("the used rounds come first", sizes)
    assert all(a + b > C for a, b in zip(used, used[1:])), ("two consecutive rounds hold more than C", used, C)
    for cut in starts[1:-1]:
        if 0 < cut < R and cut not in off:
            e = max(i for i, o in enumerate(off) if o < cut)
            assert counts[e] > C, ("a cut inside an expert of at most C rows", cut, counts, C)
            # every C rows from the expert's first row: with C a multiple of 128 the FP8 weight gradient's 128-row
            # blocks never straddle two rounds (megamoe.ops.wgrad_rounds.fp8_k_grouped_round)
            assert (cut - off[e]) % C == 0, ("a cut inside an expert off its C-row pieces", cut, off[e], C)
    return sizes


def split_experts(ids_all: list[torch.Tensor], rank: int, L: int, C: int) -> list[bool]:
    """Per local expert of ``rank``: is it split across receive rounds? Rounds are cut at expert boundaries,
    so exactly the experts with more than C rows are."""
    return [c > C for c in expert_counts(ids_all, rank, L)]


def routing(kind: str, T: int, K: int, E: int, seed: int, rank: int = 0) -> torch.Tensor:
    """int64 [T, K] distinct expert ids per token: 'uniform', 'zipf' (exponent 1.2), 'hot' (expert 0 in
    every token), 'ties' (all tokens pick experts 0..K-1); or 'repeat': every slot of a token on one expert
    drawn uniformly (repeated ids, which the layer allows). For "all tokens on rank 0's experts", call
    'uniform' with E = L (rank 0's range)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int64)
    if kind == "uniform":
        return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if kind == "zipf":
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=g, dtype=torch.float64)))
        return torch.topk(p.log()[None, :] + gumbel, K, dim=1).indices
    if kind == "hot":
        rest = torch.stack([torch.randperm(E - 1, generator=g)[:K - 1] + 1 for _ in range(T)]) if K > 1 else None
        hot = torch.zeros(T, 1, dtype=torch.int64)
        return hot if rest is None else torch.cat([hot, rest], 1)
    if kind == "ties":
        return torch.arange(K, dtype=torch.int64).repeat(T, 1)
    if kind == "repeat":
        return torch.randint(0, E, (T, 1), generator=g).repeat(1, K)
    raise ValueError(kind)
