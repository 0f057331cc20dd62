"""Fragment-level emulation of verify_attention_wide_kernel (ffi/verify_attention.cu) for one block of 32 query
rows over three 32-position tiles, without a GPU: ldmatrix (plain and .trans) and mma.sync m16n8k16 are emulated
lane by lane from their PTX-documented fragment layouts, on a byte-addressed shared memory, with the kernel's own
lane address formulas (k_lane, v_lane, p_lane, the partial-score and P layouts), and the result is compared with
float64 attention (with a tree mask over the last 16 positions, 2 heads, a partial last tile; --no-mask: none).
It checks the index math of a kernel written when no device time was left; it is a
transcription, so keep it in step with the kernel.  Prints the relative error of out (bf16 P: ~1e-3) and of lse.

    python ffi/tools/emulate_wide.py
"""
import numpy as np
rng=np.random.default_rng(0)
kRowBytes=1168; kKSlice=144; kKSteps=9; kPStride=40; kPartStride=40
def bf16(x):  # round to bf16, return float32
    x=np.asarray(x,np.float32); u=x.view(np.uint32).astype(np.uint64)
    u=((u+0x7fff+((u>>16)&1))>>16)<<16
    return u.astype(np.uint32).view(np.float32)
SM=np.zeros(120000,np.uint8)
def st_bf16(addr,vals):
    v=bf16(np.asarray(vals,np.float32)).view(np.uint32)>>16
    SM[addr:addr+2*len(v)]=np.frombuffer(v.astype(np.uint16).tobytes(),np.uint8)
def ld_bf16(addr,n):
    return (np.frombuffer(SM[addr:addr+2*n].tobytes(),np.uint16).astype(np.uint32)<<16).view(np.float32)
