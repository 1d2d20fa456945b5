# hosts: 3
# timeout: 900
# vms: yes
# Issue 21, item 6: Pacemaker drives hag. Hosts 0 and 1 are a two-node
# corosync + Pacemaker cluster (Debian's packages, from the runner's root),
# host 2 runs corosync-qnetd, their quorum device's third vote. The VM is
# the promotable clone vgpu-vm-clone of ocf:hag:vm
# (scripts/pacemaker/vm), configured with pcs as docs/pacemaker.md
# says; fencing is fence_haghost (guest/fence_haghost.sh), through which
# the harness really kills a test host. Promoted on host 0 (a location
# preference), the VM is started there and protected by hagctl checkpoint;
# host 1's hagctl backup stands by with --on-silence hold. Host 0 is lost
# for real after epoch 4. Host 1 keeps quorum with the qdevice's vote, its
# backup holds (it never takes over on silence alone); Pacemaker fences
# host 0 (the harness confirms its QEMU is dead) and then promotes host 1,
# whose promote is `hagctl takeover`: the VM resumes from the last
# acknowledged epoch and the guest verifies there. No two copies run:
# the takeover (the promote's request, never the backup's own decision)
# starts only after the fence's confirmation that host 0 is off.
GUEST_ARGS="--seconds=120,--mib=8,--cpu-mib=8,--progress=1"
# The same vGPU id on both nodes: the resource's standby command (one for
# the cluster) names it.
uuid=8a6c0000-4a47-4000-8000-0000000a1b2c
qnetd=$(host_ip 2)
repo=$(sed -n 's/.*hag_repo=\([^ ]*\).*/\1/p' /proc/cmdline)

ha_key
host_root_up
for h in 0 1 2; do
	[ "$h" = "$HAG_HOST" ] || wait_for 60 ping -c 1 -W 1 "$(host_ip $h)" || fail "host $h unreachable"
done
hostname "host$HAG_HOST"

if [ "$HAG_HOST" = 2 ]; then
	step "host 2: corosync-qnetd on $qnetd (the quorum device's vote)"
	mkdir -p "$HOST_ROOT/run/corosync-qnetd"
	in_root corosync-qnetd -f -s off >/tmp/qnetd.log 2>&1 &
	signal_ready 7301
	in_root corosync-qnetd-tool -l 2>&1 || true
	cat /tmp/qnetd.log
	exit 0
fi

load_hag
mdev_create "$uuid"
mkdir -p "$HOST_ROOT/etc/hag" "$HOST_ROOT/usr/lib/ocf/resource.d/hag" "$HOST_ROOT/var/log/hag"
cp /etc/hag/pair.key "$HOST_ROOT/etc/hag/pair.key"
cp "$HOST_ROOT$repo/scripts/pacemaker/vm" "$HOST_ROOT/usr/lib/ocf/resource.d/hag/vm"
cp /hag/fence_haghost.sh "$HOST_ROOT/usr/sbin/fence_haghost"
chmod 0755 "$HOST_ROOT/usr/lib/ocf/resource.d/hag/vm" "$HOST_ROOT/usr/sbin/fence_haghost"
peer=$((1 - HAG_HOST))
cat >"$HOST_ROOT/etc/hag/vm.conf" <<EOF
[checkpoint]
qmp = /tmp/vm.qmp
backup = $(host_ip $peer):7200
interval = 1s
[backup]
listen = $(host_ip "$HAG_HOST"):7200
failover-timeout = 3
EOF
# A cold start (vm_start): the VM's QEMU, RAM in a shared file, QMP for
# hagctl, daemonized with its pid in /tmp/vm.pid.
cat >/tmp/vm-start <<EOF
#!/bin/sh
rm -f /tmp/vm.console /tmp/vm.qmp
exec $(vm_words vm "$uuid" "$GUEST_ARGS") \
	-object memory-backend-file,id=ram0,size=${VM_MIB}M,mem-path=/tmp/vm.ram,share=on \
	-machine memory-backend=ram0 -overcommit mem-lock=on \
	-qmp unix:/tmp/vm.qmp,server=on,wait=off -daemonize -pidfile /tmp/vm.pid 2>/tmp/vm.qemu.err
EOF
chmod +x /tmp/vm-start
# The standby's command line: the VM's own (hagctl backup adds its RAM
# backend, -incoming and QMP).
standby="-- $(vm_words vm "$uuid" "$GUEST_ARGS")"

