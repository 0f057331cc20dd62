"""Fragment-level emulation of the decode kernel (ffi/verify_attention.cu, verify_attention_decode_kernel) on a
CPU: the kernel's own shared-memory layout and ldmatrix lane addresses, mma.sync m16n8k16 lane by lane, the
transposed scores S^T = K·Q^T, the per-warp online softmax, P through the warp's buffer, O^T += V^T·P^T and the
block's combine of its warps, against float64 attention. Index errors (a swapped matrix, a wrong row of a
fragment) give errors of order 1; bf16 rounding gives ~1e-3.

    python ffi/tools/emulate_decode.py
"""
import numpy as np

from emulate_mma import SM, bf16, ldmatrix, mma, st_bf16

kRowBytes, kTile, kRows, kWarps = 1168, 16, 8, 4
kStageBytes = kTile * kRowBytes
kQOff = kWarps * kStageBytes
kPStride = 48
kPOff = kQOff + kRows * kRowBytes
kPBytes = kRows * kPStride


def emulate(rows, num_heads, num_queries, positions, valid, tree, scale, seed):
    rng = np.random.default_rng(seed)
    Q = bf16(rng.normal(size=(rows, 576)))
    KV = bf16(rng.normal(size=(positions, 576)) * 2)
    first = valid - num_queries
    scale_log2 = scale * 1.4426950408889634

    def visible(row, pos):
        if pos >= valid:
            return False
        j = pos - first
        return j < 0 or bool((int(tree[min(row, rows - 1) // num_heads, j // 32]) >> (j % 32)) & 1)

    SM[:] = 0
    for r in range(kRows):  # Q rows, zeros past the last
        st_bf16(kQOff + r * kRowBytes, Q[r] if r < rows else np.zeros(576))
    num_tiles = (valid + kTile - 1) // kTile
    state = []
    for warp in range(kWarps):
        stage = warp * kStageBytes
        p_smem = kPOff + warp * kPBytes
        acc = np.zeros((32, 32, 4), np.float32)  # [lane][m16 tile of dims][4]
        row_max = np.full((32, 2), -np.inf); row_sum = np.zeros((32, 2))
        lanes = np.arange(32)
        k_lane = [stage + ((l % 8) + ((l // 8) % 2) * 8) * kRowBytes + (l // 16) * 16 for l in lanes]
        q_lane = [kQOff + (l % 8) * kRowBytes + (l // 8) * 16 for l in lanes]
        v_lane = [stage + ((l % 8) + (l // 16) * 8) * kRowBytes + ((l // 8) % 2) * 16 for l in lanes]
        pb_lane = [p_smem + (l % 8) * kPStride + ((l // 8) % 2) * 16 for l in lanes]
        for tile in range(warp, num_tiles, kWarps):
            for r in range(kTile):  # the tile's copy (zeros past valid)
                pos = tile * kTile + r
                st_bf16(stage + r * kRowBytes, KV[pos] if pos < valid else np.zeros(576))
            s4 = np.zeros((4, 32, 4), np.float32)
            for ks in range(0, 36, 2):
                qb = ldmatrix([a + ks * 32 for a in q_lane])
                ka = ldmatrix([a + ks * 32 for a in k_lane])
                kb = ldmatrix([a + (ks + 1) * 32 for a in k_lane])
                s4[ks % 4] = mma(s4[ks % 4], ka, qb[:, 0], qb[:, 1])
                s4[(ks + 1) % 4] = mma(s4[(ks + 1) % 4], kb, qb[:, 2], qb[:, 3])
            s = (s4.sum(0) * scale_log2).astype(np.float64)  # [lane][e]
            tile_pos = tile * kTile
            for l in lanes:
                g, qd = l // 4, l % 4
                for e in range(4):
                    pos, row = tile_pos + g + (e // 2) * 8, 2 * qd + e % 2
                    if tile_pos + kTile > min(first, valid) and not visible(row, pos):
                        s[l, e] = -np.inf
            scale_f = np.zeros((32, 2))
            for h in range(2):
                tmax = np.maximum(s[:, h], s[:, h + 2])
                for l in lanes:  # the max over the 8 lanes of a qd (xor 4, 8, 16)
                    tmax[l] = max(tmax[m] for m in lanes if m % 4 == l % 4)
                new_max = np.maximum(row_max[:, h], tmax)
                base = np.where(new_max == -np.inf, 0, new_max)
                scale_f[:, h] = np.exp2(row_max[:, h] - base)
                row_max[:, h] = new_max
                s[:, h] = np.exp2(s[:, h] - base); s[:, h + 2] = np.exp2(s[:, h + 2] - base)
                row_sum[:, h] = row_sum[:, h] * scale_f[:, h] + s[:, h] + s[:, h + 2]
            acc[:, :, 0] *= scale_f[:, 0:1]; acc[:, :, 1] *= scale_f[:, 1:2]
            acc[:, :, 2] *= scale_f[:, 0:1]; acc[:, :, 3] *= scale_f[:, 1:2]
            for l in lanes:
                g, qd = l // 4, l % 4
                for e in range(4):
                    row, pos = 2 * qd + e % 2, g + (e // 2) * 8
                    st_bf16(p_smem + row * kPStride + pos * 2, [s[l, e]])
            pb = ldmatrix(pb_lane)  # x2: matrices 0 and 1
            for t in range(32):
                va = ldmatrix([a + t * 32 for a in v_lane], trans=True)
                acc[:, t] = mma(acc[:, t], va, pb[:, 0], pb[:, 1])
        for h in range(2):
            for l in lanes:
                row_sum[l, h] = sum(row_sum[m, h] for m in lanes if m % 4 == l % 4)
        O = np.zeros((kRows, 512)); stat_m = np.zeros(kRows); stat_l = np.zeros(kRows)
        for l in lanes:
            g, qd = l // 4, l % 4
            for t in range(32):
                d = t * 16 + g
                O[2 * qd, d], O[2 * qd + 1, d], O[2 * qd, d + 8], O[2 * qd + 1, d + 8] = acc[l, t]
            if g == 0:
                stat_m[2 * qd], stat_m[2 * qd + 1] = row_max[l]
                stat_l[2 * qd], stat_l[2 * qd + 1] = row_sum[l]
        state.append((O, stat_m, stat_l))
    out = np.zeros((rows, 512)); lse = np.zeros(rows)
    for row in range(rows):  # the block's combine
        m = max(st[1][row] for st in state)
        w = [0.0 if m == -np.inf else np.exp2(st[1][row] - m) for st in state]
        total = sum(wi * st[2][row] for wi, st in zip(w, state))
        out[row] = sum(wi * st[0][row] for wi, st in zip(w, state)) / total
        lse[row] = (m + np.log2(total)) * np.log(2)
    S = Q.astype(np.float64) @ KV.T.astype(np.float64) * scale
    for r in range(rows):
        for pos in range(positions):
            if not visible(r, pos):
                S[r, pos] = -np.inf
    ref_lse = np.log(np.exp(S - S.max(1, keepdims=True)).sum(1)) + S.max(1)
    ref = np.exp(S - ref_lse[:, None]) @ KV[:, :512].astype(np.float64)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    print(f"rows {rows} (T {num_queries} x H {num_heads}), {valid} of {positions} positions: out rel err {err:.2e}, "
          f"lse max err {np.abs(lse - ref_lse).max():.2e}")
    assert err < 1e-2 and np.abs(lse - ref_lse).max() < 1e-2
    return err


def main():
    one = np.ones((1, 1), np.uint32)
    emulate(8, 8, 1, 150, 147, one, 0.07, 0)   # T = 1, H = 8: 10 tiles over the 4 warps, a partial last tile
    tree = np.zeros((4, 1), np.uint32)         # T = 4, H = 2: an irregular ancestor mask over the last 4 positions
    for i in range(4):
        for j in range(i + 1):
            if j == i or (i + j) % 3:
                tree[i, 0] |= np.uint32(1 << j)
    emulate(8, 2, 4, 90, 83, tree, 0.05, 1)
    emulate(3, 1, 3, 40, 40, np.array([[1], [3], [5]], np.uint32), 0.06, 2)  # 3 rows: padding rows and a warp with no tile


if __name__ == "__main__":
    main()
