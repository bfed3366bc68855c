#!/usr/bin/env bash
# Runs a scenario (default tests/interop/rcm-roce.sh on soft-RoCE) in the QEMU harness with the
# rcm binary, then checks every ICRC / MPA CRC in the captures with `rcm decode`.
# Usage: tests/interop/run-rcm.sh RCM_BIN OUT_DIR [SCENARIO.sh] [rxe|siw]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
harness=${RCM_INTEROP_HARNESS:-$top/../shared/interop}
rcm=$1 out=$2 scenario=${3:-$here/rcm-roce.sh} rdma=${4:-rxe}
mkdir -p "$out"
rc=0
"$harness/run-vm.sh" --quiet --timeout 420 --rdma "$rdma" --scenario "$scenario" --extra-bin "$rcm" --out "$out" || rc=$?
grep -E '^verdict ' "$out/console.log" || true
for cap in "$out"/*.pcap; do
    [ -f "$cap" ] || continue
    "$rcm" decode "$cap" > "${cap%.pcap}.txt" || { echo "interop: bad packets in $cap" >&2; rc=1; }
done
if [ "$rc" != 0 ]; then
    # What failed, with the kernel tools' output and counters (both in the console log) and
    # rcm's decode of every capture.
    echo "interop: failed (rc=$rc); console: $out/console.log" >&2
    tail -n 200 "$out/console.log" >&2 || true
    for txt in "$out"/*.txt; do
        [ -f "$txt" ] || continue
        echo "--- rcm decode of ${txt%.txt}.pcap" >&2
        cat "$txt" >&2
    done
    exit 1
fi
echo "interop: ok"
