#!/usr/bin/env python
"""Key-side methods for 2-bit KV on SmolLM2-135M-Instruct: a CPU fake-quant perplexity study.

Measurement only (no product code). Steps:

1. Per-KV-head OSCAR rotations: loaded from ``--rot`` if present, else fitted with
   ``oscarkv.calibration.api.calibrate`` (granularity kv_head, library defaults: 20,000 tokens of
   the stdlib ``calib`` split, 2,048-token windows, seed 0) and saved there.
2. Statistics of post-RoPE K/V in the rotated basis (per layer, KV head, channel: mean and std of
   keys and values, RMS of the grouped queries) from the *same* calibration windows, positions
   >= 64 of each window only (the sink tokens are never quantized, so they are left out).
3. Per-layer key sensitivity on the calibration split's next two windows (what ``calibrate`` uses
   as hold-out text): KL to the exact model when only that layer's keys are K2 (+ static offset),
   and the attention-output error of that layer.
4. Perplexity on ``eval_sequences`` (stdlib ``eval`` split, disjoint from the calibration text):
   N windows of 2,048 tokens; the first 1,536 are prefilled exactly (shared by every variant, as
   in ``oscarkv eval``), the last 512 are scored teacher-forced. In the scored pass every layer's
   attention is replaced by a fake-quant attention in the rotated basis where query at absolute
   position p sees key/value j exactly iff ``j < 64`` or ``p - j < 256`` (sink 64 + the 256 most
   recent tokens including itself, i.e. decoding with demote_block 1), and the fake-quantized
   (quantize -> dequantize) version otherwise.

Run:  .venv/bin/python lab/scripts/smollm2_keyside.py [--nseq 12] [--only NAME ...]
Results are written incrementally to lab/results/smollm2_keyside_cpu.json (finished variants
are skipped on a re-run unless --redo).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from oscarkv.calibration.capture import capture_attention, route_attention
from oscarkv.calibration.data import eval_sequences, token_sequences
from oscarkv.config import CalibrationConfig, QuantSpec
from oscarkv.quant import RowFormat, fake_quantize_rows
from oscarkv.quant.quantizer import dequantize_affine, quantize_asymmetric
from oscarkv.rotation import load_rotations, rotate_heads, save_rotations

ROOT = Path(__file__).resolve().parents[2]
SINK, RECENT, CTX_128K = 64, 256, 131072
IMPL = "keyside_fakeq"


# ----------------------------------------------------------------------------------------------
# variants
# ----------------------------------------------------------------------------------------------
@dataclass
class Variant:
    name: str
    kbits: int | None = 2  # None: exact keys
    vbits: int | None = 2  # None: exact values
    kgroup: int = 64  # elements per (scale, zero) along the rotated head dim
    kquant: str = "asymmetric"  # asymmetric | symmetric (scale only) | perchannel (token groups)
    ktok_group: int = 64  # perchannel: tokens per (scale, zero) of one channel
    k_off: str = "none"  # none | static | static_all (subtracted from every tier) | oracle
    v_off: str = "none"  # none | static
    k_alpha: float = 0.0  # divide rotated keys by std^alpha, multiply queries by it
    k_clip: float = 0.96
    k_clip_hi: float | None = None  # key clip for layers stored with >= 3 bits (None: k_clip)
    v_clip: float = 0.92
    rotate: bool = True
    layer_kbits: dict[int, int | None] = field(default_factory=dict)  # per-layer override
    exact_sdpa: bool = False  # the plain model (no fake-quant attention at all)
    note: str = ""

    def key_bits_of(self, layer: int) -> int | None:
        return self.layer_kbits.get(layer, self.kbits)

    def _k_cost(self, b: int | None, d: int) -> float:
        if b is None:
            return 16.0
        if self.kquant == "perchannel":
            return b + 32.0 / self.ktok_group
        meta = 16.0 if self.kquant == "symmetric" else 32.0
        return b + meta / self.kgroup

    def bits(self, layers: list[int], d: int = 64, ctx: int = CTX_128K) -> dict[str, float]:
        k = sum(self._k_cost(self.key_bits_of(i), d) for i in layers) / len(layers)
        v = 16.0 if self.vbits is None else self.vbits + 32.0 / d
        q = (k + v) / 2
        hp = min(ctx, SINK + RECENT)
        return {"k_tier": k, "v_tier": v, "tier": q, "at_128k": (hp * 16 + (ctx - hp) * q) / ctx}


# ----------------------------------------------------------------------------------------------
# the per-layer transforms and the fake-quant attention
# ----------------------------------------------------------------------------------------------
class LayerData:
    """Rotations and calibrated statistics of one layer (rotated basis, per KV head)."""

    def __init__(self, rk, rv, kmean, kstd, vmean, qrms):
        self.rk, self.rv = rk.float(), rv.float()
        self.kmean, self.kstd, self.vmean, self.qrms = kmean, kstd, vmean, qrms


def fq_rows(x: torch.Tensor, bits: int, group: int, clip: float, quant: str) -> torch.Tensor:
    fmt = RowFormat(head_dim=x.shape[-1], bits=bits, group=group, clip=clip, quantizer=quant)
    return fake_quantize_rows(x, fmt)


def fq_perchannel(x: torch.Tensor, bits: int, tok_group: int) -> torch.Tensor:
    """Asymmetric min-max per channel over blocks of ``tok_group`` consecutive tokens
    (KIVI-style keys); ``x [B, H, T, d]``, blocks aligned at row 0 of ``x``."""
    b, h, t, d = x.shape
    pad = (-t) % tok_group
    xp = torch.cat([x, x[:, :, -1:].expand(b, h, pad, d)], 2) if pad else x
    xt = xp.transpose(-1, -2)  # [B, H, d, T']
    codes, meta = quantize_asymmetric(xt, bits, tok_group, "fp16")
    return dequantize_affine(codes, meta).transpose(-1, -2)[:, :, :t]


def quant_keys(kt: torch.Tensor, var: Variant, bits: int) -> torch.Tensor:
    if var.kquant == "perchannel":
        return fq_perchannel(kt, bits, var.ktok_group)
    clip = var.k_clip_hi if (bits >= 3 and var.k_clip_hi is not None) else var.k_clip
    return fq_rows(kt, bits, var.kgroup, clip, var.kquant)


def per_head(x: torch.Tensor, n: int) -> torch.Tensor:
    """[Hkv, d] statistics -> [1, Hkv, 1, d]."""
    return x[None, :, None, :]


def fake_attention(q, k, v, scaling, var: Variant, ld: LayerData, layer: int):
    """Attention of the ``Tq`` queries ``q [B, Hq, Tq, d]`` (the last Tq positions) over
    ``k, v [B, Hkv, Tk, d]`` with the windowed fake-quant rule of the module docstring.
    Returns ``[B, Tq, Hq, d]`` (like sdpa_attention_forward) in q's dtype."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = hq // hkv
    kb, vb = var.key_bits_of(layer), var.vbits
    eye = torch.eye(d)
    rk = ld.rk if var.rotate else eye
    rv = ld.rv if var.rotate else eye
    qr = rotate_heads(q.float(), rk)  # [B, Hq, Tq, d]
    kr = rotate_heads(k.float(), rk)
    vr = rotate_heads(v.float(), rv)

    # ---- key transform (exact for attention) ----
    zero = torch.zeros(1, hkv, 1, d)
    if var.k_off in ("static", "static_all"):
        mu = per_head(ld.kmean, hkv)
    elif var.k_off == "oracle":
        hi = max(SINK + 1, tk - RECENT)
        mu = kr[:, :, SINK:hi].mean(2, keepdim=True)
    else:
        mu = zero
    s = per_head(ld.kstd.clamp_min(1e-6) ** var.k_alpha, hkv) if var.k_alpha else torch.ones(1, hkv, 1, d)
    if var.k_alpha:
        s = s / s.log().mean(-1, keepdim=True).exp()  # geometric mean 1 (cosmetic)
    # keys the scores use: quantize (kr - mu)/s, add mu/s back -> q̃·k̂ = q·(Q(...)*s + mu);
    # "static_all" instead keeps the offset subtracted everywhere (scores shift by q·mu per query)
    kt = (kr - mu) / s
    if kb is None:
        khat = kt
    else:
        khat = kt.clone()
        khat[:, :, SINK:] = quant_keys(kt[:, :, SINK:], var, kb)
    if var.k_off != "static_all":
        kt, khat = kt + mu / s, khat + mu / s
    qt = qr * s.repeat_interleave(g, 1)

    # ---- values ----
    muv = per_head(ld.vmean, hkv) if var.v_off == "static" else zero
    if vb is None:
        vhat = vr
    else:
        vhat = vr.clone()
        vhat[:, :, SINK:] = fq_rows(vr[:, :, SINK:] - muv, vb, d, var.v_clip, "asymmetric") + muv

    # ---- windowed mixture: A = sink (exact), B = always quantized, C = per-query ----
    qg = qt.reshape(b, hkv, g * tq, d)
    qpos = torch.arange(tk - tq, tk).repeat(g)[:, None]  # [g*Tq, 1]
    c0 = min(max(SINK, tk - tq - RECENT + 1), tk)
    jc = torch.arange(c0, tk)[None, :]
    exact_c = (qpos - jc) < RECENT
    future_c = jc > qpos
    s_a = qg @ kt[:, :, :SINK].transpose(-1, -2)
    s_b = qg @ khat[:, :, SINK:c0].transpose(-1, -2)
    s_c = torch.where(exact_c, qg @ kt[:, :, c0:].transpose(-1, -2), qg @ khat[:, :, c0:].transpose(-1, -2))
    s_c = s_c.masked_fill(future_c, float("-inf"))
    p = (torch.cat([s_a, s_b, s_c], -1) * scaling).softmax(-1)
    pa, pb, pc = p[..., :SINK], p[..., SINK:c0], p[..., c0:]
    o = pa @ vr[:, :, :SINK] + pb @ vhat[:, :, SINK:c0]
    o = o + (pc * exact_c) @ vr[:, :, c0:] + (pc * ~exact_c) @ vhat[:, :, c0:]
    o = rotate_heads(o, rv, inverse=True)  # [B, Hkv, g*Tq, d]
    return o.reshape(b, hq, tq, d).transpose(1, 2).to(q.dtype)


