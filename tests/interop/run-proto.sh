#!/usr/bin/env bash
# Runs tests/interop/proto-ucmatose.sh in the QEMU harness (../shared/interop) with the
# udp_peer example, then checks the captures with `rcm decode`. Needs root (QEMU, apt).
# Usage: tests/interop/run-proto.sh UDP_PEER_BIN RCM_BIN OUT_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
harness=${RCM_INTEROP_HARNESS:-$top/../shared/interop}
peer=$1 rcm=$2 out=$3
mkdir -p "$out"
rc=0
"$harness/run-vm.sh" --quiet --timeout 200 --scenario "$here/proto-ucmatose.sh" \
    --extra-bin "$peer" --out "$out" || rc=$?
grep -E 'udp_peer|ucmatose (server|client) rc' "$out/console.log" | grep -E 'rc=|established=' || true
if [ "$rc" != 0 ]; then
    echo "interop: scenario failed (rc=$rc); console: $out/console.log" >&2
    tail -40 "$out/console.log" >&2
    exit 1
fi
for cap in active passive; do
    "$rcm" decode "$out/$cap.pcap" > "$out/$cap.txt"
    for msg in REQ REP RTU DREQ DREP; do
        grep -q " $msg " "$out/$cap.txt" || { echo "interop: no $msg in $cap capture" >&2; exit 1; }
    done
    if grep -q 'crc=bad' "$out/$cap.txt"; then echo "interop: bad ICRC in $cap" >&2; exit 1; fi
done
echo "interop: ok"
