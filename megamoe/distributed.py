"""Expert-parallel workspace: one symmetric-memory pool per EP group, carved into regions.

This is the only megamoe module that touches ``torch.distributed._symmetric_memory``.

Legend: W EP world size, T_cap token capacity per rank (``max_tokens``), D hidden, K top-k, E global
experts, L = E / W local experts, N_cap = T_cap * K (token, slot) rows.

Layout of one rank's pool (identical on every rank, byte offsets aligned to 256):

=============  ===========================  ===================================================
region         dtype / shape                written by / read by
=============  ===========================  ===================================================
``flags``      int32 [16 + 2W]              word 0: epoch counter (local, +1 per exchange);
                                            word 1: status (0 = ok, else packed error, local);
                                            ``[16 + s]``: "plan ready" epoch written by source s;
                                            ``[16 + W + d]``: "pushes done" epoch written by rank d.
``plan``       int32 [4 + E]                owner: ``[0]`` = T, ``[4 + e]`` = rows routed to expert e
``sorted``     int32 [N_cap]                owner: flat rows ``t*K + k`` stably sorted by expert id
``weights``    fp32 [N_cap]                 owner: ``topk_weights_TK`` (read in the backward)
``rows``       act dtype [2, T_cap, D]      owner: channel 0 = x, channel 1 = output gradient
``slots``      act dtype [T_cap, K, D]      peers push expert outputs / input gradients into slot
                                            ``(t, k)`` of the owner, each slot written exactly once
``dots``       fp32 [T_cap * K, P_MAX]      backward: peers push each row's routing-weight partial
                                            dot products (P = ceil(F / min(BLOCK_N, 128)) <= P_MAX = 64)
=============  ===========================  ===================================================

Total bytes = ``T_cap*D*es*(2 + K) + T_cap*K*(8 + 4*P_MAX) + 4*E`` + alignment (es = element size),
e.g. 596 MB for the deepseek-v3 shape (D 7168, K 8, bf16) at T_cap = 4096.

Synchronisation: flags only grow (the epoch counter lives on the device and each exchange adds one),
so nothing is ever reset and CUDA graphs replay. Every cross-GPU handoff is a release store at system
scope by the writer and an acquire load at system scope by the reader (see ``kernels/ep_comm.py``).
Every wait is bounded; a timeout writes a packed status word that :meth:`EPWorkspace.check` turns into
:class:`EPTimeoutError` naming this rank, the stage and the peer.

Two ways to build a workspace: :func:`get_workspace` (CUDA, symmetric memory over a process group) and
:meth:`EPWorkspace.from_shared_buffers` (CPU tensors in shared memory, one process per simulated rank,
for the Triton interpreter tests).

Ranks on one machine: :func:`run_ranks` runs a function in W spawned processes (the training CLI's
reproducibility check, scripts/bits_digest.py), :func:`free_port` gives their rendezvous port.
"""

from __future__ import annotations

import queue
import socket
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .validation import check_same_across_ranks

__all__ = ["WorkspaceSpec", "EPWorkspace", "EPTimeoutError", "get_workspace", "reserve_workspace",
           "STAGE_NAMES", "P_MAX", "FLAG_READY", "FLAG_EPOCH", "FLAG_STATUS",
           "default_capacity_rows", "max_rounds", "max_received_rows", "free_port", "run_ranks"]

FLAG_EPOCH, FLAG_STATUS, FLAG_READY = 0, 1, 16
_ALIGN = 256
P_MAX = 64  # routing-weight partial dots per row that the backward can carry

# Stage ids written into the status word (kept in sync with kernels/ep_comm.py).
STAGE_NAMES = {1: "dispatch: waiting for the peer's routing plan and token rows",
               2: "combine: waiting for the peer's pushed expert rows",
               3: "routing plan: expert id out of range",
               4: "schedule: received rows exceed the launched rounds (a peer's plan above this workspace's "
                  "max_tokens: workspaces of different sizes across ranks?)",
               5: "expert GEMM: waiting for this rank's own pull of the round's rows, running beside it "
                  "(EPOptions.pull_programs)"}


class EPTimeoutError(RuntimeError):
    """A bounded wait of the expert-parallel protocol expired, or the device found bad input."""


