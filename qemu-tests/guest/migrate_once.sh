# One live migration of a frames VM from host 0 to host 1, shared by the
# migration scenarios; on host 1 the VM is asked to end its run 2 s after
# it arrived (hag-vmm finish). Set by the caller: ITERATIONS (the longest
# run), MIGRATE_FLAGS, and
# check_result EXIT_STATUS, which judges the VM's end on host 1
# (/tmp/vm.out holds its output).
load_hag
ha_key
uuid=$(new_uuid)
mdev_create "$uuid"
target=$(host_ip 1)
peer=$(host_ip $((1 - HAG_HOST)))
sock=/tmp/vm.sock
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

if [ "$HAG_HOST" = 1 ]; then
	step "host 1: incoming VM, receiver on $target:7100"
	hag-vmm serve --mdev "$uuid" --control "$sock" --incoming >/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "incoming VM did not start: $(cat /tmp/vm.err)"
	hagctl receive --listen "$target:7100" --vm "$sock" --json >/tmp/recv.out 2>/tmp/recv.err ||
		fail "hagctl receive failed: $(cat /tmp/recv.err)"
	cat /tmp/recv.err /tmp/recv.out
	step "host 1: the VM runs on here 2 s, ends its run and verifies its guest RAM"
	sleep 2
	# A VM that already failed has nothing to finish.
	hag-vmm finish --control "$sock" || true
	rc=0
	wait "$vm" || rc=$?
	cat /tmp/vm.err /tmp/vm.out
	check_result "$rc"
else
	step "host 0: VM with the frames workload"
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" >/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat /tmp/vm.err)"
	sleep 5
	step "host 0: migrate to $target:7100 $MIGRATE_FLAGS"
	# shellcheck disable=SC2086
	hagctl migrate --vm "$sock" --to "$target:7100" $MIGRATE_FLAGS --json >/tmp/mig.out 2>/tmp/mig.err ||
		fail "hagctl migrate failed: $(cat /tmp/mig.err)"
	cat /tmp/mig.err /tmp/mig.out
	grep -q '"downtime_ms"' /tmp/mig.out || fail "no migration report"
	rc=0
	wait "$vm" || rc=$?
	cat /tmp/vm.err /tmp/vm.out
	expect_eq "source VM exit status" "$rc" 0
	grep -q '^stopped: quit at iteration' /tmp/vm.out || fail "the source VM did not stop after the migration"
fi
