#!/usr/bin/env python3
"""emulate_fp8_mma_layout -- the index arithmetic of k_f8mma (src/kernels/cuda/cuda_gemv_f8mma.cu)
in numpy, checked against x . (w * scale)^T (and the gate|up SwiGLU form) in float64.

Each lane's loads, the A/B fragments it hands to mma.sync m16n8k16 (placed where PTX's fragment
layout puts them: A rows g / g + 8, columns 2t, 2t + 1 / + 8; B rows 2t, 2t + 1 / + 8, column g;
C rows g / g + 8, columns 2t, 2t + 1), the per-chunk block scales, the split-K sum of the SK
warps of a tile in split order and the epilogue's stores (MODE 0 rows, MODE 1 SwiGLU of the
gate|up pair, MODE 2 the q|k|v RoPE pairs and v rows before bias/RoPE, which test_backend_ops'
test_fp8_mma_qkv checks on the GPU) are emulated for several shapes, tile
counts a warp (MT) and splits (SK), with partial tiles, partial 64-column chunks and 128 x 128
scale blocks.  It checks the kernel's layout without a GPU (the hardware's rounding is not
emulated: values are float64); exit status 1 on a mismatch or an output written twice / never.
Usage: python3 tools/emulate_fp8_mma_layout.py
"""
import sys

import numpy as np

rng = np.random.default_rng(1)
FM_WARPS, FM_LD = 8, 4

QA = {}  # MODE 2: nh, nkv, hd


