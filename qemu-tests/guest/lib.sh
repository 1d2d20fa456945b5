# Helpers for scenario scripts on test hosts (sourced by /init, so every
# scenario has them). Scenarios run under `sh -e`: any failing command fails
# the scenario; `fail` says why first.

HAG_MODULE=/hag/hag_mdev.ko
HAG_MDEV_PARENT=/sys/class/mdev_bus/hag
HAG_SIM_TYPE_DIR=$HAG_MDEV_PARENT/mdev_supported_types/hag-sim

# Host I has address 192.0.2.(10+I) on eth0, the data network, and
# 198.51.100.(10+I) on eth1, a second path (TEST-NET-1 and -2: never routed
# anywhere; both networks are QEMU UDP sockets on the runner's loopback).
host_ip() { echo "192.0.2.$((10 + $1))"; }
host_ip2() { echo "198.51.100.$((10 + $1))"; }

net_up() {
	ip link set lo up
	if [ -e /sys/class/net/eth0 ]; then
		ip addr add "$(host_ip "$HAG_HOST")/24" dev eth0
		ip link set eth0 up
	fi
	if [ -e /sys/class/net/eth1 ]; then
		ip addr add "$(host_ip2 "$HAG_HOST")/24" dev eth1
		ip link set eth1 up
	fi
}

fail() {
	echo "FAIL: $*"
	exit 1
}

# A step of the scenario, with the host's uptime (hosts' logs have no
# clock of their own outside the kernel's messages).
step() { echo "--- [$(cut -d' ' -f1 /proc/uptime) s] $*"; }

# expect_eq WHAT ACTUAL EXPECTED
expect_eq() {
	[ "$2" = "$3" ] || fail "$1: got '$2', expected '$3'"
}

# wait_for SECONDS COMMAND...: retries COMMAND every 0.2 s until it succeeds.
wait_for() {
	local limit=$(($1 * 5)) i=0
	shift
	until "$@" >/dev/null 2>&1; do
		i=$((i + 1))
		[ "$i" -lt "$limit" ] || return 1
		sleep 0.2
	done
}

load_hag() {
	grep -q '^mdev ' /proc/modules || insmod /hag/mdev.ko
	# Only in the GVT-g kernel's initramfs: hag_mdev.ko then needs it.
	[ ! -e /hag/kvmgt.ko ] || grep -q '^kvmgt ' /proc/modules || insmod /hag/kvmgt.ko
	insmod "$HAG_MODULE" "$@"
	[ -c /dev/hag ] || fail "/dev/hag missing after insmod"
}

unload_hag() {
	rmmod hag_mdev
}

new_uuid() { cat /proc/sys/kernel/random/uuid; }

# mdev_create UUID: creates a hag-sim vGPU.
mdev_create() {
	echo "$1" >"$HAG_SIM_TYPE_DIR/create" || fail "creating hag-sim mdev $1"
}

mdev_remove() {
	echo 1 >"/sys/bus/mdev/devices/$1/remove" || fail "removing mdev $1"
}

# lose_this_host: the harness kills this host's QEMU process at once (a power
# cut: no cleanup, no more output). Never returns.
lose_this_host() {
	echo "HAG-KILL-HOST"
	while :; do sleep 1; done
}

# ha_pair: the two hosts of a hag-vmm protection scenario: the module
# loaded, the pair's key in place, a new vGPU ($uuid) on this host, the
# peer ($peer) reachable; $backup is host 1's hagctl backup address and
# $sock the VM's control socket.
ha_pair() {
	uuid=$(new_uuid)
	backup=$(host_ip 1):7200
	peer=$(host_ip $((1 - HAG_HOST)))
	sock=/tmp/vm.sock
	load_hag
	ha_key
	mdev_create "$uuid"
	wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
}

# ha_trio: the three hosts of a witness scenario (hosts 0 and 1 a pair,
# host 2 its witness, at $witness): the module loaded, the pair's key in
# place, every host reachable.
ha_trio() {
	witness=$(host_ip 2):7300
	load_hag
	ha_key
	for h in 0 1 2; do
		[ "$h" = "$HAG_HOST" ] || wait_for 60 ping -c 1 -W 1 "$(host_ip $h)" || fail "host $h unreachable"
	done
}

# witness_host: host 2's part of a witness scenario: hagctl witness on
# $witness until host 0 says it is done (connecting to port 7301), then its
# log.
witness_host() {
	step "host 2: witness on $witness"
	hagctl witness --new --listen "$witness" --key /etc/hag/pair.key --state-dir /tmp/witness \
		>/tmp/witness.out 2>/tmp/witness.err &
	signal_ready 7301
	cat /tmp/witness.err
}

# ---- Real VMs (scenarios with `# vms: yes`) -------------------------------
# The runner's root, read-only over 9p, under a tmpfs overlay: QEMU 10,
# libvirt and their libraries come from there. Commands run in it with
# `in_root`; /dev, /proc, /sys, /tmp and /hag are the test host's own, and
# hagctl is this initramfs's.
HOST_ROOT=/hostroot

