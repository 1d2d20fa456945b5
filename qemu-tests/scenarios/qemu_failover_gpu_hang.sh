# hosts: 2
# timeout: 900
# vms: yes
# A real VM (QEMU/KVM, Linux guest, hag-sim vGPU) on host 0 runs hag-guest,
# protected by hagctl checkpoint --qmp (1 s epochs) to hagctl backup on host
# 1, its network output held per epoch. A GPU hang is injected into host 0's
# vGPU: hagctl sees the vgpu-hung event, stops QEMU and sends HANG; host 1
# starts QEMU on its standby image, loads the last acknowledged epoch into
# its own vGPU (generation 1), and the guest must verify all of its memory
# and its result there. What the client saw must be one run's output, never
# contradicted.
FAULT=gpu-hang
GUEST_ARGS="--seconds=60,--mib=8,--cpu-mib=8,--progress=1"
check_backup() {
	expect_eq "hagctl backup exit status" "$1" 0
	grep -q '"reason":".*vGPU hang' /tmp/backup.out || fail "no takeover after the hang"
	grep -q '"generation":1' /tmp/backup.out || fail "the takeover did not raise the generation"
	vm_result vm 600
	grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console || { vm_show vm; fail "the guest did not verify on host 1"; }
	in_root python3 /hag/client_check.py --require-pass /tmp/client.log || fail "the client's view"
}
check_primary() {
	expect_eq "hagctl checkpoint exit status" "$1" 0
	grep -q '"outcome":"handed-over"' /tmp/cp.out || fail "the checkpoint did not hand over"
	grep -q 'at generation 1' /tmp/cp.out || fail "the backup did not confirm generation 1"
	wait_for 30 sh -c "! kill -0 $(cat /tmp/vm.pid 2>/dev/null || echo 1) 2>/dev/null" ||
		fail "host 0's QEMU still runs after the takeover"
}
. /hag/qemu_protect_once.sh