step "host $HAG_HOST: corosync (knet, authenticated), corosync-qdevice (qnetd at $qnetd), pacemakerd"
# The cluster's key, the same on both nodes (corosync-keygen's size).
(umask 077 && for i in 1 2 3 4; do printf %s "$HAG_TEST_KEY"; done >"$HOST_ROOT/etc/corosync/authkey")
cat >"$HOST_ROOT/etc/corosync/corosync.conf" <<EOF
totem {
	version: 2
	cluster_name: hag
	transport: knet
	crypto_cipher: aes256
	crypto_hash: sha256
	token: 3000
}
nodelist {
	node {
		ring0_addr: $(host_ip 0)
		name: host0
		nodeid: 1
	}
	node {
		ring0_addr: $(host_ip 1)
		name: host1
		nodeid: 2
	}
}
quorum {
	provider: corosync_votequorum
	device {
		model: net
		votes: 1
		net {
			host: $qnetd
			algorithm: ffsplit
			tls: off
		}
	}
}
logging {
	to_stderr: no
	to_logfile: yes
	logfile: /var/log/corosync/corosync.log
	to_syslog: no
	timestamp: on
}
EOF
mkdir -p "$HOST_ROOT/var/log/corosync" "$HOST_ROOT/var/log/pacemaker" "$HOST_ROOT/run/corosync-qdevice" /dev/shm
# libqb's IPC (corosync's, Pacemaker's) is in shared memory.
mount -t tmpfs tmpfs "$HOST_ROOT/dev/shm"
in_root corosync -f >/tmp/corosync.out 2>&1 &
wait_for 60 in_root corosync-cfgtool -s >/dev/null 2>&1 || fail "corosync did not start: $(cat /tmp/corosync.out)"
in_root corosync-qdevice -f >/tmp/qdevice.out 2>&1 &
PCMK_logfile=/var/log/pacemaker/pacemaker.log in_root pacemakerd >/tmp/pacemakerd.out 2>&1 &

# pacemaker_log: the cluster's account, for a failure's diagnosis.
pacemaker_log() {
	echo "--- crm_mon -1:"
	in_root crm_mon -1 2>&1
	echo "--- corosync-quorumtool -s:"
	in_root corosync-quorumtool -s 2>&1
	for f in /var/log/hag/ocf-vm.log /var/log/fence_haghost.log; do
		echo "--- $f:"
		cat "$HOST_ROOT$f" 2>/dev/null
	done
	echo "--- pacemaker's log (the scheduler's and controller's notices):"
	grep -E 'pacemaker-(controld|schedulerd|fenced).*(notice|warning|error)' "$HOST_ROOT/var/log/pacemaker/pacemaker.log" |
		grep -v 'Calculated transition' | tail -60
}
# configure CIB: host 0's configuration (docs/pacemaker.md's pcs commands)
# made with pcs -f on a copy of the cluster's CIB, CIB.orig, while the
# nodes come online (each pcs is a Python start: seconds in a test host);
# pushed once they are, as a diff against that copy, so that what the
# cluster wrote meanwhile (its nodes, its own properties) stays.
configure() {
	# The copy once a DC is elected: it has then written the cluster's own
	# properties, which a diff made from an older copy would create again.
	wait_for 240 sh -c "chroot $HOST_ROOT crm_mon -1 2>/dev/null | grep -q 'Current DC: host'" ||
		{ echo "no DC was elected"; return 1; }
	wait_for 120 in_root pcs cluster cib "$1.orig" || { echo "pcs cluster cib never answered"; return 1; }
	cp "$HOST_ROOT$1.orig" "$HOST_ROOT$1"
	pcs_f() {
		local f=$1
		shift
		in_root pcs -f "$f" "$@" || { echo "pcs -f $f $*: failed"; return 1; }
	}
	pcs_f "$1" property set stonith-enabled=true &&
		pcs_f "$1" stonith create fence-hosts fence_haghost pcmk_host_list="host0 host1" &&
		pcs_f "$1" resource create vgpu-vm ocf:hag:vm name=vm hagctl=/usr/local/bin/hagctl vm_start=/tmp/vm-start \
			vm_stop='kill -TERM $(cat /tmp/vm.pid)' vm_pidfile=/tmp/vm.pid "backup_args=$standby" \
			op monitor interval=5s role=Promoted monitor interval=6s role=Unpromoted \
			promotable promoted-max=1 clone-max=2 notify=true &&
		pcs_f "$1" constraint location vgpu-vm-clone rule role=Promoted score=50 '#uname' eq host0
}
cib=/tmp/cib.xml
if [ "$HAG_HOST" = 0 ]; then
	(configure "$cib" >/tmp/configure.out 2>&1; echo $? >/tmp/configure.rc) &
