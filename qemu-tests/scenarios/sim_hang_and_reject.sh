# hosts: 1
# A batch that chains to itself hangs the vGPU, never the kernel: the
# watchdog stops it, raises HANG and multicasts vgpu-hung. A command that
# writes outside graphics memory is rejected whole, with its address, and
# multicast as command-rejected. The vGPU works again after RESET.
# A guest that keeps hanging it gets less and less engine time: each hang
# in a row halves the work the next submission may do and doubles the pause
# between its slices (HangBackoff); a submission that finishes restores
# the full allowance.
load_hag
uuid=$(new_uuid)
mdev_create "$uuid"
# Long enough for the debug kernel, on which the four hangs take about
# two minutes; the scenario's end stops it.
hagctl events --json --timeout 600 >/tmp/events 2>/tmp/events.err &
wait_for 30 grep -q listening /tmp/events.err || fail "hagctl events did not subscribe"

step "a self-chaining batch hangs the vGPU, four times in a row"
# The watchdog at its longest: each hang is the work budget's, whose
# size the back-off sets.
hang() { hag-vmm run --mdev "$uuid" --workload hang --watchdog-ms 600000 --timeout 120; }
for n in 1 2 3 4; do
	hang || fail "hang workload $n did not end in a detected hang"
done
step "an out-of-range store is rejected"
hag-vmm run --mdev "$uuid" --workload reject || fail "reject workload was not rejected as expected"
step "the vGPU still works"
hag-vmm run --mdev "$uuid" --workload stores || fail "vGPU unusable after hang and reject"

wait_for 10 grep -q command-rejected /tmp/events || fail "no command-rejected event: $(cat /tmp/events)"
grep -q '"event":"vgpu-hung"' /tmp/events || fail "no vgpu-hung event: $(cat /tmp/events)"
step "each hang in a row left the next submission half the work; a finished one restored it"
hang || fail "hang workload after stores did not hang"
wait_for 10 test "$(grep -c '"event":"vgpu-hung"' /tmp/events)" -ge 5 || fail "not 5 vgpu-hung events: $(cat /tmp/events)"
# "… (after W operations; hang N in a row: the next submission may do L, …)"
grep '"event":"vgpu-hung"' /tmp/events | sed -n 's/.*after \([0-9]*\) operations; hang \([0-9]*\) in a row: the next submission may do \([0-9]*\).*/\1 \2 \3/p' >/tmp/hangs
cat /tmp/hangs
full=4194304
expect_eq "hangs in a row, as counted" "$(cut -d' ' -f2 /tmp/hangs | tr '\n' ' ')" "1 2 3 4 1 "
expect_eq "work allowed after each" "$(cut -d' ' -f3 /tmp/hangs | tr '\n' ' ')" "$((full / 2)) $((full / 4)) $((full / 8)) $((full / 16)) $((full / 2)) "
# Each hung submission did what the hang before it allowed (a slice at most
# over it), the one after the finished workload the full amount again.
awk -v full=$full '{ allowed = (NR == 1 || NR == 5) ? full : prev; if ($1 < allowed || $1 > allowed + 1024) { print "hang " NR " did " $1 " operations, allowed " allowed; bad = 1 } prev = $3 } END { exit bad }' /tmp/hangs ||
	fail "a hung submission did not do the work its back-off allowed"
cat /tmp/events
grep -q "hung:" /dev/kmsg 2>/dev/null || true
dmesg | grep 'hag_mdev' | tail -3
