# hosts: 1
# timeout: 300
# The libvirt qemu hook (scripts/libvirt/qemu, which runs `hagctl
# libvirt-hook`), installed by scripts/libvirt/install.sh and run the way
# libvirt runs it: arguments
# DOMAIN OPERATION SUB-OP EXTRA, the domain XML on stdin, stdout read to EOF.
# No libvirt and no QEMU here: the "domain" is a real hag-vmm VM (its control
# socket named by <hag:protect vm-socket=…>), protected by the
# real hagctl checkpoint against a real hagctl backup on this same host.
#   started  -> hagctl checkpoint --name DOMAIN runs (pidfile, process,
#            `hagctl status`) with the settings of <hag:protect> in
#            /run/hag/DOMAIN/libvirt.conf, the domain's own key among them (<hag:protect key=…>, which the
#            backup holds and /etc/hag/pair.key is not); first with its
#            backup not yet listening: it fails, and the hook retries it
#            (RETRY) until the backup is there
#   stopped, release (after the VM is gone) -> it ends, the backup ends
#            without a takeover
#   no mdev, no hag metadata, hag absent, migrate -> left alone, exit 0,
#            a log line saying why
HOOK=/etc/libvirt/hooks/qemu
LOG=/var/log/hag/libvirt-hook.log
DOM=gpu-guest
DOM_ID=7
# libvirt: /var/lib/libvirt/qemu/domain-<id>-<name>/monitor.sock
SOCK=/var/lib/libvirt/qemu/domain-$DOM_ID-$DOM/monitor.sock
PIDFILE=/run/hag/libvirt-$DOM.pid
BACKUP=127.0.0.1:7300
vm_uuid=$(new_uuid)
backup_uuid=$(new_uuid)

load_hag
ha_key
mdev_create "$vm_uuid"
mdev_create "$backup_uuid"

# domain_xml NAME ID MDEV-UUID|"" METADATA|"": a domain XML as libvirt
# hands it to the hook (live XML, with id, aliases, and other metadata).
domain_xml() {
	cat <<EOF
<domain type='kvm' id='$2'>
  <name>$1</name>
  <uuid>0d1a2b3c-4d5e-6f70-8192-a3b4c5d6e7f8</uuid>
  <metadata>
    <libosinfo:libosinfo xmlns:libosinfo="http://libosinfo.org/xmlns/libvirt/domain/1.0">
      <libosinfo:os id="http://debian.org/debian/12"/>
    </libosinfo:libosinfo>
    $4
  </metadata>
  <memory unit='KiB'>2097152</memory>
  <os><type arch='x86_64' machine='pc-q35-7.2'>hvm</type></os>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <interface type='network'>
      <source network='default'/>
      <address type='pci' domain='0x0000' bus='0x01' slot='0x00' function='0x0'/>
    </interface>
EOF
	if [ -n "$3" ]; then
		cat <<EOF
    <hostdev mode='subsystem' type='mdev' managed='no' model='vfio-pci' display='off'>
      <source>
        <address uuid='$3'/>
      </source>
      <alias name='hostdev0'/>
      <address type='pci' domain='0x0000' bus='0x07' slot='0x00' function='0x0'/>
    </hostdev>
EOF
	fi
	cat <<EOF
  </devices>
</domain>
EOF
}

# This pair's own key: with the fleet's (/etc/hag/pair.key) nothing pairs.
hagctl keygen /tmp/dom.key >/dev/null || fail "hagctl keygen"
PROTECT="<hag:protect xmlns:hag=\"https://hag.example/1\" backup=\"$BACKUP\" interval=\"1s\" failover-timeout=\"10\" vm-socket=\"$SOCK\" key=\"/tmp/dom.key\"/>"

# hook NAME OP SUB XMLFILE: runs the hook as libvirt does; its stdout must
# be empty and reach EOF promptly (nothing left holding it), and it must
# exit 0.
hook() {
	t0=$(date +%s)
	rc=0
	out=$("$HOOK" "$1" "$2" "$3" - <"$4") || rc=$?
	took=$(($(date +%s) - t0))
	expect_eq "hook $1 $2: exit status" "$rc" 0
	expect_eq "hook $1 $2: stdout" "$out" ""
	# Its stdout reached EOF, so nothing it left behind holds libvirt; the
	# bound only catches a hook that waits on something (a shell hook
	# forks dozens of processes, seconds under emulation on a busy machine).
	[ "$took" -le 30 ] || fail "hook $1 $2 held libvirt for ${took}s"
}

# logged PATTERN: the hook log has a line matching PATTERN.
logged() {
	grep -q -- "$1" "$LOG" || {
		cat "$LOG"
		fail "no hook log line matching '$1'"
	}
}

step "install.sh: a foreign hook is kept, hag's is installed and replaced"
mkdir -p /tmp/stage/etc/libvirt/hooks
printf '#!/bin/sh\nexit 0\n' >/tmp/stage/etc/libvirt/hooks/qemu
if /hag/libvirt/install.sh --root /tmp/stage >/tmp/inst.out 2>&1; then
	fail "install.sh replaced a hook that is not hag's"
