# Guest scenario (--rdma rxe): connection-setup rates side by side on the same emulated CPU.
# kernel<->kernel: rdma-core's cmtime client and server over rxe0 (loopback through rxe);
# rcm<->rcm: `rcm bench` on its embedded loopback devices in netns peer, then the same through
# an `rcm daemon` (the hop, as the kernel's tools cross ucma); mixed: the kernel's
# cmtime client against `rcm bench --listen`. N connections in flight each time. Prints one
# "rate NAME CONN_PER_S" line per run and a verdict line per tool.
FAIL=0
N=100
command -v rcm >/dev/null || { echo "run with --extra-bin .../rcm"; exit 2; }
verdict() { echo "verdict $1 $2"; [ "$2" = 0 ] || FAIL=1; }
# cmtime (rdma-core 44) prints "connect : total_ms ..." for the whole burst.
cmtime_rate() { awk -v n=$N '/^connect *:/ { if ($3 > 0) printf "%.0f", n * 1000 / $3 }' "$1"; }

step "1: kernel <-> kernel: cmtime over rxe0, $N connections in flight"
bg ksrv cmtime -b $INIT_IP
sleep 1
cmtime -s $INIT_IP -c $N > /tmp/kk.log 2>&1; verdict cmtime-kernel-kernel $?
cat /tmp/kk.log
stop ksrv
echo "rate kernel-kernel $(cmtime_rate /tmp/kk.log)"

step "2: rcm <-> rcm: rcm bench on loopback in netns peer, $N connections in flight"
in_peer rcm bench -c $N --json > /tmp/rr.json 2>/dev/null; verdict rcm-bench-rcm-rcm $?
# The cm connect + establish steps, to compare with cmtime's connect step.
awk -v n=$N '
  /"step": "cm connect"/ { c = 1 } /"step": "establish"/ { e = 1 }
  /"total_us"/ { if (c == 1) { tc = $2 + 0; c = 2 } if (e == 1) { te = $2 + 0; e = 2 } }
  END { if (tc + te > 0) printf "rate rcm-rcm %.0f\n", n * 1e6 / (tc + te) }' /tmp/rr.json
grep -E '"conn_per_s"' /tmp/rr.json

step "2b: rcm <-> rcm through one rcm daemon (the hop beside the kernel's ucma), $N in flight"
bg_peer dmn rcm daemon --socket /tmp/rcm.sock --bind 127.0.0.1 --bind 127.0.0.2
sleep 1
in_peer rcm bench --daemon /tmp/rcm.sock -c $N --json > /tmp/rd.json 2>/dev/null; verdict rcm-bench-daemon $?
awk -v n=$N '
  /"step": "cm connect"/ { c = 1 } /"step": "establish"/ { e = 1 }
  /"total_us"/ { if (c == 1) { tc = $2 + 0; c = 2 } if (e == 1) { te = $2 + 0; e = 2 } }
  END { if (tc + te > 0) printf "rate rcm-daemon %.0f\n", n * 1e6 / (tc + te) }' /tmp/rd.json
grep -E '"conn_per_s"' /tmp/rd.json
stop dmn

step "3: mixed: the kernel's cmtime client against rcm bench --listen"
bg_peer bsrv rcm bench --listen --bind $PEER_IP
sleep 1
cmtime -s $PEER_IP -c $N > /tmp/kr.log 2>&1; verdict cmtime-kernel-to-rcm $?
cat /tmp/kr.log
stop bsrv
for p in $(pidof rcm); do kill -9 $p; done
echo "rate kernel-rcm $(cmtime_rate /tmp/kr.log)"
exit $FAIL
