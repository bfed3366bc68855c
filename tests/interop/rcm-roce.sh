# Guest scenario: the rcm binary (in netns "peer", a plain IP stack) against the kernel's
# rdma_cm on rxe0, with rdma-core's tools as judges. Prints one "verdict NAME rc" line per
# check; exits 0 only if all passed.
FAIL=0
command -v rcm >/dev/null || { echo "run with --extra-bin .../rcm"; exit 2; }
verdict() { echo "verdict $1 $2"; [ "$2" = 0 ] || FAIL=1; }
# ud_sends_on_the_wire CAPTURE RCM KERNEL VERDICT: in the capture, 10 UD SENDs from rcm's
# address (a grep pattern) to the kernel's, each ICRC correct, and 10 the other way.
ud_sends_on_the_wire() {
    rcm decode "$HARNESS_OUT/$1.pcap" > "/tmp/$1.txt"; local r=$?
    local n k
    n=$(grep -cE "$2:[0-9]+ +> +$3:[0-9]+ +UD_SEND_ONLY_IMM .*crc=ok" "/tmp/$1.txt")
    k=$(grep -cE "$3:[0-9]+ +> +$2:[0-9]+ +UD_SEND_ONLY_IMM" "/tmp/$1.txt")
    echo "$4: rcm UD SENDs with a good ICRC: $n; the kernel's UD SENDs to rcm: $k; decode rc=$r"
    grep UD_SEND "/tmp/$1.txt" | head -4
    [ "$r" = 0 ] && [ "$n" = 10 ] && [ "$k" = 10 ]; verdict "$4" $?
}

step "1: rcm ping connects 3 times to the kernel's ucmatose server (-C 0)"
cap_start s1 veth0
bg srv ucmatose -b $INIT_IP -p 7471 -c 3 -C 0
sleep 1
# ucmatose answers with no private data, so expect none back.
in_peer rcm ping --connect $INIT_IP --bind $PEER_IP -c 3 --private-data "" --timeout 40; verdict rcm-active $?
wait_job srv 40; verdict ucmatose-server $?
stop srv; cap_stop s1

step "2: the kernel's ucmatose client connects 3 times to rcm ping --listen"
cap_start s2 veth0
bg_peer app rcm ping --listen --bind $PEER_IP -c 3 --private-data "" --timeout 40
sleep 1
ucmatose -s $PEER_IP -p 7471 -c 3 -C 0; verdict ucmatose-client $?
wait_job app 40; verdict rcm-passive $?
stop app; cap_stop s2

step "3: rejects"
cap_start s3 veth0
bg_peer app rcm ping --listen --bind $PEER_IP -c 1 --reject --private-data "" --reject-data "rcm says no" --timeout 30
sleep 1
ucmatose -s $PEER_IP -p 7999 -c 1 -C 0 > /tmp/rej8.log 2>&1
grep -q "RDMA_CM_EVENT_REJECTED, error: 8" /tmp/rej8.log; verdict kernel-sees-reject-8 $?
cat /tmp/rej8.log
ucmatose -s $PEER_IP -p 7471 -c 1 -C 0 > /tmp/rej28.log 2>&1
grep -q "RDMA_CM_EVENT_REJECTED, error: 28" /tmp/rej28.log; verdict kernel-sees-consumer-reject-28 $?
cat /tmp/rej28.log
wait_job app 30; verdict rcm-rejected-as-asked $?
stop app
in_peer rcm ping --connect $INIT_IP --bind $PEER_IP -p 7999 -c 1 --timeout 20 > /tmp/norcv.log 2>&1
grep -q "rejected, reason 8" /tmp/norcv.log; verdict rcm-sees-reject-8 $?
cat /tmp/norcv.log
cap_stop s3
# The consumer reject carried rcm's private data ("rcm says no") on the wire.
rcm decode -v $HARNESS_OUT/s3.pcap | grep -q 'private_data = 72636d2073617973206e6f'; verdict rej-carries-private-data $?

step "4: kernel cmtime client (50 connections in flight) against rcm bench --listen"
cap_start s4 veth0
bg_peer bsrv rcm bench --listen --bind $PEER_IP
sleep 1
cmtime -s $PEER_IP -c 50 > /tmp/cmtime.log 2>&1; verdict cmtime-client-50 $?
cat /tmp/cmtime.log
stop bsrv
# bg_peer's PID is the wrapper's; end the rcm server it started (this VM runs only our jobs).
for p in $(pidof rcm); do kill -9 $p; done
sleep 0.5
cap_stop s4

step "5: rcm bench (50 connections in flight) against the kernel's cmtime server"
cap_start s5 veth0
bg csrv cmtime -b $INIT_IP
sleep 1
in_peer rcm bench --server $INIT_IP --bind $PEER_IP -c 50 --timeout 60 > /tmp/rbench.log 2>&1; verdict rcm-bench-vs-cmtime-server $?
cat /tmp/rbench.log
stop csrv
cap_stop s5