host_root_up() {
	[ -d "$HOST_ROOT/usr" ] && return 0
	mkdir -p /mnt/9p /mnt/rw "$HOST_ROOT"
	mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=loose hostroot /mnt/9p ||
		fail "mounting the runner's root over 9p (is this a '# vms: yes' scenario?)"
	mount -t tmpfs tmpfs /mnt/rw
	mkdir -p /mnt/rw/upper /mnt/rw/work
	mount -t overlay overlay -o lowerdir=/mnt/9p,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work "$HOST_ROOT" ||
		fail "overlay on the runner's root"
	for d in dev proc sys tmp; do
		mount --bind "/$d" "$HOST_ROOT/$d"
	done
	mkdir -p "$HOST_ROOT/hag" "$HOST_ROOT/run"
	mount --bind /hag "$HOST_ROOT/hag"
	mount -t tmpfs tmpfs "$HOST_ROOT/run"
	cp /bin/hagctl "$HOST_ROOT/usr/local/bin/hagctl"
	# hagctl checkpoint reads a QEMU VM's disk deltas with the host root's
	# qemu-img (their files are in /tmp, which both see).
	printf '#!/bin/sh\nexec chroot %s qemu-img "$@"\n' "$HOST_ROOT" >/bin/qemu-img
	chmod +x /bin/qemu-img
	cp "/mnt/9p$(sed -n 's/.*hag_vm_kernel=\([^ ]*\).*/\1/p' /proc/cmdline)" "$(vm_kernel)" &&
		cp "/mnt/9p$(sed -n 's/.*hag_vm_initrd=\([^ ]*\).*/\1/p' /proc/cmdline)" "$(vm_initrd)" ||
		fail "copying the VM's kernel and initramfs from the runner"
	# QEMU and libvirt look for these.
	mkdir -p "$HOST_ROOT/run/libvirt" "$HOST_ROOT/var/log/libvirt/qemu" "$HOST_ROOT/var/lib/libvirt/qemu"
	[ -e /dev/kvm ] || fail "no /dev/kvm in this test host (kvm_amd did not load?)"
}

in_root() { chroot "$HOST_ROOT" "$@"; }

# package_in_root: the hag package (build/deb, `make deb`) installed with
# dpkg into the host root, which then has no other hagctl (host_root_up
# put the test build in /usr/local/bin: removed first).
package_in_root() {
	local repo deb
	host_root_up
	repo=$(sed -n 's/.*hag_repo=\([^ ]*\).*/\1/p' /proc/cmdline)
	deb=$(ls "/mnt/9p$repo"/build/deb/hag_*_amd64.deb 2>/dev/null | head -1)
	[ -n "$deb" ] || fail "no hag package in $repo/build/deb (make deb builds it)"
	rm -f "$HOST_ROOT/usr/local/bin/hagctl"
	! in_root /bin/sh -c 'command -v hagctl' || fail "a hagctl is installed before the package"
	step "dpkg -i ${deb##*/}"
	cp "$deb" /tmp/hag.deb
	# man-db's trigger rebuilds its whole index (a minute under TCG) unless
	# this file says to; Debian's build chroots leave it out the same way.
	rm -f "$HOST_ROOT/var/lib/man-db/auto-update"
	# By path: busybox's chroot would run its own dpkg applet.
	in_root /usr/bin/dpkg -i /tmp/hag.deb || fail "dpkg -i failed"
	expect_eq "the installed hagctl" "$(in_root /bin/sh -c 'readlink -f "$(command -v hagctl)"')" /usr/bin/hagctl
}

# systemd_up: this test host run by systemd, as a real host is. PID 1 (the
# initramfs's /init) becomes systemd, the host root the root of its mount
# namespace, while the scenario runs on as a process it inherited; services then run in the
# host root as units, and `in_root systemctl …` and `journalctl` work as
# on any host. systemd starts only journald and the units a scenario
# starts: the host root is the runner's own, whose boot (its fstab, its
# network, its timers) is not this host's, so those are masked in the
# overlay, and so is the boot's tmpfiles pass, which would empty /tmp (the
# test host's own, with the VMs' kernel and the scenario's files).
systemd_up() {
	host_root_up
	local units="$HOST_ROOT/etc/systemd/system" u
	mkdir -p "$units"
	cat >"$units/hag-test-host.target" <<'UNIT'
[Unit]
Description=A hag test host
Wants=systemd-journald.service
UNIT
	: >"$HOST_ROOT/etc/fstab"
	for u in local-fs.target remote-fs.target swap.target timers.target \
		systemd-udevd.service systemd-udev-trigger.service systemd-udev-settle.service \
		networking.service systemd-networkd.service systemd-resolved.service \
		systemd-timesyncd.service systemd-remount-fs.service systemd-fsck-root.service \
		systemd-modules-load.service systemd-sysctl.service systemd-binfmt.service \
		systemd-random-seed.service systemd-tmpfiles-setup-dev.service systemd-tmpfiles-setup.service \
		console-setup.service keyboard-setup.service getty.target; do
		ln -sf /dev/null "$units/$u"
	done
	# AppArmor's profiles are loaded at boot, as on a real host, where the
	# kernel has it on (`# apparmor: yes`). The runner is a container
	# whose /.dockerenv would have systemd and apparmor.service take this
	# host for one (which loads no profiles); this host is not.
	apparmor_on || ln -sf /dev/null "$units/apparmor.service"
	rm -f "$HOST_ROOT/.dockerenv"
	kill -USR1 1
	wait_for 60 systemd_answers || {
		dmesg | grep -i systemd | tail -20
		fail "systemd did not start as this host's init"
	}
	in_root systemctl is-system-running || true
	if apparmor_on; then
		in_root systemctl start apparmor.service || fail "apparmor.service: $(in_root journalctl --no-pager -u apparmor | tail -5)"
		# systemd mounted securityfs in its own mount namespace.
		mountpoint -q /sys/kernel/security || mount -t securityfs securityfs /sys/kernel/security
		echo "AppArmor: $(grep -c . /sys/kernel/security/apparmor/profiles) profiles loaded"
	fi
}

