# hosts: 1
# timeout: 240
# A VMM whose buffer faults forever stalls only its own call (issue 23,
# item 12). hag-vmm fault-check makes three VFIO calls on vGPU A (a BAR0
# write, a config read, VFIO_DEVICE_GET_INFO) with their buffer on a
# userfaultfd page left missing; while each waits in its fault, vGPU A's
# config space and BAR0, vGPU B and /dev/hag's statistics of A must
# answer. The module once copied from and to the VMM with A's lock held:
# then A and /dev/hag waited with the fault (and its work item would have).
load_hag
a=$(new_uuid)
b=$(new_uuid)
mdev_create "$a"
mdev_create "$b"

step "VFIO calls whose buffer faults, and everything else answering"
timeout 120 hag-vmm fault-check --mdev "$a" --mdev2 "$b" >/tmp/f 2>&1 || fail "fault-check failed: $(cat /tmp/f)"
cat /tmp/f
expect_eq "calls checked" "$(grep -c '^ok: ' /tmp/f)" 3
grep -q '^PASS fault-check:' /tmp/f || fail "no PASS line"

step "both vGPUs work afterwards"
for u in "$a" "$b"; do
	hag-vmm run --mdev "$u" --workload stores >/tmp/w 2>&1 || fail "vGPU $u: $(cat /tmp/w)"
	grep -q '^PASS stores' /tmp/w || fail "vGPU $u: $(cat /tmp/w)"
done
echo "ok: both vGPUs ran a workload"
