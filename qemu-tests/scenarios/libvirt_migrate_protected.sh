# hosts: 2
# timeout: 1200
# vms: yes
# `virsh migrate --live` of a domain protected by hag's hook, between the
# two hosts of a pair whose <hag:protect backup='HOST0:7200,HOST1:7200'>
# names each host's backup (the hook takes the one that is not this host).
# Each host runs a `hagctl backup` for the domain. On host 0 the domain is
# protected by host 1's backup; then migrated to host 1 with plain virsh.
# host 0's hagctl checkpoint must see the migration libvirt started (it
# never resumes the VM here, never saves during it) and end protection
# with host 1's backup, which ends without a takeover; on host 1 the hook
# protects the arrived domain with host 0's backup, and the guest's
# verdict reaches host 1's console log only through that protection (its
# epochs acknowledged by host 0; the guest is asked to end its run once
# host 1's protection is seen: guest_finish). A virsh migrate that meets an epoch's
# save is refused by QEMU ("migration process in progress"), or cancelled
# by hagctl if it began while the save had x-ignore-shared on: the domain
# runs on protected, and it is tried again.
DOM=gpu-guest
UUID=8a6c0000-4a47-4000-8000-00000000a002
GUEST_ARGS="--seconds=300,--mib=8,--cpu-mib=8,--progress=1,$GUEST_REPORT"
HOOK_LOG=$HOST_ROOT/var/log/hag/libvirt-hook.log
CP_LOG=$HOST_ROOT/var/log/hag/checkpoint-$DOM.log
CONSOLE_LOG=$HOST_ROOT/var/log/hag/console-$DOM.log
me=$(host_ip "$HAG_HOST")
peer=$(host_ip $((1 - HAG_HOST)))
load_hag
ha_key
mdev_create "$UUID"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

qmp=/tmp/hag-$DOM.qmp
DOMAIN_SHARED_RAM=1
DOMAIN_CONSOLE_SOCKET=1
DOMAIN_XML_EXTRA="<metadata><hag:protect xmlns:hag='https://hag.example/1' backup='$(host_ip 0):7200,$(host_ip 1):7200' interval='1s' failover-timeout='10' qmp-socket='$qmp' console-socket='/tmp/$DOM.console.sock'/></metadata>
  <qemu:commandline><qemu:arg value='-qmp'/><qemu:arg value='unix:$qmp,server=on,wait=off'/></qemu:commandline>"
# A failed protection (the other host's backup not there yet) is
# retried every 3 s.
hook_libvirt_up RETRY=3
guest_net_up
DOMAIN_NET=1 domain_xml "$DOM" "$UUID" "$GUEST_ARGS" >"$HOST_ROOT/tmp/$DOM.xml"

# This host's backup for the domain while it runs on the other host.
step "host $HAG_HOST: hagctl backup on $me:7200 (the domain's backup while it runs on the other host)"
in_root /usr/local/bin/hagctl backup --listen "$me:7200" --failover-timeout 10 --status-dir /tmp/hag-backup \
	--state-dir /tmp/hag-backup --libvirt-domain "/tmp/$DOM.xml" >/tmp/backup.out 2>/tmp/backup.err &
backup_pid=$!

# backup_ended: this host's backup ended with the protection it served,
# having applied epochs and never taken over.
backup_ended() {
	local rc=0
	wait_for 600 sh -c "! kill -0 $backup_pid" || { cat /tmp/backup.err; fail "this host's backup did not end"; }
	wait "$backup_pid" || rc=$?
	cat /tmp/backup.err /tmp/backup.out
	expect_eq "hagctl backup exit status" "$rc" 0
	grep -q 'epoch [0-9]* applied' /tmp/backup.err || fail "no epoch reached this host's backup"
	grep -q 'backup done: protection ends' /tmp/backup.err || fail "this host's backup did not end with the protection"
	! grep -q '^takeover' /tmp/backup.out || fail "this host's backup took over"
}

