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
