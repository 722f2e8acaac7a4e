"""What a model directory must hold before oscarkv loads its weights, checked in seconds.

:func:`check_model_source` reads ``config.json``, looks for weights and tokenizer files, and
builds the model on the ``meta`` device (no memory, no weights) to see its attention modules:
a causal LM whose every layer is full softmax attention routed through transformers'
``AttentionInterface``. Anything else is a :class:`~oscarkv.errors.ModelError` naming the
directory, what was found and what oscarkv needs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelError
from ..rotation import attention_layer_ids
from ..utils.models import supports_attention_interface

__all__ = ["TOKENIZER_FILES", "ModelInfo", "check_model_config", "check_model_source"]

#: any one of these makes a directory hold a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_NEEDS = "a directory with config.json, weights (*.safetensors) and tokenizer files"


@dataclass(frozen=True)
class ModelInfo:
    """A checked model source: its config and the facts the pre-flight checks use."""

    path: str
    config: Any
    max_positions: int | None


def _listing(d: Path) -> str:
    names = sorted(p.name for p in d.iterdir())
    return ", ".join(names[:8]) + (f", … ({len(names)} entries)" if len(names) > 8 else "") or "nothing"


def _load_config(path: str) -> Any:
    import transformers
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except OSError as e:
        raise ModelError(
            f"model {path}: not a local directory and not loadable as a hub id ({str(e).splitlines()[0][:200]})",
            f"pass {_NEEDS}",
        ) from None
    except Exception as e:  # unknown model_type, strict config field checks: all mean "bad config"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelError(
            f"model {path}: transformers {transformers.__version__} cannot read its config ({first[:200]})",
            "an unknown model_type needs a newer transformers; otherwise fix config.json",
        ) from None


def _check_files(d: Path) -> None:
    """Headers of the weight files and the tokenizer JSON parse (truncated copies fail here)."""
    from safetensors import safe_open

    for f in sorted(d.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:  # safetensors raises its own types for a bad header or size
            raise ModelError(
                f"model {d}: {f.name} is truncated or corrupt ({type(e).__name__}: {str(e).splitlines()[0][:120]})",
                "copy the model files again",
            ) from None
    tj = d / "tokenizer.json"
    if tj.is_file():
        try:
            json.loads(tj.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelError(
                f"model {d}: tokenizer.json is not valid JSON ({e})", "copy the tokenizer files again"
            ) from None


def check_model_source(path: str, weights: bool = True) -> ModelInfo:
    """Check that ``path`` (a local directory, or a hub id) is a model oscarkv can load and cache.

    Local directories are checked file by file (config.json parses, weights and a tokenizer are
    present) before the config is read; then :func:`check_model_config`. ``weights=False``: a
    directory without weight files passes (the engine's ``load_format="dummy"``). Raises
    ModelError.
    """
    p = Path(path).expanduser()
    if not p.exists():
        if not _HUB_ID.match(path):
            raise ModelError(f"model {path}: no such directory", f"pass {_NEEDS}")
    elif not p.is_dir():
        raise ModelError(f"model {path}: is a file; expected a model directory", f"pass {_NEEDS}")
    else:
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise ModelError(
                f"model {path}: not a model directory (no config.json; it holds {_listing(p)})",
                f"pass {_NEEDS}",
            )
        try:
            raw = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelError(f"model {path}: config.json is not valid JSON ({e})") from None
        if not isinstance(raw, dict) or "model_type" not in raw:
            raise ModelError(f"model {path}: config.json has no model_type; expected a transformers config")
        if weights and not any(next(p.glob(g), None) for g in _WEIGHTS):
            raise ModelError(
                f"model {path}: no weights (no *.safetensors or pytorch_model*.bin; it holds {_listing(p)})",
                "copy the weights next to config.json",
            )
        _check_files(p)
        if not any((p / n).is_file() for n in TOKENIZER_FILES):
            raise ModelError(
                f"model {path}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)})",
                "copy the tokenizer files next to config.json; without them the text cannot be encoded",
            )
    config = _load_config(path)
    check_model_config(config, path)
    text = config.get_text_config()
    mp = getattr(text, "max_position_embeddings", None)
    if isinstance(mp, int) and mp < 2:
        raise ModelError(
            f"model {path}: config.json says max_position_embeddings {mp}; a causal LM needs >= 2"
        )
    return ModelInfo(path, config, mp if isinstance(mp, int) else None)


def check_model_config(config: Any, name: str = "model") -> None:
    """Raise ModelError unless ``config`` describes a causal LM oscarkv can cache (see module doc)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils import logging as hf_logging

    mt = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False) or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelError(
            f"model {name}: model_type {mt!r} is not a decoder-only causal language model",
            "oscarkv caches decoder-only LMs (Llama, Mistral, Qwen2/Qwen3, Gemma, SmolLM, ...)",
        )
    text = config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or [])
    sliding = [k for k in kinds if "sliding" in k or "chunked" in k]
    window = getattr(text, "sliding_window", None)
    if sliding or (window and getattr(text, "use_sliding_window", True)):
        raise ModelError(
            f"model {name}: uses sliding-window attention ({', '.join(sliding) or f'window {window}'}); "
            "oscarkv keeps every token and supports full attention only"
        )
    ids = attention_layer_ids(text)
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    if not ids:
        raise ModelError(
            f"model {name}: model_type {mt!r} has no softmax attention layers "
            "(state-space and RNN models keep no KV cache)"
        )
    if ids != list(range(n)):
        raise ModelError(
            f"model {name}: mixes attention with other layer types ({sorted(kinds)}); "
            "oscarkv supports models whose every layer is full attention"
        )
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # building an encoder as a causal LM logs advice we replace
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        hf_logging.set_verbosity(level)
    if not supports_attention_interface(model):
        raise ModelError(
            f"model {name}: {type(model).__name__} does not route attention through transformers' "
            "AttentionInterface, so oscarkv cannot see its keys and values",
            "supported: models whose attention calls ALL_ATTENTION_FUNCTIONS (Llama, Qwen3, ...)",
        )
    attn = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    if not attn:
        raise ModelError(
            f"model {name}: {type(model).__name__} has no softmax attention layers "
            "(state-space and RNN models keep no KV cache)"
        )
    if not all(m.is_causal for m in attn):
        raise ModelError(f"model {name}: {type(model).__name__} has bidirectional (encoder) attention")
