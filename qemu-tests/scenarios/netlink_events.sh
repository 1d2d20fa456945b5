# hosts: 1
# Creating and removing a vGPU multicasts events on the hag netlink family,
# and hagctl events prints them (one JSON object per line).
load_hag
hagctl events --json --count 2 --timeout 60 >/tmp/events 2>/tmp/events.err &
listener=$!
wait_for 30 grep -q listening /tmp/events.err || fail "hagctl events did not subscribe: $(cat /tmp/events.err)"

uuid=$(new_uuid)
step "create and remove $uuid"
mdev_create "$uuid"
mdev_remove "$uuid"
wait "$listener" || fail "hagctl events failed: $(cat /tmp/events.err)"
cat /tmp/events
expect_eq "event lines" "$(wc -l </tmp/events)" 2
sed -n 1p /tmp/events | grep -q "\"event\":\"vgpu-created\".*\"uuid\":\"$uuid\"" || fail "first event is not vgpu-created for $uuid"
sed -n 2p /tmp/events | grep -q "\"event\":\"vgpu-removed\".*\"uuid\":\"$uuid\"" || fail "second event is not vgpu-removed for $uuid"