class Router:
    """Attention implementation: exact SDPA unless a variant is active."""

    def __init__(self):
        self.var: Variant | None = None
        self.layers: dict[int, LayerData] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.var is None or self.var.exact_sdpa:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, **kwargs
            )
        i = int(module.layer_idx)
        return fake_attention(query, key, value, scaling, self.var, self.layers[i], i), None


# ----------------------------------------------------------------------------------------------
# scoring: exact shared prefix, variant-specific scored pass
# ----------------------------------------------------------------------------------------------
class Scorer:
    @torch.inference_mode()
    def __init__(self, model, router: Router, seqs: torch.Tensor, ctx: int, batch: int):
        from transformers import DynamicCache

        self.model, self.router, self.ctx = model, router, ctx
        self.batches = []
        router.var = None
        with torch.inference_mode():
            for j in range(0, len(seqs), batch):
                s = seqs[j : j + batch]
                cache = DynamicCache()
                first = model(
                    input_ids=s[:, :ctx], past_key_values=cache, use_cache=True, logits_to_keep=1
                ).logits
                self.batches.append({"seq": s, "cache": cache, "first": first.float()})
        self.ref = None  # exact log-probs (fp16) per batch, for KL
        self.ref = [self._logprobs(bt).half() for bt in self.batches]

    def _logprobs(self, bt) -> torch.Tensor:
        s, cache = bt["seq"], bt["cache"]
        n = s.shape[1] - 1 - self.ctx
        try:
            logits = self.model(input_ids=s[:, self.ctx : -1], past_key_values=cache, use_cache=True).logits
        finally:
            cache.crop(-n)
        assert cache.get_seq_length() == self.ctx
        return torch.cat([bt["first"], logits.float()], 1).log_softmax(-1)

    @torch.inference_mode()
    def score(self, var: Variant | None) -> dict:
        self.router.var = var
        nll, kl, n, per_seq = 0.0, 0.0, 0, []
        try:
            for bt, ref in zip(self.batches, self.ref, strict=True):
                lp = self._logprobs(bt)
                tgt = bt["seq"][:, self.ctx :]
                tok = -lp.gather(-1, tgt[..., None])[..., 0].double()
                per_seq += tok.sum(-1).tolist()
                nll += float(tok.sum())
                r = ref.float()
                kl += float((r.exp() * (r - lp)).sum(-1).double().sum())
                n += tgt.numel()
        finally:
            self.router.var = None
        return {
            "ppl": math.exp(nll / n),
            "nll_per_tok": nll / n,
            "kl_per_tok": kl / n,
            "tokens": n,
            "seq_nll": per_seq,
        }


