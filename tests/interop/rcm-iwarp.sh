# Guest scenario (run with --rdma siw): the rcm binary's iWARP devices (plain TCP in netns
# "peer") against the kernel's rdma_cm on siw0, with rdma-core's tools as judges. Prints one
# "verdict NAME rc" line per check; exits 0 only if all passed.
FAIL=0
command -v rcm >/dev/null || { echo "run with --extra-bin .../rcm"; exit 2; }
verdict() { echo "verdict $1 $2"; [ "$2" = 0 ] || FAIL=1; }

step "1: rcm ping --transport iwarp connects 3 times to the kernel's ucmatose server on siw0"
cap_start w1 veth0 tcp
bg srv ucmatose -b $INIT_IP -p 7471 -c 3 -C 0
sleep 1
in_peer rcm ping --transport iwarp --no-messages --connect $INIT_IP --bind $PEER_IP -c 3 --private-data "" --timeout 40; verdict rcm-iwarp-active $?
wait_job srv 40; verdict ucmatose-siw-server $?
stop srv; cap_stop w1

step "2: the kernel's ucmatose client on siw0 connects 3 times to rcm ping --transport iwarp --listen"
cap_start w2 veth0 tcp
bg_peer app rcm ping --transport iwarp --no-messages --listen --bind $PEER_IP -c 3 --private-data "" --timeout 40
sleep 1
ucmatose -s $PEER_IP -p 7471 -c 3 -C 0; verdict ucmatose-siw-client $?
wait_job app 40; verdict rcm-iwarp-passive $?
stop app; cap_stop w2

step "3: rcm rejects with private data; the kernel's ucmatose sees REJECTED"
cap_start w3 veth0 tcp
bg_peer app rcm ping --transport iwarp --no-messages --listen --bind $PEER_IP -c 1 --reject --private-data "" --timeout 30
sleep 1
ucmatose -s $PEER_IP -p 7471 -c 1 -C 0 > /tmp/iwrej.log 2>&1
grep -q "RDMA_CM_EVENT_REJECTED" /tmp/iwrej.log; verdict kernel-siw-sees-reject $?
cat /tmp/iwrej.log
wait_job app 30; verdict rcm-iwarp-rejected-as-asked $?
stop app; cap_stop w3

step "4: MPA revision 1 (siw mpa_version=1) both ways"
siw_param mpa_version 1
cap_start w4 veth0 tcp
bg srv ucmatose -b $INIT_IP -p 7471 -c 2 -C 0
sleep 1
in_peer rcm ping --transport iwarp --mpa-version 1 --no-messages --connect $INIT_IP --bind $PEER_IP -c 2 --private-data "" --timeout 40; verdict rcm-iwarp-active-mpa-v1 $?
wait_job srv 40; verdict ucmatose-siw-server-mpa-v1 $?
stop srv
bg_peer app rcm ping --transport iwarp --mpa-version 1 --no-messages --listen --bind $PEER_IP -c 2 --private-data "" --timeout 40
sleep 1
ucmatose -s $PEER_IP -p 7471 -c 2 -C 0; verdict ucmatose-siw-client-mpa-v1 $?
wait_job app 40; verdict rcm-iwarp-passive-mpa-v1 $?
stop app; cap_stop w4
siw_param mpa_version 2
if [ "$FAIL" != 0 ]; then
  echo "--- siw parameters and counters"
  for f in /sys/module/siw/parameters/* /sys/class/infiniband/siw0/ports/1/counters/* \
           /sys/class/infiniband/siw0/ports/1/hw_counters/*; do
    [ -r "$f" ] && echo "$f = $(cat $f)"
  done
fi
exit $FAIL
