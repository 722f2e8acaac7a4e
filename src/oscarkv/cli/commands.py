"""The commands behind ``oscarkv calibrate | info | eval | generate | demo``.

Each command checks all of its input first (:mod:`.preflight`: flags, paths, the model
directory, the rotations, the prompt), then loads the model, then writes its results before it
prints anything else.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from .args import dataclass_from_args
from .preflight import check_model, load_checked_rotations, read_json_file, read_prompt

if TYPE_CHECKING:
    from ..rotation import RotationSet

__all__ = ["cmd_calibrate", "cmd_demo", "cmd_eval", "cmd_generate", "cmd_info"]


def cmd_info(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..errors import InputError
    from ..rotation import load_rotations

    if args.strict and not args.model_config:
        raise InputError("--strict compares the artifact with a model: pass --model-config CONFIG.json too")
    cfg = read_json_file(args.model_config, "--model-config") if args.model_config else None
    if cfg is not None and not isinstance(cfg, dict):
        raise InputError(f"--model-config {args.model_config}: expected a JSON object (a config.json)")
    rs = load_rotations(args.path, v_path=args.v_path, model_config=cfg, strict=args.strict)
    p, spec = rs.provenance, rs.spec
    ortho = rs.orthogonality_errors()
    t = Table(title=f"rotations: {args.path}", show_header=False)
    t.add_row("source", p.source + (f" ({p.model_name})" if p.model_name else ""))
    t.add_row("layers", f"{len(rs.layer_ids)}: {rs.layer_ids}")
    t.add_row("head dim", str(rs.head_dim))
    gran = rs.granularity + (f" ({rs.num_kv_heads} KV heads)" if rs.num_kv_heads else "")
    t.add_row("granularity", gran)
    t.add_row("spec", ", ".join(f"{k}={v}" for k, v in spec.to_dict().items()))
    worst = max(ortho, key=ortho.__getitem__)
    t.add_row("worst orthogonality", f"{ortho[worst]:.2e} (layer {worst}); max|RᵀR − I|")
    clips = {i: rs.clips(i) for i in rs.layer_ids}
    if any(rs.layers[i].k_clip is not None or rs.layers[i].v_clip is not None for i in clips):
        t.add_row("per-layer clips", "; ".join(f"{i}: {k:.3f}/{v:.3f}" for i, (k, v) in clips.items()))
    high = {i: rs.key_bits(i) for i in rs.layer_ids if rs.key_bits(i) != spec.key_bits}
    if high:
        by_bits = {b: [i for i in high if high[i] == b] for b in sorted(set(high.values()))}
        t.add_row(
            "per-layer key bits",
            "; ".join(f"{b}-bit in {len(ls)} layers {ls}" for b, ls in by_bits.items())
            + f"; {spec.key_bits}-bit elsewhere",
        )
    bpe = [f"{n // 1024}K: {rs.bits_per_element(n):.3f}" for n in (4096, 32768, 131072)]
    t.add_row("bits/element", f"tier {rs.bits_per_element(None):.3f}; " + ", ".join(bpe))
    line = granularity_line(rs)
    if line:
        t.add_row("granularity choice", line.removeprefix("granularity: "))
    line = target_line(rs)
    if line:
        t.add_row("quality target", line.removeprefix("quality target: "))
    if p.recipe:
        skip = ("clip_search", "rotation_select", "offsets", "key_bits", "granularity_choice")
        t.add_row("recipe", ", ".join(f"{k}={v}" for k, v in p.recipe.items() if k not in skip))
        sel = p.recipe.get("rotation_select")
        if isinstance(sel, dict):
            t.add_row("rotation selection", "; ".join(f"{i}: K {c['k']}, V {c['v']}" for i, c in sel.items()))
    offs = {kind: [getattr(lr, f"{kind}_offset") for lr in rs.layers.values()] for kind in ("k", "v")}
    kept = {
        kind: sum(int((o.abs().sum(-1) > 0).sum()) for o in os if o is not None) for kind, os in offs.items()
    }
    hkv = rs.num_kv_heads or next((o.shape[0] for os in offs.values() for o in os if o is not None), None)
    mode = p.recipe.get("offsets", "none") if p.recipe else "none"
    mode = "auto" if isinstance(mode, dict) else mode
    of = f" of {len(rs.layer_ids) * hkv}" if hkv else ""
    t.add_row("channel offsets", f"{mode}: K in {kept['k']}{of}, V in {kept['v']}{of} (layer, KV head) pairs")
    if p.config_hash:
        t.add_row("model config hash", p.config_hash)
    if p.library_version:
        t.add_row("written by", f"oscarkv {p.library_version} {p.created}")
    Console().print(t)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..calibration import calibrate
    from ..calibration.data import check_sources
    from ..calibration.report import summary_rows
    from ..config import CalibrationConfig, QuantSpec, SpecError
    from ..hf.loading import load_model
    from ..rotation import ARTIFACT_NAME, save_oscar_files, save_rotations
    from ..utils.files import check_output_dir

    cfg = dataclass_from_args(CalibrationConfig, args)
    spec = dataclass_from_args(QuantSpec, args)
    if args.export_oscar and (cfg.granularity == "kv_head" or cfg.compares_granularity):
        why = ", which picks kv_head where that lowers the held-out loss" if cfg.granularity == "auto" else ""
        raise SpecError(
            f"--export-oscar needs --granularity layer (got {cfg.granularity}{why}): OSCAR files hold one "
            "matrix per layer",
            "pass --granularity layer with --export-oscar",
        )
    oscar_files = ("k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt") if args.export_oscar else ()
    out = check_output_dir(args.out, (ARTIFACT_NAME, *oscar_files), overwrite=args.overwrite)
    if args.data:
        check_sources(args.data)
    info, device = check_model(args.model, args.device)
    cfg.check_model_positions(info.max_positions)
    from ..rotation import model_head_dim

    spec.group_for(model_head_dim(info.config))
    model, tok = load_model(args.model, device, args.dtype, info=info)
    rs = calibrate(model, tok, cfg, spec, data=args.data or None, progress=not args.quiet)
    con = Console()
    written = [save_rotations(rs, out, overwrite=args.overwrite)]
    if args.export_oscar:
        written += save_oscar_files(rs, out, overwrite=args.overwrite)
    t = Table(title=f"{cfg.method} rotations ({rs.granularity}, V target {cfg.v_target})")
    cols = ("layer", "K λmax/mean", "V λmax/mean", "K clip", "V clip", "max|RᵀR−I|", "err", "K/V gain")
    for c in cols:
        t.add_column(c, justify="right")
    for r in summary_rows(rs):
        err = f"{r['err_global']:.2e}" if "err_global" in r else "-"
        gain = f"{r['k_gain']:.0%}/{r['v_gain']:.0%}" if "k_gain" in r else "-"
        t.add_row(
            str(r["layer"]),
            f"{r['k_spread']:.1f}",
            f"{r['v_spread']:.1f}",
            f"{r['k_clip']:.2f}",
            f"{r['v_clip']:.2f}",
            f"{r['ortho']:.1e}",
            err,
            gain,
        )
    con.print(t)
    con.print(
        "err: held-out relative attention-output error (INT2, windows) at the global clips; "
        "K/V gain: error reduction from the chosen K / V clip"
    )
    for line in (granularity_line(rs), target_line(rs)):
        if line:
            con.print(line)
    con.print("wrote " + ", ".join(str(f) for f in written))
    if args.export_oscar:
        con.print("(the .pt files are in OSCAR's RotationZoo format)")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import platform
    import time

    from rich.console import Console

    from ..calibration.data import check_sources
    from ..config import EvalConfig, SpecError
    from ..eval import run_eval, summary_markdown, write_report
    from ..eval.methods import CALIBRATED_METHODS
    from ..eval.report import REPORT_FILES, high_key_layers
    from ..hf.loading import load_model
    from ..utils.files import check_output_dir

    cfg = dataclass_from_args(EvalConfig, args)
    data = [str(f) for f in check_sources(args.data)]
    calibrated = [m for m in cfg.method_list if m in CALIBRATED_METHODS]
    if not args.rotations and calibrated:
        raise SpecError(
            f"method {calibrated[0]!r} needs --rotations DIR (from `oscarkv calibrate`)",
            f"pass --rotations, or leave {calibrated[0]} out of --methods",
        )
    if args.rotations and not calibrated:
        raise SpecError(
            f"--rotations is only used by the 'oscar' method (and oscar-fp8w), which --methods {cfg.methods} "
            "leaves out",
            "add oscar to --methods, or drop --rotations",
        )
    recipe_dirs = _recipe_dirs(args.recipe)
    out = check_output_dir(args.out, REPORT_FILES, overwrite=args.overwrite)
    info, device = check_model(args.model, args.device)
    cfg.check_model_positions(info.max_positions)
    rots = load_checked_rotations(args.rotations, info.config, args.strict) if args.rotations else None
    recipes = {n: load_checked_rotations(p, info.config, args.strict) for n, p in recipe_dirs.items()}
    con = Console()
    model, tok = load_model(args.model, device, args.dtype, info=info)
    t0 = time.perf_counter()
    rows = run_eval(
        model,
        tok,
        rots,
        cfg,
        progress=lambda m: con.print(f"[dim]{time.perf_counter() - t0:6.0f}s[/] {m}"),
        data=args.data,
        recipes=recipes,
    )
    settings = {
        **dataclasses.asdict(cfg.effective()),
        "quick": cfg.quick,
        "model": args.model,
        "rotations": args.rotations,
        "recipes": recipe_dirs or None,
        # layer -> key bits where the oscar rotations keep wider keys (shaded in layer_errors.png)
        "wide_key_layers": high_key_layers(rots) if rots is not None else None,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        # the user's files (perplexity, per-layer errors), else this Python's standard library;
        # the needle filler is always the standard library
        "data": data or None,
        "python": platform.python_version(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    files = write_report(out, rows, settings)
    con.print(summary_markdown(rows, settings))
    con.print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _recipe_dirs(specs: list[str]) -> dict[str, str]:
    """``--recipe NAME=DIR`` values as ``{NAME: DIR}``; a clear error for a malformed or repeated one."""
    from ..errors import InputError

    out: dict[str, str] = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if (
            not sep
            or not name
            or not path
            or not name.replace("-", "").replace("_", "").replace(".", "").isalnum()
        ):
            raise InputError(
                f"--recipe {s!r}: expected NAME=DIR with a name of letters, digits, '-', '_' or '.'",
                "e.g. --recipe k4x13=rot-3bit",
            )
        if name in out:
            raise InputError(f"--recipe names {name!r} twice", "give each artifact its own name")
        out[name] = path
    return out


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from transformers import DynamicCache, TextStreamer

    from ..config import GenerateConfig
    from ..errors import InputError
    from ..hf import OscarCache
    from ..hf.loading import load_model
    from .engine_cmd import check_engine_flags, generate_engine

    check_engine_flags(args)
    gen = dataclass_from_args(GenerateConfig, args)
    if args.engine:
        return generate_engine(args, gen)
    prompt = read_prompt(args.prompt)
    info, device = check_model(args.model, args.device)
    rots = load_checked_rotations(args.rotations, info.config, args.strict) if args.rotations else None
    if info.max_positions and gen.max_new_tokens >= info.max_positions:
        raise InputError(
            f"--max-new-tokens {gen.max_new_tokens} leaves no room for a prompt in the model's "
            f"{info.max_positions} positions",
            f"pass --max-new-tokens below {info.max_positions}",
        )
    from ..kernels import resolve

    resolve(args.backend, device)  # a backend that cannot run here fails before the model loads
    model, tok = load_model(args.model, device, args.dtype, info=info)
    cache = (
        OscarCache.from_rotations(model, rots, backend=args.backend) if rots is not None else DynamicCache()
    )
    ids = tok(prompt, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    if ids.shape[1] == 0:
        raise InputError("--prompt: the prompt encodes to no tokens", "pass some text")
    if info.max_positions and ids.shape[1] + gen.max_new_tokens > info.max_positions:
        raise InputError(
            f"--prompt: {ids.shape[1]} prompt tokens + --max-new-tokens {gen.max_new_tokens} exceed the "
            f"model's {info.max_positions} positions",
            "shorten the prompt or lower --max-new-tokens",
        )
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=gen.max_new_tokens,
            streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True),
            pad_token_id=getattr(tok, "pad_token_id", None) or 0,
            **gen.sampling_kwargs(),
        )
    Console(stderr=True).print(f"\n[dim]{_kv_line(cache, next(model.parameters()).dtype)}[/]")
    return 0


def _kv_line(cache: Any, dtype: Any) -> str:
    """One line on the KV memory ``cache`` holds, naming the dtype its unquantized rows are stored in
    (fp32 where the model runs in fp32 on a CPU)."""
    name = str(dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")
    name = name.replace("float16", "fp16")
    if not hasattr(cache, "memory_report"):  # transformers' DynamicCache: no rotations
        n_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                      if t is not None)  # fmt: skip
        tokens = cache.get_seq_length()
        return (
            f"KV cache: {n_bytes / 2**20:.1f} MiB for {tokens} tokens in {name} (no rotations: uncompressed)"
        )
    rep = cache.memory_report()
    line = (f"KV cache: {rep['total_bytes'] / 2**20:.1f} MiB for {rep['tokens_quantized']} quantized + "
            f"{rep['tokens_hp']} {name} tokens ({rep['bits_per_element']:.2f} bits/element; "
            f"{rep['bf16_bytes'] / 2**20:.1f} MiB in BF16)")  # fmt: skip
    if rep["total_bytes"] > rep["bf16_bytes"]:
        line += f"; more than BF16: a prompt this short stays in the {name} windows"
    return line


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import DEMO_OUTPUTS, run_demo
    from ..hf.loading import resolve_device
    from ..utils.files import check_output_dir

    check_output_dir(args.out, DEMO_OUTPUTS, overwrite=args.overwrite)
    return run_demo(args.out, resolve_device(args.device), args.quick, args.overwrite)


def granularity_line(rs: RotationSet) -> str | None:
    """What ``--granularity auto`` chose for ``rs`` and why, in one line; ``None`` for an artifact
    calibrated with an explicit granularity."""
    ch = rs.provenance.recipe.get("granularity_choice") if rs.provenance.recipe else None
    if not isinstance(ch, dict) or "chosen" not in ch:
        return None
    if "nll_layer" not in ch:
        return f"granularity: auto chose {ch['chosen']} ({ch.get('reason', 'no comparison')})"
    gain = ch["nll_layer"] - ch["nll_kv_head"]
    return (
        f"granularity: auto chose {ch['chosen']}: held-out NLL {ch['nll_layer']:.4f} per layer, "
        f"{ch['nll_kv_head']:.4f} per KV head (unquantized {ch['nll_unquantized']:.4f}; per KV head "
        f"{'lower' if gain >= 0 else 'higher'} by {abs(gain):.4f}, margin {ch['margin']})"
    )


def target_line(rs: RotationSet) -> str | None:
    """What the quality target (``--max-ppl-increase``) of ``rs``'s calibration chose and measured,
    in one line; ``None`` for an artifact calibrated without one."""
    kb = rs.provenance.recipe.get("key_bits") if rs.provenance.recipe else None
    if not isinstance(kb, dict) or "target" not in kb:
        return None
    bpe = ", ".join(f"{n // 1024}K {rs.bits_per_element(n):.2f}" for n in (4096, 32768, 131072))
    layers = kb["layers"]
    raised = (
        f"{len(layers)} layers' keys raised to {kb['high_bits']} bits {layers}"
        if layers
        else "no layer raised"
    )
    verdict = "met" if kb["met"] else f"missed under the ceiling of {kb['ceiling']} bits per element"
    return (
        f"quality target: held-out perplexity x{kb['ppl_ratio_before']:.4f} of the unquantized model's with the "
        f"spec's widths, x{kb['ppl_ratio']:.4f} with {raised} (target x{kb['target']:.4f}: {verdict}); "
        f"bits per element {bpe}"
    )