# ----------------------------------------------------------------------------------------------
# calibration + statistics
# ----------------------------------------------------------------------------------------------
def calib_windows(tok, cfg: CalibrationConfig):
    n_cal = cfg.num_sequences
    ids = token_sequences(tok, None, n_cal + 2, cfg.seq_len, cfg.seed)
    cal = list(ids[:n_cal].reshape(-1)[: cfg.tokens].split(cfg.seq_len))
    return cal, ids[n_cal:]


def get_rotations(model, tok, rot_dir: Path, log):
    art = rot_dir / "rotations.safetensors"
    if art.is_file():
        log(f"rotations: loading {art}")
        rs = load_rotations(rot_dir, model_config=model.config)
    else:
        from oscarkv.calibration.api import calibrate

        log("rotations: calibrating (kv_head) on CPU ...")
        t = time.time()
        rs = calibrate(model, tok, CalibrationConfig(granularity="kv_head"), QuantSpec())
        save_rotations(rs, art)
        log(f"rotations: done in {time.time() - t:.0f}s -> {art}")
    if rs.granularity != "kv_head":
        raise SystemExit(f"{rot_dir}: expected kv_head rotations, found {rs.granularity}")
    return rs


@torch.inference_mode()
def kv_stats(model, windows, rs, hkv, g, d):
    """Per layer: rotated-basis mean/std of keys and values and RMS of queries, positions >= SINK."""
    acc: dict[int, dict[str, torch.Tensor]] = {}

    def cb(i, q, k, v, o):
        a = acc.setdefault(i, {})
        sl = slice(SINK, None)
        kk = k[:, :, sl].double()
        vv = v[:, :, sl].double()
        qq = (
            q[:, :, sl]
            .double()
            .reshape(q.shape[0], hkv, g, -1, d)
            .transpose(2, 3)
            .reshape(q.shape[0], hkv, -1, d)
        )
        for name, x in (("k", kk), ("v", vv), ("q", qq)):
            a[name + "_n"] = a.get(name + "_n", 0) + x.shape[0] * x.shape[2]
            a[name + "_s"] = a.get(name + "_s", 0) + x.sum((0, 2))
            a[name + "_g"] = a.get(name + "_g", 0) + torch.einsum("bhti,bhtj->hij", x, x)

    with capture_attention(model, cb):
        for w in windows:
            model(input_ids=w[None], use_cache=False)
    out = {}
    for i, a in acc.items():
        lr = rs.layers[i]
        res = {}
        for name, r in (("k", lr.k), ("v", lr.v), ("q", lr.k)):
            r = r.double()
            mean = a[name + "_s"] / a[name + "_n"]  # [H, d]
            gram = a[name + "_g"] / a[name + "_n"]  # [H, d, d]
            mean_r = torch.einsum("hi,hij->hj", mean, r)
            sq_r = torch.einsum("hij,hik,hkj->hj", r, gram, r)  # diag(Rᵀ E[xxᵀ] R)
            res[name + "mean"] = mean_r.float()
            res[name + "std"] = (sq_r - mean_r**2).clamp_min(0).sqrt().float()
            res[name + "rms"] = sq_r.clamp_min(0).sqrt().float()
        out[i] = res
    return out


