# hosts: 2
# timeout: 900
# vms: yes
# qemu_migrate_live with the vGPU's GPU dirty bits withheld from QEMU
# (hag_mdev withhold_gpu_dirty=1: VFIO DMA logging reports no page): QEMU
# then copies a page the GPU wrote after its last copy never again, and the
# guest's own check must FAIL on host 1. The scenario passes only then, so
# it shows that qemu_migrate_live can fail.
HAG_PARAMS=withhold_gpu_dirty=1
GUEST_ARGS="--seconds=120,--mib=8,--cpu-mib=8"
check_target() {
	expect_eq "hagctl receive status" "$1" 0
	vm_result vm 600
	vm_show vm
	grep -q 'HAG-GUEST-RESULT FAIL' /tmp/vm.console ||
		fail "the guest verified on host 1 although QEMU never saw a GPU-dirty page"
}
check_source() {
	[ "$1" = 0 ] || { vm_show vm; fail "hagctl migrate failed ($1)"; }
}
. /hag/qemu_migrate_once.sh
