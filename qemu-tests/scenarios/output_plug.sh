# hosts: 2
# vms: yes
# timeout: 360
# The output gate (hagctl's plug.rs: sch_plug over rtnetlink) on a real
# interface. Host 0 plugs its eth0 with plug_gate (hagctl's example, the
# gate driven by hand) and runs hag-guest --report (its CPU workload alone)
# towards host 1, where `hag-guest listen` is the outside client; host 0
# asks the client what it has seen over eth1, which is not plugged.
#  A: a whole run held from attach; a boundary alone releases nothing;
#     release_one lets out exactly the run's datagrams.
#  B: epochs while the run goes (Remus's pipeline: boundary i+1 before
#     release i): each release lets out exactly the epoch before the last
#     boundary; a second boundary before a release is refused.
#  C: the gate's owner is killed while it holds: nothing leaves; the next
#     attach drops what it held, so it never arrives; detach restores the
#     default qdisc.
# Host 1 then judges each client log with guest/client_check.py (python3
# from the runner's root, hence vms: yes).
me=$(host_ip "$HAG_HOST")
peer=$(host_ip $((1 - HAG_HOST)))
side=$(host_ip2 $((1 - HAG_HOST)))

if [ "$HAG_HOST" = 1 ]; then
	step "host 1: three clients listen (UDP 7100-7102 on eth0, counts on TCP 7110-7112)"
	port=7100
	for c in a b c; do
		hag-guest listen --port "$port" --query-port $((port + 10)) >"/tmp/client-$c.log" 2>"/tmp/client-$c.err" &
		port=$((port + 1))
	done
	for q in 7110 7111 7112; do
		wait_for 30 port_listening "$q" || fail "the client's count port $q is not listening: $(cat /tmp/client-*.err)"
	done
	host_root_up
	signal_ready 7000
	step "host 1: waiting for host 0 to finish"
	nc -l -p 7001 </dev/null >/tmp/done || fail "host 0's end signal failed"
	expect_eq "host 0's end signal" "$(cat /tmp/done)" "done"
	for c in a b c; do
		echo "--- client $c saw:"
		cat "/tmp/client-$c.log"
		in_root python3 /hag/client_check.py --require-pass "/tmp/client-$c.log" ||
			fail "client $c's view does not hold"
	done
	exit 0
fi

# ---- host 0 ----------------------------------------------------------------
step "host 0: plug_gate --selfcheck-here (the unit test's check, on this host's lo)"
[ -x /bin/plug_gate ] || fail "no /bin/plug_gate in the initramfs: build it (make controller)"
# The test kernel has no network namespaces, so it runs on the host's own lo.
plug_gate --selfcheck-here || fail "the gate's own check failed on this kernel"

step "host 0 reaches host 1 on eth0 and on eth1; host 1's ARP entry is made permanent"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
# The plug holds ARP too: a neighbour entry that went stale while held
# would be probed through the plug, fail and drop what waits on it.
mac=$(awk -v ip="$peer" '$1 == ip { print $4 }' /proc/net/arp)
[ -n "$mac" ] || fail "no ARP entry for $peer: $(cat /proc/net/arp)"
arp -i eth0 -s "$peer" "$mac"
await_ready "$side" 7000