def ldmatrix(addrs,trans=False):
    # addrs: 32 lane addresses; returns regs[lane][m] as pairs of floats
    out=np.zeros((32,4,2),np.float32)
    for m in range(4):
        rows=[ld_bf16(addrs[8*m+r],8) for r in range(8)]
        M=np.stack(rows)  # 8x8 [row][col]
        for l in range(32):
            if not trans: out[l,m]=M[l//4,2*(l%4):2*(l%4)+2]
            else: out[l,m]=[M[2*(l%4),l//4],M[2*(l%4)+1,l//4]]
    return out
def mma(C,A,B0,B1):
    # C[l][4], A[l][4][2], B0,B1[l][2] -> per-lane fragments
    Am=np.zeros((16,16),np.float32); Bm=np.zeros((16,8),np.float32); Cm=np.zeros((16,8),np.float32)
    for l in range(32):
        g,qd=l//4,l%4
        Am[g,2*qd:2*qd+2]=A[l][0]; Am[g+8,2*qd:2*qd+2]=A[l][1]; Am[g,2*qd+8:2*qd+10]=A[l][2]; Am[g+8,2*qd+8:2*qd+10]=A[l][3]
        Bm[2*qd:2*qd+2,g]=B0[l]; Bm[2*qd+8:2*qd+10,g]=B1[l]
        Cm[g,2*qd:2*qd+2]=C[l][0:2]; Cm[g+8,2*qd:2*qd+2]=C[l][2:4]
    D=Am@Bm+Cm
    out=np.zeros((32,4),np.float32)
    for l in range(32):
        g,qd=l//4,l%4
        out[l,0:2]=D[g,2*qd:2*qd+2]; out[l,2:4]=D[g+8,2*qd:2*qd+2]
    return out
ntiles=3; kTile=32; scale=0.07; scale_log2=scale*1.4426950408889634
import sys
NQ, NH = (16, 2) if '--no-mask' not in sys.argv else (0, 1)   # query tokens (the last NQ positions), heads
valid = ntiles*kTile - 5 if NQ else ntiles*kTile              # kv_len: the last tile is partial
first = valid - NQ
mask_words = max(1, (NQ + 31)//32)
tree = np.zeros((max(NQ,1), mask_words), np.uint32)
for i in range(NQ):
    for j in range(i+1):
        if j == i or (i + j) % 3 != 0: tree[i, j//32] |= np.uint32(1 << (j % 32))   # an irregular ancestor set
def visible(row, pos):   # the kernel's rule (kdtree::position_visible)
    if pos >= valid: return False
    j = pos - first
    if j < 0: return True
    t = min(row, 31) // NH
    return bool((int(tree[t, j//32]) >> (j % 32)) & 1)
Q=bf16(rng.normal(size=(32,576))); KV=bf16(rng.normal(size=(ntiles*kTile,576))*2)
stage=0; kPOff=95232; kPartOff=74752
part=np.zeros((4,32,kPartStride),np.float32)
m_run=np.full((8,32),-np.inf,np.float32); l_run=np.zeros((8,32),np.float32)  # [warp][lane]
acc=np.zeros((8,32,2,8,4),np.float32)  # [warp][lane][mt][nb][4]
# Q fragments per warp/lane
def qfrag(warp,lane,mt,ks):
    ds=warp%4; g,qd=lane//4,lane%4
    ra=mt*16+g; rb=ra+8; k0=ds*kKSlice+ks*16+2*qd
    return np.array([Q[ra,k0:k0+2],Q[rb,k0:k0+2],Q[ra,k0+8:k0+10],Q[rb,k0+8:k0+10]])
for t in range(ntiles):
    base=(t%2)*kTile*kRowBytes
    for r in range(kTile): st_bf16(base+r*kRowBytes, KV[t*kTile+r])
    # QK
    for warp in range(8):
        ds,ph=warp%4,warp//4
        s=np.zeros((2,2,32,4),np.float32)
        for ks in range(kKSteps):
            addrs=[]
            for lane in range(32):
                mat=lane//8
                k_lane=((lane%8)+(mat//2)*8+ph*16)*kRowBytes+(ds*kKSlice+(mat%2)*8)*2
                addrs.append(base+k_lane+ks*32)
            kb=ldmatrix(addrs)
            for mt in range(2):
                A=[qfrag(warp,l,mt,ks) for l in range(32)]
                s[mt][0]=mma(s[mt][0],A,kb[:,0],kb[:,1]); s[mt][1]=mma(s[mt][1],A,kb[:,2],kb[:,3])
        for lane in range(32):
            g,qd=lane//4,lane%4
            for mt in range(2):
                for nb in range(2):
                    col=ph*16+nb*8+2*qd
                    part[ds,mt*16+g,col:col+2]=s[mt][nb][lane][0:2]; part[ds,mt*16+g+8,col:col+2]=s[mt][nb][lane][2:4]
    # softmax
    scale_s=np.zeros(32,np.float32)
    for warp in range(8):
        xs=np.zeros((32,4),np.float32)
        for lane in range(32):
            rr=warp*4+lane//8; pp=(lane%8)*4
            xs[lane]=sum(part[sl,rr,pp:pp+4] for sl in range(4))*scale_log2
            tile_pos=t*kTile
            if NQ and tile_pos+kTile > min(first, valid):   # the kernel's masked path, word arithmetic included
                j0=tile_pos-first; w0=max(j0,0)>>5; t_row=min(rr,31)//NH
                lo=int(tree[t_row,w0]) if w0 < mask_words else 0; hi=int(tree[t_row,w0+1]) if w0+1 < mask_words else 0
                bits=(hi<<32)|lo
                for i in range(4):
                    pos=tile_pos+pp+i; j=pos-first
                    vis = pos < valid and (j < 0 or ((bits >> (j - 32*w0)) & 1))
                    if not vis: xs[lane,i]=-np.inf
        for lane in range(32):
            rr=warp*4+lane//8; pp=(lane%8)*4
            grp=[ (lane//8)*8+i for i in range(8)]
            tmax=max(xs[o].max() for o in grp)
            nm=max(m_run[warp,lane],tmax); bse=0 if nm==-np.inf else nm
            sc=np.exp2(m_run[warp,lane]-bse); m_run[warp,lane]=nm
            x=np.exp2(xs[lane]-bse); l_run[warp,lane]=l_run[warp,lane]*sc+x.sum()
            st_bf16(kPOff+(rr*kPStride+pp)*2,x)
            if lane%8==0: scale_s[rr]=sc
    # PV
    for warp in range(8):
        for lane in range(32):
            g=lane//4
            f=[[scale_s[g],scale_s[g+8]],[scale_s[16+g],scale_s[24+g]]]
            for mt in range(2):
                acc[warp,lane,mt,:,0:2]*=f[mt][0]; acc[warp,lane,mt,:,2:4]*=f[mt][1]
        for u in range(2):
            pa=[]
            for mt in range(2):
                addrs=[kPOff+((l%8)+((l//8)%2)*8)*(kPStride*2)+((l//8)//2)*16+mt*16*kPStride*2+u*32 for l in range(32)]
                pa.append(ldmatrix(addrs))
            for j in range(4):
                addrs=[base+((l%8)+((l//8)%2)*8)*kRowBytes+(warp*64+((l//8)//2)*8)*2+u*16*kRowBytes+j*32 for l in range(32)]
                vb=ldmatrix(addrs,trans=True)
                for mt in range(2):
                    A=[pa[mt][l] for l in range(32)]
                    acc[warp,:,mt,2*j]=mma(acc[warp,:,mt,2*j],A,vb[:,0],vb[:,1])
                    acc[warp,:,mt,2*j+1]=mma(acc[warp,:,mt,2*j+1],A,vb[:,2],vb[:,3])
# epilogue
stat_m=np.zeros(32); stat_l=np.zeros(32)
for warp in range(8):
    for lane in range(32):
        rr=warp*4+lane//8
        if lane%8==0:
            stat_m[rr]=m_run[warp,lane]; stat_l[rr]=sum(l_run[warp,(lane//8)*8+i] for i in range(8))
out=np.zeros((32,512)); lse=np.zeros(32)
for warp in range(8):
    for lane in range(32):
        g,qd=lane//4,lane%4
        for mt in range(2):
            for h in range(2):
                rl=mt*16+g+8*h
                inv=1/stat_l[rl]
                for nb in range(8):
                    out[rl,warp*64+nb*8+2*qd:warp*64+nb*8+2*qd+2]=acc[warp,lane,mt,nb,2*h:2*h+2]*inv
                lse[rl]=(stat_m[rl]+np.log2(stat_l[rl]))*np.log(2)
S=Q.astype(np.float64)@KV.T.astype(np.float64)*scale
for r in range(32):
    for pos in range(ntiles*kTile):
        if not visible(r,pos): S[r,pos]=-np.inf
ref_lse=np.log(np.exp(S-S.max(1,keepdims=True)).sum(1))+S.max(1)
P=np.exp(S-ref_lse[:,None]); ref=P@KV[:,:512]
assert np.isfinite(out).all() and np.isfinite(lse).all()
print("out rel err", np.linalg.norm(out-ref)/np.linalg.norm(ref), "lse max err", np.abs(lse-ref_lse).max())
