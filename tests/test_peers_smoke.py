"""benchmarks/peers.py (issue 44: our verify op against FlashMLA and FlashInfer): its --smoke run end to end on the
FFI's CPU handler, and the pieces the GPU run relies on that a CPU can check (the shared slot layout, the plan, the
derived columns, the XLA baseline taken from earlier results). Correctness only: nothing here looks at a timing."""

import json
import os
import sys
import time

import jax
import numpy as np
import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import peers  # noqa: E402
from kdtree_jax.ops import ffi as vffi  # noqa: E402

pytestmark = pytest.mark.skipif(not vffi.available(), reason="the compiled extension is not built")


def test_peers_smoke(tmp_path):
    out = tmp_path / "p"
    assert peers.main(["--smoke", "--out", str(out)]) == 0
    data = json.loads((tmp_path / "p.json").read_text())
    meta, rows = data["meta"], data["rows"]
    for key in ("date", "device", "commit", "jax", "plan", "peers", "mask", "slots", "timing"):
        assert key in meta, key
    assert meta["plan"] == "smoke" and "causal" in meta["mask"]
    assert [(r["B"], r["H"], r["T"], r["L"]) for r in rows] == [(1, 2, 3, 256)]
    row = rows[0]
    ours = row["ours"]
    assert ours["us"] > 0 and ours["loop_us"] > 0 and ours["num_splits"] >= 1
    if jax.default_backend() == "cpu":  # no CUDA-event harness: the headline is the XLA program's span
        assert ours["us_from"] == "span" and ours["us"] == ours["span_us"]
    # Each peer ran or says why not (here: no PyTorch with a CUDA device), in one line, in the meta and the row.
    for name in ("flashmla", "flashinfer"):
        info = meta["peers"][name]
        if info["error"]:
            assert row[name]["unavailable"] and row[name]["error"] == info["error"] and "\n" not in info["error"]
        else:
            assert row[name]["us"] > 0
    # Outputs checked: ours against the float32 reference (the row is small), and against every peer that ran.
    checks = row["checks"]
    assert checks["ours_vs_reference"]["ok"] and checks["ours_vs_reference"]["lse"]["ok"] and checks["agree"]
    # The XLA baseline (verify_kernel.xla_row: dense and chunked, the faster by device time) and the derived columns.
    xla = row["xla"]
    assert xla["xla_us"] == min(xla["xla_dense_us"], xla["xla_chunked_us"]) and xla["xla_loop_us"] > 0
    assert row["speedup"]["xla"] == pytest.approx(xla["xla_us"] / ours["us"])
    assert row["tbps"]["ours"] == pytest.approx(256 * 1152 / (ours["us"] * 1e-6) / 1e12)
    assert row["targets"]["need"] == 1.1 and "vs_xla_2x" not in row["targets"]  # L < 64k: no XLA target
    md = (tmp_path / "p.md").read_text()
    assert md.startswith("# Verify attention against FlashMLA and FlashInfer")
    assert "causal set" in md and "\n| 1 | 2 | 3 | 256 |" in md and "## Ours in a loop" in md


def test_shared_slot_layout():
    """Our kv_slots are the page table expanded: every slot of the layer once, each 64-position page contiguous, so
    FlashMLA's block table (the pages), FlashInfer's kv_indices and our kv_slots (the slots) address the same rows."""
    pages = np.asarray(peers.make_pages(2, 512))
    slots = np.asarray(peers.slots_of(peers.make_pages(2, 512)))
    assert pages.shape == (2, 8) and slots.shape == (2, 512)
    assert sorted(slots.ravel().tolist()) == list(range(2 * 512))
    assert (slots.reshape(2, 8, 64) == pages[:, :, None] * 64 + np.arange(64)).all()
    assert not (pages.ravel() == np.arange(16)).all()  # scattered