fi
/hag/libvirt/install.sh --root /tmp/stage --dropin >/tmp/inst.out 2>&1 || fail "install --dropin: $(cat /tmp/inst.out)"
[ -x /tmp/stage/etc/libvirt/hooks/qemu.d/50-hag ] || fail "no qemu.d/50-hag"
grep -q 'exit 0' /tmp/stage/etc/libvirt/hooks/qemu || fail "the foreign hook changed"
/hag/libvirt/install.sh >/tmp/inst.out 2>&1 || fail "install: $(cat /tmp/inst.out)"
/hag/libvirt/install.sh >/tmp/inst.out 2>&1 || fail "reinstall: $(cat /tmp/inst.out)"
[ -x "$HOOK" ] || fail "$HOOK not installed"
[ -f /etc/hag/hag.conf ] || fail "no /etc/hag/hag.conf"
[ -d /var/log/hag ] || fail "no /var/log/hag"
echo "HAGCTL=/bin/hagctl" >>/etc/hag/hag.conf

step "domains left alone: no mdev, no hag metadata, hag absent"
domain_xml plain 3 "" "$PROTECT" >/tmp/plain.xml
hook plain started begin /tmp/plain.xml
logged "plain started/begin: left alone: the domain XML has no mdev hostdev"
domain_xml nometa 4 "$vm_uuid" "" >/tmp/nometa.xml
hook nometa started begin /tmp/nometa.xml
logged "nometa started/begin: left alone: mdev $vm_uuid, but no <hag:protect"
domain_xml nothag 5 "$(new_uuid)" "$PROTECT" >/tmp/nothag.xml
hook nothag started begin /tmp/nothag.xml
logged "nothag started/begin: left alone: <hag:protect> is set, but no mdev of the domain"
# hag absent: hagctl missing (through a config only this test points to).
printf 'HAGCTL=/nonexistent/hagctl\n' >/tmp/absent.conf
domain_xml absent 6 "$vm_uuid" "$PROTECT" >/tmp/absent.xml
rc=0
out=$(HAG_CONF=/tmp/absent.conf "$HOOK" absent started begin - </tmp/absent.xml) || rc=$?
expect_eq "hook without hagctl: exit status" "$rc" 0
expect_eq "hook without hagctl: stdout" "$out" ""
logged "absent started/begin: not protected: hag is not installed here"
hook nometa stopped end /tmp/nometa.xml
logged "nometa stopped/end: not protected by this hook: nothing to stop"
ls /run/hag/libvirt-* >/dev/null 2>&1 && fail "a left-alone domain got state: $(ls /run/hag)"

step "migrate (incoming): XML unchanged, domain marked incoming"
hook "$DOM-in" migrate begin /tmp/absent.xml
logged "$DOM-in migrate/begin: incoming domain: marked /run/hag/libvirt-$DOM-in.incoming"
[ -f "/run/hag/libvirt-$DOM-in.incoming" ] || fail "no incoming mark"
hook "$DOM-in" release end /tmp/absent.xml
[ ! -e "/run/hag/libvirt-$DOM-in.incoming" ] || fail "release kept the incoming mark"

step "VM at $SOCK; its backup not there yet"
echo "RETRY=3" >>/etc/hag/hag.conf
mkdir -p "$(dirname "$SOCK")"
hag-vmm serve --mdev "$vm_uuid" --control "$SOCK" --iterations 200000 >/tmp/vm.out 2>/tmp/vm.err &
vm_pid=$!
wait_for 30 test -S "$SOCK" || fail "VM did not start: $(cat /tmp/vm.err)"

step "started with the backup unreachable: protection fails and is retried"
domain_xml "$DOM" "$DOM_ID" "$vm_uuid" "$PROTECT" >/tmp/dom.xml
hook "$DOM" prepare begin /tmp/dom.xml
hook "$DOM" start begin /tmp/dom.xml
hook "$DOM" started begin /tmp/dom.xml
logged "$DOM started/begin: protecting vGPU $vm_uuid: hagctl checkpoint --vm $SOCK"
retrying() { grep -q "$DOM supervise/-: protection failed; retrying in 3s while the domain runs" "$LOG"; }
wait_for 90 retrying || fail "no retry after the failed protection: $(cat "$LOG")"

step "backup on $BACKUP: the retry protects the domain"
hagctl backup --listen "$BACKUP" --mdev "$backup_uuid" --control /tmp/backup-vm.sock \
	--failover-timeout 10 --key /tmp/dom.key >/tmp/backup.out 2>/tmp/backup.err &
