# hosts: 2
# timeout: 400
# Output commit: a VM protected by hagctl checkpoint holds its console
# output (progress lines and the PASS line) until the epoch it belongs to is
# acknowledged. The workload finishes on host 0: the last epoch captures
# the finished VM, and only its acknowledgement releases the PASS line;
# then protection ends and host 1's backup exits without a takeover.
ITERATIONS=4000
ha_pair

if [ "$HAG_HOST" = 1 ]; then
	step "host 1: backup on $backup"
	rc=0
	hagctl backup --listen "$backup" --mdev "$uuid" --control "$sock" >/tmp/backup.out 2>/tmp/backup.err || rc=$?
	cat /tmp/backup.err /tmp/backup.out
	expect_eq "hagctl backup exit status" "$rc" 0
	! grep -q takeover /tmp/backup.out || fail "the backup took over a VM that finished"
	grep -q 'backup done: protection ends: finished' /tmp/backup.err || fail "protection did not end cleanly"
else
	step "host 0: protected VM runs to the end"
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" --progress 1000 \
		>/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat /tmp/vm.err)"
	rc=0
	hagctl checkpoint --vm "$sock" --backup "$backup" --interval 1s --json >/tmp/cp.out 2>/tmp/cp.err || rc=$?
	cat /tmp/cp.err /tmp/cp.out
	expect_eq "hagctl checkpoint exit status" "$rc" 0
	grep -q '"outcome":"finished"' /tmp/cp.out || fail "protection did not end with the VM finishing"
	grep -q '(VM finished)' /tmp/cp.err || fail "the finished VM was not checkpointed"
	rc=0
	wait "$vm" || rc=$?
	cat /tmp/vm.out
	expect_eq "VM exit status" "$rc" 0
	grep -q "^PASS frames: $ITERATIONS iterations verified" /tmp/vm.out || fail "no PASS line"
	grep -q '^frames: iteration 1000' /tmp/vm.out || fail "progress lines were not released"
	# The last epoch's acknowledgement released the PASS line.
	last=$(grep -o '"released":[0-9]*' /tmp/cp.out | tail -1)
	[ "$last" != '"released":0' ] || fail "the last epoch released nothing"
fi
