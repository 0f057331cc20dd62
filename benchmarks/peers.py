"""Our verify-attention op against the kernels a user would pick instead, on one GPU, on the same data (issue 44).

    python benchmarks/peers.py [--plan grid|key] [--deadline-s S] [--resume] [--out benchmarks/results/peers_h200]
    python benchmarks/peers.py --smoke     # the script's whole path on a CPU in seconds (temp dir): our op through
                                           # the FFI's CPU handler against XLA, the peers reported as unavailable

Kernels, per row (B in {1, 8} x H in {8, 16, 128} x T in {1, 9, 16, 33, 64} x L in {4k, 16k, 64k, 128k}; --plan key:
the rows issue 44 quotes, first):
  * ours: `kdtree_jax.ops.ffi.verify_attention_ffi` (variant auto: the Hopper wgmma kernel on an H200), page size 1,
    its tree mask set to the chain's (causal) mask;
  * FlashMLA: the `sgl-flash-mla` wheel's frozen legacy extension, SM90 dense MLA decoding
    (`torch.ops.flash_mla_legacy.dense_decode_fwd`), page size 64, causal; its split schedule (tile scheduler
    metadata) is computed once per row outside the timing, as a model computes it once per step for all layers;
  * FlashInfer: `flashinfer.mla.BatchMLAPagedAttentionWrapper(backend="fa3")`, page size 1, causal, planned once per
    row outside the timing (a model plans once per step), natural-log lse requested as ours and FlashMLA return it;
  * the fair XLA baseline: `kdtree_jax/ops/xla.py` (bf16 rows gathered from the pool, einsums with float32
    accumulation, float32 softmax), dense and chunked over L, the faster by device time, timed by
    benchmarks/verify_kernel.py's own `xla_row` (on the rows of --xla-plan; its compiles and autotuning take
    ~20 s a shape, so it runs after every kernel row, while the deadline allows; --refs-from takes the baseline of
    rows an earlier peers or verify_kernel result measured).
The peers have no tree mask: they are compared on the causal set, which equals our tree mask for a chain (query i sees
the prefix and query tokens 0..i; kv_lens = L includes the T query tokens, the last T positions, as our contract
says; FlashMLA's and FlashInfer's causal masks are aligned to the end of the KV sequence, the same set).

Same data: one latent pool [layers, B*L, 576] bf16 per (B, L) (verify_kernel.make_pool: random normal, enough
layers that a timed program's calls all read different layers), shared with PyTorch through DLPack without a copy:
FlashMLA reads a layer as [B*L/64, 64, 1, 576] pages, FlashInfer as [B*L, 1, 576] pages of one row, we as
[B*L, 576] rows. The slot table is page-scattered: each sequence's positions are 64-position pages in a random
order (slot = page * 64 + offset), so that all three address the same rows: FlashMLA's block table is the page
list, FlashInfer's kv_indices and our kv_slots are the slots. q [B, T, H, 576] (FlashInfer: the same memory as
[B*T, H, 576]), softmax scale 192^-0.5 (K2's), kv_lens = L for every sequence.

Timing (no host launch in any number; device time a call):
  * ours (`us`, the headline): the benchmark target's CUDA-event harness (kdtree_jax._kernel_bench, as
    verify_variants.py times the kernel for the current results): a CUDA graph of 20 calls of the op's kernels (the
    main kernel and the split merge, at the op's own split count) on consecutive layers of its own ~512 MB pool
    (uniform random bf16, token-scattered slots: page size 1's worst case), CUDA events around its replay / 20; the
    same method as the peers';
  * ours on the row's own data (`span_us`, on --span's rows: --plan key's by default, ~2 s a row): one jitted XLA
    program of k calls, each on its own layer, all outputs returned, XLA's default command buffers making it one CUDA
    graph; its first kernel's start to its last kernel's end from CUPTI's device timestamps / k
    (verify_kernel.device_per_call): the op as a model calls it, a check of the headline;
  * FlashMLA, FlashInfer: a torch CUDA graph of k calls on k layers of the shared pool, replayed n times between two
    CUDA events recorded behind a ~1 ms device spin (so the host has queued the replays before the first event
    runs), elapsed / (n * k), median of 5.
  k: enough calls that one graph's layers together are at least twice the L2 (so no call finds its layer there), 4
  to 20. Where --in-loop says (the L = 4k, T = 16 rows by default: issue 44's in-loop target), also our op's in-loop
  µs (n calls inside one jitted fori_loop, each on the layer the previous call's lse picks: verify_kernel.loop_per_call)
  and the empty loop's.
Checks on every row (layer 0): ours, FlashMLA's and FlashInfer's outputs against each other (max |a - b| and that
over max |b|), and lse; on the rows with at most --ref-max-scores B*T*H*L scores, against the float32-HIGHEST
reference (kdtree_jax/ops/reference.py) too.
Columns: each kernel's µs, peer µs / ours (> 1: ours faster), ours / XLA, TB/s (KV bytes B*L*1152 / time) and
TFLOP/s (2*B*T*H*L*(576+512) / time) of each kernel, the agreement, and issue 44's targets (T >= 9: >= 1.1x both
peers; T = 1: >= 1.2x both; >= 2x XLA at L >= 64k) met or missed per row.

A peer that fails to import, plan or run is recorded with its error (per row where it fails there) and the grid goes
on. A kernel fault that breaks the process's CUDA context (an illegal memory access, ...) is recorded on its row, the
results are saved and the script exits 3; `--resume` (gpu_peers.sh reruns it) goes on without running what faulted
on that row again. A peer whose CUDA graph capture fails has no figure on the row (its error says so, with its
plain-launch time beside as a diagnosis: that one can hold host launch costs). Results are rewritten after every row (a run cut short by --deadline-s keeps its rows; --resume measures only
what is missing), one file per device: benchmarks/results/peers_<device>.{md,json}, stamped with the date, the
device and the commit (kdtree_jax.provenance).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import sys
import tempfile
import time
import traceback

if __name__ == "__main__" and "--smoke" not in sys.argv:  # JAX and PyTorch share the GPU: JAX takes memory as it
    # needs it, not 75% of it up front (set before JAX starts its backend; an importer sets it itself)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import verify_kernel as vk  # noqa: E402  -- the data layout, the op, the XLA baseline and the timing helpers

from kdtree_jax.ops import ffi as vffi  # noqa: E402
from kdtree_jax.ops.masks import causal_mask  # noqa: E402
from kdtree_jax.ops.reference import verify_attention_reference  # noqa: E402
from kdtree_jax.provenance import git_commit, smoke_dir  # noqa: E402

WIDTH, LATENT, ROPE = vk.WIDTH, vk.LATENT, vk.WIDTH - vk.LATENT
SCALE = vk.SCALE
ROW_BYTES = vk.ROW_BYTES
PAGE = 64                          # FlashMLA's page size; our slot table is scattered in pages of this size
BS, HS, TS, LS = [1, 8], [8, 16, 128], [1, 9, 16, 33, 64], [4096, 16384, 65536, 131072]
L2_BYTES = 60 << 20                # an H200's L2 (the GPU's own figure replaces it when torch reads it)
MIN_CALLS, MAX_CALLS = 4, 20
REF_MAX_SCORES = 1 << 24           # the float32 reference on rows with at most this many B*T*H*L scores
PEER_NAMES = ("flashmla", "flashinfer")
LABELS = {"ours": "ours", "flashmla": "FlashMLA", "flashinfer": "FlashInfer", "xla": "XLA"}
AGREE_REL = 2e-2                   # outputs agree when max |a - b| <= this x max |b| (bf16 outputs: 2^-8 a rounding)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def short(e: BaseException, n: int = 300) -> str:
    return f"{type(e).__name__}: {str(e).strip()}"[:n]


STICKY = ("illegal memory access", "unspecified launch failure", "misaligned address", "device-side assert",
          "illegal instruction", "CUDA_ERROR_ILLEGAL", "CUDA_ERROR_LAUNCH_FAILED")
BROKEN_RC = 3  # the process's CUDA context is broken: gpu_peers.sh starts the script again with --resume


class BrokenContext(RuntimeError):
    """A kernel faulted: the CUDA context is unusable for the rest of this process (the row keeps the error, so a
    --resume run skips what faulted)."""


def check_sticky(e: BaseException) -> None:
    if any(s in str(e) for s in STICKY):
        raise BrokenContext(short(e)) from e


# ---- the plan

def grid_plan():
    """Every row of issue 44's grid, grouped by (B, L) so that one pool serves 15 rows, the groups ordered so that a
    run cut short keeps the rows the issue quotes most (B = 1 at 64k first, B = 8 at 128k last)."""
    groups = [(1, 65536), (1, 4096), (1, 131072), (1, 16384), (8, 65536), (8, 16384), (8, 4096), (8, 131072)]
    return [(b, h, t, length) for b, length in groups for h in HS for t in TS]


def key_plan():
    """The rows issue 44's measurements quote (a quick device call), as (B, H, T, L): B = 1, H = 8 at 4k / 64k / 128k,
    T = 1 / 16 / 64; H = 128, T = 1 at 64k; H = 16, T = 9 / 33 at 64k; B = 8, H = 8, T = 16 at 64k."""
    rows = [(1, 8, t, length) for length in (65536, 4096, 131072) for t in (1, 16, 64)]
    rows += [(1, 128, 1, 65536), (1, 16, 9, 65536), (1, 16, 33, 65536), (8, 8, 16, 65536)]
    return rows


def smoke_plan():
    """One tiny row (T = 3: the chain's mask is more than the diagonal; four 64-position pages)."""
    return [(1, 2, 3, 256)]


def xla_plan(plan):
    """Rows of `plan` that get the XLA baseline measured (after all kernel rows, while the deadline allows): issue
    44's XLA target is at L >= 64k for every T <= 64; B = 1, H = 8 first (the rows verify_variants quotes), then
    H = 16, then B = 8, H = 8; T = 1, 16, 64 before 9, 33."""
    in_plan = set(plan)
    return [(b, h, t, length) for b, h in ((1, 8), (1, 16), (8, 8)) for length in (65536, 131072)
            for t in (1, 16, 64, 9, 33) if (b, h, t, length) in in_plan]


# ---- data

def make_pool(batch, length):
    """verify_kernel's pool: [layers, B*L, 576] bf16, random normal, enough layers for distinct calls."""
    return vk.make_pool(jax.random.PRNGKey(length + 7 * batch), batch, length)


def calls_for(batch, length, num_layers, l2_bytes) -> int:
    """Calls a timed program makes (each on its own layer): their layers together at least twice the L2."""
    layer_bytes = batch * length * ROW_BYTES
    return int(min(num_layers - 1, MAX_CALLS, max(MIN_CALLS, math.ceil(2 * l2_bytes / layer_bytes))))


def make_pages(batch, length):
    """[B, L/64] int32: each sequence's pages, all B*L/64 pages of a layer in a random order (seeded by (B, L))."""
    num_pages = batch * length // PAGE
    return jax.random.permutation(jax.random.PRNGKey(3 * length + batch), num_pages).astype(jnp.int32).reshape(
        batch, length // PAGE)


def slots_of(pages):
    """The slot of each position from the page table: page * 64 + offset."""
    batch, num_pages = pages.shape
    return (pages[:, :, None] * PAGE + jnp.arange(PAGE, dtype=jnp.int32)[None, None, :]).reshape(batch, num_pages * PAGE)


def make_args(kv_pool, kv_slots, batch, heads, num_queries, length):
    """(q, kv_pool, kv_slots, kv_lens, tree_mask): q random normal bf16, kv_lens = L, the chain's (causal) mask."""
    q = jax.random.normal(jax.random.PRNGKey(length + 31 * num_queries + 977 * heads + batch),
                          (batch, num_queries, heads, WIDTH), jnp.bfloat16)
    kv_lens = jnp.full((batch,), length, jnp.int32)
    return q, kv_pool, kv_slots, kv_lens, causal_mask(batch, num_queries)


def kv_bytes(b, length):
    return b * length * ROW_BYTES


def flops(b, t, h, length):
    return 2.0 * b * t * h * length * (WIDTH + LATENT)


# ---- PyTorch side: the peers

class Torch:
    """PyTorch, when it and a CUDA device are there (the peers run on it); `error` says why not otherwise."""

    def __init__(self):
        self.torch, self.error = None, None
        try:
            import torch
        except Exception as e:  # noqa: BLE001
            self.error = f"PyTorch is not importable ({short(e, 120)})"
            return
        if not torch.cuda.is_available():
            self.error = f"PyTorch {torch.__version__} sees no CUDA device"
            return
        self.torch = torch

    def sync(self) -> None:
        if self.torch is not None:
            self.torch.cuda.synchronize()

    def from_jax(self, x):
        """A torch view of a JAX GPU array (DLPack, no copy), after the array is ready."""
        torch = self.torch
        jax.block_until_ready(x)
        try:
            return torch.utils.dlpack.from_dlpack(x.__dlpack__())
        except Exception:  # noqa: BLE001 -- an older or newer exchange: let torch ask for it
            return torch.from_dlpack(x)

    def graph_us(self, call, layers, replays: int = 0, reps: int = 5) -> float:
        """µs a call of call(layer) over `layers`: one CUDA graph of the calls, replayed `replays` times between two
        CUDA events recorded behind a device spin (the host has queued the replays by the time the first event
        runs), elapsed / (replays * calls), median of `reps`."""
        torch = self.torch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture (lazy initialisation, the peers' workspaces)
            for _ in range(2):
                for layer in layers:
                    call(layer)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: what JAX's own threads do meanwhile (event polls) cannot invalidate this capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outs = [call(layer) for layer in layers]
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        once = time.perf_counter() - t0
        if not replays:  # about 20 ms of replays, 2 to 50
            replays = int(min(50, max(2, 0.02 / max(once, 1e-6))))
        spin = getattr(torch.cuda, "_sleep", None)
        times = []
        for _ in range(reps):
            if spin is not None:
                spin(2_000_000)  # ~1 ms of device time at ~2 GHz
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / (replays * len(layers)))
        del graph, outs
        return float(np.median(times))

    def eager_us(self, call, layers, reps: int = 5) -> float:
        """µs a call with plain launches (no graph) between CUDA events behind a device spin: where a capture failed,
        a diagnosis only (the host's launch cost can be in it: never the row's figure)."""
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        spin = getattr(torch.cuda, "_sleep", None)
        times = []
        for _ in range(reps):
            if spin is not None:
                spin(2_000_000)
            start.record()
            for layer in layers:
                call(layer)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(layers))
        return float(np.median(times))


class FlashMLA:
    """sgl-flash-mla's legacy SM90 dense decoding (page 64, causal)."""
    name = "flashmla"

    def __init__(self, tc: Torch):
        self.tc, self.error, self.version, self.how = tc, None, None, None
        if tc.torch is None:
            self.error = tc.error
            return
        torch = tc.torch
        try:
            major, minor = torch.cuda.get_device_capability()
            if (major, minor) != (9, 0):
                raise RuntimeError(f"its dense decoding kernels are SM90-only; this GPU is sm_{major}{minor}")
            import importlib.util
            spec = importlib.util.find_spec("flash_mla")
            if spec is None:
                raise ImportError("no module named flash_mla (the sgl-flash-mla wheel: .whl/, benchmarks/peers_wheels.py)")
            folder = os.path.dirname(spec.origin)
            with open(os.path.join(folder, "VERSION")) as f:
                self.version = f.read().strip()
            try:  # the whole wheel: its own loader registers both extensions
                import flash_mla  # noqa: F401
                self.how = "flash_mla (its loader)"
            except ImportError as e:  # the slim wheel (no SM100 extension): load the legacy one ourselves
                legacy = sorted(p for p in os.listdir(folder) if p.startswith("_C_legacy") and p.endswith(".so"))
                if not legacy:
                    raise ImportError(f"flash_mla has no legacy (SM90) extension in {folder}") from e
                torch.ops.load_library(os.path.join(folder, legacy[0]))
                self.how = f"torch.ops.load_library({legacy[0]}) (flash_mla's loader: {short(e, 100)})"
            self.op = torch.ops.flash_mla_legacy.dense_decode_fwd
        except Exception as e:  # noqa: BLE001
            self.error = short(e)

    def prepare(self, ctx):
        """call(layer) -> (out [B, T, H, 512], lse [B, T, H]) on ctx's data; the split schedule computed here."""
        torch = self.tc.torch
        q, pages, (batch, _, _, length) = ctx["q_t"], ctx["pages_t"], ctx["shape"]
        seqlens = torch.full((batch,), length, dtype=torch.int32, device=q.device)
        caches = [ctx["pool_t"][i].view(-1, PAGE, 1, WIDTH) for i in range(ctx["pool_t"].shape[0])]
        _, _, meta, splits = self.op(q, caches[0], LATENT, seqlens, pages, SCALE, True, None, None)
        torch.cuda.synchronize()

        def call(layer):
            out, lse, _, _ = self.op(q, caches[layer], LATENT, seqlens, pages, SCALE, True, meta, splits)
            return out, lse.transpose(1, 2)
        return call, dict(sm_parts=int(meta.shape[0]))


class FlashInfer:
    """FlashInfer's BatchMLAPagedAttentionWrapper, backend fa3 (page 1, causal)."""
    name = "flashinfer"

    def __init__(self, tc: Torch):
        self.tc, self.error, self.version = tc, None, None
        if tc.torch is None:
            self.error = tc.error
            return
        torch = tc.torch
        try:
            import flashinfer
            from flashinfer.mla import BatchMLAPagedAttentionWrapper
            self.version = flashinfer.__version__
            self.wrapper_cls = BatchMLAPagedAttentionWrapper
            self.metadata_cls = getattr(flashinfer.mla, "MLAPlanMetadata", None)
            # its docs start at 128 MiB; the grid's largest rows (B = 8, T = 64, H = 128) split into many partials
            self.workspace = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        except Exception as e:  # noqa: BLE001
            self.error = short(e)

    def prepare(self, ctx):
        torch = self.tc.torch
        q, slots, (batch, num_queries, heads, length) = ctx["q_t"], ctx["slots_t"], ctx["shape"]
        dev = q.device
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * num_queries
        kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * length
        kv_indices = slots.reshape(-1).contiguous()
        kv_len = torch.full((batch,), length, dtype=torch.int32, device=dev)
        wrapper = self.wrapper_cls(self.workspace, use_cuda_graph=True, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                                   kv_indices=kv_indices, kv_len_arr=kv_len, backend="fa3")
        common = dict(num_heads=heads, head_dim_ckv=LATENT, head_dim_kpe=ROPE, page_size=1, causal=True,
                      sm_scale=SCALE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        if self.metadata_cls is not None:  # 0.7: the canonical metadata form, packed q and KV
            wrapper.plan(metadata=self.metadata_cls.csr(qo_indptr.cpu(), kv_indptr.cpu(), kv_indices.cpu(),
                                                        kv_len.cpu()), lse_mode="basee", **common)
            query = q.view(batch * num_queries, heads, WIDTH)
            caches = [ctx["pool_t"][i].view(-1, 1, WIDTH) for i in range(ctx["pool_t"].shape[0])]

            def run(layer):
                return wrapper.run(query=query, kv_cache=caches[layer], return_lse=True, return_lse_base_on_e=True)
        else:  # older releases: flat CSR metadata, split q and KV (views of the same memory)
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, **common)
            flat = q.view(batch * num_queries, heads, WIDTH)
            q_nope, q_pe = flat[..., :LATENT], flat[..., LATENT:]
            caches = [(ctx["pool_t"][i].view(-1, 1, WIDTH)[..., :LATENT], ctx["pool_t"][i].view(-1, 1, WIDTH)[..., LATENT:])
                      for i in range(ctx["pool_t"].shape[0])]

            def run(layer):
                out, lse = wrapper.run(q_nope, q_pe, *caches[layer], return_lse=True)
                return out, lse * math.log(2.0)  # base 2 there

        def call(layer):
            out, lse = run(layer)
            return out.view(batch, num_queries, heads, LATENT), lse.view(batch, num_queries, heads)
        return call, dict(wrapper=wrapper)


# ---- our op and the checks

def ours_row(args, shape, num_layers, calls, span: bool, in_loop: bool, events: bool) -> dict:
    """Our op on the row. `us` (the headline): the benchmark target's CUDA-event time over a CUDA graph (events, on a
    GPU), else the k-call XLA program's CUPTI span on the row's own data (span_us: also measured where `span`);
    in-loop µs and the empty loop's where `in_loop`."""
    batch, num_queries, heads, length = shape
    op = vk.kernel_op("auto")
    splits, rows_per_block = vk.variant_splits(batch, num_queries, heads, length, "auto")
    out = dict(num_splits=splits, rows_per_block=rows_per_block,
               variant=vffi.resolve_variant("auto", num_queries * heads))
    if events:
        try:
            ev = vk.device_timing(batch, num_queries, heads, length, True, splits, "auto")
            out.update(events_plain_us=ev["device_us"], events_graph_us=ev["device_graph_us"],
                       events_main_us=ev["device_main_us"], events_merge_us=ev["device_merge_us"])
        except Exception as e:  # noqa: BLE001
            out["events_error"] = short(e)
    if span or out.get("events_graph_us") is None:
        timed = vk.device_per_call(vk.unrolled(op, num_layers), args, calls, reps=3, warm_s=0.05)
        main_us, merge_us = vk.split_main_merge(timed["kernels"])
        out.update(span_us=timed["us"], span_wall_us=timed["wall_us"], span_main_us=main_us, span_merge_us=merge_us,
                   kernels_per_call=timed["kernels_per_call"], span_compile_s=round(timed["compile_s"], 2))
    out["us"] = out.get("events_graph_us") or out.get("span_us")
    out["us_from"] = "events" if out.get("events_graph_us") else "span"
    if in_loop:
        try:
            out["loop_us"], _ = vk.loop_per_call(op, num_layers, args, vk.loop_iters(out["us"]))
            out["empty_loop_us"], _ = vk.loop_per_call(None, num_layers, args, 64)
        except Exception as e:  # noqa: BLE001
            out["loop_error"] = short(e)
    return out


@functools.cache
def _layer0(kind, rope):
    if kind == "ours":
        op = vk.kernel_op("auto")
    else:
        op = functools.partial(verify_attention_reference, softmax_scale=SCALE, rope_dim=rope)
    return jax.jit(lambda q, pool, slots, lens, mask: op(q, pool, jnp.int32(0), slots, lens, mask))


def diff(a, b, xp) -> dict:
    """max |a - b| and that over max |b| (float32), for outputs; NaN anywhere counts as a disagreement."""
    a, b = xp.f32(a), xp.f32(b)
    d = xp.max(xp.abs(a - b))
    scale = xp.max(xp.abs(b))
    ok = bool(np.isfinite(d)) and d <= AGREE_REL * max(scale, 1e-6)
    return dict(max_abs=d, rel=d / max(scale, 1e-30), ok=ok)


def lse_diff(a, b, xp) -> dict:
    """max |a - b| of two lse arrays [B, T, H] where b is finite."""
    a, b = xp.f32(a), xp.f32(b)
    d = xp.max(xp.where(xp.isfinite(b), xp.abs(a - b), 0.0))
    return dict(max_abs=d, ok=bool(np.isfinite(d)) and d <= 1e-2)


class NumpyXP:
    """The few array functions `diff` uses, on numpy arrays (a CPU run)."""

    @staticmethod
    def f32(x):
        return np.asarray(x).astype(np.float32)

    @staticmethod
    def max(x):
        return float(np.max(x)) if x.size else 0.0

    abs, isfinite, where = staticmethod(np.abs), staticmethod(np.isfinite), staticmethod(np.where)


class TorchXP:
    """The same on torch tensors (the checks run on the GPU, where the outputs are)."""

    def __init__(self, torch):
        self.t = torch

    def f32(self, x):
        return x.float()

    def max(self, x):
        return float(self.t.max(x).item()) if x.numel() else 0.0

    def abs(self, x):
        return self.t.abs(x)

    def isfinite(self, x):
        return self.t.isfinite(x)

    def where(self, c, a, b):
        return self.t.where(c, a, self.t.full_like(a, b))


# ---- one row

def measure_row(row, args, ctx, num_layers, calls, peers, tc, opts) -> None:
    """Fills `row` (a dict) with what it lacks of ours and each peer, then the checks among the outputs this call
    made; a part's failure is recorded, not raised, except a fault that breaks the CUDA context (BrokenContext, raised
    after the row records it)."""
    shape = (row["B"], row["T"], row["H"], row["L"])
    part_s = row.setdefault("part_s", {})  # where a row's seconds go (host time: compiles, plans, captures, checks)
    t_part = time.perf_counter()
    if "ours" not in row or ("error" in row["ours"] and not row["ours"].get("fatal")):
        try:
            row["ours"] = ours_row(args, shape, num_layers, calls, opts["span"](row), opts["in_loop"](row),
                                   opts["events"])
            o = row["ours"]
            log(f"  ours: {o['us']:.1f} µs (CUDA events {fmt(o.get('events_graph_us'), '.1f')}, XLA-program span "
                f"{fmt(o.get('span_us'), '.1f')}, in-loop {fmt(o.get('loop_us'), '.1f')}), {o['num_splits']} splits")
        except Exception as e:  # noqa: BLE001
            row["ours"] = dict(error=short(e), fatal=any(x in str(e) for x in STICKY))
            log(f"  ours failed: {row['ours']['error']}")
            check_sticky(e)
    outs = {}
    try:  # ready before the peers run: nothing of ours may overlap their timing
        outs["ours"] = jax.block_until_ready(_layer0("ours", ROPE)(*args))
    except Exception as e:  # noqa: BLE001
        row.setdefault("checks", {})["ours_error"] = short(e)
        check_sticky(e)
    part_s["ours"] = round(time.perf_counter() - t_part, 2)
    for peer in peers:
        t_part = time.perf_counter()
        if peer.error:
            row[peer.name] = dict(error=peer.error, unavailable=True)
            continue
        if peer.name in row and not row[peer.name].get("unavailable"):
            continue  # measured (or failed) in an earlier call
        try:
            call, info = peer.prepare(ctx)
            extra = {k: v for k, v in info.items() if isinstance(v, (int, float, str))}
            try:
                us = tc.graph_us(call, list(range(calls)))
            except Exception as e:  # noqa: BLE001 -- no graph: plain launches timed for a diagnosis, no figure
                check_sticky(e)
                tc.sync()
                extra.update(graph_error=short(e, 400), eager_us=tc.eager_us(call, list(range(calls))))
                us = None
            outs[peer.name] = call(0)
            row[peer.name] = dict(us=us, **extra)
            if us is None:
                row[peer.name]["error"] = "no CUDA graph: " + extra["graph_error"]
            log(f"  {LABELS[peer.name]}: {fmt(us, '.1f')} µs" + (f" (capture failed: {extra['graph_error']}; plain "
                f"launches {extra['eager_us']:.1f} µs)" if us is None else ""))
            tc.sync()
        except Exception as e:  # noqa: BLE001 -- a peer that rejects a shape or fails: recorded, the grid goes on
            row[peer.name] = dict(error=short(e, 500))
            log(f"  {LABELS[peer.name]} failed: {row[peer.name]['error']}")
            if opts.get("traceback"):
                traceback.print_exc()
            check_sticky(e)
            try:
                tc.sync()
            except Exception as e2:  # noqa: BLE001 -- the failure broke the context after all
                check_sticky(e2)
                raise
        finally:
            part_s[peer.name] = round(time.perf_counter() - t_part, 2)
    t_part = time.perf_counter()
    try:
        row["checks"] = dict(row.get("checks", {}), **check_outputs(row, args, outs, tc, opts["ref_max_scores"]))
    except Exception as e:  # noqa: BLE001
        row["checks"] = dict(row.get("checks", {}), error=short(e), agree=None)
        log(f"  checks failed: {row['checks']['error']}")
        check_sticky(e)
    part_s["checks"] = round(time.perf_counter() - t_part, 2)
    if tc.torch is not None:
        tc.torch.cuda.empty_cache()


def check_outputs(row, args, outs, tc, ref_max_scores) -> dict:
    """Pairwise agreement of the kernels' outputs (layer 0), and against the float32 reference on small rows."""
    checks = {}
    b, t, h, length = row["B"], row["T"], row["H"], row["L"]
    if b * t * h * length <= ref_max_scores:
        try:
            outs["reference"] = _layer0("reference", ROPE)(*args)
        except Exception as e:  # noqa: BLE001
            checks["reference_error"] = short(e)
    if tc.torch is not None:
        conv = {k: tuple(tc.from_jax(x) if isinstance(x, jax.Array) else x for x in v) for k, v in outs.items()}
        xp = TorchXP(tc.torch)
    else:
        conv = {k: tuple(np.asarray(x) for x in v) for k, v in outs.items()}
        xp = NumpyXP
    names = [n for n in ("ours", "flashmla", "flashinfer", "reference") if n in conv]
    for i, a in enumerate(names):
        for bname in names[i + 1:]:
            key = f"{a}_vs_{bname}"
            try:
                checks[key] = diff(conv[a][0], conv[bname][0], xp)
                checks[key]["lse"] = lse_diff(conv[a][1], conv[bname][1], xp)
                if "flashmla" in (a, bname):  # its lse's base is not documented: both readings kept
                    other, fm = (conv[bname][1], conv[a][1]) if a == "flashmla" else (conv[a][1], conv[bname][1])
                    checks[key]["lse_if_flashmla_log2"] = lse_diff(other, fm * math.log(2.0), xp)
            except Exception as e:  # noqa: BLE001
                checks[key] = dict(error=short(e))
    checks["agree"] = all(v.get("ok", False) for k, v in checks.items() if isinstance(v, dict) and "_vs_" in k)
    return checks


# ---- derived columns, targets

def derive(row) -> None:
    """Speed-ups (peer µs / ours: > 1 means ours is faster), TB/s, TFLOP/s, issue 44's targets per row."""
    b, t, h, length = row["B"], row["T"], row["H"], row["L"]
    ours = (row.get("ours") or {}).get("us")
    times = {n: (row.get(n) or {}).get("us") for n in ("ours", *PEER_NAMES)}
    times["xla"] = (row.get("xla") or {}).get("xla_us")
    row["tbps"] = {n: kv_bytes(b, length) / (us * 1e-6) / 1e12 for n, us in times.items() if us}
    row["tflops"] = {n: flops(b, t, h, length) / (us * 1e-6) / 1e12 for n, us in times.items() if us}
    row["speedup"] = {n: times[n] / ours for n in (*PEER_NAMES, "xla") if ours and times.get(n)}
    need = 1.2 if t == 1 else 1.1
    targets = {f"vs_{p}": (row["speedup"][p] >= need) if p in row["speedup"] else None for p in PEER_NAMES}
    if length >= 65536:
        targets["vs_xla_2x"] = (row["speedup"]["xla"] >= 2.0) if "xla" in row["speedup"] else None
    row["targets"] = dict(targets, need=need)


# ---- results

def fmt(x, spec):
    return vk.fmt(x, spec)


def write_results(path, meta, rows):
    with open(path + ".json.tmp", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    os.replace(path + ".json.tmp", path + ".json")
    peers = meta.get("peers", {})
    lines = [f"# Verify attention against FlashMLA and FlashInfer on {meta['device']}", "",
             f"Date {meta['date']}, commit `{meta['commit']}`, jax {meta['jax']}, torch {meta.get('torch') or '–'}, "
             f"plan `{meta['plan']}`. Generated by `benchmarks/peers.py` (issue 44).", "",
             "Peers: " + "; ".join(
                 f"{LABELS[n]} " + (f"{p['version']} ({p['what']})" if not p.get("error") else f"unavailable: {p['error']}")
                 for n, p in peers.items()) + ".", "",
             "**The peers take no tree mask: every row compares the three kernels on the causal set, which equals our "
             "tree mask for a chain** (query i sees the prefix and query tokens 0..i; kv_lens = L includes the T "
             "query tokens). Same data for all three: one bf16 latent pool per (B, L), shared through DLPack, the "
             "slots page-scattered (64-position pages in a random order: FlashMLA's block table; FlashInfer's "
             "kv_indices and our kv_slots, page size 1, the same slots); q random normal, softmax scale 192^-0.5.", "",
             "µs: device time a call, no host launch in any number. Ours (the headline): the benchmark target's "
             "CUDA-event harness, a CUDA graph of 20 calls of the op's kernels at its own split count on its own "
             "~512 MB pool (token-scattered slots), events around the replay / 20 (as verify_variants times it). "
             "Ours span (on some rows): the op on this row's data, k calls (each on its own layer, k layers together "
             "≥ 2× L2) in one XLA program (a CUDA graph), first kernel start to last kernel end from CUPTI / k. "
             "Peers: a torch CUDA graph of k calls on k layers of the shared pool, replayed between two CUDA events "
             "/ calls, median of 5; FlashMLA's split schedule and FlashInfer's plan made once per row outside the "
             "timing (once per step in a model, for every layer). "
             "× columns: the peer's (or XLA's) µs over ours: > 1 means ours is faster. TB/s: KV bytes (B·L·1152) / "
             "time; TFLOP/s: 2·B·T·H·L·1088 / time. XLA: kdtree_jax/ops/xla.py, the faster of dense and chunked, "
             "timed by verify_kernel.xla_row (measured on the rows of the XLA plan, or taken from --refs-from with "
             "the origin in the JSON). Agree: every pair of outputs (and the float32 reference where run) within "
             f"{AGREE_REL:g} × max |out| (max abs differences in the JSON). Targets (issue 44): T ≥ 9: ≥ 1.1× both "
             "peers; T = 1: ≥ 1.2× both; L ≥ 64k: ≥ 2× XLA; ✓ met, ✗ missed, – not measured.", ""]
    if meta.get("resumed_from"):
        lines += [f"Rows measured over several calls (`--resume`): earlier ones at {meta['resumed_from']}.", ""]
    summary = target_summary(rows)
    if summary:
        lines += ["Targets: " + summary + ".", ""]
    lines += ["| B | H | T | L | ours µs | ours span µs | FlashMLA µs | FlashInfer µs | XLA µs | × FlashMLA | × FlashInfer | "
              "× XLA | ours TB/s | ours TFLOP/s | FlashMLA TB/s | FlashMLA TFLOP/s | FlashInfer TB/s | FlashInfer TFLOP/s "
              "| splits | agree | targets |",
              "|" + "---|" * 21]
    for r in sorted(rows, key=lambda r: (r["B"], r["H"], r["L"], r["T"])):
        lines.append(table_row(r))
    looped = [r for r in rows if (r.get("ours") or {}).get("loop_us") is not None]
    if looped:
        lines += ["", "## Ours in a loop", "",
                  "n calls inside one jitted `fori_loop`, each on the layer the previous call's lse picks, whole outputs "
                  "carried (verify_kernel.loop_per_call): wall time / n, which includes the loop's own cost (the empty "
                  "loop's, beside). Issue 44's in-loop target: 4k, T = 16, ≤ 15 µs.", "",
                  "| B | H | T | L | device µs | in-loop µs | empty loop µs |", "|---|---|---|---|---|---|---|"]
        for r in sorted(looped, key=lambda r: (r["B"], r["H"], r["L"], r["T"])):
            o = r["ours"]
            lines.append(f"| {r['B']} | {r['H']} | {r['T']} | {r['L']} | {fmt(o.get('us'), '.1f')} | "
                         f"{fmt(o.get('loop_us'), '.1f')} | {fmt(o.get('empty_loop_us'), '.1f')} |")
    notes = [(r, n, (r.get(n) or {}).get("error")) for r in rows for n in ("ours", *PEER_NAMES)]
    notes += [(r, "row", r.get("error")) for r in rows]
    notes += [(r, "xla", (r.get("xla") or {}).get("xla_error")) for r in rows]
    errors = {}
    for r, n, e in notes:
        if e and not (r.get(n) or {}).get("unavailable"):
            errors.setdefault((n, e), []).append(f"{r['B']}/{r['H']}/{r['T']}/{r['L']}")
    if errors:
        lines += ["", "## Failures (B/H/T/L)", ""]
        lines += [f"- {LABELS.get(n, 'the row')}: {e} ({', '.join(where[:12])}{' ...' if len(where) > 12 else ''})"
                  for (n, e), where in errors.items()]
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def mark(v):
    return "–" if v is None else ("✓" if v else "✗")


def table_row(r) -> str:
    o, fm, fi, x = (r.get(n) or {} for n in ("ours", "flashmla", "flashinfer", "xla"))
    sp, tb, tf = r.get("speedup", {}), r.get("tbps", {}), r.get("tflops", {})
    tg = r.get("targets", {})
    checks = r.get("checks", {})
    agree = "–" if not any("_vs_" in k for k in checks) else ("yes" if checks.get("agree") else "**no**")
    return (f"| {r['B']} | {r['H']} | {r['T']} | {r['L']} | {fmt(o.get('us'), '.1f')} | "
            f"{fmt(o.get('span_us'), '.1f')} | {fmt(fm.get('us'), '.1f')} | {fmt(fi.get('us'), '.1f')} | "
            f"{fmt(x.get('xla_us'), '.1f')} | {fmt(sp.get('flashmla'), '.2f')} | {fmt(sp.get('flashinfer'), '.2f')} | "
            f"{fmt(sp.get('xla'), '.2f')} | {fmt(tb.get('ours'), '.2f')} | {fmt(tf.get('ours'), '.0f')} | "
            f"{fmt(tb.get('flashmla'), '.2f')} | {fmt(tf.get('flashmla'), '.0f')} | {fmt(tb.get('flashinfer'), '.2f')} | "
            f"{fmt(tf.get('flashinfer'), '.0f')} | {fmt(o.get('num_splits'), 'd')} | {agree} | "
            f"{mark(tg.get('vs_flashmla'))}{mark(tg.get('vs_flashinfer'))}"
            f"{mark(tg.get('vs_xla_2x')) if 'vs_xla_2x' in tg else ''} |")


def target_summary(rows) -> str:
    parts = []
    for key, label in (("vs_flashmla", "vs FlashMLA"), ("vs_flashinfer", "vs FlashInfer"), ("vs_xla_2x", "2× XLA")):
        vals = [r["targets"][key] for r in rows if r.get("targets", {}).get(key) is not None]
        if vals:
            parts.append(f"{label} met on {sum(vals)} of {len(vals)} rows")
    return "; ".join(parts)


def device_tag(device: str) -> str:
    """"NVIDIA H200" -> "h200": the results file's device part, as the other results name theirs."""
    tag = "".join(c if c.isalnum() else "_" for c in device.lower().replace("nvidia", "").strip()).strip("_")
    return tag or "gpu"


def row_key(r):
    return (int(r["B"]), int(r["H"]), int(r["T"]), int(r["L"]))


def known_xla(paths):
    """Row key -> the XLA baseline columns of earlier results: a peers JSON (its rows' `xla`) or a verify_kernel
    JSON (rows with the bf16 baseline, `xla_kind`, device µs; its scattered rows only). verify_variants' XLA columns
    are in-loop µs, another figure: not taken."""
    out = {}
    for path in paths or []:
        with open(path) as f:
            data = json.load(f)
        meta = data.get("meta") or {k: data.get(k) for k in ("commit", "date", "device")}
        origin = f"{os.path.basename(path)} ({meta.get('commit')}, {meta.get('date')})"
        for r in data.get("rows", []):
            x = r.get("xla") if isinstance(r.get("xla"), dict) else r
            if x.get("xla_us") is None or r.get("slots", "scattered") != "scattered":
                continue
            if not x.get("xla_kind"):
                continue  # an older run's float32 reference, or an in-loop figure (verify_variants): not this column
            key = (int(r["B"]), int(r.get("H", 8)), int(r["T"]), int(r["L"]))
            entry = {k: v for k, v in x.items() if k.startswith("xla_")}
            out[key] = dict(entry, xla_from=x.get("xla_from", origin))
    return out


# ---- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", choices=["grid", "key"], default="grid",
                        help="grid: every row of issue 44's grid (default); key: the rows its measurements quote "
                             "(key_plan), a quick call")
    parser.add_argument("--out", default=None, help="results path without extension (default: "
                        "OUT_DIR/peers_<device>; --smoke: a new temporary directory)")
    parser.add_argument("--out-dir", default=None, help="where the default --out goes: peers_<device>.{md,json} "
                        "(default benchmarks/results; --smoke: a new temporary directory; gpu_peers.sh: $OUT)")
    parser.add_argument("--deadline-s", type=float, default=0, help="start no row (and no XLA baseline) after this "
                        "many seconds of the run (0: none); what was measured is written")
    parser.add_argument("--resume", action="store_true", help="keep OUT.json's rows and measure what they lack")
    parser.add_argument("--xla", choices=["plan", "none", "all"], default="plan",
                        help="the XLA baseline on the rows of xla_plan (L >= 64k; after every kernel row), on none, "
                             "or on every row")
    parser.add_argument("--refs-from", nargs="*", metavar="JSON", default=[],
                        help="take the XLA baseline of a row from these earlier results (peers, verify_kernel) "
                             "instead of measuring it")
    parser.add_argument("--in-loop", choices=["none", "target", "4k", "all"], default="target",
                        help="also our op's in-loop µs: on no row, on the L = 4k, T = 16 rows (issue 44's in-loop "
                             "target), on every L = 4k row, on every row")
    parser.add_argument("--span", choices=["none", "key", "all"], default="key",
                        help="also time our op as the k-call XLA program's CUPTI span on the row's own data (a check of "
                             "the CUDA-event headline, ~2 s a row): on no row, on --plan key's rows, on every row")
    parser.add_argument("--no-events", action="store_true", help="skip our kernel's CUDA-event harness figure")
    parser.add_argument("--ref-max-scores", type=int, default=REF_MAX_SCORES,
                        help="the float32 reference check on rows with at most this many B*T*H*L scores")
    parser.add_argument("--peers", default=",".join(PEER_NAMES), help="comma list of peers to run")
    parser.add_argument("--traceback", action="store_true", help="print a failing peer's traceback")
    parser.add_argument("--smoke", action="store_true",
                        help="a check of the script on any backend (seconds on a CPU): one tiny row (B = 1, H = 2, "
                             "T = 3, L = 256) through our op (the FFI's CPU handler on a CPU, in-loop too) against the "
                             "XLA baseline and the float32 reference; the peers where they can run, else one line each "
                             "saying why not; OUT defaults to a new temporary directory")
    args = parser.parse_args(argv)
    if not vffi.available():
        sys.exit("the compiled extension is not built; `pip install -e .` builds it")
    on_gpu = jax.default_backend() == "gpu"
    if not args.smoke and not (on_gpu and vffi.cuda_built()):
        sys.exit("needs a GPU and the extension built with CUDA (--smoke runs anywhere)")
    if args.smoke:
        vk.MAX_WARM_S = 0.0  # verify_kernel's timing helpers: no SM clock to ramp up on a smoke run
    device = jax.devices()[0].device_kind if on_gpu else "cpu"
    if args.out is None:
        if args.smoke and args.out_dir is None:
            args.out = os.path.join(smoke_dir("peers"), "peers_smoke")
            print(f"smoke run: results under {os.path.dirname(args.out)}", flush=True)
        else:
            out_dir = args.out_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
            args.out = os.path.join(out_dir, f"peers_{'smoke' if args.smoke else device_tag(device)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    tc = Torch()
    wanted = [n.strip() for n in args.peers.split(",") if n.strip()]
    peers = [cls(tc) for cls in (FlashMLA, FlashInfer) if cls.name in wanted]
    for p in peers:
        log(f"{LABELS[p.name]}: " + (f"unavailable: {p.error}" if p.error else f"{p.version}"))
    l2 = L2_BYTES
    if tc.torch is not None:
        l2 = int(getattr(tc.torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_BYTES)
    ext = vffi.bench_module() if on_gpu else None
    meta = dict(device=device, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                commit=git_commit(), jax=jax.__version__, torch=getattr(tc.torch, "__version__", None),
                plan="smoke" if args.smoke else args.plan, l2_bytes=l2, sm_count=vffi.sm_count() if on_gpu else None,
                page=PAGE, softmax_scale=SCALE, agree_rel=AGREE_REL,
                mask="causal (the chain's tree mask for ours; causal=True for the peers)",
                slots="page-scattered: 64-position pages in a random order; slot = page * 64 + offset",
                timing=dict(ours="kdtree_jax._kernel_bench: CUDA graph of 20 calls (own pool, token-scattered slots), "
                                 "CUDA events / 20 (`us`, `events_graph_us`)",
                            ours_span="k calls on k layers of the shared pool in one XLA program (a CUDA graph), CUPTI "
                                      "span / k (`span_us`, on --span's rows)",
                            peers="torch CUDA graph of k calls on k layers of the shared pool, CUDA events around "
                                  "replays / calls, median of 5"),
                peers={p.name: dict(version=p.version, error=p.error,
                                    what=("sgl-flash-mla legacy SM90 dense decode, page 64, causal; "
                                          + (p.how or "") if p.name == "flashmla" else
                                          "BatchMLAPagedAttentionWrapper, backend fa3, page 1, causal"))
                       for p in peers},
                env={k: os.environ[k] for k in ("FLASHINFER_DISABLE_JIT", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                                "XLA_FLAGS", "KDTREE_COMMIT") if k in os.environ})
    if ext is not None:
        try:
            meta["copy_gbps"] = ext.bench_copy_gbps(0, 2 << 30, 20)
        except Exception as e:  # noqa: BLE001
            meta["copy_gbps_error"] = short(e)

    plan = smoke_plan() if args.smoke else (grid_plan() if args.plan == "grid" else key_plan())
    rows = []
    if args.resume and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            previous = json.load(f)
        rows = previous["rows"]
        meta["resumed_from"] = f"{previous['meta'].get('date')} (commit `{previous['meta'].get('commit')}`)"
        log(f"resuming: {len(rows)} rows from {args.out}.json")
    by_key = {row_key(r): r for r in rows}
    refs = known_xla(args.refs_from)
    xla_rows = {tuple(r) for r in (plan if args.xla == "all" else xla_plan(plan) if args.xla == "plan" else [])}
    if args.smoke:
        xla_rows = {tuple(plan[0])}
    if args.smoke:
        l2 = 0  # the fewest calls a program (MIN_CALLS): a smoke run checks the code path
    key_rows = set(key_plan())

    def in_loop(r):
        return args.smoke or args.in_loop == "all" or (args.in_loop in ("4k", "target") and r["L"] == 4096
                                                       and (args.in_loop == "4k" or r["T"] == 16))

    opts = dict(in_loop=in_loop, span=lambda r: args.span == "all" or (args.span == "key" and row_key(r) in key_rows),
                events=(ext is not None and not args.no_events), ref_max_scores=args.ref_max_scores,
                traceback=args.traceback)

    def save():
        write_results(args.out, meta, rows)

    def past_deadline():
        return args.deadline_s and time.perf_counter() - T0 > args.deadline_s

    def missing(r):
        """A row an earlier call left without ours (or with ours failed), or without a peer this call has (a peer's
        recorded error on the row is its result: not retried; one unavailable then and available now is run)."""
        return ("ours" not in r or ("error" in r["ours"] and not r["ours"].get("fatal")) or "error" in r
                or any(p.name not in r or (r[p.name].get("unavailable") and p.error is None) for p in peers))

    pools = {}

    def pool_for(batch, length):
        if (batch, length) not in pools:
            pools.clear()
            if tc.torch is not None:
                tc.torch.cuda.empty_cache()
            kv_pool = make_pool(batch, length)
            pages = make_pages(batch, length)
            kv_slots = slots_of(pages)
            ctx = dict(pool_t=tc.from_jax(kv_pool) if tc.torch is not None else None,
                       pages_t=tc.from_jax(pages) if tc.torch is not None else None,
                       slots_t=tc.from_jax(kv_slots) if tc.torch is not None else None)
            pools[(batch, length)] = (kv_pool, kv_slots, ctx)
        return pools[(batch, length)]

    # Pass 1: the kernels, row by row.
    for batch, heads, num_queries, length in plan:
        key = (batch, heads, num_queries, length)
        row = by_key.get(key)
        if row is not None and not missing(row):
            continue
        if past_deadline():
            log(f"deadline ({args.deadline_s:.0f} s): B={batch} H={heads} T={num_queries} L={length} and later rows not run")
            break
        t_row = time.perf_counter()
        log(f"row B={batch} H={heads} T={num_queries} L={length}")
        if row is None:
            row = dict(B=batch, H=heads, T=num_queries, L=length)
            rows.append(row)
            by_key[key] = row
        try:
            kv_pool, kv_slots, pool_ctx = pool_for(batch, length)
            num_layers = kv_pool.shape[0]
            calls = calls_for(batch, length, num_layers, l2)
            run_args = make_args(kv_pool, kv_slots, batch, heads, num_queries, length)
            ctx = dict(pool_ctx, shape=(batch, num_queries, heads, length),
                       q_t=tc.from_jax(run_args[0]) if tc.torch is not None else None)
            row.update(layers=int(num_layers), calls=calls)
            row.pop("error", None)
            measure_row(row, run_args, ctx, num_layers, calls, peers, tc, opts)
        except BrokenContext as e:
            log(f"  a kernel faulted ({e}): the CUDA context is broken; the rows so far are saved, and a --resume run "
                f"(gpu_peers.sh starts one) goes on after what faulted")
            derive(row)
            save()
            return BROKEN_RC
        except Exception as e:  # noqa: BLE001 -- e.g. out of memory making the pool: the row says so, the grid goes on
            row["error"] = short(e, 500)
            log(f"  row failed: {row['error']}")
            if args.traceback:
                traceback.print_exc()
            pools.clear()
        if key in refs and "xla" not in row:
            row["xla"] = refs[key]
        derive(row)
        row["row_s"] = round(time.perf_counter() - t_row, 1)
        log(f"  done in {row['row_s']} s: × FlashMLA {fmt(row['speedup'].get('flashmla'), '.2f')}, × FlashInfer "
            f"{fmt(row['speedup'].get('flashinfer'), '.2f')}, agree {row.get('checks', {}).get('agree')}")
        save()

    # Pass 2: the XLA baseline where the plan asks for it and no earlier result gave it.
    for batch, heads, num_queries, length in [r for r in plan if tuple(r) in xla_rows]:
        row = by_key.get((batch, heads, num_queries, length))
        if row is None or "xla" in row:  # measured, taken from --refs-from, or failed (final)
            continue
        if past_deadline():
            log("deadline: the remaining XLA baselines not run")
            break
        log(f"XLA baseline B={batch} H={heads} T={num_queries} L={length}")
        kv_pool, kv_slots, _ = pool_for(batch, length)
        run_args = make_args(kv_pool, kv_slots, batch, heads, num_queries, length)
        try:
            chunk = 256 if args.smoke else vk.XLA_CHUNK
            row["xla"] = dict(vk.xla_row(run_args, batch, num_queries, heads, length, kv_pool.shape[0], None, chunk,
                                         (row.get("ours") or {}).get("us")),
                              xla_from=f"{meta['commit']}, {meta['date']}")
        except Exception as e:  # noqa: BLE001
            row["xla"] = dict(xla_us=None, xla_error=short(e))
            if any(x in str(e) for x in STICKY):
                derive(row)
                save()
                return BROKEN_RC
        derive(row)
        save()
    pools.clear()
    save()
    print(open(args.out + ".md").read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