apparmor_on() { [ "$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null)" = Y ]; }

systemd_answers() { in_root systemctl is-system-running | grep -qE '^(running|degraded)$'; }

# The VM's kernel and initramfs: copies in this host's /tmp of the runner's
# files named on the kernel command line (read through the raw 9p mount: the
# root's own /tmp is this host's, and the runner's files may be under its
# /tmp, a CI checkout's say).
vm_kernel() { echo /tmp/hag-vm-kernel; }
vm_initrd() { echo /tmp/hag-vm-initrd; }

# The Debian guest's kernel command line words: its root disk (vm-init
# switches to it), eth0 as the NIC's name (what its network config says),
# and systemd's failed units on the console although `quiet` is set, so
# that a boot which never gets to hag-guest shows what failed. Not every
# unit's progress (show_status=1): each console byte is an exit of the
# nested guest (boot to ready here: 213 s with them; 140 s and 200 s in
# two runs without: these machines are noisy).
DEBIAN_BOOT_WORDS="hag_root=/dev/vda net.ifnames=0 systemd.show_status=error"

VM_MIB=256

# vm_words NAME MDEV-UUID GUEST-ARGS: the QEMU command line of VM NAME, as
# shell words for eval (no single quotes inside): QEMU/KVM with the
# hag-sim vGPU MDEV-UUID (none if empty; VM_VGPU_OPTS adds vfio-pci
# properties), booting the test kernel with hag-guest GUEST-ARGS (commas
# for spaces), its console in /tmp/NAME.console. VM_CONSOLE_SOCKET=1 gives
# the console to a socket chardev, /tmp/NAME.console.sock (what hagctl
# checkpoint --console holds), QEMU still logging all of it, unheld, to
# /tmp/NAME.console for the scenario. VM_THREAD_NAMES=1 names QEMU's threads
# for what they run ("CPU 0/KVM"; a benchmark pins them). VM_NET=1 adds a
# virtio-net NIC on tap
# vmtap0 (joined to br0 by /hag/vm-ifup), VM_APPEND kernel command line
# words. VM_DISK=FILE adds a virtio-blk disk with device id vda (the
# guest's /dev/vda) on that image, of format VM_DISK_FORMAT (qcow2 unless
# set). VM_DEBIAN=1 boots the Debian guest from that disk instead
# (debian_disk makes one; vm-init switches to its root). VM_FIRMWARE=ovmf
# boots through UEFI firmware (Debian's ovmf) instead of SeaBIOS; VM_MEM_OPTS
# adds -m options (",slots=1,maxmem=…"); VM_QEMU_ARGS more QEMU words. The
# same words start a standby (hagctl backup -- …).
vm_words() {
	local name=$1 uuid=$2 gargs=$3 w names=
	[ "${VM_THREAD_NAMES:-0}" != 1 ] || names=,debug-threads=on
	w="qemu-system-x86_64 -name $name$names -accel kvm -cpu host -m $VM_MIB${VM_MEM_OPTS:-} -smp 1"
	w="$w -machine q35 -nodefaults -no-user-config -display none -no-reboot"
	case ${VM_FIRMWARE:-seabios} in
	seabios) ;;
	ovmf) w="$w -bios /usr/share/ovmf/OVMF.fd" ;;
	*) fail "VM_FIRMWARE=$VM_FIRMWARE: seabios or ovmf" ;;
	esac
	w="$w -kernel $(vm_kernel) -initrd $(vm_initrd)"
	local root=
	[ "${VM_DEBIAN:-0}" != 1 ] || root=$DEBIAN_BOOT_WORDS
	w="$w -append 'console=ttyS0 panic=-1 quiet loglevel=4 hag_guest=$gargs $root ${VM_APPEND:-}'"
	if [ "${VM_CONSOLE_SOCKET:-0}" = 1 ]; then
		w="$w -chardev socket,id=con0,path=/tmp/$name.console.sock,server=on,wait=off,logfile=/tmp/$name.console"
		w="$w -serial chardev:con0"
	else
		w="$w -serial file:/tmp/$name.console"
	fi
	if [ -n "$uuid" ]; then
		w="$w -device vfio-pci,sysfsdev=/sys/bus/mdev/devices/$uuid,id=vgpu0${VM_VGPU_OPTS:-}"
	fi
	if [ -n "${VM_DISK:-}" ]; then
		w="$w -blockdev driver=file,filename=$VM_DISK,node-name=disk0-file"
		w="$w -blockdev driver=${VM_DISK_FORMAT:-qcow2},file=disk0-file,node-name=disk0"
		w="$w -device virtio-blk-pci,drive=disk0,id=vda"
	fi
	if [ "${VM_NET:-0}" = 1 ]; then
		w="$w -netdev tap,id=net0,ifname=vmtap0,script=/hag/vm-ifup,downscript=no"
		w="$w -device virtio-net-pci,netdev=net0,mac=52:54:00:56:4d:01"
	fi
	echo "$w ${VM_QEMU_ARGS:-}"
}

