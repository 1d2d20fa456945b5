# hosts: 2
# timeout: 400
# The backup's host is lost for real after epoch 3 (issue 21, item 2). The
# primary hears nothing, goes unprotected and holds its VM's output: it is
# never released on silence (the backup might be taking over). The
# operator, who knows the backup's host is off, runs hagctl
# confirm-backup-down: the held output goes out, protection ends
# ("ended") and the VM runs on unprotected to its end, its PASS line
# released. Earlier, while the backup acknowledged epochs, the same
# command was refused. The protection runs as --name vm1 (its status in
# /run/hag/vm1/, where confirm-backup-down --name vm1 finds it).
# Enough to outlast the confirmation (reached within the first half of the run here);
# the scenario fails, saying so, if the run ends before it.
ITERATIONS=30000
ha_pair

if [ "$HAG_HOST" = 1 ]; then
	step "host 1: backup on $backup"
	hagctl backup --listen "$backup" --mdev "$uuid" --control "$sock" --failover-timeout 3 \
		>/tmp/backup.out 2>/tmp/backup.err &
	wait_for 120 grep -q 'epoch 3 applied' /tmp/backup.err || fail "no epoch 3: $(cat /tmp/backup.err)"
	# Host 0 asks to be confirmed while protected (refused) first.
	wait_for 120 sh -c "echo go | nc $peer 7300" || fail "host 0 never got to its refused confirmation"
	step "host 1: lost"
	lose_this_host
else
	step "host 0: protected VM"
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" --progress 1000 \
		>/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat /tmp/vm.err)"
	hagctl checkpoint --vm "$sock" --backup "$backup" --interval 1s --name vm1 --json \
		>/tmp/cp.out 2>/tmp/cp.err &
	cp=$!
	wait_for 120 grep -q '^epoch 3:' /tmp/cp.err || fail "no 3 epochs: $(cat /tmp/cp.err)"
	step "host 0: hagctl confirm-backup-down while the backup acknowledges epochs"
	rc=0
	hagctl confirm-backup-down --name vm1 >/tmp/confirm1.out 2>&1 || rc=$?
	cat /tmp/confirm1.out
	expect_eq "confirm-backup-down's exit status (6: refused)" "$rc" 6
	grep -q 'acknowledges epochs' /tmp/confirm1.out || fail "the refusal does not say why"
	signal_ready 7300
	wait_for 120 grep -q '"state":"unprotected"' /run/hag/vm1/checkpoint-vgpu*.json ||
		fail "host 0 did not go unprotected: $(cat /tmp/cp.err)"
	step "host 0: unprotected; its output is held"
	n1=$(wc -l </tmp/vm.out)
	sleep 3
	n2=$(wc -l </tmp/vm.out)
	expect_eq "console lines released while unprotected (held: none)" "$((n2 - n1))" 0
	! grep -q '^PASS frames' /tmp/vm.out || fail "the VM finished before the confirmation (make ITERATIONS larger)"
	step "host 0: hagctl confirm-backup-down"
	hagctl confirm-backup-down --name vm1 || fail "the confirmation failed"
	rc=0
	wait "$cp" || rc=$?
	cat /tmp/cp.err /tmp/cp.out
	expect_eq "hagctl checkpoint exit status" "$rc" 0
	grep -q '"outcome":"ended"' /tmp/cp.out || fail "protection did not end"
	grep -q 'confirmed the backup down' /tmp/cp.out || fail "the end does not say why"
	# Seen as it must be: the workload may end (ITERATIONS is its longest run).
	vm_finish "$sock"
	rc=0
	wait "$vm" || rc=$?
	expect_eq "VM exit status" "$rc" 0
	[ "$(wc -l </tmp/vm.out)" -gt "$n2" ] || fail "the held output was not released"
	grep -q "^PASS frames: [1-9][0-9]* iterations verified" /tmp/vm.out ||
		fail "the VM's PASS line did not come out: $(tail -3 /tmp/vm.out)"
fi
