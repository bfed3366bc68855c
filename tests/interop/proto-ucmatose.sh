# Guest scenario (busybox sh, sourced by the harness in the init netns): the sans-IO engine,
# driven over a plain UDP socket by the `udp_peer` example in netns "peer", against the
# kernel's rdma_cm on rxe0 with rdma-core's ucmatose as the judge.
#   1. rcm active  -> kernel passive: ucmatose server (-C 0), N connections
#   2. kernel active -> rcm passive: ucmatose client (-C 0), N connections
# Exit 0 only if both tools and both udp_peer runs exit 0.
N=${N:-2}
FAIL=0
command -v udp_peer >/dev/null || { echo "run with --extra-bin .../udp_peer"; exit 2; }

step "1: rcm connects $N times to the kernel's ucmatose server"
cap_start active veth0
bg srv ucmatose -b $INIT_IP -p 7471 -c $N -C 0
sleep 1
in_peer udp_peer connect $PEER_IP $INIT_IP 7471 $N; r=$?
echo "udp_peer connect rc=$r"; [ $r = 0 ] || FAIL=1
wait_job srv 30; r=$?
echo "ucmatose server rc=$r"; [ $r = 0 ] || FAIL=1
stop srv
cap_stop active

step "2: the kernel's ucmatose client connects $N times to rcm"
cap_start passive veth0
bg_peer app udp_peer listen $PEER_IP 7471 $N
i=0; until grep -q listening /tmp/app.log 2>/dev/null; do
  i=$((i+1)); [ $i -gt 100 ] && { echo "udp_peer did not start"; FAIL=1; break; }; sleep 0.1
done
ucmatose -s $PEER_IP -p 7471 -c $N -C 0; r=$?
echo "ucmatose client rc=$r"; [ $r = 0 ] || FAIL=1
wait_job app 30; r=$?
echo "udp_peer listen rc=$r"; [ $r = 0 ] || FAIL=1
stop app
cap_stop passive
exit $FAIL
