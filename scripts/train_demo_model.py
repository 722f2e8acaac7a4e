"""Train the tiny demo model bundled with oscarkv (run once; the result is committed).

The model is a Qwen3-architecture causal LM small enough to ship in the wheel (< 6 MB in bf16)
with the head dim of real models (128) and grouped-query attention, trained on the Python
standard library's own sources (on every machine, so the training data needs no shipping; the
``eval`` split of ``oscarkv.calibration.data.default_corpus`` is held out).

    python scripts/train_demo_model.py tokenizer --out src/oscarkv/assets/demo-model     # CPU, seconds
    python scripts/train_demo_model.py model --out src/oscarkv/assets/demo-model --minutes 4  # GPU
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=2048,
              rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=0,
              eos_token_id=0, pad_token_id=0)  # fmt: skip


def _texts(split: str) -> list[str]:
    from oscarkv.calibration.data import default_corpus

    return [p.read_text(encoding="utf-8", errors="replace") for p in default_corpus(split)]


def train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_texts("calib"), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=CONFIG["max_position_embeddings"],
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    print(f"tokenizer with {tok.get_vocab_size()} tokens -> {out}")


def train_model(out: Path, minutes: float, seq: int, batch: int, lr: float, device: str = "cuda") -> None:
    import numpy as np
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    dev = torch.device(device)
    tok = AutoTokenizer.from_pretrained(out)
    t0 = time.time()
    enc = tok(_texts("calib"), add_special_tokens=False, verbose=False)["input_ids"]
    ids = np.fromiter((t for doc in enc for t in (*doc, tok.eos_token_id)), dtype=np.int16)
    data = torch.from_numpy(ids.astype(np.int64)).to(dev)
    print(f"{len(data) / 1e6:.1f}M training tokens (tokenized in {time.time() - t0:.0f}s)", flush=True)
    cfg = Qwen3Config(**CONFIG)
    model = Qwen3ForCausalLM(cfg).to(dev)
    model.config._attn_implementation = "sdpa"
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda"
    )
    budget, warmup = minutes * 60, 100
    step, start, losses = 0, time.time(), []
    model.train()
    while (elapsed := time.time() - start) < budget:
        frac = elapsed / budget
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        off = torch.randint(0, len(data) - seq, (batch,), device=dev)
        x = data[off[:, None] + torch.arange(seq, device=dev)]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = model(input_ids=x, labels=x).loss  # transformers shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item()) if step % 50 == 0 else None
        if step % (500 if dev.type == "cuda" else 50) == 0:
            print(f"step {step} loss {loss.item():.3f} ({elapsed:.0f}s)", flush=True)
        step += 1
    model.eval()
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    summary = {"steps": step, "seq": seq, "batch": batch, "lr": lr, "minutes": minutes,
               "train_tokens_M": round(step * seq * batch / 1e6, 1), "final_loss": losses[-1] if losses else None,
               "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
               "data": "Python standard library sources, oscarkv 'calib' split"}  # fmt: skip
    (out / "training_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["tokenizer", "model"])
    ap.add_argument("--out", type=Path, default=Path("src/oscarkv/assets/demo-model"))
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.what == "tokenizer":
        train_tokenizer(args.out)
    else:
        train_model(args.out, args.minutes, args.seq, args.batch, args.lr, args.device)


if __name__ == "__main__":
    main()