# debian_image: the runner's cached Debian guest image (read-only).
debian_image() {
	local image
	image=$(sed -n 's/.*hag_vm_debian=\([^ ]*\).*/\1/p' /proc/cmdline)
	[ -n "$image" ] || fail "no Debian guest image (is the header '# debian: yes'?)"
	echo "$image"
}

# debian_disk FILE: a qcow2 disk for the Debian guest (scenarios whose
# header says `# debian: yes`): an overlay on the runner's cached image,
# which it never writes.
debian_disk() {
	local image
	image=$(debian_image)
	in_root qemu-img create -q -f qcow2 -F qcow2 -b "$image" "$1" ||
		fail "cannot make the Debian guest's disk $1 on $image"
}


# vm_start NAME MDEV-UUID GUEST-ARGS [QEMU-ARG...]: starts VM NAME
# (vm_words) daemonized, QMP at /tmp/NAME.qmp, QEMU's stderr in
# /tmp/NAME.qemu.err, its pid in /tmp/NAME.pid. VM_SHARED_RAM=1 puts guest
# RAM in a shared file, /tmp/NAME.ram (or VM_RAM_PATH), locked in memory
# (what hagctl checkpoint --qmp copies and accepts; VM_RAM_LOCK=off leaves
# it unlocked). VM_CGROUP=DIR starts QEMU in that cgroup (v2), so that the
# memory it faults in is charged there.
vm_start() {
	local name=$1 uuid=$2 gargs=$3
	shift 3
	rm -f "/tmp/$name.console" "/tmp/$name.qmp"
	if [ "${VM_SHARED_RAM:-0}" = 1 ]; then
		set -- -object "memory-backend-file,id=ram0,size=${VM_MIB}M,mem-path=${VM_RAM_PATH:-/tmp/$name.ram},share=on" \
			-machine memory-backend=ram0 -overcommit "mem-lock=${VM_RAM_LOCK:-on}" "$@"
	fi
	eval "set -- $(vm_words "$name" "$uuid" "$gargs") \"\$@\""
	[ -z "${VM_CGROUP:-}" ] || echo $$ >"$VM_CGROUP/cgroup.procs"
	in_root "$@" -qmp "unix:/tmp/$name.qmp,server=on,wait=off" \
		-daemonize -pidfile "/tmp/$name.pid" 2>"/tmp/$name.qemu.err" ||
		fail "QEMU did not start VM $name: $(cat "/tmp/$name.qemu.err")"
	[ -z "${VM_CGROUP:-}" ] || echo $$ >"${VM_CGROUP%/*}/cgroup.procs"
	wait_for 30 test -S "/tmp/$name.qmp" || fail "VM $name: no QMP socket"
}

# qmp SOCKET COMMAND [ARGUMENTS-JSON]: runs a QMP command on the QMP socket
# SOCKET (one that no hagctl holds); prints its return value as JSON.
qmp() {
	in_root python3 -c '
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rw")
f.readline()
args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
for cmd in ({"execute": "qmp_capabilities"},
            {"execute": sys.argv[2], **({"arguments": args} if args else {})}):
    f.write(json.dumps(cmd) + "\n"); f.flush()
    while True:
        r = json.loads(f.readline())
        if "return" in r or "error" in r:
            break
if "error" in r:
    sys.exit("QMP " + sys.argv[2] + ": " + r["error"].get("desc", ""))
print(json.dumps(r["return"]))' "$@"
}

# qmp_status NAME: VM NAME's run state, asked on its QMP socket.
qmp_status() {
	qmp "/tmp/$1.qmp" query-status | sed 's/.*"status": "\([a-z-]*\)".*/\1/'
}


# vm_net_up [ADDR/PREFIX]: the VMs' public network, eth1 bridged as br0
# (with ADDR on this host, for a client), for VM_NET=1 VMs' taps. A VM's
# packets leave this host by eth1's egress: what hagctl checkpoint --plug
# holds. Needs host_root_up (vm-ifup runs in the host root).
vm_net_up() {
	ip addr flush dev eth1
	ip link add br0 type bridge
	ip link set br0 type bridge forward_delay 0 stp_state 0 2>/dev/null || true
	ip link set eth1 master br0
	# A MAC set by hand stays when a VM's tap (a lower random MAC) joins:
	# VMs keep a permanent neighbour entry for it (hag_vm_neigh).
	ip link set br0 address "$(cat /sys/class/net/eth1/address)"
	ip link set br0 up
	[ -z "${1:-}" ] || ip addr add "$1" dev br0
	# QEMU's bridge helper (a standby of a libvirt domain's bridged
	# interface, hagctl backup --libvirt-domain) may join br0.
	mkdir -p "$HOST_ROOT/etc/qemu"
	echo "allow br0" >"$HOST_ROOT/etc/qemu/bridge.conf"
	cat >/hag/vm-ifup <<'SH'
#!/bin/sh
ip link set "$1" master br0 && ip link set "$1" up
SH
	chmod +x /hag/vm-ifup
}

