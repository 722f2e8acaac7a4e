"""Decode inputs in which every token is visible in the output (shared by the interpreter and GPU
kernel tests; imported, not collected).

Random inputs cannot see a lost or repeated token: at 130K tokens dropping one moves the output
by ~1e-5 relative, far inside a kernel's rounding. Here the queries are zero, so every score is
exactly 0 and every probability exactly 1 in both tiers, and the output is the plain mean of the
values of the union of both lists. The values have mean ~0 (INT2 codes ``c`` with scale 0.5 and
zero 1.5, i.e. ±0.25 / ±0.75; 16-bit values in ±1 in steps of 1/8), so the mean is ~N^-1/2 while
one token moves it by ~N^-1: a relative change of ~N^-1/2, e.g. 3e-3 at 130K tokens, against a
kernel error of ~1e-5 (its sums are exact; only the final scaling and the LSE merge round).
Each case also measures the effect of dropping the token at each split's start and end from the
expected output, so a test knows that its tolerance sees every one of them.

Prefill (:func:`prefill_case`) the same way: with zero queries new row ``i`` over a ``P``-token
prefix is the mean of the first ``P + i + 1`` values, and one key too many or too few moves it by
~``(P + i)^-1/2``.
"""

from __future__ import annotations

import torch

from oscarkv.kernels import ref
from oscarkv.quant import RowFormat

V_SCALE, V_ZERO = 0.5, 1.5