@torch.inference_mode()
def attn_sensitivity(model, router: Router, windows, tq: int, base: Variant, layers):
    """Relative attention-output error per layer of ``base`` keys (V exact) vs exact, last tq queries."""
    err = {i: 0.0 for i in layers}
    ref = {i: 0.0 for i in layers}
    exact = replace(base, kbits=None, vbits=None, layer_kbits={})

    def cb(i, q, k, v, o):
        qs = q[:, :, -tq:]
        sc = 1.0 / math.sqrt(q.shape[-1])
        o0 = fake_attention(qs, k, v, sc, exact, router.layers[i], i).float()
        o1 = fake_attention(qs, k, v, sc, base, router.layers[i], i).float()
        err[i] += float((o1 - o0).square().sum())
        ref[i] += float(o0.square().sum())

    with capture_attention(model, cb):
        model(input_ids=windows, use_cache=False)
    return {i: err[i] / ref[i] for i in layers}


# ----------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/smollm2")
    ap.add_argument("--rot", default="/tmp/smol-rot")
    ap.add_argument("--nseq", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--score", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "lab/results/smollm2_keyside_cpu.json"))
    ap.add_argument("--only", nargs="*", default=None, help="variant names to run")
    ap.add_argument("--redo", action="store_true")
    ap.add_argument("--no-kl-sensitivity", action="store_true")
    ap.add_argument("--n-mixed", type=int, default=10, help="layers given more key bits")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    out_path = Path(args.out)
    res = json.loads(out_path.read_text()) if out_path.is_file() else {}
    res.setdefault("variants", {})

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(res, indent=1))

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    cfg = model.config
    layers = list(range(cfg.num_hidden_layers))
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = hq // hkv

    rs = get_rotations(model, tok, Path(args.rot), log)
    ccfg = CalibrationConfig(granularity="kv_head")
    cal, hold = calib_windows(tok, ccfg)
    log(f"stats pass over {sum(w.numel() for w in cal)} calibration tokens ...")
    st = kv_stats(model, cal, rs, hkv, g, d)
    router = Router()
    router.layers = {
        i: LayerData(
            rs.layers[i].k, rs.layers[i].v, st[i]["kmean"], st[i]["kstd"], st[i]["vmean"], st[i]["qrms"]
        )
        for i in layers
    }
    # how big is the key mean relative to the key spread? (rotated basis, per layer)
    res["stats"] = {
        str(i): {
            "k_mean_energy_frac": float(
                (st[i]["kmean"] ** 2).sum() / ((st[i]["kmean"] ** 2) + st[i]["kstd"] ** 2).sum()
            ),
            "v_mean_energy_frac": float(
                (st[i]["vmean"] ** 2).sum() / ((st[i]["vmean"] ** 2) + st[i]["vstd"] ** 2).sum()
            ),
            "k_std_max_over_median": float((st[i]["kstd"].amax(-1) / st[i]["kstd"].median(-1).values).mean()),
        }
        for i in layers
    }
    res["setup"] = {
        "model": args.model, "rotations": args.rot, "granularity": rs.granularity,
        "rotation_recipe": rs.provenance.recipe, "spec": asdict(rs.spec),
        "eval": {"nseq": args.nseq, "seq_len": args.seq_len, "prefix": args.seq_len - args.score,
                 "scored": args.score, "source": "oscarkv.calibration.data.eval_sequences(seed=0)"},
        "rule": "prefix exact (prefill); scored query at position p sees K/V j exact iff j<64 or p-j<256, "
                "else fake-quantized (rotated basis)",
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "threads": args.threads, "date": dt.datetime.now().isoformat(timespec="seconds"),
    }  # fmt: skip
    save()

    with route_attention(model, IMPL, router):
        # ---- per-layer sensitivity (calibration hold-out text) ----
        probe = Variant("k2-probe", kbits=2, vbits=None, k_off="static")
        if "sens_attn" not in res:
            log("attention-error sensitivity ...")
            res["sens_attn"] = {
                str(k): v
                for k, v in attn_sensitivity(model, router, hold, args.score - 1, probe, layers).items()
            }
            res["sens_attn_k4"] = {
                str(k): v
                for k, v in attn_sensitivity(
                    model, router, hold, args.score - 1, replace(probe, kbits=4), layers
                ).items()
            }
            save()
        if "sens_kl" not in res and not args.no_kl_sensitivity:
            log("KL sensitivity (30 scored passes on 2 hold-out windows) ...")
            hs = Scorer(model, router, hold, args.seq_len - args.score, batch=2)
            res["sens_kl"] = {}
            for i in layers:
                v = Variant(f"k2@L{i}", kbits=None, vbits=None, k_off="static", layer_kbits={i: 2})
                res["sens_kl"][str(i)] = hs.score(v)["kl_per_tok"]
            del hs
            save()
            log("sensitivity done")

        def top(key, n):
            s = res[key]
            return sorted((int(k) for k in s), key=lambda k: -s[str(k)])[:n]

        # ---- evaluation ----
        seqs = eval_sequences(tok, args.nseq, args.seq_len, seed=0)
        ctx = args.seq_len - args.score
        scorer = None

        def run(var: Variant):
            nonlocal scorer
            if args.only is not None and var.name not in args.only:
                return
            if var.name in res["variants"] and not args.redo:
                return
            if scorer is None:
                log(f"prefill of {len(seqs)} eval windows ...")
                scorer = Scorer(model, router, seqs, ctx, args.batch)
                log("prefill done")
            t = time.time()
            r = scorer.score(var)
            r.update(bits=var.bits(layers, d), seconds=round(time.time() - t, 1), spec=asdict(var))
            res["variants"][var.name] = r
            base = res["variants"].get("bf16", {}).get("ppl")
            ratio = f"{r['ppl'] / base:.4f}x" if base else ""
            rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
            log(f"{var.name:34s} ppl {r['ppl']:.4f} {ratio} kl {r['kl_per_tok']:.4f} "
                f"bits@128K {r['bits']['at_128k']:.3f} ({r['seconds']}s, rss {rss:.1f} GiB)")  # fmt: skip
            save()

        def ppl(name):
            return res["variants"].get(name, {}).get("ppl", float("inf"))

        V = Variant
        run(V("bf16", kbits=None, vbits=None, exact_sdpa=True))
        run(
            V(
                "bf16-via-fakeq-path",
                kbits=None,
                vbits=None,
                note="sanity: exact K/V through the patched attention",
            )
        )
        run(V("K2V2 (published)"))
        run(V("K4V2", kbits=4))
        run(V("K3V2", kbits=3))
        run(V("K2V4", vbits=4))
        run(V("K2V2 no-rotation", rotate=False, note="identity basis, clips kept"))
        run(V("K2V2 +koff", k_off="static"))
        run(V("K2V2 +koff(all tiers)", k_off="static_all", note="equality check vs +koff"))
        run(V("K2V2 +koff+voff", k_off="static", v_off="static"))
        run(V("K2V2 +oracle-koff", k_off="oracle"))
        voff = "static" if ppl("K2V2 +koff+voff") < ppl("K2V2 +koff") else "none"
        sfx = "+voff" if voff == "static" else ""
        base = V("base", k_off="static", v_off=voff)
        run(replace(base, name=f"K2V2 +koff{sfx} +kscale a0.5", k_alpha=0.5))
        run(replace(base, name=f"K2V2 +koff{sfx} +kscale a1.0", k_alpha=1.0))
        run(replace(base, name=f"K2V2 +koff{sfx} g32", kgroup=32))
        run(replace(base, name=f"K3V2 +koff{sfx}", kbits=3))
        run(replace(base, name=f"K4V2 +koff{sfx}", kbits=4))
        run(replace(base, name=f"K2V2 +koff{sfx} sym(scale only)", kquant="symmetric"))
        run(replace(base, name=f"K2V2 +koff{sfx} no-kclip", k_clip=0.0))
        run(replace(base, name=f"K2V2 {'+voff ' if sfx else ''}K per-channel/64tok", k_off="none",
                    kquant="perchannel", ktok_group=64, note="KIVI-style keys in the rotated basis"))  # fmt: skip
        # value-side floor and the koff/voff split at high key bits
        run(V("K4V2 +koff", kbits=4, k_off="static"))
        run(V("K16V2", kbits=None, note="exact keys: the value-side floor"))
        run(V("K16V2 +voff", kbits=None, v_off="static"))
        run(replace(base, name=f"K2V2 +koff{sfx} kclip0.92", k_clip=0.92))
        run(replace(base, name=f"K2V2 +koff{sfx} sym +kscale a0.5", kquant="symmetric", k_alpha=0.5))
        n = args.n_mixed
        if "sens_kl" in res:
            hi = top("sens_kl", n)
            res["mixed_layers_kl"] = hi
            run(replace(base, name=f"K4x{n}/K2 (KL rank) +koff{sfx}", layer_kbits={i: 4 for i in hi}))
            run(replace(base, name=f"K3x{n}/K2 (KL rank) +koff{sfx}", layer_kbits={i: 3 for i in hi}))
            for m in (3, 5):
                run(replace(base, name=f"K4x{m}/K2 (KL rank) +koff{sfx}", layer_kbits={i: 4 for i in hi[:m]}))
        # second round: key clipping at >= 3 bits once the offset is removed, and cheaper mixes
        run(replace(base, name=f"K3V2 +koff{sfx} no-kclip", kbits=3, k_clip=0.0))
        run(V("K4V2 +koff no-kclip", kbits=4, k_off="static", k_clip=0.0))
        better = ppl(f"K3V2 +koff{sfx} no-kclip") < ppl(f"K3V2 +koff{sfx}")
        hic = {"k_clip_hi": 0.0} if better else {}
        tag = " hi-noclip" if better else ""
        if "sens_kl" in res:
            hi = top("sens_kl", n)
            run(
                replace(
                    base, name=f"K3x3/K2 (KL rank) +koff{sfx}{tag}", layer_kbits={i: 3 for i in hi[:3]}, **hic
                )
            )
            run(replace(base, name=f"K3x3/K2 (KL rank) +koff{sfx}{tag} +kscale a0.5", k_alpha=0.5,
                        layer_kbits={i: 3 for i in hi[:3]}, **hic))  # fmt: skip
            if better:
                run(
                    replace(
                        base,
                        name=f"K3x10/K2 (KL rank) +koff{sfx}{tag}",
                        layer_kbits={i: 3 for i in hi},
                        **hic,
                    )
                )
        hi_a = top("sens_attn", n)
        res["mixed_layers_attn"] = hi_a
        run(replace(base, name=f"K4x{n}/K2 (attn rank) +koff{sfx}", layer_kbits={i: 4 for i in hi_a}))
        save()
    log("done")


if __name__ == "__main__":
    main()
