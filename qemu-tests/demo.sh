# hosts: 2
# timeout: 1200
# vms: yes
# The main job, end to end, on two test hosts with hag loaded:
#   1. a real VM (QEMU 10/KVM, a Linux guest running hag-guest, a GPU and
#      CPU workload on a hag-sim vGPU) runs on host A; its progress and its
#      result go over UDP to a client on A's VM network;
#   2. QEMU migrates it live, vGPU and all, to host B (hagctl migrate
#      --qmp): RAM with KVM's dirty log plus hag's GPU dirty log, the vGPU's
#      context through VFIO migration v2;
#   3. on B the VM is protected by continuous checkpoints to a backup on A
#      (hagctl checkpoint --qmp, 1 s epochs), its packets held on B until
#      their epoch is acknowledged;
#   4. a GPU hang is injected on B: B stops its VM, A starts QEMU on its
#      standby image and resumes the last acknowledged epoch with its own
#      vGPU;
#   5. the workload finishes on A and checks every byte of its memory; the
#      client's view of the guest's output is checked: one run, never
#      contradicted.
name=$(if [ "$HAG_HOST" = 0 ]; then echo A; else echo B; fi)
me=$(host_ip "$HAG_HOST")
peer=$(host_ip $((1 - HAG_HOST)))
say() { echo "[host $name] $*"; }
prefix() { sed "s/^/[host $name] /"; }
CLIENT=203.0.113.1
PORT=7400
VM_NET=1
VM_SHARED_RAM=1
# The client is br0 on host A, whose MAC is its eth1's.
VM_APPEND="hag_vm_ip=203.0.113.50/24 hag_vm_neigh=$CLIENT,52:54:00:4a:48:00"
GUEST_ARGS="--seconds=100,--mib=8,--cpu-mib=8,--progress=2,--report,$CLIENT:$PORT"

load_hag allow_hang_injection=1
ha_key
host_root_up
uuid=$(new_uuid)
mdev_create "$uuid"
say "hag_mdev loaded; vGPU $uuid created"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

if [ "$HAG_HOST" = 0 ]; then
	vm_net_up "$CLIENT/24"
	hag-guest listen --port "$PORT" >/tmp/client.log 2>/tmp/client.err &
	client=$!
	say "1. real VM started: QEMU/KVM, Linux guest, hag-guest on the vGPU; client on $CLIENT:$PORT"
	vm_start vm "$uuid" "$GUEST_ARGS"
	vm_pid=$(cat /tmp/vm.pid)
	vm_wait_console vm 120 'hag-guest: iteration'
	prefix </tmp/vm.console
	await_ready "$peer" 7101
	say "2. hagctl migrate --qmp /tmp/vm.qmp --to $peer:7100 (QEMU migrates the VM itself)"
	hagctl migrate --qmp /tmp/vm.qmp --to "$peer:7100" 2>&1 | tee /tmp/mig.out | prefix
	wait_for 30 sh -c "! kill -0 $vm_pid" || fail "the source QEMU still runs"
	say "3. standby for B: hagctl backup --listen $me:7200 -- QEMU (this host's vGPU $uuid)"
	eval "set -- $(vm_words vm "$uuid" "$GUEST_ARGS")"
	hagctl backup --listen "$me:7200" --failover-timeout 3 --status-dir /tmp/hag-backup --state-dir /tmp/hag-backup \
		-- chroot "$HOST_ROOT" "$@" >/tmp/backup.out 2>/tmp/backup.err &
	backup=$!
	tail -f /tmp/backup.err 2>/dev/null | prefix &
	# The guest halts at its end (the test kernel cannot power off): its
	# QEMU is then ended as an operator would, and the backup with it.
	while kill -0 "$backup" 2>/dev/null; do
		if grep -q HAG-GUEST-EXIT /tmp/vm.console 2>/dev/null; then
			qemu=$(sed -n 's/.*takeover: QEMU (pid \([0-9]*\)).*/\1/p' /tmp/backup.err)
			[ -z "$qemu" ] || kill -TERM "$qemu" 2>/dev/null || true
		fi
		sleep 1
	done
	wait "$backup" || true
	grep -q "^takeover: generation 1" /tmp/backup.out || fail "the backup did not take over"
	vm_result vm 900 | prefix
	grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console ||
		{ prefix </tmp/vm.console; fail "the workload did not verify after the takeover"; }
	sleep 2
	kill "$client" 2>/dev/null || true
	say "5. the guest verified all of its memory here, after the takeover"
	say "what the client saw ($(wc -l </tmp/client.log) datagrams; first and last):"
	head -2 /tmp/client.log | prefix
	tail -2 /tmp/client.log | prefix
	in_root python3 /hag/client_check.py --require-pass /tmp/client.log 2>&1 | prefix
	in_root python3 /hag/client_check.py --require-pass /tmp/client.log >/dev/null ||
		fail "the client's view was contradicted"
	say "summary: migration downtime $(sed -n 's/.*downtime \([0-9.]* ms\).*/\1/p' /tmp/mig.out | head -1)," \
		"$(sed -n 's/^takeover: \(generation 1, resumed from epoch [0-9]* in [0-9.]* ms\).*/\1/p' /tmp/backup.out)"
else
	vm_net_up
	VM_SHARED_RAM=1 vm_start vm "$uuid" "$GUEST_ARGS" -incoming defer
	say "waiting for the VM: hagctl receive --qmp /tmp/vm.qmp --listen $me:7100"
	hagctl receive --qmp /tmp/vm.qmp --listen "$me:7100" >/tmp/recv.out 2>&1 &
	recv=$!
	wait_for 60 port_listening 7100 || fail "QEMU does not listen on 7100"
	signal_ready 7101
	wait "$recv" || { prefix </tmp/recv.out; fail "hagctl receive failed"; }
	prefix </tmp/recv.out
	vm_wait_console vm 120 'hag-guest: iteration'
	say "the VM runs here after the move"
	say "3. protecting it: hagctl checkpoint --qmp /tmp/vm.qmp --backup $peer:7200 --plug eth1 --interval 1s"
	hagctl checkpoint --qmp /tmp/vm.qmp --backup "$peer:7200" --plug eth1 --interval 1s \
		>/tmp/cp.out 2>/tmp/cp.err &
	cp=$!
	tail -f /tmp/cp.err 2>/dev/null | prefix &
	wait_for 300 grep -q '^epoch 4:' /tmp/cp.err || fail "no checkpoints: $(cat /tmp/cp.err)"
	hagctl status | prefix
	say "4. injecting a GPU hang into this host's vGPU"
	hagctl inject-hang --mdev "$uuid" 2>&1 | prefix
	wait "$cp" || true
	prefix </tmp/cp.out
	grep -q 'outcome: handed-over\|handed-over' /tmp/cp.out || fail "B did not hand the VM over"
	say "summary: pause per epoch $(sed -n 's/.*pause mean \([0-9.]* ms\).*/\1 (mean)/p' /tmp/cp.out)"
fi
