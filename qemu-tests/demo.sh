# hosts: 2
# timeout: 500
# The main job, end to end, on two GVT-g-style test hosts with hag loaded:
#   1. a VM (hag-vmm) with a hag-sim vGPU runs a GPU workload on host A;
#   2. hagctl migrates it live, vGPU and all, to host B;
#   3. on B it is protected by continuous checkpoints to a backup on A;
#   4. a GPU hang is injected on B: B stops its VM, A takes over from the
#      last acknowledged checkpoint with its own vGPU;
#   5. the workload finishes on A and checks every byte of its guest RAM.
name=$(if [ "$HAG_HOST" = 0 ]; then echo A; else echo B; fi)
me=$(host_ip "$HAG_HOST")
peer=$(host_ip $((1 - HAG_HOST)))
say() { echo "[host $name] $*"; }
prefix() { sed "s/^/[host $name] /"; }
ITERATIONS=30000
sock=/tmp/vm.sock

load_hag allow_hang_injection=1
ha_key
uuid=$(new_uuid)
mdev_create "$uuid"
say "hag_mdev loaded; vGPU $uuid created"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

if [ "$HAG_HOST" = 0 ]; then
	say "1. VM started: frames workload, $ITERATIONS GPU submissions, all its state in guest RAM"
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" >/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat /tmp/vm.err)"
	sleep 4
	hagctl status | prefix
	say "2. hagctl migrate --to $peer:7100"
	hagctl migrate --vm "$sock" --to "$peer:7100" 2>&1 | prefix
	wait "$vm" || true
	prefix </tmp/vm.out
	# The old VM has gone; this host's vGPU becomes the backup's.
	say "3. standby for B: hagctl backup --listen $me:7200"
	hagctl backup --listen "$me:7200" --mdev "$uuid" --control /tmp/standby.sock --failover-timeout 3 2>&1 |
		tee /tmp/backup.out | prefix
	grep -q "^takeover: generation 1" /tmp/backup.out || fail "the backup did not take over"
	grep -q "^PASS frames: $ITERATIONS iterations verified" /tmp/backup.out ||
		fail "the workload did not verify after the takeover"
else
	hag-vmm serve --mdev "$uuid" --control "$sock" --incoming >/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "incoming VM did not start: $(cat /tmp/vm.err)"
	say "waiting for the VM: hagctl receive --listen $me:7100"
	hagctl receive --listen "$me:7100" --vm "$sock" 2>&1 | prefix
	say "3. the VM runs here; protecting it: hagctl checkpoint --backup $peer:7200 --interval 1s"
	hagctl checkpoint --vm "$sock" --backup "$peer:7200" --interval 1s >/tmp/cp.out 2>/tmp/cp.err &
	cp=$!
	wait_for 120 grep -q '^epoch 4:' /tmp/cp.err || fail "no checkpoints: $(cat /tmp/cp.err)"
	hagctl status | prefix
	say "4. injecting a GPU hang into this host's vGPU"
	hagctl inject-hang --mdev "$uuid" 2>&1 | prefix
	wait "$cp" || true
	tail -3 /tmp/cp.err | prefix
	prefix </tmp/cp.out
	wait "$vm" || true
	prefix </tmp/vm.out
fi
