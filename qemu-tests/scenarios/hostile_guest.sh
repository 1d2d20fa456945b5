# hosts: 1
# timeout: 600
# The kernel never pays for a guest's mistakes. hag-vmm hostile calls every
# /dev/hag ioctl and the vGPU's VFIO device fd with bad numbers, pointers,
# sizes and ids (each answer's errno checked, the module answering after
# each), then fuzzes the command stream: random dwords and mutated commands
# in ring and batches, self-chaining batches, GTT entries rewritten and the
# ring moved while work runs. Whatever the outcome the vGPU is reset; no
# guest page outside what the GTT mapped may change, every changed page must
# be in the dirty log, and the harness fails on any kernel WARNING or Oops.
# The module is loaded without allow_hang_injection (IOC_INJECT_HANG: EPERM).
load_hag
uuid=$(new_uuid)
mdev_create "$uuid"
step "hostile ioctls, region accesses and 1000 fuzzed rounds"
hag-vmm hostile --mdev "$uuid" --seed 20240601 --iterations 1000 --json >/tmp/result 2>/tmp/result.err ||
	fail "hag-vmm hostile failed: $(cat /tmp/result.err) $(cat /tmp/result)"
cat /tmp/result
grep -q '"passed":true' /tmp/result || fail "hostile run did not pass"
expect_eq "rounds run" "$(sed -n 's/.*"rounds":\([0-9]*\).*/\1/p' /tmp/result)" 1000
step "the vGPU still runs a normal workload"
hag-vmm run --mdev "$uuid" --workload all || fail "vGPU unusable after the hostile run"
hagctl status
