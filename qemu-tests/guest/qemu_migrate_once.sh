# One live migration of a real VM, QEMU/KVM with a hag-sim vGPU running
# hag-guest, from host 0 to host 1 by QEMU's own migration, driven by
# `hagctl migrate --qmp` and `hagctl receive --qmp`. Shared by the qemu_migrate_*
# scenarios. Set by the caller:
#   HAG_PARAMS   hag_mdev.ko parameters (both hosts)
#   GUEST_ARGS   hag-guest's arguments, commas for spaces
#   check_target RECEIVE-STATUS   host 1's verdict (/tmp/vm.console, /tmp/recv.*)
#   check_source MIGRATE-STATUS   host 0's verdict (/tmp/vm.console, /tmp/mig.*,
#                                 $vm_pid: the source QEMU's pid)
# shellcheck disable=SC2086
load_hag $HAG_PARAMS
host_root_up
uuid=$(new_uuid)
mdev_create "$uuid"
target=$(host_ip 1)
peer=$(host_ip $((1 - HAG_HOST)))
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

if [ "$HAG_HOST" = 1 ]; then
	step "host 1: incoming VM (QEMU -incoming defer), receiver on $target:7100"
	vm_start vm "$uuid" "$GUEST_ARGS" -incoming defer
	hagctl receive --qmp /tmp/vm.qmp --listen "$target:7100" --json >/tmp/recv.out 2>/tmp/recv.err &
	recv=$!
	wait_for 60 port_listening 7100 || fail "QEMU does not listen on 7100: $(cat /tmp/recv.err)"
	signal_ready 7101
	rc=0
	wait "$recv" || rc=$?
	cat /tmp/recv.err /tmp/recv.out
	check_target "$rc"
else
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
	hagctl migrate --qmp /tmp/vm.qmp --to "$target:7100" --json >/tmp/mig.out 2>/tmp/mig.err || rc=$?
	cat /tmp/mig.err /tmp/mig.out
	check_source "$rc"
fi
