"""Fragment-level emulation of verify_attention_ws_kernel (ffi/verify_attention.cu), the warp-specialised kernel,
for one block of 32 query rows over seven 16-position tiles (the 4-stage ring wraps), without a GPU: ldmatrix and
mma.sync are emulated lane by lane (ffi/tools/emulate_mma.py) with the kernel's own lane address formulas
(score warps: k_lane, the partial-score layout, the softmax's 4 threads a row, P's double buffer; value warps:
v_lane, p_lane, 128 output dims a warp), compared with float64 attention (a tree mask over the last 16 positions,
2 heads, a partial last tile; --no-mask: none).  The roles run one after the other, tile by tile, so this checks
the index math and the buffer choice, not the named-barrier hand-offs (compute-sanitizer's racecheck and
synccheck do, on a GPU: tests/test_verify_attention_gpu.py).  A transcription: keep it in step with the kernel.

    python ffi/tools/emulate_ws.py
"""
import sys

import numpy as np

from emulate_mma import Problem, kKSlice, kRowBytes, ldmatrix, normalise, pv_block, rescale, score_partials, st_bf16

kTile = 16; kRing = 4; ntiles = 7
kPartStride = 24; kPStride = 24; kPBufBytes = 32 * kPStride * 2
kKvBytes = kRing * kTile * kRowBytes; kPOff = kKvBytes + 4 * 32 * kPartStride * 4
pb = Problem(ntiles * kTile, masked='--no-mask' not in sys.argv)
part = np.zeros((4, 32, kPartStride), np.float32)
m_run = np.full(128, -np.inf, np.float32); l_run = np.zeros(128, np.float32)  # [score thread]
acc = np.zeros((4, 32, 2, 16, 4), np.float32)  # [value warp][lane][mt][nb][4]
scale_s = np.zeros((2, 32), np.float32)
for i in range(ntiles):
    base = (i % kRing) * kTile * kRowBytes  # read_off of tile i (the score warps copied it into stage i % 4)
    for r in range(kTile): st_bf16(base + r * kRowBytes, pb.KV[i * kTile + r])
    buf = i & 1
    # score warps: Q·Kᵀ over dim slice ds = warp, 32 rows x 16 positions
    for ds in range(4):
        score_partials(pb, part, ds, lambda l, ks: base + ((l % 8) + ((l // 8) // 2) * 8) * kRowBytes
                       + (ds * kKSlice + ((l // 8) % 2) * 8) * 2 + ks * 32)
    # score warps: softmax, thread t = row t // 4, positions 4 (t % 4) .. + 3
    xs = np.zeros((128, 4), np.float32)
    for t in range(128):
        rr, pp = t // 4, (t % 4) * 4
        xs[t] = sum(part[sl, rr, pp:pp + 4] for sl in range(4)) * pb.scale_log2
        bits = pb.mask_row_bits(rr, i * kTile, kTile)
        for e in range(4):
            if not pb.kernel_visible(bits, i * kTile + pp + e): xs[t, e] = -np.inf
    for t in range(128):
        rr, pp = t // 4, (t % 4) * 4
        tmax = max(xs[(t // 4) * 4 + o].max() for o in range(4))  # shuffles xor 1, 2
        nm = max(m_run[t], tmax); bse = 0 if nm == -np.inf else nm
        sc = np.exp2(m_run[t] - bse); m_run[t] = nm
        x = np.exp2(xs[t] - bse); l_run[t] = l_run[t] * sc + x.sum()
        st_bf16(kPOff + ((buf * 32 + rr) * kPStride + pp) * 2, x)
        if t % 4 == 0: scale_s[buf, rr] = sc
    # value warps: O += P(i)·V(i) over dims [128 vw, + 128)
    for vw in range(4):
        rescale(acc[vw], lambda row: scale_s[buf, row])
        p_lane = [kPOff + ((l % 8) + ((l // 8) % 2) * 8) * (kPStride * 2) + ((l // 8) // 2) * 16 for l in range(32)]
        pa = [ldmatrix([a + buf * kPBufBytes + mt * 16 * (kPStride * 2) for a in p_lane]) for mt in range(2)]
        for j in range(8):
            pv_block(acc[vw], pa, lambda l: base + ((l % 8) + ((l // 8) % 2) * 8) * kRowBytes
                     + (vw * 128 + ((l // 8) // 2) * 8) * 2 + j * 32, j)
# epilogue: the score threads' quads give each row's max and sum; value warps normalise their columns
stat_m = np.zeros(32); stat_l = np.zeros(32)
for t in range(0, 128, 4):
    stat_m[t // 4] = m_run[t]; stat_l[t // 4] = l_run[t:t + 4].sum()
out, lse = normalise(acc, stat_m, stat_l, 128)
pb.check(out, lse)
