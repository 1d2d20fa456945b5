# hosts: 3
# timeout: 500
# Issue 21, item 1: the backup's host is lost, with a witness on a third
# host. Host 0 runs two hag-vmm VMs with the frames workload, each
# protected by a hagctl backup of its own on host 1: vm1 with the witness
# (host 2's hagctl witness; --witness on both sides), vm2 with it on the
# primary only (the negative control: its backup would take over on
# silence alone, so a grant would protect nothing). Host 1 is lost once
# both backups applied epoch 3. vm1's primary, unprotected past the
# failover timeout, claims the VM from the witness, is granted it (stored
# before the answer), releases the output it held and runs on: its
# workload's PASS line comes out. vm2's primary, told at pairing that its
# backup uses no witness, never claims and holds its output as without
# one: nothing of vm2 comes out while vm1's flows, until the operator
# confirms its backup down.
# Enough to outlast the confirmation (reached within the first half of the run here);
# the scenario fails, saying so, if the run ends before it.
ITERATIONS=14000
ha_trio

case $HAG_HOST in
2)
	witness_host
	grep -q 'claimed vm1 .* for the primary at generation 0: granted to the primary at generation 0' \
		/tmp/witness.err || fail "the witness did not grant vm1 to its primary"
	! grep -q 'claimed vm2' /tmp/witness.err || fail "vm2's primary claimed though its backup uses no witness"
	grep -q '"winner": "primary"' /tmp/witness/witness.json || fail "the grant was not stored"
	;;
1)
	u1=$(new_uuid)
	u2=$(new_uuid)
	mdev_create "$u1"
	mdev_create "$u2"
	step "host 1: backups of vm1 (with the witness) and vm2 (without)"
	hagctl backup --name vm1 --listen "$(host_ip 1):7200" --mdev "$u1" --failover-timeout 3 \
		--witness "$witness" >/tmp/backup1.out 2>/tmp/backup1.err &
	hagctl backup --name vm2 --listen "$(host_ip 1):7202" --mdev "$u2" --failover-timeout 3 \
		>/tmp/backup2.out 2>/tmp/backup2.err &
	wait_for 180 grep -q 'epoch 3 applied' /tmp/backup1.err || fail "vm1: no epoch 3: $(cat /tmp/backup1.err)"
	wait_for 180 grep -q 'epoch 3 applied' /tmp/backup2.err || fail "vm2: no epoch 3: $(cat /tmp/backup2.err)"
	step "host 1: lost"
	lose_this_host
	;;
0)
	for vm in vm1 vm2; do
		u=$(new_uuid)
		mdev_create "$u"
		hag-vmm serve --mdev "$u" --control "/tmp/$vm.sock" --iterations "$ITERATIONS" --progress 1000 \
			>"/tmp/$vm.out" 2>"/tmp/$vm.err" &
		echo $! >"/tmp/$vm.pid"
		wait_for 30 test -S "/tmp/$vm.sock" || fail "$vm did not start: $(cat "/tmp/$vm.err")"
	done
	step "host 0: vm1 protected with the witness, vm2 with it on the primary only"
	hagctl checkpoint --vm /tmp/vm1.sock --backup "$(host_ip 1):7200" --interval 1s --name vm1 \
		--witness "$witness" --json >/tmp/cp1.out 2>/tmp/cp1.err &
	cp1=$!
	hagctl checkpoint --vm /tmp/vm2.sock --backup "$(host_ip 1):7202" --interval 1s --name vm2 \
		--witness "$witness" --json >/tmp/cp2.out 2>/tmp/cp2.err &
	cp2=$!
	wait_for 180 grep -q '^epoch 3:' /tmp/cp1.err || fail "vm1: no 3 epochs: $(cat /tmp/cp1.err)"
	wait_for 180 grep -q '^epoch 3:' /tmp/cp2.err || fail "vm2: no 3 epochs: $(cat /tmp/cp2.err)"
	step "host 0: waiting for host 1's loss"
	wait_for 120 grep -q 'the witness granted this primary' /tmp/cp1.err ||
		fail "vm1's primary was not granted the VM: $(cat /tmp/cp1.err)"
	wait_for 60 grep -q '"state":"unprotected"' /run/hag/vm2/checkpoint-vgpu*.json ||
		fail "vm2's primary did not go unprotected: $(cat /tmp/cp2.err)"
	grep -q 'takes over on silence alone, not with this primary.s witness' /tmp/cp2.err ||
		fail "vm2's primary did not say its backup uses no witness: $(cat /tmp/cp2.err)"
	step "host 0: vm1 granted, its output flows; vm2's is held"
	a1=$(wc -l </tmp/vm1.out)
	a2=$(wc -l </tmp/vm2.out)
	sleep 4
	b1=$(wc -l </tmp/vm1.out)
	b2=$(wc -l </tmp/vm2.out)
	[ "$b1" -gt "$a1" ] || fail "vm1's output does not come out after the grant"
	expect_eq "vm2's console lines while unprotected, its backup without the witness (held: none)" "$((b2 - a2))" 0
	! grep -q '^PASS frames' /tmp/vm2.out || fail "vm2 finished before the confirmation (make ITERATIONS larger)"
	step "host 0: the operator confirms vm2's backup down"
	hagctl confirm-backup-down --name vm2 || fail "vm2's confirmation failed"
	# Both seen as they must be: the workloads may end (ITERATIONS is
	# their longest run), vm2 once its protection has.
	vm_finish /tmp/vm1.sock
	wait_for 60 grep -q 'confirmed the backup down' /tmp/cp2.out || fail "vm2's protection did not end"
	vm_finish /tmp/vm2.sock
	for vm in vm1 vm2; do
		rc=0
		wait "$(cat /tmp/$vm.pid)" || rc=$?
		expect_eq "$vm's exit status" "$rc" 0
		grep -q "^PASS frames: [1-9][0-9]* iterations verified" "/tmp/$vm.out" ||
			fail "$vm's PASS line did not come out: $(tail -3 "/tmp/$vm.out")"
	done
	rc=0
	wait "$cp1" || rc=$?
	cat /tmp/cp1.err /tmp/cp1.out
	expect_eq "vm1's hagctl checkpoint exit status" "$rc" 0
	grep -q 'granted to this primary by the witness' /tmp/cp1.out || fail "vm1's protection does not say it ended granted"
	rc=0
	wait "$cp2" || rc=$?
	cat /tmp/cp2.err /tmp/cp2.out
	expect_eq "vm2's hagctl checkpoint exit status" "$rc" 0
	grep -q 'confirmed the backup down' /tmp/cp2.out || fail "vm2's protection does not say it ended confirmed"
	await_ready "$(host_ip 2)" 7301
	;;
esac
