"""Checkpoint directory -> :class:`Decoder`: config checks, streamed safetensors, ``R_V`` absorption.

Checkpoint names are HF's (``model.layers.{i}.self_attn.q_proj.weight``, ``lm_head.weight``, ...);
the decoder's modules say where each lands (:meth:`Decoder.checkpoint_targets`: q/k/v in row
blocks of ``qkv_proj``, gate/up in ``gate_up_proj``, each expert in its slot of the stacked
experts, this rank's slice under tensor parallelism). Every tensor is rounded to its parameter's
dtype on copy, as ``from_pretrained(dtype=...)`` does; after loading, each linear's weight method
finishes its tensors (:meth:`~.linear.LinearMethod.finish`) and ``R_V`` is folded in.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ...errors import ModelError
from ...kernels import KernelOps
from ...rotation import absorb_output_weight, absorb_value_weight
from .decoder import Decoder, ModelShape, model_shape
from .layers import model_error, text_config
from .linear import Linear, Target, Unquantized
from .parallel import Comm
from .quant import weight_method
from .registry import check_split

__all__ = ["LOAD_FORMATS", "absorb", "check_model_split", "load_decoder"]

log = logging.getLogger("oscarkv.engine")
LOAD_FORMATS = ("safetensors", "dummy")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry


def load_decoder(
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    r_v: dict[int, torch.Tensor] | None = None,
    load_format: str = "safetensors",
    seed: int = 0,
    ops: KernelOps | None = None,
    comm: Comm | None = None,
) -> tuple[Decoder, ModelShape]:
    """Build the decoder of ``model_dir`` in ``dtype`` on ``device`` and fill its weights.

    ``r_v`` maps layer -> fp32 ``[d, d]`` or ``[Hkv, d, d]``; those layers' ``v_proj`` then emits
    ``v·R_V`` and their ``o_proj`` takes attention outputs in that basis (``R_Vᵀ`` folded into its
    input columns, per query head), both in fp32 after rounding to ``dtype``.
    ``load_format="dummy"`` reads no weights: N(0, 0.02) from a ``seed``-ed generator, norms 1.
    ``ops``: the kernels the decoder's norms and activation run (default: the torch twins).
    ``comm``: tensor parallelism; the decoder holds this rank's shards and reads only those
    slices of the checkpoint (``r_v`` is given whole and sliced to the rank's KV heads).
    Returns ``(decoder in eval mode without grads, shape)``; raises ``ModelError`` (one line).
    """
    from transformers import AutoConfig, GenerationConfig

    where = f"model {model_dir}"
    if load_format not in LOAD_FORMATS:
        raise model_error(where, f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if not Path(model_dir).is_dir():
        raise model_error(
            where, "not a directory", "pass a local directory with config.json and *.safetensors"
        )
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise model_error(
            where, f"cannot read config.json ({(str(e).splitlines() or [''])[0][:200]})"
        ) from None
    try:
        gen = GenerationConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        gen = None
    shape = model_shape(config, gen, where)
    tc = text_config(config)
    tp, rank = (1, 0) if comm is None else (comm.world, comm.rank)
    check_split(tc, tp, where)
    rots = {
        i: r if r.dim() == 2 else kv_head_slice(r, tp, rank) for i, r in _check_r_v(r_v, shape, where).items()
    }
    method = weight_method(config, where)
    files = _checkpoint_files(Path(model_dir)) if load_format == "safetensors" else []
    model, targets = _build(tc, shape, where, dtype=dtype, device=device, ops=ops, comm=comm, method=method)
    with torch.no_grad():
        if load_format == "dummy":
            _fill_dummy(model, seed)
        else:
            _load_files(model, targets, files, where, tc)
        model.finish()
        for i, r in rots.items():
            absorb(model, i, r)
    return model.eval().requires_grad_(False), shape


def _build(config: Any, shape: ModelShape, where: str, **kw: Any) -> tuple[Decoder, dict[str, Target]]:
    """The decoder and its checkpoint targets; a size the weight method cannot split (an FP8
    part that is not whole 128-row blocks) is a :class:`ModelError`."""
    try:
        model = Decoder(config, shape, **kw)
        return model, model.checkpoint_targets()
    except ModelError:
        raise
    except ValueError as e:
        hint = (
            "FP8 block-scaled projections are fused and split on whole 128x128 blocks: use a "
            "tensor_parallel that keeps every part whole, or the bf16 checkpoint"
        )
        raise model_error(where, str(e), hint) from None


def check_model_split(model_dir: str, tp: int) -> None:
    """Raise :class:`ModelError` if ``tp`` ranks cannot split the model's sizes (an unreadable
    config is left to :func:`load_decoder`'s error)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError):
        return
    where = f"model {model_dir}"
    tc = text_config(config)
    check_split(tc, tp, where)
    method = weight_method(config, where)
    if tp > 1 and not isinstance(method, Unquantized):  # the rank's parts, built on the meta device
        _build(tc, model_shape(config, None, where), where, dtype=torch.bfloat16, device="meta",
               comm=_MetaComm(0, tp), method=method)  # fmt: skip


class _MetaComm(NamedTuple):
    """A rank's place in the group, enough to size its parts (nothing is communicated)."""

    rank: int
    world: int


def kv_head_slice(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """``rank``'s part of a per-KV-head tensor ``[Hkv, ...]`` (rotations, offsets): ``Hkv/tp`` heads."""
    if tp == 1:
        return t
    n = t.shape[0] // tp
    return t[rank * n : (rank + 1) * n]


def _check_r_v(r_v: dict[int, torch.Tensor] | None, shape: ModelShape, where: str) -> dict[int, torch.Tensor]:
    d, hkv, n = shape.head_dim, shape.num_kv_heads, shape.num_layers
    out = {}
    for i, r in (r_v or {}).items():
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise model_error(where, f"r_v has layer {i!r}; the model's layers are 0..{n - 1}")
        if tuple(r.shape) not in ((d, d), (hkv, d, d)):
            raise model_error(
                where, f"r_v[{i}] has shape {list(r.shape)}; expected [{d}, {d}] or [{hkv}, {d}, {d}]"
            )
        out[i] = r.to(torch.float32)
    return out


def _checkpoint_files(root: Path) -> list[Path]:
    """The ``*.safetensors`` files of the index json, else every ``*.safetensors`` in ``root``."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise model_error(str(index), f"unreadable safetensors index ({type(e).__name__}: {e})") from None
        lost = [n for n in names if not (root / n).is_file()]
        if lost:
            raise model_error(str(index), f"names {len(lost)} missing weight file(s): {', '.join(lost[:4])}")
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise model_error(
            f"model {root}", "no *.safetensors weights", "save with save_pretrained, or use dummy weights"
        )
    return files


def absorb(model: Decoder, layer: int, r: torch.Tensor) -> None:
    """Fold ``R_V`` into layer's ``v_proj`` rows (weight and bias) and ``R_Vᵀ`` into its ``o_proj``
    input columns (this rank's), in fp32 from the stored weights, stored back as the method stores
    (after :meth:`Decoder.finish`: FP8 weights kept for FP8 GEMMs are requantized per block,
    dequantized ones rounded to the model dtype as unquantized weights are)."""
    attn = model.layers[layer].self_attn
    qkv, o = attn.qkv_proj, attn.o_proj
    d = model.shape.head_dim
    o.method.set_dense_weight(o, absorb_output_weight(o.method.dense_weight(o), r, d))
    rows = qkv.part_rows(2)
    b = None if qkv.bias is None else qkv.shard(qkv.bias.detach(), 2)
    w, b_new = absorb_value_weight(qkv.method.dense_weight(qkv, rows), b, r, d)
    qkv.method.set_dense_weight(qkv, w, rows)
    if b is not None and b_new is not None:
        b.copy_(b_new)


def _read(f: Any, key: str, target: Target, where: str) -> torch.Tensor:
    """The checkpoint tensor ``key`` (only ``target.shard``'s slice of it), its shape checked
    against the destination."""
    dst, shard = target
    if shard is None:
        t = f.get_tensor(key)
        got, want = list(t.shape), list(dst.shape)
    else:
        sl = f.get_slice(key)
        got = list(sl.get_shape())
        want = [shard.full if i == shard.dim else n for i, n in enumerate(dst.shape)]
        if got == want:
            t = sl[(slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.length),)]
    if got != want:
        raise model_error(where, f"{key} has shape {got}; the config gives {want}")
    return t


def _load_files(
    model: Decoder, targets: dict[str, Target], files: list[Path], where: str, config: Any
) -> None:
    from safetensors import SafetensorError, safe_open

    skipped = model.family.skipped(config)
    seen: set[str] = set()
    unexpected: list[str] = []
    n_skipped = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    target = targets.get(key)
                    if target is None:
                        tied_head = key == "lm_head.weight" and model.lm_head is None
                        if skipped(key):
                            n_skipped += 1
                        elif not (tied_head or key.endswith(_IGNORED_SUFFIXES)):
                            unexpected.append(key)
                        continue
                    target.dst.copy_(_read(f, key, target, where))
                    seen.add(key)
        except (OSError, SafetensorError) as e:
            raise model_error(where, f"cannot read {path.name} ({e})") from None
    if n_skipped:
        log.info(
            "%s: skipped %d checkpoint tensors the engine does not use (multi-token prediction)",
            where,
            n_skipped,
        )
    missing = [k for k in targets if k not in seen]
    if missing or unexpected:
        lists = [(f"{label} {len(ks)}: {', '.join(ks[:6])}" + (" ..." if len(ks) > 6 else ""))
                 for label, ks in (("missing", missing), ("unexpected", unexpected)) if ks]  # fmt: skip
        msg = f"checkpoint does not match its {model.shape.model_type} config: {'; '.join(lists)}"
        raise model_error(where, msg, "the weights must be the HF checkpoint of this config.json")


def _fill_dummy(model: Decoder, seed: int) -> None:
    """Seeded N(0, 0.02) weights and biases (each linear's weights as its method stores them),
    RMSNorm weights 1, correction biases 0."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    filled: set[int] = set()
    for name, p in model.named_parameters():
        mod = model.get_submodule(name.rpartition(".")[0])
        if isinstance(mod, Linear) and p is not mod.bias:
            if id(mod) not in filled:  # at its first tensor, so unquantized draws stay in order
                mod.method.fill_dummy(mod, gen)
                filled.add(id(mod))
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("correction"):
            p.zero_()
        elif p.dtype.is_floating_point and p.element_size() >= 2:
            p.normal_(0.0, 0.02, generator=gen)
