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
	takeover_verified "$1" '.*vGPU hang'
}
check_primary() {
	handed_over "$1"
	wait_for 30 sh -c "! kill -0 $(cat /tmp/vm.pid 2>/dev/null || echo 1) 2>/dev/null" ||
		fail "host 0's QEMU still runs after the takeover"
}
. /hag/qemu_protect_once.sh