backup_pid=$!
protected() { hagctl status | grep -q "protected, last epoch"; }
wait_for 90 protected || fail "the retried protection did not protect the VM: $(cat "$LOG")"
cp_pid=$(cat "$PIDFILE")
kill -0 "$cp_pid" || fail "hagctl checkpoint (pid $cp_pid) is not running"
tr '\0' ' ' <"/proc/$cp_pid/cmdline" | grep -q "checkpoint --name $DOM" ||
	fail "pid $cp_pid is not the checkpoint: $(tr '\0' ' ' <"/proc/$cp_pid/cmdline")"
# Its settings: the domain's <hag:protect>, as hagctl libvirt-hook wrote them.
SETTINGS=/run/hag/$DOM/libvirt.conf
for line in "vm = $SOCK" "backup = $BACKUP" "interval = 1s" "failover-timeout = 10" "key = /tmp/dom.key"; do
	grep -qx "$line" "$SETTINGS" || fail "$SETTINGS has no line '$line': $(cat "$SETTINGS")"
done
if ! wait_for 90 protected; then
	hagctl status
	cat /var/log/hag/checkpoint-$DOM.log /tmp/backup.err
	fail "hagctl status does not show the VM protected"
fi
hagctl status
kill -0 "$cp_pid" || fail "hagctl checkpoint died"

step "started again (or reconnect): nothing new"
hook "$DOM" reconnect begin /tmp/dom.xml
logged "$DOM reconnect/begin: already protected"
expect_eq "checkpoint pid after reconnect" "$(cat "$PIDFILE")" "$cp_pid"
# shellcheck disable=SC2009 # busybox has no pgrep
expect_eq "hagctl checkpoint processes" "$(ps | grep -c '[h]agctl checkpoint')" 1

step "stopped: the VM is gone (QEMU exited), protection ends"
kill "$vm_pid"
wait "$vm_pid" 2>/dev/null || :
hook "$DOM" stopped end /tmp/dom.xml
hook "$DOM" release end /tmp/dom.xml
gone() { ! kill -0 "$cp_pid" 2>/dev/null; }
wait_for 30 gone || fail "hagctl checkpoint (pid $cp_pid) still runs after stopped"
wait_for 10 test ! -e "$PIDFILE" || fail "pidfile $PIDFILE left behind"
logged "$DOM stopped/end: ending protection: supervisor pid"
logged "$DOM release/end: protection already ending"
wait_for 10 test ! -e "/run/hag/libvirt-$DOM.supervisor" || fail "the supervisor did not end"
for f in protect supervisor pid; do
	[ ! -e "/run/hag/libvirt-$DOM.$f" ] || fail "/run/hag/libvirt-$DOM.$f left behind"
done
[ ! -e "$SETTINGS" ] || fail "$SETTINGS left behind"
logged "$DOM supervise/-: hagctl checkpoint pid $cp_pid exited with status 0 after [0-9]*s: checkpoint to $BACKUP: vm-stopped"
logged "$DOM supervise/-: protection ended"
! grep -q "after the stop: SIGTERM" "$LOG" || fail "the checkpoint had to be killed"
hagctl status | grep -q "protected" && fail "hagctl status still shows protection: $(hagctl status)"
rc=0
wait "$backup_pid" || rc=$?
cat /tmp/backup.err /tmp/backup.out
expect_eq "hagctl backup exit status" "$rc" 0
grep -q takeover /tmp/backup.out && fail "the backup took over a VM that libvirt stopped"
grep -q 'protection ends' /tmp/backup.err || fail "the backup did not see protection end"

step "incoming (migrate, then started while the VM is still incoming): retried, ended by release"
IN=gpu-guest-in
IN_SOCK=/var/lib/libvirt/qemu/domain-8-$IN/monitor.sock
mkdir -p "$(dirname "$IN_SOCK")"
hag-vmm serve --incoming --mdev "$vm_uuid" --control "$IN_SOCK" >/tmp/in.out 2>/tmp/in.err &
in_pid=$!
wait_for 30 test -S "$IN_SOCK" || fail "incoming VM did not start: $(cat /tmp/in.err)"
domain_xml "$IN" 8 "$vm_uuid" "$(echo "$PROTECT" | sed "s|$SOCK|$IN_SOCK|")" >/tmp/in.xml
hook "$IN" migrate begin /tmp/in.xml
hook "$IN" started begin /tmp/in.xml
retried() { grep -q "$IN supervise/-: the domain is incoming (migration or restore): retrying in 2s" "$LOG"; }
wait_for 30 retried || fail "no retry for the incoming domain: $(cat "$LOG")"
hook "$IN" stopped end /tmp/in.xml
hook "$IN" release end /tmp/in.xml
wait_for 20 test ! -e "/run/hag/libvirt-$IN.supervisor" || fail "the incoming domain's supervisor did not end"
logged "$IN supervise/-: hagctl checkpoint pid [0-9]* exited with status 1 after [0-9]*s: .*hagctl: .*incoming"
logged "$IN supervise/-: protection ended"
kill "$in_pid"
wait "$in_pid" 2>/dev/null || :

step "hook log"
cat "$LOG"
step "checkpoint log"
cat "/var/log/hag/checkpoint-$DOM.log"
