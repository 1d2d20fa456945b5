# hosts: 1
# hag-vmm attaches a hag-sim vGPU through VFIO (container, group, device,
# DMA mapping, MSI eventfd) and runs GPU workloads from its guest driver:
# stores, blits, batches. Each result is verified in guest RAM, and every
# guest page the engine wrote must be in hag's GPU dirty log (missed 0).
load_hag
uuid=$(new_uuid)
mdev_create "$uuid"
hag-vmm run --mdev "$uuid" --workload all --json >/tmp/result || fail "hag-vmm failed: $(cat /tmp/result)"
cat /tmp/result
expect_eq "workloads run" "$(grep -c '"workload"' /tmp/result)" 3
! grep -q '"missed":[1-9]' /tmp/result || fail "the dirty log missed a GPU write"
hagctl status

step "the counters: every accepted submission was modelled precisely, none took the fallback"
json=$(hagctl status --json)
echo "$json"
num() { echo "$json" | grep -o "\"$1\":[0-9]*" | head -1 | cut -d: -f2; }
subs=$(num submissions)
rej=$(num rejected)
precise=$(num precise_workloads)
fallback=$(num fallback_workloads)
[ -n "$subs" ] && [ -n "$precise" ] && [ -n "$fallback" ] || fail "status --json lacks the workload counts: $json"
[ "$subs" -gt 0 ] || fail "no submissions counted: $json"
expect_eq "precise workloads (submissions - rejected)" "$precise" "$((subs - rej))"
expect_eq "fallback workloads of a hag-sim vGPU" "$fallback" 0
hagctl status | grep -q "^ *submissions $subs, rejected $rej, precise $precise, fallback 0, commands " ||
	fail "text status lacks the precise/fallback counts"
