# hosts: 2
# timeout: 900
# vms: yes
# Output commit on a real VM's real network: the guest on host 0 sends its
# progress (every second) and its result over UDP to a client on host 1,
# through eth1, where hagctl checkpoint --plug holds each epoch's packets
# (sch_plug) until the backup acknowledges it. For 8 s the backup applies
# epochs but acknowledges none (its test fault drop-acks): the client must
# receive nothing in that time, although the guest sends on; once acks flow
# again (after a resynchronisation) the held packets arrive, in order, none
# lost. The guest finishes on host 0 (asked to end its run once 10 more
# lines came after the window); the client must see its PASS and a
# view never contradicted. The VM's serial console is held the same way
# (hagctl checkpoint --console): once epochs run, while none is
# acknowledged its released log must not grow although the guest prints
# every second (during the first synchronisation, before any epoch, it
# goes out at once: nothing could be taken over then), and in the end it
# must hold everything the guest printed, in order.
FAULT=none
CONSOLE=1
GUEST_ARGS="--seconds=120,--mib=8,--cpu-mib=8,--progress=1"
BACKUP_ARGS="--test-fault-file /tmp/fault"
during_backup() {
	wait_for 300 grep -q 'epoch 6 applied' /tmp/backup.err || fail "no epoch 6"
	echo drop-acks >/tmp/fault
	wait_for 60 grep -q 'test fault now 2' /tmp/backup.err || fail "the backup never read the fault"
	# An ack sent before the fault took hold may still be releasing
	# datagrams: the window starts once the client has heard nothing new
	# for 2 s.
	settled() { a=$(wc -l </tmp/client.log); sleep 2; [ "$(wc -l </tmp/client.log)" = "$a" ]; }
	wait_for 60 settled || fail "the client kept receiving after the fault"
	before=$(wc -l </tmp/client.log)
	sleep 8
	after=$(wc -l </tmp/client.log)
	rm -f /tmp/fault
	echo "client lines while acks were dropped: $before, then $after"
	echo "$before $after" >/tmp/window
}
# The window seen and the held lines delivered, 10 more besides: the
# guest may end its run (--seconds is its longest).
guest_may_finish() {
	read -r _ after </tmp/window 2>/dev/null && [ "$(wc -l </tmp/client.log)" -gt $((after + 10)) ]
}
# Every second: console lines released, console lines the guest printed
# (QEMU's unheld log), epochs acknowledged.
during_primary() {
	while :; do
		echo "$(wc -l </tmp/vm.console.held 2>/dev/null) $(wc -l </tmp/vm.console) $(grep -c 'acked in' /tmp/cp.err)"
		sleep 1
	done
}
check_backup() {
	expect_eq "hagctl backup exit status" "$1" 0
	! grep -q '"generation":1' /tmp/backup.out || fail "the backup took over"
	read -r before after </tmp/window || fail "the fault window did not run: $(cat /tmp/during.out)"
	cat /tmp/during.out
	[ "$before" -gt 0 ] || fail "the client had heard nothing before the window"
	expect_eq "lines the client received while no epoch was acknowledged" "$after" "$before"
	total=$(wc -l </tmp/client.log)
	[ "$total" -gt $((after + 4)) ] || fail "the held lines never arrived ($total lines in all)"
	in_root python3 /hag/client_check.py --require-pass /tmp/client.log || fail "the client's view"
}
check_primary() {
	expect_eq "hagctl checkpoint exit status" "$1" 0
	grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console || fail "the guest did not verify on host 0"
	grep -q '"outcome":"\(finished\|ended\|vm-stopped\)"' /tmp/cp.out || fail "protection did not end with the VM"
	# Every stretch of 6 s or more without an acknowledgement after the
	# first (the backup's drop-acks window), its first and last samples
	# left out (a release and its epoch line may straddle a sample): the
	# released console must not have grown in it, while the guest printed
	# on. Before the first acknowledgement (the first synchronisation) it
	# must have grown: nothing is held before the first epoch.
	in_root python3 -c '
import sys
rows = [tuple(map(int, l.split())) for l in open("/tmp/during.out") if len(l.split()) == 3]
runs, start = [], 0
for i in range(1, len(rows) + 1):
    if i == len(rows) or rows[i][2] != rows[start][2]:
        runs.append(rows[start:i][1:-1])
        start = i
runs = [r for r in runs if len(r) >= 4]
for r in runs:
    print(f"console while {r[0][2]} epochs were acknowledged ({len(r)} s): released {r[0][0]}..{r[-1][0]} lines, printed {r[0][1]}..{r[-1][1]}")
held = [r for r in runs if r[0][2] > 0]
ok = len(held) >= 1 and all(len({x[0] for x in r}) == 1 and r[-1][1] > r[0][1] + 2 for r in held)
ok = ok and all(r[-1][0] > r[0][0] for r in runs if r[0][2] == 0)
sys.exit(0 if ok else 1)
' || fail "the console was not held while no epoch was acknowledged, or held before the first: $(cat /tmp/during.out)"
	# What came out is what the guest printed from the moment hagctl
	# connected, in order, none lost, to its last line.
	in_root python3 -c '
import sys
held, printed = open("/tmp/vm.console.held", "rb").read(), open("/tmp/vm.console", "rb").read()
print(f"console: {len(held)} bytes released, {len(printed)} printed since boot")
sys.exit(0 if held and held in printed and b"HAG-GUEST-EXIT" in held else 1)
' || fail "the released console is not what the guest printed: $(tail -3 /tmp/vm.console.held)"
}
. /hag/qemu_protect_once.sh