def fm_row(MODE, p, r, N):
    if MODE == 0: return min(16*p + r, N-1)
    if MODE == 1:
        o = min(8*p + (r & 7), N-1)
        return o if r < 8 else N + o
    nh, nkv, hd = QA['nh'], QA['nkv'], QA['hd']
    hq = hd // 16; nr = (nh + nkv)*hq
    if p < nr: return (p // hq)*hd + (p % hq)*8 + (r & 7) + (0 if r < 8 else hd//2)
    return min((nh + nkv)*hd + 16*(p - nr) + r, N-1)

def run(MODE, T, N, K, bn, bk, MT, SK):
    rows = 2*N if MODE == 1 else N
    w = rng.standard_normal((rows, K)).astype(np.float32)
    x = rng.standard_normal((T, K)).astype(np.float32)
    nkb = (K + bk - 1)//bk
    s = (rng.random(((rows + bn - 1)//bn, nkb)) + 0.5).astype(np.float32)
    BS = 1 if bk < K else 0
    NT = 2 if T > 8 else 1
    U = FM_LD // MT
    n_tiles = (N + 15)//16 if MODE == 0 else (N + 7)//8 if MODE == 1 else \
        (QA['nh'] + QA['nkv'])*(QA['hd']//16) + QA['nkv']*QA['hd']//16
    K16 = K//16; CH = (K16 + 3)//4
    lenc = (CH + SK - 1)//SK
    tpc = FM_WARPS//SK*MT
    grid = (n_tiles + tpc - 1)//tpc
    y = np.full((T, N), np.nan)
    written = np.zeros((T, N), int)
    for bx in range(grid):
        accs = {}
        for wi in range(FM_WARPS):
            p0 = (bx*(FM_WARPS//SK) + wi//SK)*MT; sp = wi % SK
            c_lo = sp*lenc; c_hi = min(CH, c_lo + lenc)
            live = p0 < n_tiles
            acc = np.zeros((32, MT, NT, 4))
            if live and c_lo < c_hi:
                for c in range(c_lo, c_hi):
                    for m in range(MT):
                        # per lane registers
                        A = np.zeros((4, 16, 16)); B = np.zeros((NT, 4, 16, 8))
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            i = 4*c + t
                            rlo = fm_row(MODE, p0+m, g, N); rhi = fm_row(MODE, p0+m, g+8, N)
                            wl = w[rlo, 16*i:16*i+16] if i < K16 else np.zeros(16)
                            wh = w[rhi, 16*i:16*i+16] if i < K16 else np.zeros(16)
                            for j in range(4):
                                # a0 = lo elems 0,1 ; a2 = lo elems 2,3 ; a1/a3 from hi row
                                A[j, g, 2*t:2*t+2] = wl[4*j:4*j+2]
                                A[j, g+8, 2*t:2*t+2] = wh[4*j:4*j+2]
                                A[j, g, 2*t+8:2*t+10] = wl[4*j+2:4*j+4]
                                A[j, g+8, 2*t+8:2*t+10] = wh[4*j+2:4*j+4]
                            for n in range(NT):
                                tok = g + 8*n
                                xv = x[tok, 16*i:16*i+16] if (tok < T and i < K16) else np.zeros(16)
                                for j in range(4):
                                    B[n, j, 2*t:2*t+2, g] = xv[4*j:4*j+2]       # b0 = word 2j
                                    B[n, j, 2*t+8:2*t+10, g] = xv[4*j+2:4*j+4]  # b1 = word 2j+1
                        kb = (64*c)//bk if BS else 0
                        for n in range(NT):
                            D = sum(A[j] @ B[n, j] for j in range(4))  # 16 x 8
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                d = [D[g, 2*t], D[g, 2*t+1], D[g+8, 2*t], D[g+8, 2*t+1]]
                                if BS:
                                    rlo = fm_row(MODE, p0+m, g, N); rhi = fm_row(MODE, p0+m, g+8, N)
                                    sl = s[rlo//bn, kb]; sh = s[rhi//bn, kb]
                                    acc[lane, m, n] += [sl*d[0], sl*d[1], sh*d[2], sh*d[3]]
                                else:
                                    acc[lane, m, n] += d
            accs[wi] = (acc, p0, sp, live)
        for wi in range(FM_WARPS):
            acc, p0, sp, live = accs[wi]
            if SK > 1:
                if sp: continue
                acc = sum(accs[wi + q][0] for q in range(SK))
            if not live: continue
            for m in range(MT):
                p = p0 + m
                if p >= n_tiles: break
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    rlo = fm_row(MODE, p, g, N); rhi = fm_row(MODE, p, g+8, N)
                    slo = 1 if BS else s[rlo//bn, 0]; shi = 1 if BS else s[rhi//bn, 0]
                    for n in range(NT):
                        for e in range(2):
                            tok = 8*n + 2*t + e
                            if tok >= T: continue
                            vlo = acc[lane, m, n, e]*slo; vhi = acc[lane, m, n, 2+e]*shi
                            if MODE == 0:
                                olo = 16*p + g; ohi = olo + 8
                                if olo < N: y[tok, olo] = vlo; written[tok, olo] += 1
                                if ohi < N: y[tok, ohi] = vhi; written[tok, ohi] += 1
                            elif MODE == 2:  # the pair (rlo, rhi) before bias and RoPE
                                y[tok, rlo] = vlo; written[tok, rlo] += 1
                                y[tok, rhi] = vhi; written[tok, rhi] += 1
                            else:
                                o = 8*p + g
                                if o < N: y[tok, o] = vlo/(1+np.exp(-vlo))*vhi; written[tok, o] += 1
    # reference
    sfull = np.repeat(np.repeat(s, bn, 0)[:rows], bk, 1)[:, :K]
    wd = w.astype(np.float64)*sfull.astype(np.float64)
    r = x.astype(np.float64) @ wd.T
    if MODE == 1:
        gg, uu = r[:, :N], r[:, N:]
        r = gg/(1+np.exp(-gg))*uu
    err = np.max(np.abs(y - r)/(1 + np.abs(r)))
    ok = err < 1e-9 and (written == 1).all()
    print(f"MODE {MODE} T {T} N {N} K {K} bn {bn} bk {bk} MT {MT} SK {SK}: err {err:.2e} writes ok {(written==1).all()}", "" if ok else "<<<<< FAIL")
    return ok

allok = True
for nh, nkv, hd, T, K, bn, bk, SK in [(6, 2, 16, 3, 272, 1, 272, 2), (4, 2, 32, 9, 336, 128, 128, 4),
                                     (3, 1, 64, 16, 1040, 1, 1040, 8)]:
    QA.update(nh=nh, nkv=nkv, hd=hd)
    allok &= run(2, T, (nh + 2*nkv)*hd, K, bn, bk, 1, SK)
for MODE, T, N, K, bn, bk, MT, SK in [
    (0, 1, 37, 272, 37, 272, 1, 1), (0, 7, 37, 272, 1, 272, 2, 2), (0, 9, 40, 336, 128, 128, 1, 4),
    (0, 16, 50, 1040, 1, 1040, 2, 8), (0, 3, 3, 16, 3, 16, 1, 8), (0, 16, 33, 4112, 128, 128, 2, 4),
    (1, 1, 20, 272, 40, 272, 2, 1), (1, 7, 12, 336, 1, 336, 1, 2), (1, 16, 30, 1040, 128, 128, 2, 8),
    (1, 9, 9, 144, 128, 64, 1, 4),
]:
    allok &= run(MODE, T, N, K, bn, bk, MT, SK)
print("ALL OK" if allok else "SOME FAILED")
sys.exit(0 if allok else 1)