def coverage_case(lens_q: list[int], lens_h: list[int], hq: int, hkv: int, d: int, device: str,
                  meta: str = "fp16", seed: int = 0):  # fmt: skip
    """``(args, want, fmt)``: ``decode_attention``'s arguments (zero queries, shuffled slot lists, K
    random) and the expected fp64 output ``[B, Hq, d]`` (the mean over each sequence's tokens)."""
    g = torch.Generator().manual_seed(seed)
    fmt = RowFormat(d, 2, d, meta_dtype=meta)
    nq, nh = max(sum(lens_q), 1), max(sum(lens_h), 1)
    mdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[meta]
    kc = torch.randint(0, 256, (nq, hkv, d // 4), dtype=torch.uint8, generator=g)
    vc = torch.randint(0, 256, (nq, hkv, d // 4), dtype=torch.uint8, generator=g)
    km = torch.stack([torch.rand(nq, hkv, 1, generator=g) + 0.1, torch.rand(nq, hkv, 1, generator=g) * 3], -1)
    vm = torch.tensor([V_SCALE, V_ZERO]).expand(nq, hkv, 1, 2).contiguous()
    hk = torch.randn(nh, hkv, d, generator=g)
    hv = torch.randint(-8, 9, (nh, hkv, d), generator=g) / 8.0
    qi = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    hi = torch.tensor([0, *torch.tensor(lens_h).cumsum(0).tolist()], dtype=torch.int32)
    qx = torch.randperm(nq, generator=g)[: sum(lens_q)].to(torch.int32)
    hx = torch.randperm(nh, generator=g)[: sum(lens_h)].to(torch.int32)
    q = torch.zeros(len(lens_q), hq, d)
    # fp16 on the GPU: the output comes in the queries' dtype, and bf16's 8 bits cannot show one token
    # in 130K (a change of ~3e-3 against a rounding of 2^-9); fp32 on the CPU (the interpreter's
    # 16-bit dots are unreliable). The bf16 path is the random tests'.
    dtype = torch.float16 if device != "cpu" else torch.float32
    pools = (kc, km.to(mdt), vc, vm.to(mdt), hk.to(dtype), hv.to(dtype))
    args = (q.to(dtype), *pools, qi, qx, hi, hx, d**-0.5, fmt, fmt)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    v_q = ref.dequantize(args[3], args[4], fmt).double()  # exact: codes ± 1.5, times 0.5
    want = expected_means(v_q, args[6].double(), *args[7:11], hq)
    return args, want, fmt


def expected_means(v_q: torch.Tensor, v_h: torch.Tensor, qi, qx, hi, hx, hq: int) -> torch.Tensor:
    """fp64 mean of each sequence's values over both lists, per KV head, repeated for its query
    heads: ``[B, Hq, d]`` (zeros for a sequence with no token)."""
    b, hkv, d = len(qi) - 1, v_q.shape[1], v_q.shape[2]
    out = torch.zeros(b, hkv, d, dtype=torch.float64, device=v_q.device)
    qi, hi = qi.tolist(), hi.tolist()
    for s in range(b):
        rows = torch.cat([v_q[qx[qi[s] : qi[s + 1]].long()], v_h[hx[hi[s] : hi[s + 1]].long()]])
        if len(rows):
            out[s] = rows.mean(0)
    return out.repeat_interleave(hq // hkv, dim=1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def drop_effects(args, want: torch.Tensor, positions: list[tuple[int, int]]) -> list[float]:
    """Relative change of sequence ``s``'s expected output when its quantized list loses the token
    at list position ``p``, for each ``(s, p)`` (what a lost or repeated token would cost): the mean
    of ``n`` rows without row ``v`` is ``(n·mean − v) / (n − 1)``."""
    q, _, _, vc, vm, _, _, qi, qx, hi, _, _, fmt, _ = args
    hq, hkv = q.shape[1], vc.shape[1]
    effects = []
    for s, p in positions:
        n = int(qi[s + 1] - qi[s] + hi[s + 1] - hi[s])
        slot = qx[int(qi[s]) + p].long()
        v = ref.dequantize(vc[slot][None], vm[slot][None], fmt)[0].double().repeat_interleave(hq // hkv, 0)
        mean = want[s].to(v.device)
        effects.append(rel((n * mean - v) / (n - 1), mean))
    return effects


def split_edges(p, lens_q: list[int]) -> list[tuple[int, int]]:
    """``(sequence, list position)`` of the first and last token of every INT2 split of plan ``p``
    (a :class:`~oscarkv.kernels.triton.decode.DecodePlan`; splits scaled to each list's length as
    the kernel does, ``planner.live_split``), where the list reaches it."""
    from oscarkv.kernels.triton.decode.planner import live_split

    t, out = p.splits, []
    for s, n in enumerate(lens_q):
        lo = 0
        early, late = (live_split(n, x, p.max_q, p.lp.block_n) for x in (t.split, t.split_late))
        for k in range(p.n_q_splits):
            size = early if k < t.n_early else late
            for pos in (lo, min(lo + size, n) - 1):
                if 0 <= pos < n and lo < n:
                    out.append((s, pos))
            lo += size
    return sorted(set(out))


def prefill_case(p: int, t: int, hq: int, hkv: int, d: int, device: str, dtype: torch.dtype, seed: int = 0):
    """``(args, want, effect)``: ``prefill_attention``'s arguments (zero queries), the expected fp64
    rows ``[T, Hq, d]`` and, per new row, the relative change one more visible key would make."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(p + t, hkv, d, generator=g)
    v = (torch.randint(-8, 9, (p + t, hkv, d), generator=g) / 8.0).double()
    n = (p + torch.arange(1, t + 1, dtype=torch.float64))[:, None, None]
    want = (v.cumsum(0)[p:] / n).repeat_interleave(hq // hkv, dim=1)
    nxt = torch.cat([v[p + 1 :], v[-1:]]).repeat_interleave(hq // hkv, dim=1)
    effect = rows_rel((want * n + nxt) / (n + 1), want)
    args = (torch.zeros(t, hq, d), k[:p], v[:p], k[p:], v[p:])
    args = (*(a.to(device, dtype) for a in args), d**-0.5)
    return args, want.to(device), effect.to(device)


def rows_rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative error of each row ``a[i]`` against ``b[i]``: ``[T]``."""
    return (a.double() - b.double()).flatten(1).norm(dim=1) / b.double().flatten(1).norm(dim=1)
