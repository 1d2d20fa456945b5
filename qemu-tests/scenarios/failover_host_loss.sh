# hosts: 2
# timeout: 500
# A hag-vmm VM running the frames GPU workload on host 0 is protected by
# continuous checkpoints to host 1. Mid-run host 0 "dies": its network
# link goes down and its hagctl checkpoint and VM are killed with SIGKILL,
# no cleanup. Host 1's backup hears nothing past --failover-timeout and
# takes over from the last acknowledged epoch; the workload must finish
# there and verify all of its guest RAM.
ITERATIONS=30000
uuid=$(new_uuid)
backup=$(host_ip 1):7200
peer=$(host_ip $((1 - HAG_HOST)))
sock=/tmp/vm.sock
load_hag
mdev_create "$uuid"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

if [ "$HAG_HOST" = 1 ]; then
	step "host 1: backup on $backup"
	rc=0
	hagctl backup --listen "$backup" --mdev "$uuid" --control "$sock" --failover-timeout 3 --json \
		>/tmp/backup.out 2>/tmp/backup.err || rc=$?
	cat /tmp/backup.err /tmp/backup.out
	expect_eq "hagctl backup exit status" "$rc" 0
	grep -q '"reason":"the primary was silent for' /tmp/backup.out || fail "no takeover on silence"
	grep -q '"generation":1' /tmp/backup.out || fail "the takeover did not raise the generation"
	grep -q "^PASS frames: $ITERATIONS iterations verified" /tmp/backup.out ||
		fail "the workload did not verify on host 1"
else
	step "host 0: VM with the frames workload, protected by $backup"
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" --progress 2000 \
		>/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat /tmp/vm.err)"
	hagctl checkpoint --vm "$sock" --backup "$backup" --interval 1s >/tmp/cp.out 2>/tmp/cp.err &
	cp=$!
	wait_for 120 grep -q '^epoch 4:' /tmp/cp.err || fail "no 4 epochs: $(cat /tmp/cp.err)"
	sleep 2
	step "host 0: host loss (link down, hagctl and the VM killed)"
	ip link set eth0 down
	kill -9 "$cp" "$vm"
	wait "$cp" || true
	wait "$vm" || true
	cat /tmp/cp.err /tmp/vm.out
	! grep -q '^PASS frames' /tmp/vm.out || fail "the primary finished before it was lost"
fi
