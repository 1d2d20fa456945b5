# hosts: 2
# timeout: 300
# The frames workload migrates live A -> B mid-run, then B -> A, then A -> B
# again (three migrations, each into a freshly created vGPU on the receiving
# host, which runs `hag-vmm serve --incoming` + `hagctl receive`), and its
# final verification of all of its guest RAM must pass on host B. Every
# source VM must stop after the target acknowledged.
ITERATIONS=40000
# Seconds a VM runs on a host before it is migrated on.
DWELL=4
load_hag
ha_key
peer=$(host_ip $((1 - HAG_HOST)))
me=$(host_ip "$HAG_HOST")
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

# incoming N PORT: an incoming VM on a new vGPU, filled by `hagctl receive`
# on this host's PORT; leaves the VM's pid in $vm.
incoming() {
	uuid=$(new_uuid)
	mdev_create "$uuid"
	sock=/tmp/vm$1.sock
	step "host $HAG_HOST: migration $1: incoming VM on vGPU $uuid, receiver on $me:$2"
	hag-vmm serve --mdev "$uuid" --control "$sock" --incoming >"/tmp/vm$1.out" 2>"/tmp/vm$1.err" &
	vm=$!
	wait_for 30 test -S "$sock" || fail "incoming VM $1 did not start: $(cat "/tmp/vm$1.err")"
	hagctl receive --listen "$me:$2" --vm "$sock" --json >"/tmp/recv$1.out" 2>"/tmp/recv$1.err" ||
		fail "hagctl receive $1 failed: $(cat "/tmp/recv$1.err")"
	cat "/tmp/recv$1.out"
	grep -q '"resumed":true' "/tmp/recv$1.out" || fail "receive $1: the VM was not resumed here"
}

# outgoing N PORT: migrates the VM $vm (control socket of migration N-1)
# to the peer's PORT after $DWELL s, and checks that it stopped here.
outgoing() {
	sock=/tmp/vm$(($1 - 1)).sock
	sleep "$DWELL"
	step "host $HAG_HOST: migration $1: to $peer:$2"
	hagctl migrate --vm "$sock" --to "$peer:$2" --json >"/tmp/mig$1.out" 2>"/tmp/mig$1.err" ||
		fail "hagctl migrate $1 failed: $(cat "/tmp/mig$1.err") $(cat "/tmp/vm$(($1 - 1)).err")"
	cat "/tmp/mig$1.err" "/tmp/mig$1.out"
	grep -q '"downtime_ms"' "/tmp/mig$1.out" || fail "migration $1: no report"
	rc=0
	wait "$vm" || rc=$?
	cat "/tmp/vm$(($1 - 1)).err" "/tmp/vm$(($1 - 1)).out"
	expect_eq "migration $1: source VM exit status" "$rc" 0
	grep -q '^stopped: quit at iteration' "/tmp/vm$(($1 - 1)).out" ||
		fail "migration $1: the source VM did not stop after the migration"
}

if [ "$HAG_HOST" = 0 ]; then
	uuid=$(new_uuid)
	mdev_create "$uuid"
	step "host 0: VM with the frames workload ($ITERATIONS iterations)"
	hag-vmm serve --mdev "$uuid" --control /tmp/vm0.sock --iterations "$ITERATIONS" >/tmp/vm0.out 2>/tmp/vm0.err &
	vm=$!
	wait_for 30 test -S /tmp/vm0.sock || fail "VM did not start: $(cat /tmp/vm0.err)"
	outgoing 1 7101
	incoming 2 7102
	outgoing 3 7103
	step "host 0: done; the VM went to host 1 three times and came back twice"
else
	incoming 1 7101
	outgoing 2 7102
	incoming 3 7103
	step "host 1: the VM runs here 2 s more, ends its run and verifies its guest RAM"
	sleep 2
	vm_finish /tmp/vm3.sock
	rc=0
	wait "$vm" || rc=$?
	cat /tmp/vm3.err /tmp/vm3.out
	expect_eq "final VM exit status" "$rc" 0
	grep -q "^PASS frames: [1-9][0-9]* iterations verified" /tmp/vm3.out || fail "the workload did not verify on host 1"
	grep -q '"paused_at_iteration"' /tmp/mig2.out
	echo "round trip: A->B->A->B, PASS on host 1"
fi