# count PORT: how many datagrams the client on host 1 has logged (asked over eth1).
count() { nc "$side" "$1" </dev/null; }
# expect_count WHAT PORT N: the client has N, and still N a second later.
expect_count() {
	wait_for 10 sh -c "[ \"\$(nc $side $2 </dev/null)\" -ge $3 ]" || true
	sleep 1
	expect_eq "$1" "$(count "$2")" "$3"
}
# gate_start: plug_gate attaches to eth0 and reads commands from fd 3.
gate_start() {
	rm -f /tmp/gate.in /tmp/gate.out
	mkfifo /tmp/gate.in
	plug_gate eth0 </tmp/gate.in >/tmp/gate.out 2>&1 &
	gate_pid=$!
	exec 3>/tmp/gate.in
	wait_for 10 test -s /tmp/gate.out || fail "plug_gate did not answer its attach"
	echo "gate: $(tail -n 1 /tmp/gate.out)"
	grep -q '^ok attach' /tmp/gate.out || fail "attach: $(cat /tmp/gate.out)"
}
# gate CMD: sends CMD, sets $answer to its line.
gate_raw() {
	n=$(wc -l </tmp/gate.out)
	echo "$*" >&3
	wait_for 10 sh -c "[ \$(wc -l </tmp/gate.out) -gt $n ]" || fail "plug_gate did not answer '$*'"
	answer=$(tail -n 1 /tmp/gate.out)
	echo "gate: $answer"
}
gate() {
	gate_raw "$@"
	case "$answer" in ok*) ;; *) fail "plug_gate $*: $answer" ;; esac
}
# sent CONSOLE: the datagrams a hag-guest run has sent (its lines that went out).
sent() { grep -c -e '^hag-guest: iteration' -e '^HAG-GUEST-RESULT' "$1" || true; }
# lines CONSOLE N: waits until the run has printed N progress lines (each
# sent before it was printed, so already in the qdisc).
lines() {
	wait_for 30 sh -c "[ \$(grep -c '^hag-guest: iteration' $1) -ge $2 ]" ||
		fail "the run did not print $2 progress lines: $(cat "$1")"
}
guest_run() { # PORT SECONDS PROGRESS CONSOLE
	hag-guest --no-vgpu --rate 20 --cpu-mib 1 --iterations 1 --seconds "$2" --progress "$3" \
		--report "$peer:$1" >"$4" 2>&1
}

step "A: a whole run is held from attach until buffer + release_one"
gate_start
guest_run 7100 4 1 /tmp/run-a.console || fail "run A: $(cat /tmp/run-a.console)"
cat /tmp/run-a.console
n_a=$(sent /tmp/run-a.console)
[ "$n_a" -ge 4 ] || fail "run A sent only $n_a datagrams"
gate stats
expect_count "the client, run A held (no boundary yet)" 7110 0
gate buffer
expect_count "the client, run A buffered (no release yet)" 7110 0
gate release-one
expect_count "the client, after release_one" 7110 "$n_a"
gate detach

step "B: epochs while the run goes: each release lets out the epoch before the last boundary"
gate_start
# A progress line every 8 s: each boundary below must be set before the
# next line goes out, and a gate command takes seconds on a busy machine.
guest_run 7101 48 8 /tmp/run-b.console &
run_b=$!
lines /tmp/run-b.console 1
gate buffer
expect_count "the client, epoch 1 (seq 1) buffered" 7111 0
lines /tmp/run-b.console 2
gate release-one
gate buffer
gate_raw buffer
case "$answer" in
"error buffer: eth0: an epoch is already buffered"*) ;;
*) fail "a second boundary before the release was not refused: $answer" ;;
esac
expect_count "the client, epoch 1 released, epoch 2 (seq 2) buffered" 7111 1
lines /tmp/run-b.console 3
expect_count "the client, epoch 2 buffered, seq 3 current" 7111 1
gate release-one
expect_count "the client, epoch 2 (seq 2) released" 7111 2
gate release-indefinite
wait "$run_b" || fail "run B: $(cat /tmp/run-b.console)"
cat /tmp/run-b.console
n_b=$(sent /tmp/run-b.console)
expect_count "the client, after release_indefinite and the run's end" 7111 "$n_b"

step "C: the gate's owner dies while holding; the next attach drops what it held"
gate buffer
guest_run 7102 2 1 /tmp/run-c1.console || fail "run C1: $(cat /tmp/run-c1.console)"
gate stats
kill -9 "$gate_pid"
wait "$gate_pid" 2>/dev/null || true
exec 3>&-
echo "plug_gate killed"
expect_count "the client, its gate's owner dead" 7112 0
gate_start
gate release-indefinite
expect_count "the client, after a new attach and release_indefinite" 7112 0
gate detach
guest_run 7102 2 1 /tmp/run-c2.console || fail "run C2: $(cat /tmp/run-c2.console)"
expect_count "the client, after detach (the default qdisc)" 7112 "$(sent /tmp/run-c2.console)"

step "host 0: done; host 1 judges the clients' logs"
wait_for 30 sh -c "echo done | nc $side 7001" || fail "cannot tell host 1 we are done"
