# hosts: 1
# A batch that chains to itself hangs the vGPU, never the kernel: the
# watchdog stops it, raises HANG and multicasts vgpu-hung. A command that
# writes outside graphics memory is rejected whole, with its address, and
# multicast as command-rejected. The vGPU works again after RESET.
load_hag
uuid=$(new_uuid)
mdev_create "$uuid"
hagctl events --json --timeout 120 >/tmp/events 2>/tmp/events.err &
wait_for 30 grep -q listening /tmp/events.err || fail "hagctl events did not subscribe"

step "a self-chaining batch hangs the vGPU"
hag-vmm run --mdev "$uuid" --workload hang || fail "hang workload did not end in a detected hang"
step "an out-of-range store is rejected"
hag-vmm run --mdev "$uuid" --workload reject || fail "reject workload was not rejected as expected"
step "the vGPU still works"
hag-vmm run --mdev "$uuid" --workload stores || fail "vGPU unusable after hang and reject"

wait_for 10 grep -q command-rejected /tmp/events || fail "no command-rejected event: $(cat /tmp/events)"
grep -q '"event":"vgpu-hung"' /tmp/events || fail "no vgpu-hung event: $(cat /tmp/events)"
cat /tmp/events
grep -q "hung:" /dev/kmsg 2>/dev/null || true
dmesg | grep 'hag_mdev' | tail -3
