# One live migration of a real VM, QEMU/KVM with a hag-sim vGPU running
# hag-guest, from host 0 to host 1 by QEMU's own migration, driven by
# `hagctl migrate --qmp` and `hagctl receive --qmp`. Shared by the qemu_migrate_*
# scenarios. Set by the caller:
#   HAG_PARAMS   hag_mdev.ko parameters (both hosts)
#   GUEST_ARGS   hag-guest's arguments, commas for spaces
#   check_target RECEIVE-STATUS   host 1's verdict (/tmp/vm.console, /tmp/recv.*)
#   check_source MIGRATE-STATUS   host 0's verdict (/tmp/vm.console, /tmp/mig.*,
#                                 $vm_pid: the source QEMU's pid)
#   COPY_STORAGE=1  the VM has a local disk (virtio-blk vda, a 64 MiB qcow2
#                   in /tmp) that hag-guest commits synced records to, moved
#                   with it (hagctl migrate/receive --copy-storage; the
#                   target QEMU starts with -S and an empty qcow2 of the
#                   same size)
# The guest reports to its client on host 1 wherever it runs; once the
# migration has ended (either way) and the guest has reported 5 more
# seconds of progress, it is asked to end its run (guest_finish): its
# --seconds is only an upper bound.
# shellcheck disable=SC2086
load_hag $HAG_PARAMS
host_root_up
uuid=$(new_uuid)
mdev_create "$uuid"
target=$(host_ip 1)
peer=$(host_ip $((1 - HAG_HOST)))
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
GUEST_ARGS="$GUEST_ARGS,--progress=1,$GUEST_REPORT"
VM_NET=1
VM_APPEND=$GUEST_NET_WORDS
storage=
if [ "${COPY_STORAGE:-0}" = 1 ]; then
	VM_DISK=/tmp/vm-disk.qcow2
	GUEST_ARGS="$GUEST_ARGS,--disk,/dev/vda"
	storage=--copy-storage
	in_root qemu-img create -q -f qcow2 "$VM_DISK" 64M || fail "cannot make the VM's disk"
fi

if [ "$HAG_HOST" = 1 ]; then
	vm_net_up "$GUEST_CLIENT/24"
	guest_client_up
	step "host 1: incoming VM (QEMU -incoming defer), receiver on $target:7100"
	# shellcheck disable=SC2046
	vm_start vm "$uuid" "$GUEST_ARGS" -incoming defer $([ -z "$storage" ] || echo -S)
	hagctl receive --qmp /tmp/vm.qmp --listen "$target:7100" $storage --json >/tmp/recv.out 2>/tmp/recv.err &
	recv=$!
	wait_for 60 port_listening 7100 || fail "QEMU does not listen on 7100: $(cat /tmp/recv.err)"
	signal_ready 7101
	rc=0
	wait "$recv" || rc=$?
	cat /tmp/recv.err /tmp/recv.out
	guest_finish_after_progress "after the migration"
	check_target "$rc"
else
	vm_net_up
	step "host 0: VM with hag-guest on vGPU $uuid"
	vm_start vm "$uuid" "$GUEST_ARGS"
	# QEMU removes its pidfile when it exits.
	vm_pid=$(cat /tmp/vm.pid)
	vm_wait_console vm 600 HAG-GUEST-READY
	# Some GPU and CPU work done before the move.
	vm_wait_console vm 600 'hag-guest: iteration'
	await_ready "$target" 7101
	step "host 0: hagctl migrate --qmp to $target:7100"
	rc=0
	hagctl migrate --qmp /tmp/vm.qmp --to "$target:7100" $storage --json >/tmp/mig.out 2>/tmp/mig.err || rc=$?
	cat /tmp/mig.err /tmp/mig.out
	check_source "$rc"
fi