@dataclass(frozen=True)
class WorkspaceSpec:
    """Sizes that fix the workspace layout; identical on every rank of the group.

    world: W. max_tokens: T_cap, the most tokens any rank may pass to one call. hidden: D. top_k: K.
    num_experts: E (global). dtype: activation dtype of the token rows.
    """

    world: int
    max_tokens: int
    hidden: int
    top_k: int
    num_experts: int
    dtype: torch.dtype

    def __post_init__(self):
        for name in ("world", "max_tokens", "hidden", "top_k", "num_experts"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"megamoe.distributed: {name} must be a positive int, got {v!r}")
        if self.num_experts % self.world:
            raise ValueError(f"megamoe.distributed: num_experts={self.num_experts} not divisible by W={self.world}")

    def covers(self, other: WorkspaceSpec) -> bool:
        return (self.world == other.world and self.hidden == other.hidden and self.top_k == other.top_k
                and self.num_experts == other.num_experts and self.dtype == other.dtype
                and self.max_tokens >= other.max_tokens)

    def layout(self) -> dict[str, tuple[int, int]]:
        """{region: (byte offset, byte size)} in the order of the module docstring."""
        es = torch.empty((), dtype=self.dtype).element_size()
        n_cap = self.max_tokens * self.top_k
        sizes = [("flags", 4 * (16 + 2 * self.world)), ("plan", 4 * (4 + self.num_experts)),
                 ("sorted", 4 * n_cap), ("weights", 4 * n_cap), ("rows", es * 2 * self.max_tokens * self.hidden),
                 ("slots", es * n_cap * self.hidden), ("dots", 4 * n_cap * P_MAX)]
        out, off = {}, 0
        for name, size in sizes:
            out[name] = (off, size)
            off = (off + size + _ALIGN - 1) // _ALIGN * _ALIGN
        out["total"] = (0, off)
        return out

    @property
    def nbytes(self) -> int:
        return self.layout()["total"][1]


