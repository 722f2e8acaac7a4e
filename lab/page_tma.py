"""A page-table INT2 decode tile loop against the engine's row-list kernel (#52 item 1).

The experiment: the swap loop's math (``kernels/triton/decode/loop_swap.py``) with its tiles
read page by page from a page table, the code tiles either by bulk copies (TMA, ``--tma 1``:
host tensor descriptors over the pools viewed as ``[slots, Hkv·d/4]`` bytes, one ``[page,
HP·d/4]`` box per page and tensor) or by pointer loads from the page's base (``--tma 0``). Only
the INT2 tier is read (the 16-bit lists are empty on both sides); the partial states go through
the product's merge kernel. Both sides run the same pools, page tables and queries, ``--layers``
copies of the pools in turn from one CUDA graph (so the reads come from HBM, not L2); the output
is checked against the product kernel's.

    python lab/page_tma.py --shapes 8x4096,1x65536,32x16384 [--stages 2,3,4] [--pps 8,16,32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _harness import copy_bandwidth, save

from oscarkv.kernels.triton import decode as tdec
from oscarkv.kernels.triton.decode.common import inv_sum, store_lse
from oscarkv.kernels.triton.decode.loop_swap import meta_cols, query_operands, softmax_step
from oscarkv.kernels.triton.decode.planes import dot8, dot_i8, key_planes_i8, store8, vp8, word_planes, zeros8
from oscarkv.kernels.triton.decode.stages import merge
from oscarkv.quant import RowFormat

LOG2E = 1.4426950408889634


@triton.jit
def page_stage1(Q, kdesc, KM, vdesc, VM, KC, VC, PT, NTOK, O, LSE, qk_scale, pt_stride, pps, total,
                HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                PS: tl.constexpr, ASM: tl.constexpr, KI8: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """Program (head group, sequence, split): pages ``[pps·sp, pps·(sp+1))`` of sequence ``b``'s
    INT2 list (``NTOK[b]`` tokens, page ``i`` at slots ``PT[b, i]·PS …``), one page per tile."""
    D4: tl.constexpr = D // 4
    D8: tl.constexpr = D // 8
    hg = tl.program_id(0)
    b = tl.program_id(1)
    sp = tl.program_id(2)
    h0 = hg * HP
    n = tl.load(NTOK + b)
    p_lo = sp * pps
    p_hi = tl.minimum(p_lo + pps, (n + PS - 1) // PS)
    offs_c = tl.arange(0, HP * GP)
    gmask = offs_c % GP < G
    qrow = b * HKV * G + (h0 + offs_c // GP) * G + offs_c % GP
    row = qrow.to(tl.int64) * total + sp
    offs_t = tl.arange(0, PS)
    q00, q01, q10, q11, q20, q21, q30, q31, qsum, kscale, offs_k, offs_r, diag = query_operands(
        Q, qrow, offs_c, gmask, qk_scale, HP, GP, D, KI8
    )
    KROW: tl.constexpr = HKV * D4 if KI8 else HKV * D8
    kcol = h0 * D4 if KI8 else h0 * D8
    zq = qsum * qk_scale
    m_i = tl.full([HP * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP * GP], tl.float32)
    zacc = tl.zeros([HP * GP], tl.float32)
    a00, a01, a10, a11, a20, a21, a30, a31 = zeros8(HP * D8, HP * GP)
    for i in range(p_lo, p_hi):
        pg = tl.load(PT + b * pt_stride + i)
        row0 = pg.to(tl.int64) * PS
        nmask = offs_t < n - i * PS
        sh = (row0 + offs_t) * HKV + h0
        if TMA:
            kc = kdesc.load([pg * PS, kcol])  # TMA coordinates are int32
            vc = tl.trans(vdesc.load([pg * PS, h0 * D8]))
        else:
            kc = tl.load(KC + (row0 + offs_t)[:, None] * KROW + kcol + offs_k[None, :])
            vc = tl.load(VC + (row0 + offs_t)[None, :] * (HKV * D8) + h0 * D8 + offs_r[:, None])
        ks, kz = meta_cols(KM, sh, nmask, HP, GP, 1)
        if KI8:
            k0, k1, k2, k3 = key_planes_i8(kc, ASM)
            t = dot_i8(k0, k1, k2, k3, q00, q01, q10, q11, q20, q21, q30, q31)
        else:
            k00, k01, k10, k11, k20, k21, k30, k31 = word_planes(kc, ASM)
            t = dot8(k00, k01, k10, k11, k20, k21, k30, k31, q00, q01, q10, q11, q20, q21, q30, q31)
        ps, m_i, l_i, zacc, a00, a01, a10, a11, a20, a21, a30, a31 = softmax_step(
            t,
            kscale,
            ks,
            kz,
            zq,
            nmask,
            VM,
            sh,
            m_i,
            l_i,
            zacc,
            a00,
            a01,
            a10,
            a11,
            a20,
            a21,
            a30,
            a31,
            HP,
            GP,
            1,
        )
        v00, v01, v10, v11, v20, v21, v30, v31 = word_planes(vc, ASM)
        a00, a01, a10, a11, a20, a21, a30, a31 = vp8(
            ps, v00, v01, v10, v11, v20, v21, v30, v31, a00, a01, a10, a11, a20, a21, a30, a31
        )
    inv = inv_sum(l_i)
    z = zacc * inv
    op = O + row[None, :] * D + 2 * (offs_r % D8)[:, None]
    store8(op, a00, a01, a10, a11, a20, a21, a30, a31, inv[None, :], z[None, :], diag & gmask[None, :], D4)
    store_lse(LSE, row, gmask, m_i, l_i)


class PageDecode:
    """The experiment's launch for one pool set: ``(q) -> out`` with fixed page tables."""

    def __init__(self, pools, pt, ntok, hq, hkv, d, ps, pps, hp, ki8, tma, stages):
        kc, km, vc, vm = pools
        self.kc2 = kc.view(kc.shape[0], -1) if ki8 else kc.view(torch.int16).view(kc.shape[0], -1)
        self.vc2 = vc.view(torch.int16).view(vc.shape[0], -1)
        kbox = [ps, hp * d // 4] if ki8 else [ps, hp * d // 8]
        self.kdesc = TensorDescriptor.from_tensor(self.kc2, kbox) if tma else self.kc2
        self.vdesc = TensorDescriptor.from_tensor(self.vc2, [ps, hp * d // 8]) if tma else self.vc2
        self.km, self.vm = km.view(torch.int32).view(-1), vm.view(torch.int32).view(-1)
        self.pt, self.ntok = pt, ntok
        self.b = pt.shape[0]
        self.splits = triton.cdiv(pt.shape[1], pps)
        self.args = (hq, hkv, d, ps, pps, hp, ki8, tma, stages)
        g = hq // hkv
        self.gp = 1 << (g - 1).bit_length()

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        hq, hkv, d, ps, pps, hp, ki8, tma, stages = self.args
        b, total = self.b, self.splits
        o = torch.empty(b, hq, total, d, device=q.device, dtype=torch.float32)
        lse = torch.empty(b, hq, total, device=q.device, dtype=torch.float32)
        page_stage1[(hkv // hp, b, total)](
            q, self.kdesc, self.km, self.vdesc, self.vm, self.kc2, self.vc2, self.pt, self.ntok, o, lse,
            d**-0.5 * LOG2E, self.pt.stride(0), pps, total, HKV=hkv, G=hq // hkv, GP=self.gp, HP=hp, D=d, PS=ps,
            ASM=True, KI8=ki8, TMA=tma, num_warps=1, num_stages=stages,
        )  # fmt: skip
        out = torch.empty_like(q)
        merge[(b * hq, d // 32)](o, lse, out, total, S_BLOCK=min(64, triton.next_power_of_2(total)), D=d, DB=32,
                                 PDL=False, num_warps=1)  # fmt: skip
        return out


def make_case(b, L, hkv, d, ps, gen):
    """Pools of ``b × L`` INT2 tokens in pages shuffled over the pool, and the page tables."""
    npg = L // ps
    slots = b * L + ps
    dev = "cuda"
    kc = torch.randint(0, 256, (slots, hkv, d // 4), dtype=torch.uint8, device=dev, generator=gen)
    vc = torch.randint(0, 256, (slots, hkv, d // 4), dtype=torch.uint8, device=dev, generator=gen)

    def meta():
        s = torch.rand(slots, hkv, 1, device=dev, generator=gen) * 0.05 + 0.01
        z = torch.rand(slots, hkv, 1, device=dev, generator=gen) * 3
        return torch.stack([s, z], -1).to(torch.bfloat16)

    km, vm = meta(), meta()
    perm = torch.randperm(b * npg, device=dev, generator=gen).to(torch.int32) + 1  # page 0 unused
    pt = perm.view(b, npg).contiguous()
    ntok = torch.full((b,), L, dtype=torch.int32, device=dev)
    return (kc, km, vc, vm), pt, ntok


def product_call(pools, pt, ntok, hq, hkv, d, ps, L):
    """The engine's kernel on the same INT2 rows (lists expanded from the page tables), empty 16-bit lists."""
    kc, km, vc, vm = pools
    b = pt.shape[0]
    rows = (pt.long()[:, :, None] * ps + torch.arange(ps, device=pt.device)).view(b, -1)[:, :L]
    indices = rows.reshape(-1).to(torch.int32).contiguous()
    indptr = torch.arange(b + 1, device=pt.device, dtype=torch.int32) * L
    hp = torch.zeros(1, hkv, d, device=pt.device, dtype=torch.bfloat16)
    hptr = torch.zeros(b + 1, device=pt.device, dtype=torch.int32)
    hidx = torch.zeros(1, device=pt.device, dtype=torch.int32)
    fmt = RowFormat(d, 2, d, clip=0.0)
    plan = tdec.plan(b, hq, hkv, d, (L, 0), pt.device)

    def call(q):
        return tdec.decode_attention(q, kc, km, vc, vm, hp, hp, indptr, indices, hptr, hidx, d**-0.5, fmt, fmt,
                                     lens_hint=(L, 0), plan=plan)  # fmt: skip

    return call, plan


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8x4096,1x65536,32x16384")
    ap.add_argument("--layers", type=int, default=8, help="pool copies read in turn (beats L2)")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--pps", default="8,16,32", help="pages per split")
    ap.add_argument("--tma", default="1,0")
    ap.add_argument(
        "--hp", default="auto", help="KV heads per program: auto (the product's plan), or a number"
    )
    ap.add_argument("--name", default="page_tma")
    args = ap.parse_args(argv)
    hq, hkv, d, ps = 32, 8, 128, 16
    bw = copy_bandwidth("cuda")
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        b, L = map(int, shape.split("x"))
        cases = [make_case(b, L, hkv, d, ps, gen) for _ in range(args.layers)]
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        prods = [product_call(p, pt, n, hq, hkv, d, ps, L) for p, pt, n in cases]
        lp = prods[0][1].lp
        nbytes = b * L * hkv * 2 * (d // 4 + 4) * args.layers
        torch.cuda.synchronize()
        want = prods[0][0](q)
        ms = triton.testing.do_bench_cudagraph(
            lambda q=q, prods=prods: [c(q) for c, _ in prods], rep=200, return_mode="median"
        )
        row = {"shape": shape, "variant": f"product {lp.loop} hp{lp.hpb} ki8={lp.k_int8} bn{lp.block_n}",
               "us_per_layer": 1e3 * ms / args.layers, "copy_frac": nbytes / (ms / 1e3) / bw, "err": 0.0}  # fmt: skip
        rows.append(row)
        print(row, flush=True)
        hps = (
            [lp.hpb if lp.loop == "swap" else 1]
            if args.hp == "auto"
            else [int(x) for x in args.hp.split(",")]
        )
        for hp in hps:
            ki8 = hp * d // 4 >= 64
            for tma in (int(x) for x in args.tma.split(",")):
                for st in (int(x) for x in args.stages.split(",")):
                    for pps in (int(x) for x in args.pps.split(",")):
                        try:
                            runs = [
                                PageDecode(p, pt, n, hq, hkv, d, ps, pps, hp, ki8, tma, st)
                                for p, pt, n in cases
                            ]
                            got = runs[0](q)
                            torch.cuda.synchronize()
                            err = float((got.float() - want.float()).norm() / want.float().norm())
                            ms = triton.testing.do_bench_cudagraph(lambda q=q, runs=runs: [r(q) for r in runs], rep=200,
                                                                   return_mode="median")  # fmt: skip
                        except Exception as e:  # a variant that does not compile is a result too
                            print(
                                f"{shape} hp{hp} tma{tma} st{st} pps{pps}: {type(e).__name__}: {str(e)[:200]}"
                            )
                            continue
                        row = {"shape": shape, "variant": f"pages hp{hp} ki8={ki8} tma={tma} stages={st} pps={pps}",
                               "us_per_layer": 1e3 * ms / args.layers, "copy_frac": nbytes / (ms / 1e3) / bw,
                               "err": err}  # fmt: skip
                        rows.append(row)
                        print(row, flush=True)
        del cases, prods
        torch.cuda.empty_cache()
    md = "| shape | variant | µs per layer | share of copy | rel. err vs product |\n|---|---|---|---|---|\n"
    md += "\n".join(
        f"| {r['shape']} | {r['variant']} | {r['us_per_layer']:.1f} | {r['copy_frac']:.0%} | {r['err']:.1e} |"
        for r in rows
    )
    print(md)
    save(args.name, {"rows": rows, "copy_bytes_per_s": bw}, md)


if __name__ == "__main__":
    main()
