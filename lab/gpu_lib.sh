# Sourced by the lab/gpu_run*.sh device calls: the checkout's package on the path, the commit for
# the results' provenance, `step NAME` headers, and `sync_out`, which copies to $OUT only the
# results written since the call began (the device returns a limited number of files), and
# benchmarks/history.csv when a run appended to it (its new rows go into the checkout's copy).
# Give COMMIT as a literal hash in the run command: the device copy's git history can be stale.
export PYTHONPATH=$PWD/src
echo "${COMMIT:-unknown}" > benchmarks/results/.commit
_MARK=$(mktemp)
step() { echo "== $1 ($(date +%T))"; }
sync_out() { find benchmarks/results benchmarks/history.csv -type f -newer "$_MARK" -exec cp --parents {} "$OUT/" \; ; }
# SmolLM2 on the device at /tmp/smollm2: join the parts copied to /tmp by the two calls before
# (.gl/a/p1, .gl/c/p2) with .gl/b/p3, check, and convert from GGUF (skipped when already there).
smollm2() {
  [ -d /tmp/smollm2 ] && return 0
  [ -f /tmp/p1 ] || { echo "parts gone"; exit 3; }
  cat /tmp/p1 /tmp/p2 .gl/b/p3 > /tmp/smol.gguf && echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol.gguf" | sha256sum -c --quiet && echo sha-ok
  python -m pip install -q --no-deps --no-index .gl/b/gguf-0.19.0-py3-none-any.whl .gl/b/accelerate-1.16.0-py3-none-any.whl 2>&1 | grep -v WARN | tail -1
  timeout 120 python .gl/b/convert_gguf.py /tmp smol.gguf /tmp/smollm2 > "$OUT/convert.log" 2>&1; echo "convert rc=$?"
}
