# hosts: 1
# The module loads, registers /dev/hag, the netlink family and the mdev
# parent, and unloads leaving none of them behind; twice, to catch state
# that survives an unload.
for round in 1 2; do
	step "round $round: insmod"
	load_hag
	grep -q '^hag_mdev ' /proc/modules || fail "hag_mdev not in /proc/modules"
	[ -d "$HAG_MDEV_PARENT" ] || fail "mdev parent $HAG_MDEV_PARENT missing"
	[ -d "$HAG_SIM_TYPE_DIR" ] || fail "mdev type dir $HAG_SIM_TYPE_DIR missing"
	expect_eq "available instances" "$(cat "$HAG_SIM_TYPE_DIR/available_instances")" 8
	expect_eq "device_api" "$(cat "$HAG_SIM_TYPE_DIR/device_api")" vfio-pci
	grep -q ' hag$' /proc/misc || fail "hag not in /proc/misc"

	step "round $round: rmmod"
	unload_hag
	! grep -q '^hag_mdev ' /proc/modules || fail "hag_mdev still loaded"
	[ ! -e /dev/hag ] || fail "/dev/hag left behind"
	[ ! -e "$HAG_MDEV_PARENT" ] || fail "mdev parent left behind"
	[ ! -e /sys/class/hag ] || fail "/sys/class/hag left behind"
	! grep -q ' hag$' /proc/misc || fail "misc device left behind"
done
echo "module loaded and unloaded twice, nothing left behind"
