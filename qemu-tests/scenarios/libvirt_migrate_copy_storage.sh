# hosts: 2
# timeout: 1500
# vms: yes
# debian: yes
# memory: 3072
# libvirt_migrate_live with a local disk: the Debian guest (systemd,
# PostgreSQL 15, hag-guest's GPU workload as a service) defined in real
# libvirtd on host 0 with its hag-sim vGPU, a NIC on br0 and its root disk,
# a qcow2 overlay in host 0's /tmp, is moved to host 1 with `virsh migrate
# --live --copy-storage-all` (its disk mirrored over NBD into an empty
# qcow2 of the same virtual size on host 1, then its RAM and vGPU). A
# client on host 1 commits rows to the guest's PostgreSQL from before the
# migration until after it (the guest is reached over the eth1 segment
# both hosts' br0 share). On host 1: every acknowledged commit is in the
# table, PostgreSQL neither restarted nor ran crash recovery, the guest's
# hag-guest verifies (GPU, memory, records it synced to a file on the
# disk; asked to end its run once the client has stopped: guest_finish);
# the domain runs on host 1 and is gone from host 0.
DOM=gpu-guest
# Both hosts create the vGPU under one UUID, as libvirt's migration expects.
UUID=8a6c0000-4a47-4000-8000-00000000a002
DISK=/tmp/$DOM.qcow2
CLIENT=$GUEST_CLIENT
VM_ADDR=203.0.113.50
VM_MIB=512
# Long enough to span the migration (its disk mirror and RAM copy); it is
# asked to end once the client has seen the guest answer on host 1.
GUEST_ARGS="--seconds=400,--mib=8,--cpu-mib=8,--progress=1,--disk,/var/lib/hag-guest-records,$GUEST_REPORT"
load_hag
mdev_create "$UUID"
libvirt_up
target=$(host_ip 1)
source=$(host_ip 0)
peer=$(host_ip $((1 - HAG_HOST)))
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

# acked: how many commits the client saw acknowledged so far.
acked() { grep -c '^acked ' /tmp/db.log 2>/dev/null || true; }
# domstate: the domain's state on this host's libvirtd (empty if it has none).
domstate() { chroot "$HOST_ROOT" virsh domstate "$DOM" 2>/dev/null | head -1; }

if [ "$HAG_HOST" = 1 ]; then
	vm_net_up "$CLIENT/24"
	guest_client_up
	step "host 1: waiting for the guest to run on host 0"
	await_ready "$source" 7102 600
	cap=$(in_root virsh -c qemu+tcp://testhost0/system domblkinfo "$DOM" vda | sed -n 's/^Capacity: *\([0-9]*\)$/\1/p')
	[ -n "$cap" ] || fail "no capacity for $DOM's vda from host 0's libvirtd"
	step "host 1: the target disk $DISK, qcow2 of $cap bytes (the source's virtual size)"
	in_root qemu-img create -q -f qcow2 "$DISK" "$cap" || fail "cannot make the target disk"
	step "host 1: client commits to PostgreSQL on $VM_ADDR (guest on host 0)"
	: >/tmp/db.log
	# Not through in_root: $! is then the client's own pid (chroot execs
	# it), not a subshell's that SIGTERM would end without it.
	chroot "$HOST_ROOT" python3 /hag/db_client.py commit --host "$VM_ADDR" --log /tmp/db.log >/tmp/db.err 2>&1 &
	db_client=$!
	wait_for 300 sh -c "[ \$(grep -c '^acked ' /tmp/db.log) -ge 20 ]" ||
		{ cat /tmp/db.err; fail "the client saw no 20 commits acknowledged on host 0: $(tail -3 /tmp/db.log)"; }
	step "host 1: $(acked) commits acknowledged; ready for the incoming domain"
	signal_ready 7101
	n=0
	while [ "$(domstate)" != running ]; do
		n=$((n + 1))
		[ "$n" -lt 600 ] || fail "the domain is not running on host 1 after 600 s: state '$(domstate)'"
		kill -0 "$db_client" 2>/dev/null || { cat /tmp/db.err; fail "the client ended during the migration"; }
		[ $((n % 10)) != 0 ] || echo "host 1: migrating (state here '$(domstate)'), $(acked) commits acknowledged"
		sleep 1
	done
	at_move=$(acked)
	step "host 1: the domain runs here; $at_move commits acknowledged so far"
	# The client goes on committing to the guest, now on this host.
	wait_for 180 sh -c "[ \$(grep -c '^acked ' /tmp/db.log) -ge $((at_move + 20)) ]" ||
		{ cat /tmp/db.err; fail "no 20 more commits acknowledged after the migration: $(tail -3 /tmp/db.log)"; }
	kill -TERM "$db_client"
	wait "$db_client" || true
	! kill -0 "$db_client" 2>/dev/null || fail "the client runs on after SIGTERM"
	sed 's/^/[db client] /' /tmp/db.err
	step "host 1: client stopped after $(acked) commits ($at_move before the guest ran here)"
	guest_finish
	vm_result "$DOM" 600
	rc=0
	step "host 1: the database's verdict"
	in_root python3 /hag/db_client.py check --host "$VM_ADDR" --log /tmp/db.log || rc=$?
	vm_show "$DOM"
	in_root virsh list --all
	in_root virsh domblklist "$DOM"
	in_root qemu-img info -U "$DISK"
	expect_eq "db_client.py check's exit status" "$rc" 0
	grep -q 'HAG-GUEST-RESULT PASS' "/tmp/$DOM.console" || fail "the guest did not verify on host 1"
	expect_eq "the domain's state on host 1" "$(domstate)" running
else
	vm_net_up
	step "host 0: the Debian guest's disk $DISK, virsh define + start (vGPU $UUID)"
	debian_disk "$DISK"
	in_root qemu-img info --output=json "$DISK"
	DOMAIN_DEBIAN_DISK=$DISK DOMAIN_NET=1 domain_xml "$DOM" "$UUID" "$GUEST_ARGS" >"/tmp/$DOM.xml"
	in_root virsh define "/tmp/$DOM.xml"
	in_root virsh start "$DOM" || fail "virsh start: $(tail -5 "$HOST_ROOT/var/log/libvirt/qemu/$DOM.log")"
	vm_wait_console "$DOM" 600 HAG-GUEST-READY
	vm_wait_console "$DOM" 600 'hag-guest: iteration'
	step "host 0: the guest runs"
	signal_ready 7102
	await_ready "$target" 7101 600
	step "host 0: virsh migrate --live --copy-storage-all $DOM qemu+tcp://testhost1/system"
	in_root virsh migrate --live --copy-storage-all --verbose --persistent --undefinesource "$DOM" \
		qemu+tcp://testhost1/system --migrateuri "tcp://$target" >/tmp/mig.out 2>&1 ||
		{
			cat /tmp/mig.out
			tail -20 "$HOST_ROOT/var/log/libvirt/qemu/$DOM.log"
			grep -i 'error' "$HOST_ROOT/var/log/libvirt/libvirtd.log" | tail -20
			tail -20 "/tmp/$DOM.console"
			fail "virsh migrate failed"
		}
	cat /tmp/mig.out
	step "host 0: migrated"
	in_root virsh list --all
	! in_root virsh domstate "$DOM" 2>/dev/null || fail "the domain is still defined on host 0"
	echo "--- the guest's console on host 0 (its last 20 lines):"
	tail -20 "/tmp/$DOM.console" | guest_oops_quoted
	! grep -q HAG-GUEST-RESULT "/tmp/$DOM.console" || fail "the guest finished on host 0, before the migration"
fi