step "7: UD (SIDR): rcm ping --ps udp against the kernel's udaddy, both ways"
cap_start s7 veth0
bg usrv udaddy -b $INIT_IP -c 1 -C 0
sleep 1
in_peer rcm ping --ps udp --connect $INIT_IP --bind $PEER_IP -c 1 --messages 0 --private-data "" --timeout 30; verdict rcm-sidr-active $?
wait_job usrv 30; verdict udaddy-server $?
stop usrv
bg_peer uapp rcm ping --ps udp --listen --bind $PEER_IP -c 1 --messages 0 --private-data "" --timeout 30
sleep 1
udaddy -s $PEER_IP -c 1 -C 0; verdict udaddy-client $?
wait_job uapp 30; verdict rcm-sidr-passive $?
stop uapp
cap_stop s7

step "7b: UD datagrams: SIDR, then 5 UD SENDs each way between rcm and the kernel's udaddy"
# udaddy (-C 5 -S 100) sends SEND-with-immediate (its QPN) and waits for as many receives,
# polling forever: it exits 0 only once rxe accepted 5 of rcm's UD packets.
cap_start s7b veth0
bg usrv udaddy -b $INIT_IP -c 1 -C 5 -S 100
sleep 1
in_peer rcm ping --ps udp --connect $INIT_IP --bind $PEER_IP -c 1 --messages 5 --size 100 --private-data "" --timeout 30; verdict rcm-ud-active $?
wait_job usrv 30; verdict udaddy-server-ud $?
stop usrv
bg_peer uapp rcm ping --ps udp --listen --bind $PEER_IP -c 1 --messages 5 --private-data "" --timeout 40
sleep 1
timeout 30 udaddy -s $PEER_IP -c 1 -C 5 -S 100; verdict udaddy-client-ud $?
wait_job uapp 30; verdict rcm-ud-passive $?
stop uapp
cap_stop s7b
# rcm's UD SENDs on the wire: 10 (5 per run), every ICRC correct over the real IP header.
ud_sends_on_the_wire s7b "$PEER_IP" "$INIT_IP" ud-sends-on-the-wire

step "8: rcm daemon owns the peer's CM port; rcm ping --daemon connects to the kernel's ucmatose"
cap_start s8 veth0
bg_peer dmn rcm daemon --socket /tmp/rcm-vm.sock --bind $PEER_IP
sleep 1
bg srv ucmatose -b $INIT_IP -p 7471 -c 2 -C 0
sleep 1
in_peer rcm ping --daemon /tmp/rcm-vm.sock --connect $INIT_IP -c 2 --private-data "" --timeout 40; verdict rcm-via-daemon-active $?
wait_job srv 40; verdict ucmatose-server-vs-daemon $?
stop srv
# The daemon exits 0 on SIGTERM once every id is destroyed (this VM runs only our jobs).
for p in $(pidof rcm); do kill -TERM $p; done
sleep 1
[ -e /tmp/rcm-vm.sock ]; [ $? != 0 ]; verdict daemon-removed-its-socket $?
cap_stop s8

step "9: IPv6 (2001:2::/48, RFC 5180): RC both ways, SIDR and 5 UD SENDs each way, cmtime -c 50 each way"
# rxe sends RoCEv2 over IPv6 with UDP checksum 0; rcm's IPv6 devices take such datagrams
# (UDP_NO_CHECK6_RX), without which they never heard the kernel. The kernel checks rcm's ICRC
# over the IPv6 header (rxe drops a bad one): udaddy exits 0 only after 5 of rcm's UD SENDs.
A6=2001:2::1; B6=2001:2::2
ip -6 addr add $A6/64 dev veth0 nodad
in_peer /usr/sbin/ip -6 addr add $B6/64 dev veth1 nodad
sleep 1
cap_start s9 veth0
bg srv ucmatose -f ip -b $A6 -p 7471 -c 1 -C 0
sleep 1
in_peer rcm ping --connect $A6 --bind $B6 -c 1 --private-data "" --timeout 30; verdict rcm-active-v6 $?
wait_job srv 30; verdict ucmatose-server-v6 $?
stop srv
bg_peer app rcm ping --listen --bind $B6 -c 1 --private-data "" --timeout 40
sleep 1
timeout 30 ucmatose -f ip -s $B6 -b $A6 -p 7471 -c 1 -C 0; verdict ucmatose-client-v6 $?
wait_job app 30; verdict rcm-passive-v6 $?
stop app
bg usrv udaddy -b $A6 -c 1 -C 5 -S 100
sleep 1
in_peer rcm ping --ps udp --connect $A6 --bind $B6 -c 1 --messages 5 --size 100 --private-data "" --timeout 30; verdict rcm-ud-active-v6 $?
wait_job usrv 30; verdict udaddy-server-ud-v6 $?
stop usrv
bg_peer uapp rcm ping --ps udp --listen --bind $B6 -c 1 --messages 5 --private-data "" --timeout 40
sleep 1
timeout 30 udaddy -s $B6 -b $A6 -c 1 -C 5 -S 100; verdict udaddy-client-ud-v6 $?
wait_job uapp 30; verdict rcm-ud-passive-v6 $?
stop uapp
cap_stop s9
ud_sends_on_the_wire s9 "\[$B6\]" "\[$A6\]" ud-sends-on-the-wire-v6
# 50 connections in flight each way over IPv6: rcm's REPs and DREQs to one peer leave in
# segmented sends, whose every datagram's ICRC rxe checks.
cap_start s9b veth0
bg_peer bsrv rcm bench --listen --bind $B6
sleep 1
timeout 60 cmtime -s $B6 -b $A6 -c 50 > /tmp/cmtime6.log 2>&1; verdict cmtime-client-50-v6 $?
cat /tmp/cmtime6.log
stop bsrv
for p in $(pidof rcm); do kill -9 $p; done
sleep 0.5
bg csrv cmtime -b $A6
sleep 1
in_peer rcm bench --server $A6 --bind $B6 -c 50 --timeout 60 > /tmp/rbench6.log 2>&1; verdict rcm-bench-vs-cmtime-server-v6 $?
cat /tmp/rbench6.log
stop csrv
cap_stop s9b

