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
# lost. The guest finishes on host 0; the client must see its PASS and a
# view never contradicted.
FAULT=none
GUEST_ARGS="--seconds=150,--mib=8,--cpu-mib=8,--progress=1"
BACKUP_ARGS="--test-fault-file /tmp/fault"
during_backup() {
	wait_for 300 grep -q 'epoch 6 applied' /tmp/backup.err || fail "no epoch 6"
	echo drop-acks >/tmp/fault
	sleep 1
	before=$(wc -l </tmp/client.log)
	sleep 8
	after=$(wc -l </tmp/client.log)
	rm -f /tmp/fault
	echo "client lines while acks were dropped: $before, then $after"
	echo "$before $after" >/tmp/window
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
}
. /hag/qemu_protect_once.sh
