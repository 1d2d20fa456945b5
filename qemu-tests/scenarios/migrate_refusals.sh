# hosts: 2
# timeout: 300
# Damaged migrations are refused, and nothing is lost:
# (a) hagctl migrate --inject-fault corrupt-page flips a byte of a PAGES
#     frame (pre-copy), then --inject-fault truncate-context cuts the CONTEXT
#     frame in half during stop-and-copy. Each time host 1's `hagctl
#     receive` must fail naming the damaged frame and discard its incoming
#     VM, and host 0's VM must run on (resumed after the stop-and-copy) and
#     finish with PASS there.
# (b) on host 1, IOC_RESTORE_CONTEXT refuses a snapshot with a flipped byte
#     or truncated (EINVAL), of an unknown version (EPROTO), of another
#     vGPU (EXDEV), and with config space changed where a guest cannot
#     write (EINVAL), leaving the target vGPU as it was (hag-vmm
#     context-check).
ITERATIONS=20000
load_hag
ha_key
peer=$(host_ip $((1 - HAG_HOST)))
me=$(host_ip "$HAG_HOST")
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

if [ "$HAG_HOST" = 1 ]; then
	# refused N PORT PATTERN: an incoming VM whose migration must be refused
	# with an error matching PATTERN, and the VM discarded.
	refused() {
		uuid=$(new_uuid)
		mdev_create "$uuid"
		sock=/tmp/vm$1.sock
		step "host 1: incoming VM $1, receiver on $me:$2 (must refuse)"
		hag-vmm serve --mdev "$uuid" --control "$sock" --incoming >"/tmp/vm$1.out" 2>"/tmp/vm$1.err" &
		vm=$!
		wait_for 30 test -S "$sock" || fail "incoming VM $1 did not start: $(cat "/tmp/vm$1.err")"
		if hagctl receive --listen "$me:$2" --vm "$sock" >"/tmp/recv$1.out" 2>"/tmp/recv$1.err"; then
			fail "hagctl receive $1 accepted a damaged stream: $(cat "/tmp/recv$1.out")"
		fi
		cat "/tmp/recv$1.err"
		grep -q "$3" "/tmp/recv$1.err" || fail "receive $1: the error does not name the damage ($3)"
		grep -q 'the incoming VM was discarded' "/tmp/recv$1.err" || fail "receive $1: the incoming VM was not discarded"
		rc=0
		wait "$vm" || rc=$?
		cat "/tmp/vm$1.out"
		expect_eq "discarded VM $1 exit status" "$rc" 0
		grep -q '^stopped: quit' "/tmp/vm$1.out" || fail "incoming VM $1 did not stop"
		mdev_remove "$uuid"
	}
	refused 1 7101 'PAGES frame damaged: crc32'
	refused 2 7102 'stream truncated inside a CONTEXT frame'

	step "host 1: restoring damaged or mismatched snapshots into a vGPU"
	a=$(new_uuid)
	b=$(new_uuid)
	mdev_create "$a"
	mdev_create "$b"
	hag-vmm context-check --mdev "$a" --mdev2 "$b" >/tmp/ctx 2>&1 || fail "context-check failed: $(cat /tmp/ctx)"
	cat /tmp/ctx
	grep -q '^PASS context-check:' /tmp/ctx || fail "no PASS line from context-check"
	dmesg | grep 'restore refused' || fail "the module did not log its refusals"
	dmesg | grep -q 'restore refused: snapshot version' || fail "no message for the unknown version"
	dmesg | grep -q 'restore refused: snapshot of a gvt vGPU' || fail "no message for the mismatched vGPU"
	dmesg | grep -q 'restore refused: config space byte 0xb is read-only and differs' ||
		fail "no message for the snapshot's read-only config byte"
	mdev_remove "$a"
	mdev_remove "$b"
else
	uuid=$(new_uuid)
	mdev_create "$uuid"
	sock=/tmp/vm.sock
	step "host 0: VM with the frames workload (at most $ITERATIONS iterations)"
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" >/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat /tmp/vm.err)"
	sleep 3
	n=1
	for fault in corrupt-page truncate-context; do
		step "host 0: migrate with --inject-fault $fault (must fail)"
		if hagctl migrate --vm "$sock" --to "$peer:710$n" --inject-fault "$fault" --json >"/tmp/mig$n.out" 2>"/tmp/mig$n.err"; then
			fail "migration with $fault succeeded: $(cat "/tmp/mig$n.out")"
		fi
		cat "/tmp/mig$n.err"
		grep -q 'the source VM keeps running' "/tmp/mig$n.err" || fail "$fault: the source did not keep its VM running"
		kill -0 "$vm" || fail "$fault: the source VM died"
		n=$((n + 1))
		sleep 2
	done
	step "host 0: the VM runs on here 2 s, ends its run and verifies its guest RAM"
	sleep 2
	vm_finish "$sock"
	rc=0
	wait "$vm" || rc=$?
	cat /tmp/vm.err /tmp/vm.out
	expect_eq "source VM exit status" "$rc" 0
	grep -q "^PASS frames: [1-9][0-9]* iterations verified" /tmp/vm.out || fail "the workload did not verify on host 0 after the failed migrations"
fi
