# hosts: 1
# timeout: 600
# vms: yes
# hagctl checkpoint --qmp refuses, before it protects anything, a VM whose
# guest writes its CPU dirty source (soft-dirty bits) could miss, saying
# why, and the VM runs on untouched: guest RAM not locked (reclaim drops
# the bits), guest RAM on hugetlbfs (one bit per mapping), and guest RAM's
# file held by another process (as virtiofsd or a vhost-user back end
# would: its writes set no bit of QEMU's). A locked VM on tmpfs gets past
# these checks to the next one; one with a migration blocker is refused
# too (each epoch saves its state by migration), as are disks hagctl
# cannot replicate: one whose device has no id (nothing to name its
# replica by) and a vhost-user-blk disk (qemu-storage-daemon writes it,
# past QEMU's block layer and its dirty bitmaps). A kernel whose bits
# fail hagctl's self-test is a unit test (vmm::dirty_source). No vGPU: the
# refusals come before hagctl looks for one. Last, with a vGPU, a backup
# whose standby is not this VM as its guest sees it (a second vCPU, one
# more device): refused at pairing, before anything is protected, each
# difference named on both sides.
VM_MIB=128
ha_key
host_root_up
# checkpoint_says PATTERN: hagctl checkpoint of VM vm fails saying PATTERN
# (a grep pattern), and the VM runs on.
checkpoint_says() {
	rc=0
	hagctl checkpoint --qmp /tmp/vm.qmp --backup 127.0.0.1:7200 --connect-timeout 2 \
		--json >/tmp/cp.out 2>/tmp/cp.err || rc=$?
	cat /tmp/cp.err
	[ "$rc" != 0 ] || fail "hagctl checkpoint protected the VM"
	grep -q "$1" /tmp/cp.err || fail "hagctl checkpoint did not say '$1'"
	expect_eq "the VM's state after the refusal" "$(qmp_status vm)" running
}
vm_stop() {
	pid=$(cat /tmp/vm.pid)
	kill "$pid"
	wait_for 30 sh -c "! kill -0 $pid 2>/dev/null" || fail "QEMU did not end"
}

step "guest RAM in a shared file, not locked"
VM_SHARED_RAM=1 VM_RAM_LOCK=off vm_start vm "" "--seconds=600"
checkpoint_says 'guest RAM is not locked in memory.*mem-lock=on'
vm_stop

step "guest RAM locked, on hugetlbfs"
echo 80 >/proc/sys/vm/nr_hugepages
mkdir -p "$HOST_ROOT/tmp/huge"
mount -t hugetlbfs none "$HOST_ROOT/tmp/huge" || fail "mounting hugetlbfs"
VM_SHARED_RAM=1 VM_RAM_PATH=/tmp/huge/vm.ram vm_start vm "" "--seconds=600"
checkpoint_says 'guest RAM is in 2048 KiB huge pages (hugetlbfs)'
vm_stop
umount "$HOST_ROOT/tmp/huge"

step "guest RAM locked on tmpfs, and another process maps its file"
VM_SHARED_RAM=1 vm_start vm "" "--seconds=600"
in_root python3 -c '
import mmap, os, time
fd = os.open("/tmp/vm.ram", os.O_RDWR)
m = mmap.mmap(fd, 4096)
os.close(fd)
print("mapped", os.getpid(), flush=True)
time.sleep(3600)' >/tmp/mapper.out &
wait_for 30 grep -q mapped /tmp/mapper.out || fail "the second process did not map the file"
mapper=$(sed -n 's/^mapped //p' /tmp/mapper.out)
checkpoint_says "another process holds guest RAM's file [^ ]*/tmp/vm.ram (pid $mapper (python3) maps it)"
kill "$mapper"
wait_for 30 sh -c "! kill -0 $mapper 2>/dev/null" || fail "the second process did not end"

step "the same VM, nothing else holding its RAM: past the dirty source's checks"
checkpoint_says '0 mdev vfio-pci devices'
vm_stop

step "a VM that QEMU refuses to migrate (a read-write vvfat drive)"
mkdir -p /tmp/vvfat
VM_SHARED_RAM=1 vm_start vm "" "--seconds=600" -drive file=fat:rw:/tmp/vvfat,format=raw,if=none,id=vvfat0
checkpoint_says 'QEMU refuses to migrate this VM (.*vvfat (rw) format.*does not support live migration'
vm_stop

step "a writable disk whose device has no id"
in_root qemu-img create -q -f qcow2 /tmp/anon.qcow2 16M || fail "qemu-img create"
VM_SHARED_RAM=1 vm_start vm "" "--seconds=600" \
	-drive file=/tmp/anon.qcow2,format=qcow2,if=none,id=anon0 -device virtio-blk-pci,drive=anon0
checkpoint_says 'the writable disk of device /machine/peripheral-anon/[^ ]* has no device id'
vm_stop

step "a vhost-user-blk disk (qemu-storage-daemon writes it)"
in_root qemu-img create -q -f raw /tmp/vub.raw 16M || fail "qemu-img create"
in_root qemu-storage-daemon --blockdev driver=file,node-name=vub,filename=/tmp/vub.raw \
	--export type=vhost-user-blk,id=vub,node-name=vub,addr.type=unix,addr.path=/tmp/vub.sock,writable=on \
	>/tmp/qsd.out 2>&1 &
wait_for 30 test -S /tmp/vub.sock || fail "qemu-storage-daemon did not listen: $(cat /tmp/qsd.out)"
VM_SHARED_RAM=1 vm_start vm "" "--seconds=600" \
	-chardev socket,id=vubc,path=/tmp/vub.sock -device vhost-user-blk-pci,chardev=vubc,id=vub0
checkpoint_says 'disk device vub0 (vhost-user-blk-pci) cannot be protected: a vhost-user back end writes its disk'
vm_stop

step "a backup whose QEMU command line is not this VM's: a second vCPU, one more device"
load_hag
uuid=$(new_uuid)
standby_uuid=$(new_uuid)
mdev_create "$uuid"
mdev_create "$standby_uuid"
VM_SHARED_RAM=1 vm_start vm "$uuid" "--seconds=600"
eval "set -- $(vm_words standby "$standby_uuid" --seconds=600)"
hagctl backup --listen 127.0.0.1:7200 --failover-timeout 3 --status-dir /tmp/hb --state-dir /tmp/hb \
	-- chroot "$HOST_ROOT" "$@" -smp 2 -device virtio-rng-pci,id=rng9 >/tmp/backup.out 2>/tmp/backup.err &
backup=$!
checkpoint_says "the QEMU that would take over is not the primary's VM.*vCPUs: 1 on the primary, 2 here.*device rng9: nothing on the primary, virtio-rng-pci on /machine/q35/pcie.0 at "
grep -q "device rng9: nothing on the primary" /tmp/backup.err || fail "the backup did not say why: $(cat /tmp/backup.err)"
kill "$backup"
vm_stop
