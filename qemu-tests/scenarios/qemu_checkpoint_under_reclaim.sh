# hosts: 2
# timeout: 900
# vms: yes
# qemu_failover_host_loss under memory pressure. On host 0 QEMU runs in a
# memory cgroup with swap (a RAM disk), and while hagctl protects the VM
# the cgroup's memory is pushed out every 200 ms (memory.reclaim: what the
# host's own reclaim does under pressure, or MADV_PAGEOUT). Reclaiming a
# page of a shared file drops its page table entry and the soft-dirty bit
# with it, so a guest write just before it would never reach the backup:
# hagctl protects only guest RAM that is locked (QEMU -overcommit
# mem-lock=on), which reclaim cannot take. A canary process in the same
# cgroup shows that the pressure is real (its memory is swapped out) while
# none of QEMU's is. Then host 0 is lost; the guest must verify on host 1.
FAULT=host-loss
GUEST_ARGS="--seconds=60,--mib=8,--cpu-mib=8,--progress=1"
# The console, for the pressure's account (during_primary's own output
# goes to a file that dies with the host).
exec 3>&1
if [ "$HAG_HOST" = 0 ]; then
	host_root_up
	mkswap /dev/ram0 >/dev/null && swapon /dev/ram0 || fail "no swap on /dev/ram0"
	mkdir -p /sys/fs/cgroup
	mount -t cgroup2 none /sys/fs/cgroup || fail "no cgroup2"
	echo +memory >/sys/fs/cgroup/cgroup.subtree_control
	mkdir /sys/fs/cgroup/vm
	VM_CGROUP=/sys/fs/cgroup/vm
	# 48 MiB of anonymous memory that nothing locks, charged to the cgroup.
	echo $$ >"$VM_CGROUP/cgroup.procs"
	# (chroot itself, not in_root: $! must be python's pid.)
	chroot "$HOST_ROOT" python3 -c 'import time; b = bytearray(b"c" * (48 << 20)); time.sleep(3600)' &
	canary=$!
	echo $$ >/sys/fs/cgroup/cgroup.procs
fi
# swapped PID: the kB of PID's memory in swap.
swapped() { sed -n 's/^VmSwap:[[:space:]]*\([0-9]*\) kB/\1/p' "/proc/$1/status"; }
during_primary() {
	n=0
	# Bounded: host 0 is lost long before.
	while [ "$n" -lt 3000 ]; do
		n=$((n + 1))
		echo 64M >"$VM_CGROUP/memory.reclaim" 2>/dev/null || true
		usleep 200000
	done
}
before_fault() {
	wait_for 60 sh -c "grep -q 'VmSwap:[[:space:]]*[0-9]\{5,\} kB' /proc/$canary/status" ||
		fail "memory.reclaim pushed out none of the canary's memory: there is no pressure to test ($(grep -E '^(anon|shmem|unevictable) ' "$VM_CGROUP/memory.stat" | tr '\n' ' '); QEMU in $(cat /proc/"$(cat /tmp/vm.pid)"/cgroup))"
	qemu=$(cat /tmp/vm.pid)
	echo "under pressure: the canary has $(swapped "$canary") kB in swap, QEMU $(swapped "$qemu") kB" \
		"($(sed -n 's/^VmLck:[[:space:]]*//p' "/proc/$qemu/status") locked, $(grep -E '^(shmem|unevictable) ' "$VM_CGROUP/memory.stat" | tr '\n' ' ')in its cgroup)" >&3
	expect_eq "kB of QEMU's memory in swap" "$(swapped "$qemu")" 0
	# Guest RAM is shared memory, which VmSwap does not count: it must
	# all be in the cgroup's unevictable (locked) memory.
	unevictable=$(sed -n 's/^unevictable //p' "$VM_CGROUP/memory.stat")
	[ "$unevictable" -ge $((VM_MIB << 20)) ] ||
		fail "the cgroup holds $unevictable bytes of unevictable memory, less than the guest's $VM_MIB MiB: guest RAM can be reclaimed"
}
check_backup() {
	takeover_verified "$1" 'the primary was silent for'
}
check_primary() { :; }
. /hag/qemu_protect_once.sh
