"""Convert a GGUF checkpoint into a transformers folder: bf16 safetensors, tokenizer, chat template.

usage: python scripts/convert_gguf.py GGUF_FILE OUT_DIR

The weights are dequantized (Q4_K, Q6_K, Q4_1, Q8_0, ... blocks unpacked by the ``gguf`` package)
and saved in bf16, so the folder loads with plain ``AutoModelForCausalLM.from_pretrained``; the
tokenizer and the chat template come from the GGUF header. The saved config carries no
``quantization_config``: the folder is an ordinary dense checkpoint.

transformers 5.17 dequantizes GGUF weights by default; newer versions keep them packed unless
given ``GgufConfig(dequantize=True)``, which this script passes wherever it exists. The result is
written to a temporary sibling folder and renamed into place at the end, so a failed conversion
never leaves a half-written model behind, and OUT_DIR is refused if it exists and is not empty.

Needs torch, transformers >= 5.17, gguf and accelerate (``scripts/get_smollm2.sh`` and
``scripts/get_qwen25_coder.sh`` install the last two). Used by those scripts; see docs/eval.md.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any


def dequantize_kwargs() -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that make this transformers unpack GGUF weights."""
    import transformers

    cls = getattr(transformers, "GgufConfig", None)
    if cls is not None and "dequantize" in inspect.signature(cls).parameters:
        return {"quantization_config": cls(dequantize=True)}
    return {}  # older versions (5.17) have no switch: they always dequantize


def check_out_dir(out: Path) -> None:
    """Refuse an OUT_DIR that exists and is not an empty folder (never overwrite a user's files)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "holds a model" if (out / "config.json").exists() else "is not an empty folder"
        raise SystemExit(f"convert_gguf: {out} already exists and {what}; refusing to overwrite it")


def convert(gguf_file: Path, out: Path) -> None:
    """Dequantize ``gguf_file`` and save model (bf16), tokenizer and chat template to ``out``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_out_dir(out)
    src, name = str(gguf_file.resolve().parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype=torch.bfloat16, **dequantize_kwargs()
    )
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the model folder gets the usual mode
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for f in tmp.iterdir():  # some writers make private files; give them the usual mode
            f.chmod(0o666 & ~umask)
        check_out_dir(out)  # nobody wrote there meanwhile
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} (transformers {transformers.__version__}, {n:,} parameters)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf_file", type=Path, help="the .gguf checkpoint")
    parser.add_argument("out_dir", type=Path, help="new (or empty) folder for the transformers checkpoint")
    args = parser.parse_args(argv)
    if not args.gguf_file.is_file():
        parser.error(f"no such file: {args.gguf_file}")
    check_out_dir(args.out_dir)
    convert(args.gguf_file, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
