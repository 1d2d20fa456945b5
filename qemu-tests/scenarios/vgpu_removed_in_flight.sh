# hosts: 1
# timeout: 240
# A vGPU removed while calls that already found it are in flight (issue 13,
# item 4: clones of the vGPU outlive its remove). hag-vmm remove-check:
# (1) IOC_QUIESCE waiting on a looping batch across the mdev's remove and
# the VMM's close is refused (ECANCELED or ENODEV), never succeeds, and
# every per-vGPU ioctl for the id then gets ENODEV; (2) with the module's
# test-only test_hold_vgpu_ms, each of ten per-vGPU ioctls is held past
# the remove of its vGPU (as a blocked user copy would hold it) and must
# fail with ENODEV, where without the lifetime fix it succeeded. The
# harness fails the scenario on any kernel warning; the module must then
# unload with nothing left.
load_hag allow_hang_injection=1
uuid=$(new_uuid)
mdev_create "$uuid"

step "a quiesce in flight across the remove"
timeout 90 hag-vmm remove-check --mdev "$uuid" >/tmp/r 2>&1 || fail "remove-check --mdev failed: $(cat /tmp/r)"
cat /tmp/r
grep -q '^PASS remove-check:' /tmp/r || fail "no PASS line"
[ ! -e "/sys/bus/mdev/devices/$uuid" ] || fail "mdev $uuid still there"
unload_hag

step "each per-vGPU ioctl held past its vGPU's remove"
load_hag allow_hang_injection=1 test_hold_vgpu_ms=1500
timeout 150 hag-vmm remove-check --held --hold-ms 1500 >/tmp/r 2>&1 || fail "remove-check --held failed: $(cat /tmp/r)"
cat /tmp/r
grep -q '^PASS remove-check:' /tmp/r || fail "no PASS line"
hagctl status
expect_eq "vGPUs left" "$(hagctl status --json | grep -o '"source":"sim"' | wc -l)" 0

step "the module unloads cleanly"
unload_hag
[ -z "$(ls /sys/bus/mdev/devices)" ] || fail "mdevs left after rmmod: $(ls /sys/bus/mdev/devices)"
[ ! -e /dev/hag ] || fail "/dev/hag left after rmmod"