step "10: an MRA from the kernel: its ucmatose server stopped while rcm's REQ arrives"
# ib_cm answers rcm's repeated REQ with an MRA (service timeout 24, ~69 s); rcm must wait
# that long instead of giving up at its own deadline, and complete once the server runs.
cap_start s10 veth0
bg srv ucmatose -b $INIT_IP -p 7474 -c 1 -C 0
sleep 1
SP=$(cat /tmp/srv.pid); kill -STOP $SP
bg_peer cli rcm ping --connect $INIT_IP --bind $PEER_IP -p 7474 -c 1 --private-data "" --timeout 120
sleep 12
kill -CONT $SP
wait_job cli 100; verdict rcm-active-after-mra $?
stop cli
wait_job srv 20; verdict ucmatose-server-after-mra $?
stop srv
cap_stop s10
rcm decode $HARNESS_OUT/s10.pcap > /tmp/s10.txt
grep -q " MRA .*mraed=Req service_timeout=24" /tmp/s10.txt; verdict kernel-sent-mra $?

step "11: SIDR to a port with no kernel listener (status 1), and rcm rejecting the kernel's SIDR_REQ (status 2)"
in_peer rcm ping --ps udp --connect $INIT_IP --bind $PEER_IP -p 7999 -c 1 --messages 0 --timeout 20 > /tmp/sidr1.log 2>&1; r=$?
cat /tmp/sidr1.log
[ "$r" = 1 ] && grep -q "UNREACHABLE: SIDR status 1 (UnsupportedServiceId)" /tmp/sidr1.log; verdict rcm-sees-sidr-no-service $?
# And the other way: rcm rejects the kernel's SIDR_REQ (status 2), udaddy sees UNREACHABLE 2.
bg_peer uapp rcm ping --ps udp --listen --bind $PEER_IP -c 1 --reject --messages 0 --private-data "" --timeout 30
sleep 1
udaddy -s $PEER_IP -c 1 -C 0 > /tmp/sidrrej.log 2>&1
cat /tmp/sidrrej.log
grep -q "RDMA_CM_EVENT_UNREACHABLE, error: 2" /tmp/sidrrej.log; verdict udaddy-sees-sidr-reject $?
wait_job uapp 30; verdict rcm-sidr-rejected-as-asked $?
stop uapp

step "6: timewait agreement: the kernel never had to retry a DREQ or DREP to rcm"
r=0
for f in /sys/class/infiniband/rxe0/ports/1/cm_tx_retries/dreq /sys/class/infiniband/rxe0/ports/1/cm_tx_retries/drep; do
  [ -r "$f" ] || continue
  n=$(cat "$f"); echo "$f = $n"; [ "$n" = 0 ] || r=1
done
verdict no-stray-dreq-retries $r
if [ "$FAIL" != 0 ]; then
  echo "--- rdma counters (rxe0)"
  for f in /sys/class/infiniband/rxe0/ports/1/counters/* /sys/class/infiniband/rxe0/ports/1/hw_counters/* \
           /sys/class/infiniband/rxe0/ports/1/cm_rx_msgs/* /sys/class/infiniband/rxe0/ports/1/cm_tx_msgs/*; do
    [ -r "$f" ] && echo "$f = $(cat $f)"
  done
fi
exit $FAIL
