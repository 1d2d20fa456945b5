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

step() { echo "--- $*"; }

# expect_eq WHAT ACTUAL EXPECTED
expect_eq() {
	[ "$2" = "$3" ] || fail "$1: got '$2', expected '$3'"
}

# wait_for SECONDS COMMAND...: retries COMMAND every 0.2 s until it succeeds.
wait_for() {
	limit=$(($1 * 5))
	shift
	i=0
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
