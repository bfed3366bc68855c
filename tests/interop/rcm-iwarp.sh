# Guest scenario (run with --rdma siw): the rcm binary's iWARP devices (plain TCP in netns
# "peer") against the kernel's rdma_cm on siw0, with rdma-core's tools as judges. Prints one
# "verdict NAME rc" line per check; exits 0 only if all passed.
FAIL=0
command -v rcm >/dev/null || { echo "run with --extra-bin .../rcm"; exit 2; }
verdict() { echo "verdict $1 $2"; [ "$2" = 0 ] || FAIL=1; }
# with_siw_param PARAM PORT CAPTURE TAG: with siw's PARAM set to 1, the kernel's ucmatose
# client sends 2 messages of 100 bytes to rcm ping --listen on PORT and takes rcm's 2
# (verdicts ucmatose-siw-client-TAG, rcm-iwarp-passive-TAG); PARAM back to 0, the capture
# decoded into /tmp/CAPTURE.txt.
with_siw_param() {
    siw_param "$1" 1
    cap_start "$3" veth0 tcp
    bg_peer app rcm ping --transport iwarp --listen --bind $PEER_IP -p "$2" -c 1 -C 2 --private-data "" --timeout 40
    sleep 1
    timeout 40 ucmatose -s $PEER_IP -p "$2" -c 1 -C 2 -S 100; verdict "ucmatose-siw-client-$4" $?
    wait_job app 40; verdict "rcm-iwarp-passive-$4" $?
    stop app; cap_stop "$3"
    siw_param "$1" 0
    rcm decode "$HARNESS_OUT/$3.pcap" > "/tmp/$3.txt"
}

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

step "5: messages (RDMAP Sends in FPDUs) with the kernel's ucmatose -C 2 -S 100, both ways"
# ucmatose's server sends all its messages and then receives; its client receives all and
# then answers: rcm sends all of its own before it waits, so neither side waits for the
# other. ucmatose's messages are its buffer (not rcm's format): counted, not checked.
cap_start w5 veth0 tcp
bg srv ucmatose -b $INIT_IP -p 7472 -c 1 -C 2 -S 100
sleep 1
in_peer rcm ping --transport iwarp --connect $INIT_IP --bind $PEER_IP -p 7472 -c 1 -C 2 --private-data "" --timeout 40 > /tmp/w5a.log 2>&1; verdict rcm-iwarp-messages-active $?
cat /tmp/w5a.log
wait_job srv 40; verdict ucmatose-siw-messages-server $?
stop srv
bg_peer app rcm ping --transport iwarp --listen --bind $PEER_IP -p 7473 -c 1 -C 2 --private-data "" --timeout 40
sleep 1
timeout 40 ucmatose -s $PEER_IP -p 7473 -c 1 -C 2 -S 100; verdict ucmatose-siw-messages-client $?
wait_job app 40; verdict rcm-iwarp-messages-passive $?
stop app; cap_stop w5

step "6: IPv6 (2001:2::/48, RFC 5180) both ways"
A6=2001:2::1; B6=2001:2::2
ip -6 addr add $A6/64 dev veth0 nodad
in_peer /usr/sbin/ip -6 addr add $B6/64 dev veth1 nodad
sleep 1
cap_start w6 veth0 tcp
bg srv ucmatose -f ip -b $A6 -p 7471 -c 1 -C 0
sleep 1
in_peer rcm ping --transport iwarp --no-messages --connect $A6 --bind $B6 -c 1 --private-data "" --timeout 30; verdict rcm-iwarp-active-v6 $?
wait_job srv 30; verdict ucmatose-siw-server-v6 $?
stop srv
bg_peer app rcm ping --transport iwarp --no-messages --listen --bind $B6 -c 1 --private-data "" --timeout 40
sleep 1
timeout 30 ucmatose -f ip -s $B6 -b $A6 -p 7471 -c 1 -C 0; verdict ucmatose-siw-client-v6 $?
wait_job app 30; verdict rcm-iwarp-passive-v6 $?
stop app; cap_stop w6
step "7: MPA CRC: the kernel's ucmatose client asks for CRC (siw mpa_crc_required=1), rcm ping --listen agrees"
# rcm answers the C flag with C and then frames every FPDU with CRC32c; siw checks them.
with_siw_param mpa_crc_required 7474 w7 crc
n=$(grep -cE "$PEER_IP:7474 +> +$INIT_IP:[0-9]+ +FPDU_SEND .*crc=ok" /tmp/w7.txt)
echo "rcm FPDUs with a correct CRC: $n"; grep -E "MPA_RE|FPDU" /tmp/w7.txt
grep -q "MPA_REP rev=2 flags=CE" /tmp/w7.txt && [ "$n" = 2 ]; verdict rcm-fpdus-carry-crc $?
step "8: MPA v2 peer-to-peer: the kernel's ucmatose client (siw peer_to_peer=1) offers RTR, rcm ping --listen picks one"
# The client's ready-to-receive message (a zero-length RDMA WRITE, the type rcm chose) must
# come before rcm takes the stream as up; then messages both ways.
with_siw_param peer_to_peer 7475 w8 p2p
grep -E "MPA_RE|FPDU" /tmp/w8.txt
grep -q "MPA_REP rev=2 .*p2p=write " /tmp/w8.txt && grep -q "FPDU_RDMA_WRITE .*len=0" /tmp/w8.txt; verdict p2p-rtr-on-the-wire $?
if [ "$FAIL" != 0 ]; then
  echo "--- siw parameters and counters"
  for f in /sys/module/siw/parameters/* /sys/class/infiniband/siw0/ports/1/counters/* \
           /sys/class/infiniband/siw0/ports/1/hw_counters/*; do
    [ -r "$f" ] && echo "$f = $(cat $f)"
  done
fi
exit $FAIL
