# Sourced by the lab/gpu_run*.sh device calls: the checkout's package on the path, the commit for
# the results' provenance, `step NAME` headers, and `sync_out`, which copies to $OUT only the
# results written since the call began (the device returns a limited number of files).
# Give COMMIT as a literal hash in the run command: the device copy's git history can be stale.
export PYTHONPATH=$PWD/src
echo "${COMMIT:-unknown}" > benchmarks/results/.commit
_MARK=$(mktemp)
step() { echo "== $1 ($(date +%T))"; }
sync_out() { find benchmarks/results -type f -newer "$_MARK" -exec cp --parents {} "$OUT/" \; ; }
