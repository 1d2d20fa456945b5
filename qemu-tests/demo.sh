# hosts: 1
# The demo, as it stands: a GVT-g-style host with hag loaded, one simulated
# vGPU created the way an operator (or libvirt) creates one, and what hagctl
# reports about it.
echo
echo "== hag demo on test host $(host_ip "$HAG_HOST") (kernel $(uname -r)) =="
step "insmod hag_mdev.ko"
load_hag
dmesg | grep 'hag_mdev' | tail -1 | sed 's/^\[[^]]*\] //'

step "hagctl events, listening in the background"
hagctl events >/tmp/events 2>/dev/null &
sleep 1

uuid=$(new_uuid)
step "create a hag-sim vGPU: echo $uuid > $HAG_SIM_TYPE_DIR/create"
mdev_create "$uuid"
echo "VFIO group for the VMM: /dev/vfio/$(basename "$(readlink "/sys/bus/mdev/devices/$uuid/iommu_group")")"

step "hagctl status"
hagctl status
step "hagctl status --json"
hagctl status --json
step "events seen"
sleep 1
cat /tmp/events
echo "== demo done =="
