# hosts: 2
# timeout: 900
# vms: yes
# A takeover of a libvirt domain leaves it a libvirt domain on the
# survivor, on its disk's replica. Host 0's domain (hag-sim vGPU, guest RAM
# in a shared file, hagctl's own QMP socket, a qcow2 data disk hag-guest
# commits synced records to) is protected by hag's hook against host 1's
# `hagctl backup --libvirt-domain DOMAIN.xml --takeover-by-libvirt`. Host
# 0's QEMU is killed (SIGKILL): its checkpoint hands the VM over, and host
# 1's backup writes the last acknowledged epoch as a libvirt save image of
# the domain (defined on both hosts, one UUID) and has libvirtd restore it
# paused (the hook links guest RAM to the standby image), then resumes it
# with virsh. On host 1 `virsh list` must show the domain running, with
# x-ignore-shared off (asked through libvirt's own monitor), its disk on
# host 1's replica (host 1 has no copy of host 0's image), in the running
# domain and in its definition; `virsh suspend` and `virsh resume` must
# work on it. The domain is protected
# again by its own configuration (backup='HOST0:7200,HOST1:7200': host 0's
# backup, which stands by once its VM was handed over) at the takeover's
# generation: epochs must be acknowledged, and host 0's backup must
# receive the disk. The guest must verify on host 1, its records read
# back from the disk (asked to end its run once those checks passed: guest_finish); when
# it powers off, libvirt must record the domain shut off, and both backups
# must end.
DOM=gpu-guest
GUEST_ARGS="--seconds=300,--mib=8,--cpu-mib=8,--progress=1,--disk,/dev/vda,$GUEST_REPORT"
DOMAIN_DISK=/tmp/$DOM-data.qcow2
HOOK_LOG=$HOST_ROOT/var/log/hag/libvirt-hook.log
CP_LOG=$HOST_ROOT/var/log/hag/checkpoint-$DOM.log
backup=$(host_ip 1):7200
backup0=$(host_ip 0):7200
peer=$(host_ip $((1 - HAG_HOST)))
uuid=$(new_uuid)
load_hag
ha_key
mdev_create "$uuid"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
qmp=/tmp/hag-$DOM.qmp
DOMAIN_SHARED_RAM=1
DOMAIN_XML_EXTRA="<uuid>8a6c0000-4a47-4000-8000-00000000b001</uuid>
  <metadata><hag:protect xmlns:hag='https://hag.example/1' backup='$backup0,$backup' interval='1s' qmp-socket='$qmp'/></metadata>
  <qemu:commandline><qemu:arg value='-qmp'/><qemu:arg value='unix:$qmp,server=on,wait=off'/></qemu:commandline>"
