# hosts: 2
# timeout: 900
# vms: yes
# qemu_migrate_live with a local disk, moved by hagctl itself: the VM has a
# virtio-blk disk (a 64 MiB qcow2 in host 0's /tmp) to which hag-guest
# commits numbered records, each synced before it counts; `hagctl migrate
# --copy-storage` mirrors it into the target's NBD export (`hagctl receive
# --copy-storage`, the target QEMU started with -S on an empty qcow2 of the
# same size) while RAM is pre-copied, then migrates. On host 1 the guest
# must verify all of its memory and read back every record it committed
# (on host 0 and on host 1) from the disk it now has; both reports name the
# disk; the source QEMU must be gone.
GUEST_ARGS="--seconds=120,--mib=8,--cpu-mib=8"
COPY_STORAGE=1
check_target() {
	expect_eq "hagctl receive status" "$1" 0
	grep -q '"disks"' /tmp/recv.out && grep -q '"vda"' /tmp/recv.out ||
		fail "hagctl receive does not name the disk it received"
	vm_result vm 600
	vm_show vm
	grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console || fail "the guest did not verify on host 1"
	grep -q 'disk [1-9][0-9]* records' /tmp/vm.console || fail "the guest committed no records to its disk"
}
check_source() {
	[ "$1" = 0 ] || { vm_show vm; fail "hagctl migrate --copy-storage failed ($1)"; }
	grep -q '"disks"' /tmp/mig.out || fail "no disks in the migration report"
	grep -q 'vda' /tmp/mig.out || fail "the migration report does not name vda"
	wait_for 30 sh -c "! kill -0 $vm_pid" || fail "the source QEMU ($vm_pid) still runs after the migration"
	! grep -q HAG-GUEST-RESULT /tmp/vm.console || fail "the guest finished on the source, before the migration"
}
. /hag/qemu_migrate_once.sh