def test_plans_and_calls():
    grid = peers.grid_plan()
    assert len(grid) == len(set(grid)) == 2 * 3 * 5 * 4
    assert {(b, h, t, length) for b, h, t, length in grid} == {
        (b, h, t, length) for b in peers.BS for h in peers.HS for t in peers.TS for length in peers.LS}
    assert grid[0] == (1, 8, 1, 65536) and set(peers.key_plan()) <= set(grid)
    xla = peers.xla_plan(grid)
    assert xla[0][:2] == (1, 8) and all(r[3] >= 65536 for r in xla) and set(xla) <= set(grid)
    # A timed program's layers are at least twice the L2 (an H200's 60 MB), 4 to 20 calls, all on distinct layers.
    l2 = 60 << 20
    assert peers.calls_for(1, 4096, 21, l2) == 20
    assert peers.calls_for(1, 16384, 21, l2) == 7 and 7 * 16384 * 1152 >= 2 * l2
    assert peers.calls_for(8, 131072, 10, l2) == 4
    assert peers.calls_for(1, 4096, 4, l2) == 3  # never more calls than layers - 1
    assert peers.device_tag("NVIDIA H200") == "h200" and peers.device_tag("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"


def test_derive_targets():
    row = dict(B=1, H=8, T=1, L=65536, ours=dict(us=20.0), flashmla=dict(us=25.0), flashinfer=dict(error="x"),
               xla=dict(xla_us=50.0))
    peers.derive(row)
    assert row["speedup"] == {"flashmla": 1.25, "xla": 2.5}
    assert row["targets"] == dict(vs_flashmla=True, vs_flashinfer=None, vs_xla_2x=True, need=1.2)
    row = dict(B=8, H=128, T=16, L=4096, ours=dict(us=100.0), flashmla=dict(us=105.0), flashinfer=dict(us=120.0))
    peers.derive(row)
    assert row["targets"] == dict(vs_flashmla=False, vs_flashinfer=True, need=1.1)
    assert row["tflops"]["ours"] == pytest.approx(2 * 8 * 16 * 128 * 4096 * 1088 / 100e-6 / 1e12)
    assert "✓✗" not in peers.table_row(row) and "| ✗✓ |" in peers.table_row(row)


def test_known_xla(tmp_path):
    """--refs-from takes the bf16 baseline (device µs, `xla_kind`) of scattered rows, from a peers result or a
    verify_kernel one, never a float32 reference or verify_variants' in-loop figures."""
    vk_rows = [dict(B=1, L=65536, T=16, H=8, slots="scattered", xla_us=200.0, xla_kind="dense", xla_dense_us=200.0),
               dict(B=1, L=65536, T=1, H=8, slots="contiguous", xla_us=150.0, xla_kind="dense"),
               dict(B=1, L=65536, T=9, slots="scattered", xla_us=90.0)]  # an older run's float32 reference
    (tmp_path / "vk.json").write_text(json.dumps(dict(meta=dict(commit="abc", date="d"), rows=vk_rows)))
    peer_rows = [dict(B=8, H=16, T=33, L=131072, xla=dict(xla_us=900.0, xla_kind="chunked", xla_from="x, y"))]
    (tmp_path / "pe.json").write_text(json.dumps(dict(meta=dict(commit="def", date="e"), rows=peer_rows)))
    vv = dict(commit="g", date="h", rows=[dict(B=1, T=64, H=8, L=65536, xla_us=380.0, xla_best="dense")])
    (tmp_path / "vv.json").write_text(json.dumps(vv))
    known = peers.known_xla([str(tmp_path / n) for n in ("vk.json", "pe.json", "vv.json")])
    assert set(known) == {(1, 8, 16, 65536), (8, 16, 33, 131072)}
    assert known[(1, 8, 16, 65536)]["xla_us"] == 200.0 and "vk.json (abc, d)" == known[(1, 8, 16, 65536)]["xla_from"]
    assert known[(8, 16, 33, 131072)]["xla_from"] == "x, y"


def test_peers_unavailable_without_torch(monkeypatch):
    """Where PyTorch cannot be imported, both peers say so in one line and nothing else is tried."""
    monkeypatch.setitem(sys.modules, "torch", None)
    tc = peers.Torch()
    assert tc.torch is None and "PyTorch is not importable" in tc.error
    for cls in (peers.FlashMLA, peers.FlashInfer):
        assert cls(tc).error == tc.error


class _FakePeer:
    """A peer on the CPU: numpy attention on the shared data, FlashMLA's way (the page table) or FlashInfer's (the
    slots); `fault` makes its first prepare raise what a faulting kernel raises."""
    faults = {}

    def __init__(self, tc):
        self.tc, self.error, self.version, self.how = tc, None, "fake", "fake"

    def prepare(self, ctx):
        if self.faults.pop(self.name, False):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        batch, num_queries, heads, length = ctx["shape"]
        q = np.asarray(ctx["q"], np.float32)

        def call(layer):
            pool = np.asarray(ctx["pool"][layer], np.float32)
            slots = np.asarray(ctx["slots"]) if self.name == "flashinfer" else \
                (np.asarray(ctx["pages"])[:, :, None] * 64 + np.arange(64)).reshape(batch, length)
            out, lse = [], []
            for b in range(batch):
                k = pool[slots[b]]
                s = np.einsum("thd,ld->thl", q[b], k) * peers.SCALE
                causal = np.arange(length)[None, :] > (length - num_queries + np.arange(num_queries))[:, None]
                s = np.where(causal[:, None, :], -np.inf, s)
                m = s.max(-1, keepdims=True)
                p = np.exp(s - m)
                out.append(np.einsum("thl,ld->thd", p / p.sum(-1, keepdims=True), k[:, :512]))
                lse.append(np.log(p.sum(-1)) + m[..., 0])
            return np.stack(out), np.stack(lse)
        return call, dict(fake=1)


class _FakeMLA(_FakePeer):
    name = "flashmla"


class _FakeInfer(_FakePeer):
    name = "flashinfer"


class _FakeTorch(peers.Torch):
    """No torch: the peers' outputs are numpy arrays, a 'graph' is a plain loop timed on the host."""

    def __init__(self):
        self.torch, self.error = None, None

    def graph_us(self, call, layers, replays=0, reps=5):
        t0 = time.perf_counter()
        for layer in layers:
            call(layer)
        return (time.perf_counter() - t0) / len(layers) * 1e6


def test_peers_flow_fault_and_resume(tmp_path, monkeypatch):
    """Both peers through measure_row on the shared data (page table and slots address the same rows: their outputs
    agree with ours and the reference), then a peer whose kernel faults: the run saves and exits BROKEN_RC, and a
    --resume run goes on after it without running the faulted peer on that row again."""
    monkeypatch.setattr(peers, "Torch", _FakeTorch)
    monkeypatch.setattr(peers, "FlashMLA", _FakeMLA)
    monkeypatch.setattr(peers, "FlashInfer", _FakeInfer)
    real_pool_for_ctx = peers.make_args

    def make_args(kv_pool, kv_slots, batch, heads, num_queries, length):  # the fakes read numpy copies of the data
        args = real_pool_for_ctx(kv_pool, kv_slots, batch, heads, num_queries, length)
        _Ctx.latest = dict(q=args[0], pool=kv_pool, slots=kv_slots, pages=np.asarray(kv_slots)[:, ::64] // 64)
        return args
    monkeypatch.setattr(peers, "make_args", make_args)
    real_measure = peers.measure_row

    def measure_row(row, args, ctx, *rest):
        return real_measure(row, args, dict(ctx, **_Ctx.latest), *rest)
    monkeypatch.setattr(peers, "measure_row", measure_row)
    monkeypatch.setattr(peers, "smoke_plan", lambda: [(1, 2, 3, 256), (1, 2, 1, 128)])
    out = str(tmp_path / "f")
    base = ["--smoke", "--out", out, "--xla", "none", "--in-loop", "none"]
    _FakePeer.faults = {"flashinfer": True}  # FlashInfer faults on the first row
    assert peers.main(base) == peers.BROKEN_RC
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert len(rows) == 1 and "illegal memory access" in rows[0]["flashinfer"]["error"]
    assert rows[0]["flashmla"]["us"] > 0 and "checks" not in rows[0]  # nothing more runs in a broken context
    assert peers.main(base + ["--resume"]) == 0
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert [(r["T"], r["L"]) for r in rows] == [(3, 256), (1, 128)]
    assert "illegal memory access" in rows[0]["flashinfer"]["error"]  # not run again on that row
    second = rows[1]
    assert second["flashmla"]["us"] > 0 and second["flashinfer"]["us"] > 0
    for pair in ("ours_vs_flashmla", "ours_vs_flashinfer", "flashmla_vs_flashinfer", "flashinfer_vs_reference"):
        assert second["checks"][pair]["ok"] and second["checks"][pair]["lse"]["ok"], pair
    assert second["checks"]["agree"] and set(second["speedup"]) == {"flashmla", "flashinfer"}
    assert "## Failures" in (tmp_path / "f.md").read_text()


class _Ctx:
    latest = {}
