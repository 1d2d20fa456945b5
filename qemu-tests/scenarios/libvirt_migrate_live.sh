# hosts: 2
# timeout: 900
# vms: yes
# qemu_migrate_live through real libvirtd: a domain with a hag-sim mdev
# hostdev is defined and started by libvirtd on host 0 and moved with
# `virsh migrate --live` to host 1 (the vGPU's mdev has the same UUID on
# both hosts, as libvirt requires). The guest must verify all of its memory
# on host 1, the domain must be gone from host 0, and hag's qemu hook log
# must show that libvirtd itself called the hook on both hosts. The guest
# is asked to end its run once it has run 5 s on host 1 (guest_finish,
# through its client on host 1's br0).
DOM=gpu-guest
# Both hosts create the vGPU under one UUID, as libvirt's migration expects.
UUID=8a6c0000-4a47-4000-8000-00000000a001
GUEST_ARGS="--seconds=120,--mib=8,--cpu-mib=8,--progress=1,$GUEST_REPORT"
HOOK_LOG=$HOST_ROOT/var/log/hag/libvirt-hook.log
load_hag
mdev_create "$UUID"
libvirt_up
target=$(host_ip 1)
peer=$(host_ip $((1 - HAG_HOST)))
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

if [ "$HAG_HOST" = 1 ]; then
	vm_net_up "$GUEST_CLIENT/24"
	guest_client_up
	step "host 1: libvirtd ready for the incoming domain"
	signal_ready 7101
	wait_for 600 grep -q "$DOM migrate/begin" "$HOOK_LOG" || fail "libvirtd never ran the hook for the incoming domain"
	wait_for 600 sh -c "chroot $HOST_ROOT virsh domstate $DOM 2>/dev/null | grep -q running" ||
		fail "the domain never ran on host 1"
	guest_finish_after_progress "on host 1"
	step "host 1: the domain runs here; the guest verifies"
	vm_result "$DOM" 600
	vm_show "$DOM"
	in_root virsh list --all
	cat "$HOOK_LOG"
	grep -q 'HAG-GUEST-RESULT PASS' "/tmp/$DOM.console" || fail "the guest did not verify on host 1"
	grep -q "$DOM started/begin" "$HOOK_LOG" || fail "the hook did not see the domain start on host 1"
else
	vm_net_up
	step "host 0: virsh define + start (vGPU $UUID)"
	DOMAIN_NET=1 domain_xml "$DOM" "$UUID" "$GUEST_ARGS" >/tmp/$DOM.xml
	in_root virsh define "/tmp/$DOM.xml"
	in_root virsh start "$DOM" || fail "virsh start: $(tail -5 "$HOST_ROOT/var/log/libvirt/qemu/$DOM.log")"
	vm_wait_console "$DOM" 600 HAG-GUEST-READY
	vm_wait_console "$DOM" 600 'hag-guest: iteration'
	await_ready "$target" 7101
	step "host 0: virsh migrate --live $DOM qemu+tcp://testhost1/system"
	in_root virsh migrate --live --verbose --persistent --undefinesource "$DOM" \
		qemu+tcp://testhost1/system --migrateuri "tcp://$target" >/tmp/mig.out 2>&1 ||
		{ cat /tmp/mig.out; tail -20 "$HOST_ROOT/var/log/libvirt/qemu/$DOM.log"; fail "virsh migrate failed"; }
	cat /tmp/mig.out
	in_root virsh list --all
	! in_root virsh domstate "$DOM" 2>/dev/null || fail "the domain is still defined on host 0"
	cat "$HOOK_LOG"
	grep -q "$DOM stopped/end" "$HOOK_LOG" || fail "the hook did not see the domain stop on host 0"
	! grep -q HAG-GUEST-RESULT "/tmp/$DOM.console" || fail "the guest finished on host 0, before the migration"
fi
