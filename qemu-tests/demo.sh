# hosts: 2
# timeout: 400
# The demo, as far as hag goes today: two GVT-g-style hosts with hag loaded.
# A VM (hag-vmm) with a hag-sim vGPU runs a GPU workload on host A; hagctl
# migrates it live, vGPU and all, to host B, where the workload finishes and
# checks every byte of its guest RAM. (Backup and failover come with issue 5.)
me=$(host_ip "$HAG_HOST")
name=$(if [ "$HAG_HOST" = 0 ]; then echo A; else echo B; fi)
say() { echo "[host $name] $*"; }
load_hag
uuid=$(new_uuid)
mdev_create "$uuid"
say "hag_mdev loaded, vGPU $uuid created"
peer=$(host_ip $((1 - HAG_HOST)))
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
sock=/tmp/vm.sock

if [ "$HAG_HOST" = 1 ]; then
	hag-vmm serve --mdev "$uuid" --control "$sock" --incoming >/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "incoming VM did not start: $(cat /tmp/vm.err)"
	say "waiting for the VM: hagctl receive --listen $me:7100"
	hagctl receive --listen "$me:7100" --vm "$sock" 2>&1 | sed "s/^/[host B] /"
	say "the VM runs here now; hagctl status:"
	hagctl status | sed "s/^/[host B]   /"
	wait "$vm" || fail "the VM failed on host B: $(cat /tmp/vm.out)"
	sed "s/^/[host B] VM: /" /tmp/vm.out
else
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations 30000 >/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat /tmp/vm.err)"
	say "VM started: frames workload, 30000 GPU submissions, all state in guest RAM"
	sleep 5
	say "hagctl status:"
	hagctl status | sed "s/^/[host A]   /"
	say "hagctl migrate --to $peer:7100"
	hagctl migrate --vm "$sock" --to "$peer:7100" 2>&1 | sed "s/^/[host A] /"
	wait "$vm" || true
	sed "s/^/[host A] VM: /" /tmp/vm.out
fi