# The guest's client: hag-guest listen on host 1's br0 (GUEST_CLIENT), where
# a guest given GUEST_REPORT in its arguments reports its progress and
# verdict from whichever host runs it (both hosts' br0 join eth1; VM_NET=1
# with VM_APPEND=$GUEST_NET_WORDS, or DOMAIN_NET=1). guest_client_up (host
# 1, after vm_net_up "$GUEST_CLIENT/24") starts it, logging to
# /tmp/client.log; guest_finish then has the guest end its run at its next
# progress line, verified as at its end, so that a scenario that has seen
# what it waits for need not wait out the guest's --seconds (an upper
# bound, kept generous for slow machines).
GUEST_CLIENT=203.0.113.1
GUEST_CLIENT_PORT=7400
GUEST_REPORT="--report,$GUEST_CLIENT:$GUEST_CLIENT_PORT"
# The client is br0 on host 1, whose MAC is its eth1's (the harness's
# 52:54:00:4a:48:HOST).
GUEST_NET_WORDS="hag_vm_ip=203.0.113.50/24 hag_vm_neigh=$GUEST_CLIENT,52:54:00:4a:48:01"
guest_client_up() {
	rm -f /tmp/guest-finish
	hag-guest listen --port "$GUEST_CLIENT_PORT" --finish-file /tmp/guest-finish \
		>/tmp/client.log 2>/tmp/client.err &
	guest_client=$!
}
guest_finish() {
	step "host $HAG_HOST: the guest is asked to end its run (verified as at its end)"
	: >/tmp/guest-finish
}
# guest_net_up: the VMs' network (vm_net_up), and on host 1 the client's
# address on it and the client.
guest_net_up() {
	if [ "$HAG_HOST" = 1 ]; then
		vm_net_up "$GUEST_CLIENT/24"
		guest_client_up
	else
		vm_net_up
	fi
}
# guest_finish_after_progress WHERE: guest_finish once the client has 5
# more of the guest's progress lines (5 s of its run WHERE), or 60 s on.
guest_finish_after_progress() {
	local lines
	lines=$(wc -l </tmp/client.log)
	wait_for 60 sh -c "[ \$(wc -l </tmp/client.log) -ge $((lines + 5)) ]" ||
		echo "the guest reported no 5 s of progress $1"
	guest_finish
}

# vm_wait_console NAME SECONDS PATTERN: waits for PATTERN on NAME's console.
vm_wait_console() {
	wait_for "$2" grep -q "$3" "/tmp/$1.console" && return 0
	# A guest whose kernel died: its whole report, reworded so that the
	# harness does not take it for this host's.
	if grep -q 'Kernel panic\|Oops\|BUG:' "/tmp/$1.console" 2>/dev/null; then
		echo "--- VM $1's kernel died; its console's end:"
		tail -60 "/tmp/$1.console" | guest_oops_quoted
	fi
	echo "--- VM $1's console's end:"
	tail -40 "/tmp/$1.console" 2>/dev/null | guest_oops_quoted
	vm_cpu_state "$1"
	# A guest that printed nothing for minutes although it prints every
	# second once running (hag-guest's progress; systemd's status lines)
	# stalled under the emulator (nested KVM on TCG, README: How the tests
	# run), a run the harness repeats once (HAG-NESTED-STALL).
	local silent
	silent=$(($(date +%s) - $(stat -c %Y "/tmp/$1.console" 2>/dev/null || date +%s)))
	if [ "$silent" -ge 300 ] && ! grep -q 'Kernel panic\|Oops\|BUG:' "/tmp/$1.console" 2>/dev/null; then
		echo "HAG-NESTED-STALL VM $1's console silent for $silent s"
	fi
	fail "VM $1: no '$3' on its console after $2 s"
}

# vm_cpu_state NAME: where VM NAME's vCPU is, twice a second apart (a
# guest that stopped printing: halted and waiting for an interrupt, or
# spinning), and this host's load; from its libvirt domain or its QMP
# socket, whichever it has. Diagnosis only: it never fails.
vm_cpu_state() {
	local i
	echo "--- VM $1's vCPU (HMP info registers, RIP and flags), this host's load $(cat /proc/loadavg)"
	for i in 1 2; do
		if in_root virsh domstate "$1" >/dev/null 2>&1; then
			in_root virsh qemu-monitor-command "$1" --hmp 'info registers' 2>&1
		elif [ -S "/tmp/$1.qmp" ]; then
			hmp "/tmp/$1.qmp" 'info registers' 2>&1
		fi | grep -E '^(RIP|EFL|CR0)|HLT' || true
		sleep 1
	done
}

# hmp SOCKET COMMAND: an HMP command through the QMP socket SOCKET (one no
# hagctl holds); prints its output.
hmp() {
	qmp "$1" human-monitor-command "{\"command-line\": \"$2\"}" |
		in_root python3 -c 'import json, sys; print(json.load(sys.stdin), end="")'
}

# vm_result NAME SECONDS: waits for hag-guest to end (vm-init's
# HAG-GUEST-EXIT); prints its verdict, or fails with the console's end if it
# ended without one (it could not run).
vm_result() {
	vm_wait_console "$1" "$2" HAG-GUEST-EXIT
	grep HAG-GUEST-RESULT "/tmp/$1.console" ||
		fail "VM $1: hag-guest ended without a verdict: $(tail -5 "/tmp/$1.console")"
}

