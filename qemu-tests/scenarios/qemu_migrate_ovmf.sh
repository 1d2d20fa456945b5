# hosts: 2
# timeout: 900
# vms: yes
# Issue 23, item 5: a VM booted by UEFI firmware (Debian's OVMF, the guest
# kernel loaded as an EFI application) migrates live as qemu_migrate_live's
# does, with guest memory far apart: 256 MiB of RAM below 4 GiB and a
# 128 MiB DIMM at 128 GiB, where a guest of more than 60 GiB has RAM (OVMF
# puts its 64-bit PCI window above that). QEMU's DMA-logging start then
# sends the vGPU one range per part (its trace says so, checked here);
# collapsed into one span they would cover more than 128 GiB, which a log
# capped at 64 GiB refused, so the VM could not migrate. The guest must
# verify all of its memory on host 1 and the source QEMU must be gone.
GUEST_ARGS="--seconds=120,--mib=8,--cpu-mib=8"
VM_FIRMWARE=ovmf
high_dimm=0x2000000000
VM_MEM_OPTS=",slots=1,maxmem=136G"
VM_QEMU_ARGS="-object memory-backend-ram,id=high0,size=128M -device pc-dimm,id=dimm0,memdev=high0,addr=$high_dimm"
VM_QEMU_ARGS="$VM_QEMU_ARGS -trace vfio_device_dirty_tracking_start -D /tmp/vm.trace"
check_target() {
	expect_eq "hagctl receive status" "$1" 0
	vm_result vm 600
	vm_show vm
	grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console || fail "the guest did not verify on host 1"
}
check_source() {
	[ "$1" = 0 ] || { vm_show vm; fail "hagctl migrate failed ($1)"; }
	wait_for 30 sh -c "! kill -0 $vm_pid" || fail "the source QEMU ($vm_pid) still runs after the migration"
	! grep -q HAG-GUEST-RESULT /tmp/vm.console || fail "the guest finished on the source, before the migration"
	# "nr_ranges 2 32:[0x0 - 0xffffffff], 64:[0x2000000000 - 0x2007ffffff], pci64:[…]"
	local start ranges high
	start=$(grep -m1 'vfio_device_dirty_tracking_start' /tmp/vm.trace) ||
		fail "QEMU did not start DMA logging on the vGPU (no trace line in /tmp/vm.trace)"
	echo "QEMU: $start"
	ranges=$(echo "$start" | sed -n 's/.*nr_ranges \([0-9]*\).*/\1/p')
	high=$(echo "$start" | sed -n 's/.* 64:\[\(0x[0-9a-f]*\) - .*/\1/p')
	[ "${ranges:-0}" -ge 2 ] || fail "QEMU asked for $ranges DMA-logging range(s), expected the low RAM and the DIMM apart"
	[ "$high" = "$high_dimm" ] || fail "QEMU's 64-bit range starts at $high, not at the DIMM ($high_dimm)"
}
. /hag/qemu_migrate_once.sh
