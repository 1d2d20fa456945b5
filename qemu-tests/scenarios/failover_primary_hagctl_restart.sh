# hosts: 2
# timeout: 400
# The primary's hagctl checkpoint dies (SIGKILL) after epoch 3 and is
# started again on the same VM at once, as systemd's Restart=on-failure
# does. The new run is a new session of the same VM instance: the backup,
# which holds the old session's checkpoint, lets it pair again (the
# checkpoint stays until the new session's first epoch replaces it)
# instead of refusing it, which left that VM running unprotected, its
# output released, while the backup took over from its checkpoint: two
# copies. The workload finishes on host 0 only, protection ends cleanly.
ITERATIONS=30000
ha_pair

if [ "$HAG_HOST" = 1 ]; then
	step "host 1: backup on $backup"
	rc=0
	hagctl backup --listen "$backup" --mdev "$uuid" --control "$sock" --failover-timeout 3 --json \
		>/tmp/backup.out 2>/tmp/backup.err || rc=$?
	cat /tmp/backup.err /tmp/backup.out
	expect_eq "hagctl backup exit status" "$rc" 0
	! grep -q 'taking over' /tmp/backup.err || fail "the backup took over from the killed run's checkpoint"
	grep -q 'session .* replaces session' /tmp/backup.err || fail "the restarted run did not pair again"
	grep -q 'backup done: protection ends: finished' /tmp/backup.err || fail "protection did not end cleanly"
else
	step "host 0: VM with the frames workload, protected by $backup"
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" --progress 2000 \
		>/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat /tmp/vm.err)"
	hagctl checkpoint --vm "$sock" --backup "$backup" --interval 1s --json >/tmp/cp1.out 2>/tmp/cp1.err &
	cp=$!
	wait_for 120 grep -q '^epoch 3:' /tmp/cp1.err || fail "no 3 epochs: $(cat /tmp/cp1.err)"
	step "host 0: hagctl checkpoint killed, started again"
	kill -KILL "$cp"
	wait "$cp" || true
	hagctl checkpoint --vm "$sock" --backup "$backup" --interval 1s --json >/tmp/cp.out 2>/tmp/cp.err &
	cp=$!
	wait_for 120 grep -q '^epoch 3:' /tmp/cp.err || fail "the restarted run did not protect the VM: $(cat /tmp/cp.err)"
	# Protected again: the workload may end (ITERATIONS is its longest run).
	vm_finish "$sock"
	rc=0
	wait "$vm" || rc=$?
	expect_eq "VM exit status" "$rc" 0
	grep -q "^PASS frames: [1-9][0-9]* iterations verified" /tmp/vm.out ||
		fail "the PASS line did not come out: $(tail -3 /tmp/vm.out)"
	rc=0
	wait "$cp" || rc=$?
	cat /tmp/cp.err /tmp/cp.out
	expect_eq "hagctl checkpoint exit status" "$rc" 0
	grep -q '"outcome":"finished"' /tmp/cp.out || fail "protection did not end with the VM"
fi