class EPWorkspace:
    """One rank's view of the pool: local region views, the peer base-pointer table, the status word.

    Attributes: ``rank``, ``world``, ``spec``, ``offsets`` ({region: byte offset}), ``aligned`` (every pool
    base 16-byte aligned: the pull / push kernels then move rows in 16-byte vectors), ``ptrs_W`` (int64 [W]
    device tensor: base address of every rank's pool as mapped in this process; ``slot_deltas_W``: int64 [W],
    every rank's slot buffer as an element offset from this rank's, or None if the pools are not 16-element
    aligned to each other, when the EP path pushes with the copy kernel), and local tensor views ``flags``,
    ``plan``, ``sorted_N``, ``weights_N``, ``rows_2TD``, ``slots_TKD``, ``dots_NP`` (flat).
    """

    def __init__(self, spec: WorkspaceSpec, rank: int, buffer_u8: torch.Tensor, peer_base_ptrs: list[int],
                 keepalive=None):
        if len(peer_base_ptrs) != spec.world or not 0 <= rank < spec.world:
            raise ValueError(f"megamoe.distributed: rank {rank} / {len(peer_base_ptrs)} pointers for W={spec.world}")
        if buffer_u8.dtype != torch.uint8 or buffer_u8.numel() < spec.nbytes:
            raise ValueError(f"megamoe.distributed: buffer must be uint8 with >= {spec.nbytes} bytes")
        self.spec, self.rank, self.world = spec, rank, spec.world
        self.buffer = buffer_u8
        self._keepalive = keepalive
        lay = spec.layout()
        self.offsets = {k: v[0] for k, v in lay.items() if k != "total"}
        self.ptrs_W = torch.tensor(peer_base_ptrs, dtype=torch.int64, device=buffer_u8.device)
        if peer_base_ptrs[rank] != buffer_u8.data_ptr():
            raise ValueError("megamoe.distributed: own entry of the pointer table must be the local buffer")

        def view(name, dtype, shape):
            off, size = lay[name]
            return buffer_u8[off:off + size].view(dtype).view(shape)

        T, K, D, E, W = spec.max_tokens, spec.top_k, spec.hidden, spec.num_experts, spec.world
        self.flags = view("flags", torch.int32, (16 + 2 * W,))
        self.plan = view("plan", torch.int32, (4 + E,))
        self.sorted_N = view("sorted", torch.int32, (T * K,))
        self.weights_N = view("weights", torch.float32, (T * K,))
        self.rows_2TD = view("rows", spec.dtype, (2, T, D))
        self.slots_TKD = view("slots", spec.dtype, (T, K, D))
        self.dots_NP = view("dots", torch.float32, (T * K * P_MAX,))
        # every rank's slot buffer as an element offset from this rank's (ops.ep_tiles.RowPush: the GEMM
        # epilogue stores result rows straight into their owners' slots); built here, outside any captured
        # or sync-checked region. The regions sit at one offset in every pool, so these are base differences.
        es = torch.empty(0, dtype=spec.dtype).element_size()
        deltas = [p - peer_base_ptrs[rank] for p in peer_base_ptrs]
        self.slot_deltas_W = None  # symmetric-memory and shared-memory pools are always aligned; if not: copy kernel
        if not any(d % (16 * es) for d in deltas):
            self.slot_deltas_W = torch.tensor([d // es for d in deltas], dtype=torch.int64, device=buffer_u8.device)
        # every pool base 16-byte aligned (the region offsets are multiples of 256): the pull and push kernels may
        # then move rows in 16-byte vectors (kernels.ep_comm ALIGNED); symmetric memory always is
        self.aligned = all(p % 16 == 0 for p in peer_base_ptrs)
        self._pending: list[tuple[torch.Tensor, object]] = []  # (pinned status copy, event)
        self._pinned, self._slot = None, 0
        self.timeout_s = 10.0

    # ----------------------------------------------------------------------------------- builders
    @classmethod
    def from_shared_buffers(cls, spec: WorkspaceSpec, rank: int, buffers: list[torch.Tensor]) -> EPWorkspace:
        """CPU simulation: ``buffers[r]`` is rank r's pool, a ``share_memory_()`` uint8 tensor mapped in
        every process; the pointer table holds this process's own mapped addresses. Zero the buffers
        before any rank starts."""
        return cls(spec, rank, buffers[rank], [b.data_ptr() for b in buffers], keepalive=buffers)

    @staticmethod
    def allocate_shared(spec: WorkspaceSpec) -> list[torch.Tensor]:
        """W zeroed shared-memory CPU pools for :meth:`from_shared_buffers` (call before spawning)."""
        return [torch.zeros(spec.nbytes, dtype=torch.uint8).share_memory_() for _ in range(spec.world)]

    # ----------------------------------------------------------------------------------- accessors
    def done_word(self, src: int) -> int:
        return FLAG_READY + self.world + src

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def epoch(self) -> int:
        """Current device epoch (host sync; for tests and diagnostics)."""
        return int(self.flags[FLAG_EPOCH].item())

    # ----------------------------------------------------------------------------------- errors
    def decode_status(self, word: int) -> str | None:
        """Readable message for a packed status word (stage << 24 | peer << 16 | epoch & 0xffff)."""
        if word == 0:
            return None
        stage, peer, epoch = (word >> 24) & 0xFF, (word >> 16) & 0xFF, word & 0xFFFF
        what = STAGE_NAMES.get(stage, f"unknown stage {stage}")
        if stage in (1, 2):
            return (f"megamoe EP rank {self.rank} of {self.world}: timed out after {self.timeout_s:g} s in stage "
                    f"'{what}' from rank {peer} (exchange epoch {epoch} mod 65536); is rank {peer} alive and "
                    f"calling the same MoE layers in the same order with T <= max_tokens={self.spec.max_tokens}?")
        if stage == 5:
            return (f"megamoe EP rank {self.rank} of {self.world}: timed out after {self.timeout_s:g} s in stage "
                    f"'{what}' (exchange epoch {epoch} mod 65536): a block of rows the GEMM needs was not flagged in "
                    "time (a pull slower than timeout_s, or a schedule / round-offset mismatch: a bug); "
                    "EPOptions(pull_programs=0) runs the pull before the GEMM")
        return f"megamoe EP rank {self.rank} of {self.world}: {what} (exchange epoch {epoch} mod 65536)"

    def check(self) -> None:
        """Raise :class:`EPTimeoutError` if any exchange so far failed. Synchronises with the device."""
        word = int(self.flags[FLAG_STATUS].item())
        self._pending.clear()
        msg = self.decode_status(word)
        if msg:
            raise EPTimeoutError(msg)

    def check_lazy(self) -> None:
        """No-sync check: on CUDA, look at status copies of earlier calls whose event has completed, then
        queue an asynchronous copy of the current word; on CPU, check now. Raises EPTimeoutError."""
        if not self.flags.is_cuda:
            return self.check()
        if torch.cuda.is_current_stream_capturing():
            return None  # no event queries or copies inside graph capture
        keep = []
        for host, ev in self._pending:
            if ev.query():
                msg = self.decode_status(int(host[0]))
                if msg:
                    self._pending.clear()
                    raise EPTimeoutError(msg)
            else:
                keep.append((host, ev))
        self._pending = keep[-3:]
        if self._pinned is None:
            self._pinned = torch.zeros(8, dtype=torch.int32, pin_memory=True)
        host = self._pinned[self._slot % 8:self._slot % 8 + 1]
        self._slot += 1
        host.copy_(self.flags[FLAG_STATUS:FLAG_STATUS + 1], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._pending.append((host, ev))


def max_received_rows(spec: WorkspaceSpec) -> int:
    """``R_bound = W*T_cap*K``: the most rows one rank can receive in an exchange (every slot of every token of
    every rank routed to its experts). With distinct ids in a token a rank receives at most ``min(K, L)`` rows
    per token, but ids may repeat (as on one GPU), so the bound does not assume it; it only matters when K > L,
    where it launches more rounds (which exit at once when unused)."""
    return spec.world * spec.max_tokens * spec.top_k


def default_capacity_rows(spec: WorkspaceSpec) -> int:
    """Receive-buffer rows per round: ``min(R_bound, max(2*T_cap*K, 1024))`` rounded up to 128
    (:func:`max_received_rows`). For W <= 2 this covers the worst case in one round; for larger W, skewed
    routing takes more rounds."""
    T, K = spec.max_tokens, spec.top_k
    cap = min(max_received_rows(spec), max(2 * T * K, 1024))
    return max(128, (cap + 127) // 128 * 128)


def max_rounds(spec: WorkspaceSpec, capacity_rows: int) -> int:
    """Rounds launched per exchange so that the worst case (R_bound rows, :func:`max_received_rows`) fits in
    rounds of at most C = ``capacity_rows`` rows: 1 if R_bound <= C, else
    ``max(2*(R_bound // (C+1)), 2*((R_bound-1) // (C+1)) + 1)``.

    Why: rounds are cut only at expert boundaries unless one expert alone has more than C rows
    (kernels/ep_comm.py), so a round may hold fewer than C rows, but any round and the next together hold
    more than C; n rounds therefore need at least floor(n/2)*(C+1) (+1 when n is odd) rows. At the default C
    with K = 8 that is 3 rounds at W = 4 and 7 at W = 8 (cutting every C rows needed 2 and 4, but split experts
    across rounds); the rounds the routing does not use exit at once."""
    R, C = max_received_rows(spec), capacity_rows
    if R <= C:
        return 1
    return max(2 * (R // (C + 1)), 2 * ((R - 1) // (C + 1)) + 1)


# ------------------------------------------------------------------------------- process groups
_WORKSPACES: dict[tuple, EPWorkspace] = {}
_RESERVED: dict[tuple, int] = {}


def _group_key(group) -> str:
    if group is None:
        group = dist.group.WORLD
    return getattr(group, "group_name", None) or str(id(group))


def _ws_key(group, hidden, top_k, num_experts, dtype) -> tuple:
    return (_group_key(group), hidden, top_k, num_experts, dtype)


def release_workspaces(group) -> None:
    """Forget ``group``'s workspaces and reserved capacity (before the group is destroyed, so a later group
    of the same name cannot get a workspace bound to the old one). Call on every rank, with no exchange
    in flight; the memory is freed once nothing else references it."""
    name = _group_key(group)
    for key in [k for k in _WORKSPACES if k[0] == name]:
        del _WORKSPACES[key]
    _RESERVED.pop(name, None)


def reserve_workspace(group, max_tokens: int) -> None:
    """Fix the per-rank token capacity of ``group``'s workspace before its first use (call on every
    rank with the same value). Without it, the first call all-reduces the largest T of the group once
    (a host synchronisation at setup) and rounds it up to a multiple of 256."""
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError("megamoe.distributed.reserve_workspace: max_tokens must be a positive int, "
                         f"got {max_tokens!r}")
    _RESERVED[_group_key(group)] = max_tokens


def get_workspace(group, *, num_tokens: int, hidden: int, top_k: int, num_experts: int, dtype: torch.dtype,
                  device: torch.device) -> EPWorkspace:
    """The workspace of ``group`` for this layer shape, created on first use.

    Creation is a collective over ``group`` (an all-reduce of the largest T, unless
    :func:`reserve_workspace` fixed it, then symmetric allocation and rendezvous), so it must not happen
    inside CUDA graph capture. The token capacity is ``max(largest T, 4096)`` rounded up to 256. A call
    with T above the capacity grows the workspace, again collectively: fine when every rank sees the
    larger T in the same call (equal T per rank, the usual case); otherwise reserve the capacity up front.
    """
    import torch.distributed._symmetric_memory as symm_mem

    key = _ws_key(group, hidden, top_k, num_experts, dtype)
    W = dist.get_world_size(group)
    ws = _WORKSPACES.get(key)
    if ws is not None and num_tokens <= ws.spec.max_tokens:
        return ws
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("megamoe EP: the workspace must be created (or grown) before CUDA graph capture; run one "
                           "eager step with the largest token count first")
    check_same_across_ranks(group, "EP workspace", {"hidden": hidden, "top_k": top_k, "num_experts": num_experts,
                                                    "dtype": dtype}, device)
    t_cap = _RESERVED.get(_group_key(group))
    if t_cap is None or num_tokens > t_cap:
        t = torch.tensor([max(num_tokens, 1)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        t_cap = (max(int(t.item()), 4096 if t_cap is None else t_cap) + 255) // 256 * 256
    spec = WorkspaceSpec(W, t_cap, hidden, top_k, num_experts, dtype)
    buf = symm_mem.empty(spec.nbytes, dtype=torch.uint8, device=device)
    buf.zero_()
    torch.cuda.synchronize(device)
    hdl = symm_mem.rendezvous(buf, group if group is not None else dist.group.WORLD)
    rank = dist.get_rank(group)
    own = hdl.buffer_ptrs[rank]
    ptrs = [p + (buf.data_ptr() - own) for p in hdl.buffer_ptrs]  # address rule: peer base + local offset
    ws = EPWorkspace(spec, rank, buf, ptrs, keepalive=hdl)
    dist.barrier(group=group)  # every rank zeroed its flags before anyone signals
    _WORKSPACES[key] = ws
    return ws


# ------------------------------------------------------------------------------- spawned ranks
def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now: the rendezvous (``tcp://127.0.0.1:port``) of ranks started on
    this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(target, rank: int, world: int, port: int, args: tuple, q) -> None:
    try:
        q.put((rank, "ok", target(rank, world, port, *args)))
    except BaseException:  # reported to the parent, then re-raised
        q.put((rank, "err", traceback.format_exc()))
        raise


def run_ranks(target, world: int, *args, timeout_s: float = 1800.0, what: str = "run_ranks") -> list:
    """Run ``target(rank, world, port, *args)`` in ``world`` spawned processes of this machine (``port``: one
    :func:`free_port` for their process group's rendezvous) and return what each returned, in rank order.

    ``target`` and ``args`` must be picklable (a module-level function), the results too. Raises RuntimeError,
    prefixed by ``what``, naming a rank that raised (with its traceback), exited without a result, or did not
    finish within ``timeout_s``; the ranks left are then killed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(target, r, world, port, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(results) < world:
            try:
                rank, status, payload = q.get(timeout=5.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and not p.is_alive()]
                if dead:
                    raise RuntimeError(f"{what}: rank {dead[0]} of {world} exited without a result (exit code "
                                       f"{procs[dead[0]].exitcode})") from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(world) if r not in results]
                    raise RuntimeError(f"{what}: ranks {missing} of {world} did not finish within {timeout_s} s") \
                        from None
                continue
            if status != "ok":
                raise RuntimeError(f"{what}: rank {rank} of {world} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=60 if len(results) == world else 1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world)]
