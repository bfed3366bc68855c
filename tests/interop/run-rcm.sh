#!/usr/bin/env bash
# Runs tests/interop/rcm-roce.sh in the QEMU harness with the rcm binary, then checks every
# ICRC in the captures with `rcm decode`. Usage: tests/interop/run-rcm.sh RCM_BIN OUT_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
harness=${RCM_INTEROP_HARNESS:-$top/../shared/interop}
rcm=$1 out=$2
mkdir -p "$out"
rc=0
"$harness/run-vm.sh" --quiet --timeout 420 --scenario "$here/rcm-roce.sh" --extra-bin "$rcm" --out "$out" || rc=$?
grep -E '^verdict ' "$out/console.log" || true
for cap in "$out"/s*.pcap; do
    [ -f "$cap" ] || continue
    "$rcm" decode "$cap" > "${cap%.pcap}.txt" || { echo "interop: bad packets in $cap" >&2; rc=1; }
done
if [ "$rc" != 0 ]; then
    echo "interop: failed (rc=$rc); console: $out/console.log" >&2
    exit 1
fi
echo "interop: ok"