# guest_oops_quoted: the guest's kernel trouble, reworded so that the
# harness does not take it for this host's (for a scenario whose guest must
# crash).
guest_oops_quoted() {
	sed -e 's/BUG:/BUG (in the guest):/g' -e 's/WARNING:/WARNING (in the guest):/g' \
		-e 's/Oops/O-ops (in the guest)/g' -e 's/Kernel panic/Kernel-panic (in the guest)/g' \
		-e 's/general protection fault/general-protection-fault (in the guest)/g' \
		-e 's/Call Trace:/Call Trace (in the guest):/g' -e 's/UBSAN:/UBSAN (in the guest):/g' \
		-e 's/KASAN:/KASAN (in the guest):/g'
}

vm_show() {
	echo "--- console of VM $1:"
	cat "/tmp/$1.console" 2>/dev/null || true
	[ ! -s "/tmp/$1.qemu.err" ] || { echo "--- QEMU stderr:"; cat "/tmp/$1.qemu.err"; }
}

# Two-host handshakes. signal_ready PORT: accepts one connection on PORT
# (stdin from /dev/null: nc would otherwise wait for input); await_ready
# HOST PORT [SECONDS]: connects until that succeeds.
signal_ready() { nc -l -p "$1" </dev/null >/dev/null || fail "ready signal on port $1 failed"; }
# await_ready HOST PORT [SECONDS]: waits until HOST signals ready on PORT,
# for SECONDS by the clock (default 300). A connection attempt that gets
# no answer at all (the peer's network gone) ends after 5 s instead of
# the kernel's two minutes of SYN retries, and the wait counts time, not
# attempts: with wait_for's count of 0.2 s attempts, 600 "seconds" of
# unanswered connects once stood a benchmark still for hours.
await_ready() {
	local end=$(($(date +%s) + ${3:-300}))
	until echo go | nc -w 5 "$1" "$2" >/dev/null 2>&1; do
		[ "$(date +%s)" -lt "$end" ] || fail "$1 never signalled ready on port $2"
		sleep 0.2
	done
}

# port_listening PORT: something on this host listens on TCP PORT (read
# from /proc/net/tcp, so nothing connects to it).
port_listening() {
	grep -qi ":$(printf '%04X' "$1") 00000000:0000 0A" /proc/net/tcp
}

# ---- libvirt (real libvirtd in the host root) -------------------------------
# libvirtd listens on TCP 16509 without authentication: the test network
# is closed and reaches nothing but the other test hosts. No cgroups, no
# namespaces; no security driver, but AppArmor where the test host has it
# on (`# apparmor: yes`: libvirt confines each QEMU with a profile of its
# own); QEMU runs as root; its stdio goes to a file (no virtlogd).
libvirt_up() {
	libvirt_conf
	# hag's qemu hook, as a user installs it; libvirtd looks for hooks
	# when it starts.
	sh /hag/libvirt/install.sh --root "$HOST_ROOT" >/dev/null || fail "installing the libvirt hook"
	in_root /usr/sbin/libvirtd --listen --daemon --pid-file=/run/libvirtd.pid ||
		fail "libvirtd did not start"
	libvirt_answers
}

# libvirt_conf: libvirtd's and its QEMU driver's settings for a test host
# (above), and the test hosts' names.
libvirt_conf() {
	host_root_up
	cat >"$HOST_ROOT/etc/libvirt/libvirtd.conf" <<CONF
listen_tls = 0
listen_tcp = 1
listen_addr = "0.0.0.0"
auth_tcp = "none"
auth_unix_rw = "none"
host_uuid = "8a6c0000-4a47-4000-8000-$(printf '%012x' "$HAG_HOST")"
log_outputs = "3:file:/var/log/libvirt/libvirtd.log"
CONF
	cat >"$HOST_ROOT/etc/libvirt/qemu.conf" <<CONF
user = "root"
group = "root"
dynamic_ownership = 0
remember_owner = 0
cgroup_controllers = [ ]
namespaces = [ ]
seccomp_sandbox = 0
security_driver = "$(apparmor_on && echo apparmor || echo none)"
stdio_handler = "file"
migration_address = "0.0.0.0"
CONF
	hostname "testhost$HAG_HOST"
	echo "$(host_ip "$HAG_HOST") testhost$HAG_HOST" >>"$HOST_ROOT/etc/hosts"
	peer_index=$((1 - HAG_HOST))
	echo "$(host_ip "$peer_index") testhost$peer_index" >>"$HOST_ROOT/etc/hosts"
}

libvirt_answers() {
	wait_for 60 in_root virsh -c qemu:///system version || {
		tail -20 "$HOST_ROOT/var/log/libvirt/libvirtd.log"
		fail "libvirtd does not answer"
	}
}

