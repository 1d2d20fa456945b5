# hosts: 1
# hag-sim vGPUs are created and removed by UUID through sysfs and show in
# hagctl status, each with its own id; the instance limit is enforced.
load_hag
a=$(new_uuid)
b=$(new_uuid)

step "create two vGPUs"
mdev_create "$a"
mdev_create "$b"
[ -e "/sys/bus/mdev/devices/$a" ] || fail "mdev $a not on the mdev bus"
expect_eq "available instances" "$(cat "$HAG_SIM_TYPE_DIR/available_instances")" 6
ls /dev/vfio
hagctl status
json=$(hagctl status --json)
echo "$json" | grep -q "\"uuid\":\"$a\"" || fail "vGPU $a missing from status: $json"
echo "$json" | grep -q "\"uuid\":\"$b\"" || fail "vGPU $b missing from status: $json"
expect_eq "vGPUs listed" "$(echo "$json" | grep -o '"source":"sim"' | wc -l)" 2

step "a duplicate UUID is refused"
if echo "$a" >"$HAG_SIM_TYPE_DIR/create" 2>/dev/null; then fail "duplicate UUID accepted"; fi

step "remove one"
mdev_remove "$a"
json=$(hagctl status --json)
! echo "$json" | grep -q "$a" || fail "removed vGPU $a still listed: $json"
echo "$json" | grep -q "$b" || fail "vGPU $b lost: $json"

step "fill to the instance limit"
n=1
while [ "$n" -lt 8 ]; do mdev_create "$(new_uuid)"; n=$((n + 1)); done
expect_eq "available instances" "$(cat "$HAG_SIM_TYPE_DIR/available_instances")" 0
if echo "$(new_uuid)" >"$HAG_SIM_TYPE_DIR/create" 2>/dev/null; then fail "ninth vGPU accepted"; fi
expect_eq "vGPUs listed" "$(hagctl status --json | grep -o '"source":"sim"' | wc -l)" 8

step "unload with vGPUs present removes them"
unload_hag
[ -z "$(ls /sys/bus/mdev/devices)" ] || fail "mdevs left after rmmod: $(ls /sys/bus/mdev/devices)"
