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
# The guest cannot flood the host's log: the rejections are all counted,
# but at most 10 lines per 5 s logged, a later line saying how many were
# left out.
# The module is loaded without allow_hang_injection (IOC_INJECT_HANG: EPERM).
load_hag
uuid=$(new_uuid)
mdev_create "$uuid"
step "hostile ioctls, region accesses and 1000 fuzzed rounds"
t0=$(cut -d. -f1 /proc/uptime)
hag-vmm hostile --mdev "$uuid" --seed 20240601 --iterations 1000 --json >/tmp/result 2>/tmp/result.err ||
	fail "hag-vmm hostile failed: $(cat /tmp/result.err) $(cat /tmp/result)"
cat /tmp/result
grep -q '"passed":true' /tmp/result || fail "hostile run did not pass"
expect_eq "rounds run" "$(sed -n 's/.*"rounds":\([0-9]*\).*/\1/p' /tmp/result)" 1000
step "the host's log: every rejection counted, at most 10 lines per 5 s of them and hangs"
t1=$(cut -d. -f1 /proc/uptime)
rejected=$(hagctl status --json | tr ',{' '\n\n' | sed -n 's/.*"rejected":\([0-9]*\).*/\1/p' | head -n 1)
lines=$(dmesg | grep -c 'submission rejected' || true)
bound=$((10 * ((t1 - t0) / 5 + 2)))
echo "$rejected submissions rejected in $((t1 - t0)) s; $lines lines logged (at most $bound)"
[ "${rejected:-0}" -gt "$bound" ] || fail "only ${rejected:-no} rejections: too few to show the log's bound"
[ "$lines" -le "$bound" ] || fail "$lines lines of rejections in the host's log, more than $bound"
# The next line, in a later interval, reports what the flood's last one
# left out.
sleep 5
hag-vmm run --mdev "$uuid" --workload reject || fail "reject workload was not rejected as expected"
dmesg | grep 'submission rejected' | tail -n 1
# Every rejection and hang (they share the budget) is a line or counted in
# a later one's "N more left out".
stat() { hagctl status --json | tr ',{' '\n\n' | sed -n "s/.*\"$1\":\([0-9]*\).*/\1/p" | head -n 1; }
counted=$(($(stat rejected) + $(stat hangs)))
accounted=$(dmesg | grep -E 'vGPU 1: submission rejected|vGPU 1 hung' |
	awk '{ n++; if (match($0, /\(([0-9]+) more left out/)) { s = substr($0, RSTART + 1); n += s + 0 } } END { print n + 0 }')
expect_eq "rejections and hangs logged or said left out" "$accounted" "$counted"
step "the vGPU still runs a normal workload"
hag-vmm run --mdev "$uuid" --workload all || fail "vGPU unusable after the hostile run"
hagctl status
