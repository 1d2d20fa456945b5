# hosts: 1
# timeout: 600
# VFIO migration v2 of a hag-sim vGPU, as QEMU >= 8 drives it: hag-vmm
# attaches two vGPUs; a quiesce held through /dev/hag outlives STOP -> RUNNING
# and goes with its own opener's file (not another's);
# runs work on A, checks that RUNNING -> STOP times out
# (ETIMEDOUT, still RUNNING) while a submission is held at a semaphore (busy
# within every budget: the timeout is certain), that STOP succeeds after a
# looping batch hung on the work budget, saves A through STOP and
# STOP_COPY, loads the data into B through RESUMING, STOP, RUNNING, compares
# registers and GTT entries, and carries on with a workload on B. A damaged
# and a truncated snapshot and an oversized stream are refused, and data
# fds outliving their state or device read nothing. The module must log why
# it refused, and removing the vGPUs and unloading must leave nothing.
load_hag
a=$(new_uuid)
b=$(new_uuid)
mdev_create "$a"
mdev_create "$b"

step "migrate A to B through VFIO"
hag-vmm vfio-migration-check --mdev "$a" --mdev2 "$b" >/tmp/result 2>&1 || fail "hag-vmm failed: $(cat /tmp/result)"
cat /tmp/result
grep -q '^PASS vfio-migration:' /tmp/result || fail "no PASS line"
expect_eq "steps passed" "$(grep -c "^ok:" /tmp/result)" 14

step "the module said why it refused"
dmesg | grep -E 'VFIO migration|restore refused' || true
dmesg | grep -q 'VFIO migration: the engine did not go idle within 2000 ms' || fail "no message for the quiesce timeout"
dmesg | grep -q 'hung: the submission did more work than any submission may' ||
	fail "the looping batch was not hung by the work budget"
dmesg | grep -q 'VFIO migration: snapshot of .* bytes refused' || fail "no message for the refused snapshot"
dmesg | grep -q 'restore refused' || fail "no restore message"

step "both vGPUs still answer, then go"
hagctl status
mdev_remove "$a"
mdev_remove "$b"
unload_hag
[ -z "$(ls /sys/bus/mdev/devices)" ] || fail "mdevs left after rmmod"
