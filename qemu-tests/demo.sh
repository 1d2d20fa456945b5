# hosts: 2
# timeout: 900
# vms: yes
# The main job, end to end, on two test hosts with hag loaded:
#   1. a real VM (QEMU 10/KVM, a Linux guest running hag-guest, a GPU and
#      CPU workload) with a hag-sim vGPU runs on host A;
#   2. QEMU migrates it live, vGPU and all, to host B (hagctl migrate
#      --qmp): RAM with KVM's dirty log plus hag's GPU dirty log, the vGPU's
#      context through VFIO migration v2; the guest verifies its memory on B;
#   3. on B a VM is protected by continuous checkpoints to a backup on A.
#      Until real VMs can be checkpointed (the next step of the work), this
#      VM is a hag-vmm one: hag's test VMM with a built-in guest driver;
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
host_root_up
uuid=$(new_uuid)
mdev_create "$uuid"
say "hag_mdev loaded; vGPU $uuid created"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
GUEST_ARGS="--seconds=40,--mib=8,--cpu-mib=8"

if [ "$HAG_HOST" = 0 ]; then
	say "1. real VM started: QEMU/KVM, Linux guest, hag-guest on the vGPU"
	vm_start vm "$uuid" "$GUEST_ARGS"
	vm_pid=$(cat /tmp/vm.pid)
	vm_wait_console vm 120 'hag-guest: iteration'
	prefix </tmp/vm.console
	hagctl status | prefix
	await_ready "$peer" 7101
	say "2. hagctl migrate --qmp /tmp/vm.qmp --to $peer:7100 (QEMU migrates the VM itself)"
	hagctl migrate --qmp /tmp/vm.qmp --to "$peer:7100" 2>&1 | prefix
	# hagctl ended the source QEMU once B ran the VM; its vGPU becomes the
	# backup's.
	wait_for 30 sh -c "! kill -0 $vm_pid" || fail "the source QEMU still runs"
	say "3. standby for B: hagctl backup --listen $me:7200"
	hagctl backup --listen "$me:7200" --mdev "$uuid" --control /tmp/standby.sock --failover-timeout 3 2>&1 |
		tee /tmp/backup.out | prefix
	grep -q "^takeover: generation 1" /tmp/backup.out || fail "the backup did not take over"
	grep -q "^PASS frames: $ITERATIONS iterations verified" /tmp/backup.out ||
		fail "the workload did not verify after the takeover"
else
	vm_start vm "$uuid" "$GUEST_ARGS" -incoming defer
	say "waiting for the VM: hagctl receive --qmp /tmp/vm.qmp --listen $me:7100"
	hagctl receive --qmp /tmp/vm.qmp --listen "$me:7100" >/tmp/recv.out 2>&1 &
	recv=$!
	wait_for 60 port_listening 7100 || fail "QEMU does not listen on 7100"
	signal_ready 7101
	wait "$recv" || { prefix </tmp/recv.out; fail "hagctl receive failed"; }
	prefix </tmp/recv.out
	vm_result vm 600 | prefix
	grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console || { prefix </tmp/vm.console; fail "the guest did not verify on B"; }
	say "the real VM verified its memory here after the move"
	uuid2=$(new_uuid)
	mdev_create "$uuid2"
	say "3. a hag-vmm VM (frames workload, $ITERATIONS GPU submissions) on vGPU $uuid2; protecting it: hagctl checkpoint --backup $peer:7200 --interval 1s"
	hag-vmm serve --mdev "$uuid2" --control "$sock" --iterations "$ITERATIONS" >/tmp/hvm.out 2>/tmp/hvm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "hag-vmm VM did not start: $(cat /tmp/hvm.err)"
	hagctl checkpoint --vm "$sock" --backup "$peer:7200" --interval 1s >/tmp/cp.out 2>/tmp/cp.err &
	cp=$!
	wait_for 120 grep -q '^epoch 4:' /tmp/cp.err || fail "no checkpoints: $(cat /tmp/cp.err)"
	hagctl status | prefix
	say "4. injecting a GPU hang into this host's vGPU"
	hagctl inject-hang --mdev "$uuid2" 2>&1 | prefix
	wait "$cp" || true
	tail -3 /tmp/cp.err | prefix
	prefix </tmp/cp.out
	wait "$vm" || true
	prefix </tmp/hvm.out
fi