# hook_libvirt_up [HAG.CONF-LINE...]: libvirt_up on a host whose protected
# domains hag's hook protects: the pair key in the host root, and
# /etc/hag/hag.conf naming hagctl (libvirtd runs hooks with
# PATH=/bin:/sbin:/usr/bin) with the given lines.
hook_libvirt_up() {
	libvirt_up
	mkdir -p "$HOST_ROOT/etc/hag"
	cp /etc/hag/pair.key "$HOST_ROOT/etc/hag/pair.key"
	{
		echo "HAGCTL=/usr/local/bin/hagctl"
		for line in "$@"; do echo "$line"; done
	} >"$HOST_ROOT/etc/hag/hag.conf"
}

# vm_finish SOCK: asks the hag-vmm VM whose control socket is SOCK to end
# its run after the iterations done so far (hag-vmm finish). A VM that
# already ended its run on its own (its --iterations all done, its socket
# removed) needs no asking: the caller checks its exit status and PASS
# line as for any other end.
vm_finish() {
	hag-vmm finish --control "$1" || [ ! -S "$1" ] || fail "hag-vmm finish --control $1 failed"
}

# finish_after_takeover SOCK [LOG]: in the background, once LOG (default
# /tmp/backup.err) says a takeover resumed the VM here and 3 s more of its
# workload ran, asks that hag-vmm VM (control socket SOCK) to end its run
# after the iterations done so far (hag-vmm finish): it verifies them all
# as at its end, so the scenario's --iterations is only an upper bound.
finish_after_takeover() {
	(wait_for 300 grep -q 'takeover: generation' "${2:-/tmp/backup.err}" && sleep 3 &&
		hag-vmm finish --control "$1") >/tmp/finish.out 2>&1 &
}

# domain_xml NAME MDEV-UUID GUEST-ARGS: a domain like vm_start's VM.
# DOMAIN_SHARED_RAM=1 adds a shared file memory backing, locked (what hagctl
# checkpoint --qmp copies and accepts), DOMAIN_CONSOLE_SOCKET=1 a serial console on
# the unix socket /tmp/NAME.console.sock instead of the file
# /tmp/NAME.console (what hagctl checkpoint --console holds),
# DOMAIN_DEBIAN_DISK=FILE boots the Debian guest from that qcow2 disk (vda;
# debian_disk makes one), DOMAIN_DISK=FILE gives the guest that qcow2 as a
# data disk (vda, libvirt's default alias virtio-disk0), DOMAIN_NET=1 adds vm_words' VM_NET NIC (virtio,
# MAC 52:54:00:56:4d:01) on the bridge br0 (vm_net_up; libvirt makes the
# tap) and gives the guest GUEST_NET_WORDS: its address and a permanent
# neighbour entry for the guest's client on host 1's br0 (the Debian
# guest's eth0 has its own address, 203.0.113.50/24), DOMAIN_XML_EXTRA elements (<metadata>,
# <qemu:commandline>) at the end.
domain_xml() {
	local backing= serial="<serial type='file'><source path='/tmp/$1.console' append='on'/></serial>"
	local disk= words= nic=
	if [ -n "${DOMAIN_DEBIAN_DISK:-}" ]; then
		disk="<disk type='file' device='disk'><driver name='qemu' type='qcow2'/><source file='$DOMAIN_DEBIAN_DISK'/><target dev='vda' bus='virtio'/><alias name='ua-vda'/></disk>"
		words=$DEBIAN_BOOT_WORDS
	elif [ -n "${DOMAIN_DISK:-}" ]; then
		disk="<disk type='file' device='disk'><driver name='qemu' type='qcow2'/><source file='$DOMAIN_DISK'/><target dev='vda' bus='virtio'/></disk>"
	fi
	if [ "${DOMAIN_NET:-0}" = 1 ]; then
		nic="<interface type='bridge'><source bridge='br0'/><mac address='52:54:00:56:4d:01'/><model type='virtio'/></interface>"
		# The Debian guest configures its own address.
		if [ -n "${DOMAIN_DEBIAN_DISK:-}" ]; then
			words="$words hag_vm_neigh=$GUEST_CLIENT,52:54:00:4a:48:01"
		else
			words="$words $GUEST_NET_WORDS"
		fi
	fi
	[ "${DOMAIN_SHARED_RAM:-0}" != 1 ] ||
		backing="<memoryBacking><source type='file'/><access mode='shared'/><locked/></memoryBacking>"
	[ "${DOMAIN_CONSOLE_SOCKET:-0}" != 1 ] ||
		serial="<serial type='unix'><source mode='bind' path='/tmp/$1.console.sock'/></serial>"
	cat <<XML
<domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>$1</name>
  <memory unit='MiB'>$VM_MIB</memory>
  $backing
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>$(vm_kernel)</kernel>
    <initrd>$(vm_initrd)</initrd>
    <cmdline>console=ttyS0 panic=-1 quiet loglevel=4 hag_guest=$3 $words</cmdline>
  </os>
  <cpu mode='host-passthrough'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    $serial
    $disk
    $nic
    <hostdev mode='subsystem' type='mdev' managed='no' model='vfio-pci' display='off'>
      <source>
        <address uuid='$2'/>
      </source>
    </hostdev>
    <controller type='usb' model='none'/>
    <video><model type='none'/></video>
    <memballoon model='none'/>
  </devices>
  ${DOMAIN_XML_EXTRA:-}
</domain>
XML
}

