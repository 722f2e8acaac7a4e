"""Checkpoint directory -> :class:`Decoder`: config checks, streamed safetensors, ``R_V`` absorption.

Checkpoint names are HF's (``model.layers.{i}.self_attn.q_proj.weight``, ``lm_head.weight``, ...);
q/k/v land in row blocks of ``qkv_proj`` and gate/up in ``gate_up_proj``. Every tensor is rounded
to the model dtype on copy, as ``from_pretrained(dtype=...)`` does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...kernels import KernelOps
from ...rotation import absorb_output_weight, absorb_value_weight
from .decoder import Decoder, ModelShape, model_shape
from .layers import SUPPORTED_MODEL_TYPES, MergedLinear, check_config, model_error, text_config
from .parallel import Comm, Shard, check_tensor_parallel, checkpoint_shard

__all__ = ["LOAD_FORMATS", "SUPPORTED_MODEL_TYPES", "check_config", "load_decoder", "model_shape"]

LOAD_FORMATS = ("safetensors", "dummy")
#: our fused projection -> the HF projections in it, in ``MergedLinear.sizes`` order
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
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
    check_tensor_parallel(shape.num_heads, shape.num_kv_heads, int(tc.intermediate_size), tp, where)
    rots = {
        i: r if r.dim() == 2 else kv_head_slice(r, tp, rank) for i, r in _check_r_v(r_v, shape, where).items()
    }
    files = _checkpoint_files(Path(model_dir)) if load_format == "safetensors" else []
    model = Decoder(tc, shape, dtype=dtype, device=device, ops=ops, comm=comm)
    with torch.no_grad():
        if load_format == "dummy":
            _fill_dummy(model, seed, rots)
        else:
            sizes = dict(heads=shape.num_heads, kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                         inter=int(tc.intermediate_size), vocab=shape.vocab, tp=tp, rank=rank)  # fmt: skip
            _load_files(model, files, rots, where, lambda key: checkpoint_shard(key, **sizes))
    return model.eval().requires_grad_(False), shape


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


def _targets(model: Decoder) -> dict[str, torch.Tensor]:
    """HF checkpoint name -> the (view of the) parameter it fills."""
    out = {}
    for name, p in model.named_parameters():
        mod_name, _, kind = name.rpartition(".")
        prefix = "" if name.startswith("lm_head.") else "model."
        mod = model.get_submodule(mod_name)
        if isinstance(mod, MergedLinear):
            parent, _, fused = mod_name.rpartition(".")
            for i, part in enumerate(PACKED[fused]):
                out[f"{prefix}{parent}.{part}.{kind}"] = mod.shard(p.detach(), i)
        else:
            out[prefix + name] = p.detach()
    return out


def _absorb(model: Decoder, layer: int, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Write ``w``/``b`` (rounded to the model dtype first) with ``R_V`` folded in into layer's v rows,
    and fold ``R_Vᵀ`` into its ``o_proj`` (already loaded: this rank's input columns)."""
    o = model.layers[layer].self_attn.o_proj.weight.detach()
    o.copy_(absorb_output_weight(o, r, model.shape.head_dim))
    qkv = model.layers[layer].self_attn.qkv_proj
    dst_w = qkv.shard(qkv.weight.detach(), 2)
    dst_b = None if qkv.bias is None else qkv.shard(qkv.bias.detach(), 2)
    w = w.to(device=dst_w.device, dtype=dst_w.dtype)
    b = None if b is None or dst_b is None else b.to(device=dst_b.device, dtype=dst_b.dtype)
    w, b = absorb_value_weight(w, b, r, model.shape.head_dim)
    dst_w.copy_(w)
    if dst_b is not None and b is not None:
        dst_b.copy_(b)


def _read(
    f: Any, key: str, shard: Shard | None, dst: torch.Tensor, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tensor, destination)``: the checkpoint tensor ``key`` (only ``shard``'s slice of it) and
    the part of ``dst`` it fills, with the shapes checked."""
    if shard is None:
        t = f.get_tensor(key)
        got, want = list(t.shape), list(dst.shape)
    else:
        sl = f.get_slice(key)
        dst = dst.narrow(shard.dim, 0, shard.length)  # vocab shards: the padding rows stay zero
        got = list(sl.get_shape())
        want = [shard.full if i == shard.dim else n for i, n in enumerate(dst.shape)]
        if got == want:
            t = sl[(slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.length),)]
    if got != want:
        raise model_error(where, f"{key} has shape {got}; the config gives {want}")
    return t, dst


def _load_files(
    model: Decoder,
    files: list[Path],
    rots: dict[int, torch.Tensor],
    where: str,
    shard_of: Callable[[str], Shard | None] = lambda key: None,
) -> None:
    from safetensors import SafetensorError, safe_open

    targets = _targets(model)
    seen: set[str] = set()
    unexpected: list[str] = []
    held: dict[str, torch.Tensor] = {}  # v_proj tensors of the rotated layers, absorbed at the end
    v_keys = {f"model.layers.{i}.self_attn.v_proj.{kind}" for i in rots for kind in ("weight", "bias")}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    dst = targets.get(key)
                    if dst is None:
                        tied_head = key == "lm_head.weight" and model.lm_head is None
                        if not (tied_head or key.endswith(_IGNORED_SUFFIXES)):
                            unexpected.append(key)
                        continue
                    t, dst = _read(f, key, shard_of(key), dst, where)
                    seen.add(key)
                    if key in v_keys:
                        held[key] = t
                    else:
                        dst.copy_(t)
        except (OSError, SafetensorError) as e:
            raise model_error(where, f"cannot read {path.name} ({e})") from None
    for i, r in rots.items():
        w = held.get(f"model.layers.{i}.self_attn.v_proj.weight")
        if w is not None:  # else it is reported missing below
            _absorb(model, i, r, w, held.get(f"model.layers.{i}.self_attn.v_proj.bias"))
    missing = [k for k in targets if k not in seen]
    if missing or unexpected:
        lists = [(f"{label} {len(ks)}: {', '.join(ks[:6])}" + (" ..." if len(ks) > 6 else ""))
                 for label, ks in (("missing", missing), ("unexpected", unexpected)) if ks]  # fmt: skip
        msg = f"checkpoint does not match its {model.shape.model_type} config: {'; '.join(lists)}"
        raise model_error(where, msg, "the weights must be the HF checkpoint of this config.json")


def _fill_dummy(model: Decoder, seed: int, rots: dict[int, torch.Tensor]) -> None:
    """Seeded N(0, 0.02) weights and biases, RMSNorm weights 1, then ``R_V`` as for real weights."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    for i, r in rots.items():
        qkv = model.layers[i].self_attn.qkv_proj
        b = None if qkv.bias is None else qkv.shard(qkv.bias, 2).clone()
        _absorb(model, i, r, qkv.shard(qkv.weight, 2).clone(), b)
