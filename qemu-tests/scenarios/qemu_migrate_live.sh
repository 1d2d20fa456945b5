# hosts: 2
# timeout: 900
# vms: yes
# A real VM (QEMU 10/KVM, Linux guest, hag-sim vGPU through vfio-pci) runs
# hag-guest, a GPU and CPU workload, on host 0; QEMU migrates it live to host
# 1 (RAM with KVM's dirty log plus the vGPU's DMA-logging report, the vGPU's
# context through VFIO migration v2), driven by hagctl over QMP. The guest
# must verify all of its memory on host 1; QEMU's downtime is printed, and
# the source QEMU must be gone (the VM never runs twice).
GUEST_ARGS="--seconds=120,--mib=8,--cpu-mib=8"
check_target() {
	expect_eq "hagctl receive status" "$1" 0
	vm_result vm 600
	vm_show vm
	grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console || fail "the guest did not verify on host 1"
}
check_source() {
	[ "$1" = 0 ] || { vm_show vm; fail "hagctl migrate failed ($1)"; }
	grep -q '"downtime_ms"' /tmp/mig.out || fail "no downtime in the migration report"
	echo "QEMU downtime: $(sed -n 's/.*"downtime_ms": *\([0-9.]*\).*/\1 ms/p' /tmp/mig.out)"
	wait_for 30 sh -c "! kill -0 $vm_pid" || fail "the source QEMU ($vm_pid) still runs after the migration"
	! grep -q HAG-GUEST-RESULT /tmp/vm.console || fail "the guest finished on the source, before the migration"
}
. /hag/qemu_migrate_once.sh
