# hosts: 2
# timeout: 900
# vms: yes
# Protection started by hag's qemu hook under real libvirtd: on host 0 a
# domain with a hag-sim mdev hostdev, guest RAM in a shared memfd
# (<memoryBacking>), a second QMP socket for hagctl (<qemu:commandline>)
# and <hag:protect backup=… qmp-socket=… console-socket=…> in its
# <metadata>, its serial console a unix socket, is defined and started with
# virsh; libvirtd runs the hook, which starts hagctl checkpoint --qmp
# --console against hagctl backup on host 1, whose standby is the same
# domain XML as libvirt would start it (--libvirt-domain: virsh
# domxml-to-native), so it matches the primary's machine, CPU and devices
# as the backup checks at pairing. Epochs must be acknowledged
# (hagctl status says the VM is protected), the guest's console lines
# must reach the hook's console log as their epochs are; QEMU's
# x-ignore-shared must be off between epochs, and return-path and
# pause-before-switchover left on (as a refused virsh migrate leaves them)
# must neither stop the epochs nor be lost; `virsh destroy` must end the
# protection: the hook's checkpoint ends, and the backup ends without a
# takeover.
DOM=gpu-guest
GUEST_ARGS="--seconds=300,--mib=8,--cpu-mib=8"
HOOK_LOG=$HOST_ROOT/var/log/hag/libvirt-hook.log
CP_LOG=$HOST_ROOT/var/log/hag/checkpoint-$DOM.log
CONSOLE_LOG=$HOST_ROOT/var/log/hag/console-$DOM.log
backup=$(host_ip 1):7200
peer=$(host_ip $((1 - HAG_HOST)))
uuid=$(new_uuid)
load_hag
ha_key
mdev_create "$uuid"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

# The same domain on both hosts (each with its own vGPU).
qmp=/tmp/hag-$DOM.qmp
DOMAIN_SHARED_RAM=1
DOMAIN_CONSOLE_SOCKET=1
DOMAIN_XML_EXTRA="<metadata><hag:protect xmlns:hag='https://hag.example/1' backup='$backup' interval='1s' failover-timeout='10' qmp-socket='$qmp' console-socket='/tmp/$DOM.console.sock'/></metadata>
  <qemu:commandline><qemu:arg value='-qmp'/><qemu:arg value='unix:$qmp,server=on,wait=off'/></qemu:commandline>"
libvirt_up
mkdir -p "$HOST_ROOT/etc/hag"
cp /etc/hag/pair.key "$HOST_ROOT/etc/hag/pair.key"
if [ "$HAG_HOST" = 1 ]; then
	step "host 1: backup on $backup, its standby the domain's XML with this host's vGPU $uuid (--libvirt-domain)"
	domain_xml "$DOM" "$uuid" "$GUEST_ARGS" >"$HOST_ROOT/tmp/$DOM.xml"
	rc=0
	in_root /usr/local/bin/hagctl backup --listen "$backup" --failover-timeout 10 --status-dir /tmp/hag-backup \
		--state-dir /tmp/hag-backup --libvirt-domain "/tmp/$DOM.xml" >/tmp/backup.out 2>/tmp/backup.err || rc=$?
	cat /tmp/backup.err /tmp/backup.out
	expect_eq "hagctl backup exit status" "$rc" 0
	grep -q 'epoch [0-9]* applied' /tmp/backup.err || fail "no epoch reached the backup"
	grep -q 'backup done: protection ends' /tmp/backup.err ||
		fail "the backup did not end with the protection"
	! grep -q '^takeover' /tmp/backup.out || fail "the backup took over"
