# hosts: 1
# The audit check can fail: with GPU dirty logging off, the pages the engine
# writes are not in the log, and hag-vmm must report them as missed and fail.
# (If this scenario passed with logging off, sim_workloads would prove
# nothing.)
load_hag
uuid=$(new_uuid)
mdev_create "$uuid"
if hag-vmm run --mdev "$uuid" --workload stores --no-dirty-log >/tmp/out 2>&1; then
	cat /tmp/out
	fail "hag-vmm passed with the dirty log off: the check cannot see a missed write"
fi
cat /tmp/out
grep -q "missed" /tmp/out || fail "failure does not name missed pages"
