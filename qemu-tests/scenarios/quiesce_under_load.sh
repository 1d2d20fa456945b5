# hosts: 1
# timeout: 180
# IOC_QUIESCE under load finishes or fails within its timeout, never hangs:
# with a submission held at a semaphore past the timeout it returns
# ETIMEDOUT and the engine keeps running (the work completes when the
# semaphore is released, new work needs no resume); with a blit in flight,
# and on an idle vGPU, it succeeds and the
# held work completes after IOC_RESUME (hag-vmm quiesce-check). Each check
# runs under an outer `timeout`, so a hang fails the scenario instead of
# stalling it.
load_hag
uuid=$(new_uuid)
mdev_create "$uuid"
for ms in 300 1000; do
	step "quiesce-check with a $ms ms timeout"
	# An outer bound: the check must end, whatever the module does.
	timeout 60 hag-vmm quiesce-check --mdev "$uuid" --timeout-ms "$ms" >/tmp/q 2>&1 ||
		fail "quiesce-check ($ms ms) failed: $(cat /tmp/q)"
	cat /tmp/q
	grep -q '^PASS quiesce-check:' /tmp/q || fail "no PASS line"
done
step "the vGPU still answers"
hagctl status | grep -q "$uuid" || fail "vGPU $uuid gone"
mdev_remove "$uuid"
unload_hag