# The pre-shared key every test host holds for hagctl's host-to-host
# connections (migrate/receive, checkpoint/backup): provisioned as an
# operator would, a file of 64 hex digits readable only by root, at
# hagctl's default --key path. Tests only: a real pair makes its own with
# `hagctl keygen FILE` and copies it over a trusted channel.
HAG_TEST_KEY=5f0c2a9e7d4b13c86a1fe2d0b7c94e3158a6d2f09b7e4c1a3d8f6b2e0c5a9174
ha_key() {
	mkdir -p /etc/hag
	(umask 077 && echo "${1:-$HAG_TEST_KEY}" >/etc/hag/pair.key)
	chmod 600 /etc/hag/pair.key
}

# A key no test host's hagctl holds (a rogue peer's), in a file of its own.
ha_rogue_key() {
	(umask 077 && echo "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef" >"$1")
}

# ---- Benchmark scenarios (qemu-tests/eval/*.sh) -------------------------------
# up: this host's uptime in seconds (the benchmarks' clock).
up() { cut -d' ' -f1 /proc/uptime; }

# bench_hosts_up CLIENT: the key, the host root, the peer reachable, and the
# VMs' network, with CLIENT (the client's address on it) on host 1.
bench_hosts_up() {
	ha_key
	host_root_up
	wait_for 60 ping -c 1 -W 1 "$(host_ip $((1 - HAG_HOST)))" || fail "$(host_ip $((1 - HAG_HOST))) unreachable"
	if [ "$HAG_HOST" = 1 ]; then
		vm_net_up "$1/24"
	else
		vm_net_up
	fi
}

# bench_plan TAG: a benchmark's items, PLAN's "ID MODE" lines, one after
# another: host 0 runs the scenario's `primary ID MODE`, host 1 its
# `backup ID MODE`; each side prints "TAGDONE ID" when done with an item.
bench_plan() {
	echo "$PLAN" | while read -r id mode; do
		[ -n "$id" ] || continue
		step "item $id: $mode"
		if [ "$HAG_HOST" = 0 ]; then
			primary "$id" "$mode" </dev/null
		else
			backup "$id" "$mode" </dev/null
		fi
		echo "${1}DONE $id"
	done
}

# bench_backup_ended ID PID TAG: waits up to 60 s for item ID's hagctl
# backup (PID, its output in /tmp/backupID.out and .err) to end, and
# prints its JSON report (a takeover's) as "TAGTAKE ID JSON".
bench_backup_ended() {
	wait_for 60 sh -c "! kill -0 $2 2>/dev/null" || {
		echo "item $1: hagctl backup still runs"
		kill "$2" 2>/dev/null || true
	}
	wait "$2" || echo "item $1: hagctl backup exited $?: $(tail -3 "/tmp/backup$1.err")"
	grep '^{' "/tmp/backup$1.out" | sed "s/^/${3}TAKE $1 /" || true
}

# bench_place PID: with the benchmarks' placement (hag_placement=1 and
# isolcpus=1 on this host's command line: qemu-tests/eval/placement.py),
# QEMU PID's vCPU thread ("CPU 0/KVM": VM_THREAD_NAMES=1) alone on CPU 1;
# isolcpus keeps everything else off it. Without, nothing.
bench_place() {
	local tid
	grep -qw hag_placement=1 /proc/cmdline || return 0
	for tid in /proc/$1/task/*; do
		[ "$(cat "$tid/comm")" != "CPU 0/KVM" ] || in_root taskset -p -c 1 "${tid##*/}" >/dev/null
	done
}

# bench_cpu1 TAG ID WHEN PID: as item ID's window starts or ends (WHEN),
# this host's CPU 1 ("TAGINRAW ID WHEN cpu1 …", /proc/stat's line), each
# task that last ran there with its CPU ticks ("TAGINRAW ID WHEN task TID
# COMM TICKS", QEMU PID's vCPU thread among them) and the TCP retransmits
# so far ("TAGNET ID WHEN N").
bench_cpu1() {
	local tid
	echo "${1}INRAW $2 $3 $(grep '^cpu1 ' /proc/stat)"
	for tid in /proc/[0-9]*/task/*; do
		[ "$(sed 's/.*) //' "$tid/stat" 2>/dev/null | awk '{ print $37 }')" != 1 ] ||
			echo "${1}INRAW $2 $3 task ${tid##*/} $(cat "$tid/comm" 2>/dev/null) $(sed 's/.*) //' "$tid/stat" 2>/dev/null | awk '{ print $12 + $13 }')"
	done
	echo "${1}NET $2 $3 $(in_root nstat -asz TcpRetransSegs 2>/dev/null | awk '$1 == "TcpRetransSegs" { print $2 }')"
}

# bench_item_ends ID UUID [QEMU-PID]: the end of item ID on this host: its
# VM's QEMU (if given) ended with SIGTERM (SIGKILL after 30 s), then its
# mdev UUID removed (retried for 30 s: QEMU may still hold it).
bench_item_ends() {
	if [ -n "${3:-}" ]; then
		kill -TERM "$3" 2>/dev/null || true
		wait_for 30 sh -c "! kill -0 $3 2>/dev/null" || kill -KILL "$3" 2>/dev/null || true
	fi
	wait_for 30 sh -c "echo 1 >/sys/bus/mdev/devices/$2/remove" || echo "item $1: mdev $2 not removed"
}