# The hook gives hagctl checkpoint 90 s to end by itself after libvirt
# reports QEMU gone: the hand-over waits for the backup's restore.
hook_libvirt_up STOP_TIMEOUT=90 RETRY=3
guest_net_up
DOMAIN_NET=1 domain_xml "$DOM" "$uuid" "$GUEST_ARGS" >"$HOST_ROOT/tmp/$DOM.xml"
if [ "$HAG_HOST" = 1 ]; then
	in_root virsh define "/tmp/$DOM.xml"
	step "host 1: backup on $backup; a takeover is a libvirt restore of the domain"
	in_root /usr/local/bin/hagctl backup --listen "$backup" --failover-timeout 10 --status-dir /tmp/hag-backup \
		--state-dir /tmp/hag-backup --libvirt-domain "/tmp/$DOM.xml" --takeover-by-libvirt \
		>/tmp/backup.out 2>/tmp/backup.err &
	bk=$!
	tail -f /tmp/backup.err 2>/dev/null | sed 's/^/[backup] /' &
	live=$!
	wait_for 600 grep -q 'takeover: generation 1\|takeover failed' /tmp/backup.err || fail "no takeover"
	grep -q 'takeover: generation 1' /tmp/backup.err || {
		cat "$HOOK_LOG"; tail -30 "$HOST_ROOT/var/log/libvirt/qemu/$DOM.log"
		grep -i 'error\|restore' "$HOST_ROOT/var/log/libvirt/libvirtd.log" | tail -20; fail "the takeover failed"; }
	cat "$HOOK_LOG"
	grep -q "$DOM start/begin: takeover restore: guest RAM" "$HOOK_LOG" || fail "the hook did not link guest RAM to the standby image"
	step "host 1: the survivor is a libvirt domain"
	in_root virsh list --all | tee /tmp/list
	grep -q "$DOM *running" /tmp/list || fail "virsh list does not show $DOM running"
	expect_eq "virsh domstate" "$(in_root virsh domstate "$DOM" | head -1)" running
	on=$(in_root virsh qemu-monitor-command "$DOM" '{"execute":"query-migrate-capabilities"}' |
		in_root python3 -c 'import json, sys
caps = {c["capability"]: c["state"] for c in json.load(sys.stdin)["return"]}
print(caps["x-ignore-shared"])')
	expect_eq "x-ignore-shared on the restored domain" "$on" False
	in_root virsh domblklist "$DOM" | tee /tmp/blk
	grep -q "^ *vda */tmp/hag-backup/.*virtio-disk0.raw *$" /tmp/blk || fail "the restored domain's vda is not host 1's replica"
	in_root virsh dumpxml --inactive "$DOM" | grep "<source file=" | tee /tmp/defined
	grep -q "/tmp/hag-backup/.*virtio-disk0.raw" /tmp/defined || fail "the domain's definition does not name the replica"
	grep "runs on its disks' replicas" /tmp/backup.err || fail "the backup did not say the domain runs on its replicas"
	in_root virsh suspend "$DOM"
	expect_eq "virsh domstate after virsh suspend" "$(in_root virsh domstate "$DOM" | head -1)" paused
	in_root virsh resume "$DOM"
	expect_eq "virsh domstate after virsh resume" "$(in_root virsh domstate "$DOM" | head -1)" running
	step "host 1: protected again, with host 0's backup"
	wait_for 300 grep -q '^epoch 3:' "$CP_LOG" || { cat "$HOOK_LOG" "$CP_LOG"; fail "the restored domain was not protected again"; }
	grep "$DOM takeover/-: protecting vGPU" "$HOOK_LOG" || fail "the takeover did not start protection through the hook's configuration"
	in_root /usr/local/bin/hagctl status | tee /tmp/status.out
	grep -q "protected, last epoch .*backup $backup0 (generation 1" /tmp/status.out || fail "not protected at the takeover's generation"
	guest_finish
	step "host 1: the guest's verdict"
	vm_result "$DOM" 600
	grep -q 'HAG-GUEST-RESULT PASS' "/tmp/$DOM.console" || { tail -20 "/tmp/$DOM.console"; fail "the guest did not verify on host 1"; }
	grep 'disk [0-9]* records' "/tmp/$DOM.console" || fail "the guest did not say how many records it read back from its disk"
	grep -q 'disk [1-9][0-9]* records' "/tmp/$DOM.console" || fail "the guest committed no records to its disk"
	step "host 1: the guest powered off: libvirt ends the domain, and the backup ends"
	wait_for 60 sh -c "chroot $HOST_ROOT virsh domstate $DOM | grep -q 'shut off'" ||
		fail "libvirt does not show the domain shut off: $(in_root virsh domstate --reason "$DOM")"
	in_root virsh domstate --reason "$DOM"
	rc=0
	wait_for 60 sh -c "! kill -0 $bk" || fail "the backup did not end with the domain"
	wait "$bk" || rc=$?
	kill "$live" 2>/dev/null || true
	cat /tmp/backup.out
	tail -3 /tmp/backup.err
	tail -8 "$CP_LOG"
	expect_eq "hagctl backup exit status" "$rc" 0
	await_ready "$(host_ip 0)" 7102
else
	step "host 0: virsh define + start; the hook protects the domain with $backup"
	in_root qemu-img create -q -f qcow2 "$DOMAIN_DISK" 64M || fail "cannot make the domain's disk"
	in_root virsh define "/tmp/$DOM.xml"
	in_root virsh start "$DOM" || fail "virsh start: $(tail -5 "$HOST_ROOT/var/log/libvirt/qemu/$DOM.log")"
	grep -o 'memory-backend-file[^ ]*' "$HOST_ROOT/var/log/libvirt/qemu/$DOM.log" | head -2
	wait_for 300 grep -q '^epoch 3:' "$CP_LOG" || { cat "$HOOK_LOG" "$CP_LOG"; fail "no 3 epochs acknowledged"; }
	pid=$(cat "$HOST_ROOT/run/libvirt/qemu/$DOM.pid")
	step "host 0: the domain's QEMU (pid $pid) killed with SIGKILL"
	kill -KILL "$pid"
	wait_for 120 grep -q "$DOM supervise/-: protection ended" "$HOOK_LOG" || { cat "$HOOK_LOG" "$CP_LOG"; fail "protection did not end"; }
	cat "$HOOK_LOG"
	tail -5 "$CP_LOG"
	grep -q 'handed-over' "$CP_LOG" || fail "the checkpoint did not hand the VM over"
	step "host 0: stands by as the domain's backup on $backup0"
	rc=0
	in_root /usr/local/bin/hagctl backup --listen "$backup0" --failover-timeout 10 --status-dir /tmp/hag-backup \
		--state-dir /tmp/hag-backup --libvirt-domain "/tmp/$DOM.xml" >/tmp/backup.out 2>/tmp/backup.err || rc=$?
	cat /tmp/backup.err /tmp/backup.out
	expect_eq "hagctl backup exit status" "$rc" 0
	grep -q 'epoch [0-9]* applied' /tmp/backup.err || fail "no epoch of the restored domain reached host 0"
	grep -q 'disk replicas summed' /tmp/backup.err || fail "host 0's backup did not replicate the restored domain's disk"
	! grep -q '^takeover' /tmp/backup.out || fail "host 0's backup took over"
	signal_ready 7102
fi
