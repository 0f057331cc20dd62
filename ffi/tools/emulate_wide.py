"""Fragment-level emulation of verify_attention_wide_kernel (ffi/verify_attention.cu) for one block of 32 query
rows over three 32-position tiles, without a GPU: ldmatrix and mma.sync are emulated lane by lane
(ffi/tools/emulate_mma.py) with the kernel's own lane address formulas (k_lane, v_lane, p_lane, the
partial-score and P layouts), and the result is compared with float64 attention (a tree mask over the last 16
positions, 2 heads, a partial last tile; --no-mask: none).  It checks the index math, not the synchronisation;
it is a transcription, so keep it in step with the kernel.  Prints the relative error of out (bf16 P: ~1e-3)
and of lse.

    python ffi/tools/emulate_wide.py
"""
import sys

import numpy as np

from emulate_mma import Problem, kKSlice, kRowBytes, ldmatrix, normalise, pv_block, rescale, score_partials, st_bf16

kPStride = 40; kPartStride = 40; ntiles = 3; kTile = 32
pb = Problem(ntiles * kTile, masked='--no-mask' not in sys.argv)
kPOff = 95232
part = np.zeros((4, 32, kPartStride), np.float32)
m_run = np.full((8, 32), -np.inf, np.float32); l_run = np.zeros((8, 32), np.float32)  # [warp][lane]
acc = np.zeros((8, 32, 2, 8, 4), np.float32)  # [warp][lane][mt][nb][4]
for t in range(ntiles):
    base = (t % 2) * kTile * kRowBytes
    for r in range(kTile): st_bf16(base + r * kRowBytes, pb.KV[t * kTile + r])
    # QK: warp w = (dim slice w % 4, position half w // 4)
    for warp in range(8):
        ds, ph = warp % 4, warp // 4
        score_partials(pb, part, ds, lambda l, ks: base + ((l % 8) + ((l // 8) // 2) * 8 + ph * 16) * kRowBytes
                       + (ds * kKSlice + ((l // 8) % 2) * 8) * 2 + ks * 32, col0=ph * 16)
    # softmax
    scale_s = np.zeros(32, np.float32)
    for warp in range(8):
        xs = np.zeros((32, 4), np.float32)
        for lane in range(32):
            rr = warp * 4 + lane // 8; pp = (lane % 8) * 4
            xs[lane] = sum(part[sl, rr, pp:pp + 4] for sl in range(4)) * pb.scale_log2
            bits = pb.mask_row_bits(rr, t * kTile, kTile)
            for i in range(4):
                if not pb.kernel_visible(bits, t * kTile + pp + i): xs[lane, i] = -np.inf
        for lane in range(32):
            rr = warp * 4 + lane // 8; pp = (lane % 8) * 4
            tmax = max(xs[(lane // 8) * 8 + i].max() for i in range(8))
            nm = max(m_run[warp, lane], tmax); bse = 0 if nm == -np.inf else nm
            sc = np.exp2(m_run[warp, lane] - bse); m_run[warp, lane] = nm
            x = np.exp2(xs[lane] - bse); l_run[warp, lane] = l_run[warp, lane] * sc + x.sum()
            st_bf16(kPOff + (rr * kPStride + pp) * 2, x)
            if lane % 8 == 0: scale_s[rr] = sc
    # PV
    for warp in range(8):
        rescale(acc[warp], lambda row: scale_s[row])
        for u in range(2):
            pa = [ldmatrix([kPOff + ((l % 8) + ((l // 8) % 2) * 8) * (kPStride * 2) + ((l // 8) // 2) * 16
                            + mt * 16 * kPStride * 2 + u * 32 for l in range(32)]) for mt in range(2)]
            for j in range(4):
                pv_block(acc[warp], pa, lambda l: base + ((l % 8) + ((l // 8) % 2) * 8) * kRowBytes
                         + (warp * 64 + ((l // 8) // 2) * 8) * 2 + u * 16 * kRowBytes + j * 32, j)
# epilogue
stat_m = np.zeros(32); stat_l = np.zeros(32)
for warp in range(8):
    for lane in range(32):
        rr = warp * 4 + lane // 8
        if lane % 8 == 0:
            stat_m[rr] = m_run[warp, lane]; stat_l[rr] = sum(l_run[warp, (lane // 8) * 8 + i] for i in range(8))
out, lse = normalise(acc, stat_m, stat_l, 64)
pb.check(out, lse)