else
	# libvirtd runs hooks with PATH=/bin:/sbin:/usr/bin.
	echo "HAGCTL=/usr/local/bin/hagctl" >"$HOST_ROOT/etc/hag/hag.conf"
	step "host 0: virsh define + start (vGPU $uuid, <hag:protect backup='$backup'>)"
	domain_xml "$DOM" "$uuid" "$GUEST_ARGS" >/tmp/$DOM.xml
	cat /tmp/$DOM.xml
	in_root virsh define "/tmp/$DOM.xml"
	in_root virsh start "$DOM" || fail "virsh start: $(tail -5 "$HOST_ROOT/var/log/libvirt/qemu/$DOM.log")"
	wait_for 60 grep -q "$DOM started/begin: protecting vGPU" "$HOOK_LOG" ||
		{ cat "$HOOK_LOG"; fail "the hook did not start protection"; }
	wait_for 300 grep -q '^epoch 3:' "$CP_LOG" || { cat "$CP_LOG"; fail "no 3 epochs acknowledged"; }
	in_root /usr/local/bin/hagctl status
	in_root /usr/local/bin/hagctl status | grep -q "protected, last epoch" || fail "hagctl status does not show the VM protected"
	wait_for 120 grep -q 'hag-guest: iteration' "$CONSOLE_LOG" ||
		fail "the guest's console never reached $CONSOLE_LOG: $(cat "$CONSOLE_LOG" 2>&1)"
	echo "console released to $CONSOLE_LOG: $(wc -l <"$CONSOLE_LOG") lines, the last: $(tail -1 "$CONSOLE_LOG")"
	# Between epochs the domain migrates like any other: hagctl sets
	# x-ignore-shared only around each save (a virsh migrate with it on
	# would leave guest RAM behind). Asked through libvirt's own monitor,
	# up to 20 times: an epoch's save (a good part of each second here)
	# may be under way.
	ignored=0
	for _ in $(seq 20); do
		on=$(in_root virsh qemu-monitor-command "$DOM" '{"execute":"query-migrate-capabilities"}' |
			in_root python3 -c 'import json, sys
caps = {c["capability"]: c["state"] for c in json.load(sys.stdin)["return"]}
print(caps["x-ignore-shared"])') || fail "no x-ignore-shared in QEMU's migration capabilities"
		[ "$on" = False ] && break
		ignored=$((ignored + 1))
		usleep 250000
	done
	[ "$ignored" -lt 20 ] || fail "x-ignore-shared stays on between epochs (on at 20 reads in 5 s)"
	echo "x-ignore-shared off at read $((ignored + 1))"
	# A virsh migrate that QEMU refused because a save was running leaves
	# libvirt's own capabilities on: QEMU refuses its reset as well. With
	# return-path or pause-before-switchover on, a save into hagctl's pipe
	# never ends (it waits for a peer's reply, or for migrate-continue).
	# Set as libvirt leaves them, epochs must go on, and between epochs
	# the capabilities must be libvirt's again.
	step "host 0: return-path and pause-before-switchover left on, as after a refused virsh migrate"
	epochs() { grep -c '^epoch [0-9]*:' "$CP_LOG"; }
	# virsh exits 0 on QEMU's error reply too (refused while a save runs).
	set_libvirt_caps() {
		in_root virsh qemu-monitor-command "$DOM" '{"execute":"migrate-set-capabilities","arguments":{"capabilities":[{"capability":"return-path","state":true},{"capability":"pause-before-switchover","state":true}]}}' 2>/dev/null |
			in_root python3 -c 'import json, sys; sys.exit(0 if "return" in json.load(sys.stdin) else 1)'
	}
	wait_for 30 set_libvirt_caps || fail "QEMU kept refusing migrate-set-capabilities"
	before=$(epochs)
	three_more() { [ "$(epochs)" -ge $((before + 3)) ]; }
	wait_for 120 three_more || { tail -20 "$CP_LOG"; fail "no epoch was acknowledged with libvirt's capabilities left on"; }
	caps_back() {
		in_root virsh qemu-monitor-command "$DOM" '{"execute":"query-migrate-capabilities"}' |
			in_root python3 -c 'import json, sys
caps = {c["capability"]: c["state"] for c in json.load(sys.stdin)["return"]}
sys.exit(0 if caps["return-path"] and caps["pause-before-switchover"] and not caps["x-ignore-shared"] else 1)'
	}
	wait_for 10 caps_back || fail "libvirt's capabilities were not set back between epochs"
	echo "$(($(epochs) - before)) epochs acknowledged since; libvirt's capabilities set back between them"
	step "host 0: virsh destroy: protection ends"
	in_root virsh destroy "$DOM"
	wait_for 120 grep -q "$DOM supervise/-: protection ended" "$HOOK_LOG" ||
		{ cat "$HOOK_LOG" "$CP_LOG"; fail "protection did not end after virsh destroy"; }
	cat "$HOOK_LOG" "$CP_LOG"
	# Whichever came first ends protection: the hook's stopped event, or
	# hagctl checkpoint seeing QEMU gone (the VM stopped: its QMP closed)
	# before libvirt ran the hook, which then has nothing left to end.
	grep -q "$DOM stopped/end: \(ending protection\|not protected by this hook\)" "$HOOK_LOG" ||
		fail "the hook did not see the domain stop"
	grep -q "$DOM stopped/end: ending protection" "$HOOK_LOG" ||
		grep -q 'checkpoint pid [0-9]* exited with status 0 .*vm-stopped' "$HOOK_LOG" ||
		fail "protection ended neither by the hook nor because the VM stopped"
fi
