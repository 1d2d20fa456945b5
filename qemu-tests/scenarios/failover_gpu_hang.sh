# hosts: 2
# timeout: 500
# A hag-vmm VM running the frames GPU workload on host 0 is protected by
# continuous checkpoints (hagctl checkpoint --interval 1s) to host 1's
# hagctl backup. After some epochs a GPU hang is injected into host 0's
# vGPU: hagctl checkpoint sees the vgpu-hung event, stops its VM and tells
# the backup, which takes over from the last acknowledged epoch with its
# own vGPU (generation 1). The workload must finish on host 1 (asked to
# end its run 3 s after the takeover) and verify all of its guest RAM; host 0's VM must have stopped without ever
# printing a result (its output was held until acknowledged).
ITERATIONS=30000
uuid=$(new_uuid)
backup=$(host_ip 1):7200
peer=$(host_ip $((1 - HAG_HOST)))
sock=/tmp/vm.sock

if [ "$HAG_HOST" = 1 ]; then
	load_hag
	ha_key
	mdev_create "$uuid"
	wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
	step "host 1: backup on $backup"
	finish_after_takeover "$sock"
	rc=0
	hagctl backup --listen "$backup" --mdev "$uuid" --control "$sock" --failover-timeout 3 \
		>/tmp/backup.out 2>/tmp/backup.err || rc=$?
	cat /tmp/backup.err /tmp/backup.out
	expect_eq "hagctl backup exit status" "$rc" 0
	grep -q '^takeover: generation 1, resumed from epoch [0-9]* in .*vGPU hang' /tmp/backup.out ||
		fail "no takeover after the hang"
	cat /tmp/finish.out
	grep -q "^PASS frames: [1-9][0-9]* iterations verified" /tmp/backup.out ||
		fail "the workload did not verify on host 1"
	cat /var/lib/hag/generation.json
	grep -q '"generation":1' /var/lib/hag/generation.json || fail "generation 1 not stored with the checkpoint"
else
	load_hag allow_hang_injection=1
	ha_key
	mdev_create "$uuid"
	wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
	step "host 0: VM with the frames workload, protected by $backup"
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" --progress 2000 \
		>/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat /tmp/vm.err)"
	hagctl checkpoint --vm "$sock" --backup "$backup" --interval 1s --json >/tmp/cp.out 2>/tmp/cp.err &
	cp=$!
	wait_for 120 grep -q '^epoch 5:' /tmp/cp.err || fail "no 5 epochs: $(cat /tmp/cp.err)"
	hagctl status
	hagctl status | grep -q "^protection: vGPU [0-9]* protected, last epoch [0-9]* acked" ||
		fail "hagctl status does not show the protection"
	step "host 0: inject a GPU hang"
	hagctl inject-hang --mdev "$uuid"
	rc=0
	wait "$cp" || rc=$?
	cat /tmp/cp.err /tmp/cp.out
	expect_eq "hagctl checkpoint exit status" "$rc" 0
	grep -q '"outcome":"handed-over"' /tmp/cp.out || fail "the checkpoint did not hand over"
	grep -q 'at generation 1' /tmp/cp.out || fail "the backup did not confirm generation 1"
	rc=0
	wait "$vm" || rc=$?
	cat /tmp/vm.err /tmp/vm.out
	expect_eq "primary VM exit status" "$rc" 0
	grep -q '^stopped: quit at iteration' /tmp/vm.out || fail "the primary VM did not stop"
	! grep -q '^FAIL frames' /tmp/vm.out || fail "the primary's FAIL line escaped output commit"
fi
