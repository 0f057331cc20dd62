"""Shared pieces of the fragment-level kernel emulations (ffi/tools/emulate_wide.py, emulate_ws.py): a
byte-addressed shared memory, bf16 rounding, ldmatrix (plain and .trans) and mma.sync m16n8k16 emulated lane by
lane from their PTX-documented fragment layouts, and one test problem (query rows, KV rows, a tree mask over the
last query positions, a partial last tile) with its float64 attention."""
import numpy as np

kRowBytes = 1168  # the kernels' padded shared-memory row
kKSlice = 144     # Q·Kᵀ dims per score warp
kKSteps = 9


def bf16(x):
    """Round to bf16 (nearest even); returns float32."""
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7fff + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


SM = np.zeros(120000, np.uint8)


def st_bf16(addr, vals):
    v = bf16(np.asarray(vals, np.float32)).view(np.uint32) >> 16
    SM[addr:addr + 2 * len(v)] = np.frombuffer(v.astype(np.uint16).tobytes(), np.uint8)


def ld_bf16(addr, n):
    return (np.frombuffer(SM[addr:addr + 2 * n].tobytes(), np.uint16).astype(np.uint32) << 16).view(np.float32)


def ldmatrix(addrs, trans=False):
    """ldmatrix.x4 from 32 lane addresses: out[lane][matrix] = the lane's two bf16 of that 8x8 matrix."""
    out = np.zeros((32, 4, 2), np.float32)
    for m in range(4):
        M = np.stack([ld_bf16(addrs[8 * m + r], 8) for r in range(8)])  # [row][col]
        for l in range(32):
            out[l, m] = M[l // 4, 2 * (l % 4):2 * (l % 4) + 2] if not trans else [M[2 * (l % 4), l // 4], M[2 * (l % 4) + 1, l // 4]]
    return out


def mma(C, A, B0, B1):
    """D = A·B + C for m16n8k16 from per-lane fragments: C[l][4], A[l][4][2], B0/B1[l][2]."""
    Am = np.zeros((16, 16), np.float32); Bm = np.zeros((16, 8), np.float32); Cm = np.zeros((16, 8), np.float32)
    for l in range(32):
        g, qd = l // 4, l % 4
        Am[g, 2 * qd:2 * qd + 2] = A[l][0]; Am[g + 8, 2 * qd:2 * qd + 2] = A[l][1]
        Am[g, 2 * qd + 8:2 * qd + 10] = A[l][2]; Am[g + 8, 2 * qd + 8:2 * qd + 10] = A[l][3]
        Bm[2 * qd:2 * qd + 2, g] = B0[l]; Bm[2 * qd + 8:2 * qd + 10, g] = B1[l]
        Cm[g, 2 * qd:2 * qd + 2] = C[l][0:2]; Cm[g + 8, 2 * qd:2 * qd + 2] = C[l][2:4]
    D = Am @ Bm + Cm
    out = np.zeros((32, 4), np.float32)
    for l in range(32):
        g, qd = l // 4, l % 4
        out[l, 0:2] = D[g, 2 * qd:2 * qd + 2]; out[l, 2:4] = D[g + 8, 2 * qd:2 * qd + 2]
    return out


class Problem:
    """32 query rows over `positions` KV positions; with `masked`, the last 16 positions are query tokens of 2
    heads under an irregular ancestor mask and kv_len stops 5 short of the last tile's end."""

    def __init__(self, positions, masked=True, seed=0):
        rng = np.random.default_rng(seed)
        self.nq, self.nh = (16, 2) if masked else (0, 1)
        self.valid = positions - 5 if masked else positions
        self.first = self.valid - self.nq
        self.mask_words = max(1, (self.nq + 31) // 32)
        self.tree = np.zeros((max(self.nq, 1), self.mask_words), np.uint32)
        for i in range(self.nq):
            for j in range(i + 1):
                if j == i or (i + j) % 3 != 0:
                    self.tree[i, j // 32] |= np.uint32(1 << (j % 32))
        self.Q = bf16(rng.normal(size=(32, 576)))
        self.KV = bf16(rng.normal(size=(positions, 576)) * 2)
        self.scale = 0.07
        self.scale_log2 = self.scale * 1.4426950408889634

    def visible(self, row, pos):  # the kernel's rule
        if pos >= self.valid:
            return False
        j = pos - self.first
        if j < 0:
            return True
        return bool((int(self.tree[min(row, 31) // self.nh, j // 32]) >> (j % 32)) & 1)

    def mask_row_bits(self, rr, tile_pos, tile):
        """The kernel's masked path for row rr and a tile at tile_pos: (w0, 64 mask bits) or None if unmasked."""
        if not self.nq or tile_pos + tile <= min(self.first, self.valid):
            return None
        j0 = tile_pos - self.first; w0 = max(j0, 0) >> 5; t_row = min(rr, 31) // self.nh
        lo = int(self.tree[t_row, w0]) if w0 < self.mask_words else 0
        hi = int(self.tree[t_row, w0 + 1]) if w0 + 1 < self.mask_words else 0
        return w0, (hi << 32) | lo

    def kernel_visible(self, bits, pos):
        if bits is None:
            return True
        w0, b = bits
        j = pos - self.first
        return pos < self.valid and (j < 0 or ((b >> (j - 32 * w0)) & 1))

    def qfrag(self, ds, lane, mt, ks):
        g, qd = lane // 4, lane % 4
        ra = mt * 16 + g; rb = ra + 8; k0 = ds * kKSlice + ks * 16 + 2 * qd
        Q = self.Q
        return np.array([Q[ra, k0:k0 + 2], Q[rb, k0:k0 + 2], Q[ra, k0 + 8:k0 + 10], Q[rb, k0 + 8:k0 + 10]])

    def check(self, out, lse):
        S = self.Q.astype(np.float64) @ self.KV.T.astype(np.float64) * self.scale
        for r in range(32):
            for pos in range(self.KV.shape[0]):
                if not self.visible(r, pos):
                    S[r, pos] = -np.inf
        ref_lse = np.log(np.exp(S - S.max(1, keepdims=True)).sum(1)) + S.max(1)
        ref = np.exp(S - ref_lse[:, None]) @ self.KV[:, :512]
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        print("out rel err", np.linalg.norm(out - ref) / np.linalg.norm(ref), "lse max err", np.abs(lse - ref_lse).max())


def score_partials(pb, part, ds, lane_addr, col0=0):
    """One score warp's Q·Kᵀ over dim slice ds for 32 rows x 16 positions (9 k-steps, two m16 tiles, two n8
    blocks), its K fragments by ldmatrix from lane_addr(lane, ks); the partials go to part[ds, row, col0 + ...]
    in the kernels' layout."""
    s = np.zeros((2, 2, 32, 4), np.float32)
    for ks in range(kKSteps):
        kb = ldmatrix([lane_addr(l, ks) for l in range(32)])
        for mt in range(2):
            A = [pb.qfrag(ds, l, mt, ks) for l in range(32)]
            s[mt][0] = mma(s[mt][0], A, kb[:, 0], kb[:, 1]); s[mt][1] = mma(s[mt][1], A, kb[:, 2], kb[:, 3])
    for lane in range(32):
        g, qd = lane // 4, lane % 4
        for mt in range(2):
            for nb in range(2):
                col = col0 + nb * 8 + 2 * qd
                part[ds, mt * 16 + g, col:col + 2] = s[mt][nb][lane][0:2]
                part[ds, mt * 16 + g + 8, col:col + 2] = s[mt][nb][lane][2:4]


def rescale(acc_w, f_of_row):
    """acc_w[lane][mt][nb][4] *= the rescale factor of each accumulator's row (f_of_row(row in 0..31))."""
    for lane in range(32):
        g = lane // 4
        for mt in range(2):
            acc_w[lane, mt, :, 0:2] *= f_of_row(mt * 16 + g); acc_w[lane, mt, :, 2:4] *= f_of_row(mt * 16 + g + 8)


def pv_block(acc_w, pa, v_addr, j):
    """O += P·V for the two n8 blocks 2j, 2j + 1 of one warp: V fragments by ldmatrix.trans from v_addr(lane)."""
    vb = ldmatrix([v_addr(l) for l in range(32)], trans=True)
    for mt in range(2):
        acc_w[:, mt, 2 * j] = mma(acc_w[:, mt, 2 * j], pa[mt], vb[:, 0], vb[:, 1])
        acc_w[:, mt, 2 * j + 1] = mma(acc_w[:, mt, 2 * j + 1], pa[mt], vb[:, 2], vb[:, 3])


def normalise(acc, stat_m, stat_l, cols_per_warp):
    """The kernels' epilogue: acc[warp][lane][mt][nb][4] over columns cols_per_warp * warp + 8 nb + 2 qd, rows
    16 mt + g (+ 8), divided by the row sums; returns (out [32, 512], lse [32])."""
    out = np.zeros((32, 512)); lse = np.zeros(32)
    for w in range(acc.shape[0]):
        for lane in range(32):
            g, qd = lane // 4, lane % 4
            for mt in range(2):
                for h in range(2):
                    rl = mt * 16 + g + 8 * h
                    for nb in range(acc.shape[3]):
                        c = w * cols_per_warp + nb * 8 + 2 * qd
                        out[rl, c:c + 2] = acc[w, lane, mt, nb, 2 * h:2 * h + 2] / stat_l[rl]
                    lse[rl] = (stat_m[rl] + np.log2(stat_l[rl])) * np.log(2)
    return out, lse