if [ "$HAG_HOST" = 1 ]; then
	signal_ready 7101
	step "host 1: the domain arrives; the hook protects it with host 0's backup"
	wait_for 600 grep -q "$DOM migrate/begin" "$HOOK_LOG" || fail "libvirtd never ran the hook for the incoming domain"
	backup_ended
	wait_for 300 grep -q '^epoch 3:' "$CP_LOG" || { cat "$HOOK_LOG" "$CP_LOG"; fail "no 3 epochs acknowledged on host 1"; }
	grep -q -- "--backup $(host_ip 0):7200" "$HOOK_LOG" || { cat "$HOOK_LOG"; fail "the hook did not choose host 0's backup"; }
	in_root /usr/local/bin/hagctl status | tee /tmp/status.out
	grep -q "protected, last epoch" /tmp/status.out || fail "hagctl status does not show the VM protected on host 1"
	guest_finish
	step "host 1: the guest's verdict, released by host 1's protection"
	wait_for 600 grep -q HAG-GUEST-RESULT "$CONSOLE_LOG" || { cat "$CP_LOG"; fail "no verdict in $CONSOLE_LOG"; }
	grep HAG-GUEST-RESULT "$CONSOLE_LOG"
	grep -q 'HAG-GUEST-RESULT PASS' "$CONSOLE_LOG" || fail "the guest did not verify on host 1"
	wait_for 120 grep -q "$DOM supervise/-: protection ended" "$HOOK_LOG" || { cat "$CP_LOG"; fail "protection on host 1 did not end with the guest"; }
	cat "$HOOK_LOG" "$CP_LOG"
	await_ready "$(host_ip 0)" 7102
else
	step "host 0: virsh define + start; the hook protects it with host 1's backup"
	in_root virsh define "/tmp/$DOM.xml"
	in_root virsh start "$DOM" || fail "virsh start: $(tail -5 "$HOST_ROOT/var/log/libvirt/qemu/$DOM.log")"
	wait_for 300 grep -q '^epoch 3:' "$CP_LOG" || { cat "$HOOK_LOG" "$CP_LOG"; fail "no 3 epochs acknowledged on host 0"; }
	grep -q -- "--backup $(host_ip 1):7200" "$HOOK_LOG" || { cat "$HOOK_LOG"; fail "the hook did not choose host 1's backup"; }
	await_ready "$(host_ip 1)" 7101
	migrated=
	for try in 1 2 3 4 5; do
		step "host 0: virsh migrate --live $DOM qemu+tcp://testhost1/system (try $try)"
		if in_root virsh migrate --live --verbose --persistent --undefinesource "$DOM" \
			qemu+tcp://testhost1/system --migrateuri "tcp://$(host_ip 1)" >/tmp/mig.out 2>&1; then
			migrated=1
			break
		fi
		cat /tmp/mig.out
		# Met an epoch's save: QEMU refused it, or hagctl cancelled it
		# (begun while the save had x-ignore-shared on) and said so.
		grep -q 'migration process in progress' /tmp/mig.out ||
			{ grep -q 'canceled by client' /tmp/mig.out && grep -q "begun while this epoch's save had x-ignore-shared on" "$CP_LOG"; } ||
			{ tail -20 "$HOST_ROOT/var/log/libvirt/qemu/$DOM.log"; fail "virsh migrate failed"; }
		# Refused: the domain runs on here, protected, once the pause of
		# the epoch whose save refused it has ended (a virsh domstate right
		# after the refusal may still fall in it).
		domain_running() { [ "$(in_root virsh domstate "$DOM")" = running ]; }
		wait_for 10 domain_running || {
			tail -20 "$CP_LOG"
			fail "domain state after a refused migration: $(in_root virsh domstate --reason "$DOM"), expected running"
		}
		sleep 2
	done
	[ -n "$migrated" ] || fail "virsh migrate met an epoch's save 5 times"
	cat /tmp/mig.out
	# Begun in an epoch's pause, libvirt migrates the domain as paused
	# (it saw QEMU's STOP) and leaves it paused on host 1: a known gap
	# (docs/libvirt.md, Limitations); the operator resumes it there, and
	# the hook's protection, retrying, then starts.
	there=$(in_root virsh -c qemu+tcp://testhost1/system domstate "$DOM" | head -1)
	if [ "$there" = paused ]; then
		echo "the domain arrived paused on host 1 (virsh migrate began in an epoch's pause): virsh resume there"
		in_root virsh -c qemu+tcp://testhost1/system resume "$DOM" || fail "virsh resume on host 1"
	fi
	! in_root virsh domstate "$DOM" 2>/dev/null || fail "the domain is still defined on host 0"
	wait_for 120 grep -q "$DOM supervise/-: protection ended" "$HOOK_LOG" || { cat "$HOOK_LOG" "$CP_LOG"; fail "protection on host 0 did not end"; }
	cat "$HOOK_LOG" "$CP_LOG"
	grep -q 'migrating away' "$CP_LOG" || fail "hagctl checkpoint did not see the migration"
	grep -q 'exited with status 0 .*migrated-away' "$HOOK_LOG" || fail "protection on host 0 did not end as migrated-away"
	backup_ended
	signal_ready 7102
fi