fi
online() { in_root crm_mon -1 2>/dev/null | grep -q 'Online: \[ host0 host1 \]'; }
wait_for 240 online || { pacemaker_log; fail "the two nodes did not come online in Pacemaker"; }
in_root corosync-quorumtool -s | grep -q 'Quorate: *Yes' || { pacemaker_log; fail "no quorum"; }

# role_is ROLE: this node's role for the VM (hagctl job --role).
role_is() { [ "$(in_root /usr/local/bin/hagctl job --name vm --role)" = "$1" ]; }
# promoted_on NODE: crm_mon shows the clone promoted there.
promoted_on() { in_root crm_mon -1 2>/dev/null | grep -Eq "(Promoted|Masters): \[ $1 \]"; }

if [ "$HAG_HOST" = 0 ]; then
	step "host 0: the cluster configured with pcs (docs/pacemaker.md): fencing, the promotable VM"
	wait_for 300 test -s /tmp/configure.rc || fail "pcs did not finish the configuration"
	[ "$(cat /tmp/configure.rc)" = 0 ] || { cat /tmp/configure.out; pacemaker_log; fail "the configuration with pcs failed"; }
	in_root pcs cluster cib-push "$cib" diff-against="$cib.orig" || fail "pcs cluster cib-push"
	step "host 0: configuration pushed; waiting for Pacemaker to promote host 0"
	wait_for 300 promoted_on host0 || { pacemaker_log; fail "the VM was not promoted on host 0"; }
	step "host 0: promoted"
	wait_for 120 role_is primary || { pacemaker_log; fail "no hagctl checkpoint protects the VM on host 0"; }
	vm_wait_console vm 300 HAG-GUEST-READY
	step "host 0: the VM runs, protected"
	wait_for 300 grep -q '^epoch 4:' "$HOST_ROOT/var/log/hag/ocf-vm.log" ||
		{ pacemaker_log; fail "no 4 epochs acknowledged"; }
	step "host 0: 4 epochs acknowledged"
	in_root crm_mon -1
	in_root /usr/local/bin/hagctl job --name vm
	grep -v '^epoch\|^round' "$HOST_ROOT/var/log/hag/ocf-vm.log" | cut -c1-200
	step "host 0: lost (the harness kills its QEMU)"
	lose_this_host
fi

# Host 1.
wait_for 300 role_is standby-holding || { pacemaker_log; fail "host 1's backup never held an epoch"; }
step "host 1: the backup holds the VM's epochs; waiting for host 0's loss"
wait_for 300 promoted_on host1 || { pacemaker_log; fail "host 1 was not promoted after host 0's loss"; }
wait_for 60 role_is took-over || { pacemaker_log; fail "host 1's backup did not take the VM over"; }
pacemaker_log
in_root corosync-quorumtool -s | grep -q 'Quorate: *Yes' || fail "host 1 lost quorum (the qdevice's vote)"
in_root stonith_admin --history host0 2>&1 | tee /tmp/fence-history
grep -Eq 'successful|succeeded' /tmp/fence-history || fail "Pacemaker has no successful fencing of host 0"
log=$HOST_ROOT/var/log/hag/ocf-vm.log
# Its own silence never took over (under --on-silence hold it says it
# holds, if it saw the silence before Pacemaker's promote asked).
grep -q 'a takeover was requested (hagctl takeover)' "$log" || fail "the takeover was not the promote's"
grep 'holding (--on-silence hold)' "$log" || echo "(the promote came before the backup's own failover timeout)"
# The takeover began only after host 0 was off: the fence's confirmation
# comes before the takeover's first line (both UTC, to the millisecond).
off_at=$(sed -n 's/^\([0-9T:.-]*\)Z fence_haghost.* host0 is off.*/\1/p' "$HOST_ROOT/var/log/fence_haghost.log" | head -1)
taken_at=$(grep -m1 'taking over from epoch' "$log" | cut -c1-23)
echo "host 0 confirmed off at ${off_at:-never}; the takeover began at ${taken_at:-never}"
[ -n "$off_at" ] && [ -n "$taken_at" ] || fail "no fence confirmation or no takeover in the logs"
[ "$(printf '%s\n%s\n' "$off_at" "$taken_at" | sort | head -1)" = "$off_at" ] ||
	fail "the takeover began ($taken_at) before host 0 was confirmed off ($off_at)"
vm_result vm 600
grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console || { vm_show vm; fail "the guest did not verify on host 1"; }
in_root crm_mon -1
await_ready "$qnetd" 7301
