"""Tiny random-weight checkpoints of the mixture-of-experts families, written with transformers.

Per-layer shapes follow the real models where it matters to the engine: head_dim 128, GQA with 2
KV heads (so tensor_parallel=2 splits them), each family's router, partial rotary where the
family has it, shared experts and dense first layers (GLM). Hidden sizes and expert counts are
small so the CPU suite runs them in seconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

MOE_KINDS = ("qwen3_moe", "glm4_moe", "glm4_moe_qknorm", "minimax_m2")
VOCAB = 2048  # the demo tokenizer's
COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
              max_position_embeddings=512, num_hidden_layers=3, tie_word_embeddings=False)  # fmt: skip


def moe_config(kind: str):
    """The config of a tiny ``kind`` model (``glm4_moe_qknorm``: GLM with ``use_qk_norm``)."""
    from transformers import AutoConfig

    if kind == "qwen3_moe":
        return AutoConfig.for_model("qwen3_moe", **COMMON, intermediate_size=96, moe_intermediate_size=64,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                    mlp_only_layers=[1])  # fmt: skip
    if kind.startswith("glm4_moe"):
        return AutoConfig.for_model("glm4_moe", **COMMON, intermediate_size=96, moe_intermediate_size=64,
                                    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                    first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                                    norm_topk_prob=True, attention_bias=True, partial_rotary_factor=0.5,
                                    use_qk_norm=kind.endswith("qknorm"), num_nextn_predict_layers=0,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    if kind == "minimax_m2":
        return AutoConfig.for_model("minimax_m2", **COMMON, intermediate_size=64, num_local_experts=8,
                                    num_experts_per_tok=2, rotary_dim=64, scoring_func="sigmoid",
                                    use_routing_bias=True, bos_token_id=1, eos_token_id=2,
                                    pad_token_id=0)  # fmt: skip
    raise ValueError(kind)


def write_moe_model(kind: str, out: Path, seed: int = 1, config=None) -> Path:
    """A random-weight ``kind`` model saved to ``out`` with the demo model's tokenizer: embeddings
    scaled so greedy choices are not near-ties, norm weights around 1, correction biases nonzero
    (they change which experts are chosen, never the weights)."""
    from transformers import AutoModelForCausalLM

    from oscarkv.demo import demo_model_path

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config if config is not None else moe_config(kind))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(40)
        model.get_output_embeddings().weight.mul_(20)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.7, 1.3)
            elif "gate.weight" in name:  # routers: spread scores so top-k choices are clear
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_path() / f, out / f)
    return out
