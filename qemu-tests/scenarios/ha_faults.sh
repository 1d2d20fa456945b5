# hosts: 2
# timeout: 600
# Faults against a protected VM (issue 12), invariants only, no timings.
# A hag-vmm VM on host 0 is protected by checkpoints to host 1. While it
# runs: a rogue peer without the pair's key, and one speaking plain TCP,
# hit the backup's port (refused and logged, protection unaffected); then
# host 0's hagctl checkpoint is stopped (SIGSTOP) past the failover
# timeout: the backup takes over from its last checkpoint and fences; the
# primary, continued, stops its VM and reports fenced. Invariants from the
# output the outside saw (each host's released console lines):
#   1. the lines host 0 released and those host 1 released form one
#      increasing sequence (host 0's all before host 1's): never contradicted;
#   2. host 0 released nothing after the epoch host 1 resumed from;
#   3. exactly one host prints the workload's result, and it verifies.
ITERATIONS=40000
uuid=$(new_uuid)
backup=$(host_ip 1):7200
peer=$(host_ip $((1 - HAG_HOST)))
sock=/tmp/vm.sock
load_hag
ha_key
mdev_create "$uuid"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

if [ "$HAG_HOST" = 1 ]; then
	step "host 1: backup on $backup"
	rc=0
	hagctl backup --listen "$backup" --mdev "$uuid" --control "$sock" --failover-timeout 3 \
		--vmm-arg=--progress --vmm-arg=1000 >/tmp/backup.out 2>/tmp/backup.err || rc=$?
	cat /tmp/backup.err /tmp/backup.out
	expect_eq "hagctl backup exit status" "$rc" 0
	grep -q 'refused a connection from .*not authenticated' /tmp/backup.err ||
		fail "the rogue peers were not refused"
	grep -q '^takeover: generation 1, resumed from epoch [0-9]*' /tmp/backup.out ||
		fail "no takeover after the primary stalled"
	grep -q "^PASS frames: $ITERATIONS iterations verified" /tmp/backup.out ||
		fail "the workload did not verify on host 1"
	epoch=$(sed -n 's/^takeover: generation 1, resumed from epoch \([0-9]*\) .*/\1/p' /tmp/backup.out)
	first=$(grep -o '^frames: iteration [0-9]*' /tmp/backup.out | head -n 1 | cut -d' ' -f3)
	echo "resumed from epoch $epoch; first line released here: iteration ${first:-none}"
	# For host 0's check (invariants 1, 2): where host 1 began.
	[ -n "$first" ] || fail "no progress line released on host 1"
	echo "$first" >/tmp/first
	nc -l -p 7300 </tmp/first >/dev/null
else
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" --progress 1000 \
		>/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat /tmp/vm.err)"
	hagctl checkpoint --vm "$sock" --backup "$backup" --interval 1s --json >/tmp/cp.out 2>/tmp/cp.err &
	cp=$!
	wait_for 120 grep -q '^epoch 3:' /tmp/cp.err || fail "no 3 epochs: $(cat /tmp/cp.err)"

	step "host 0: rogue peers on the backup's port"
	ha_rogue_key /tmp/rogue.key
	printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 2 "$(host_ip 1)" 7200 >/dev/null 2>&1 || true
	hagctl migrate --vm "$sock" --to "$backup" --key /tmp/rogue.key --connect-timeout 2 \
		>/dev/null 2>/tmp/rogue.err && fail "a peer without the key got through"
	cat /tmp/rogue.err
	grep -q 'not authenticated\|closed the connection' /tmp/rogue.err ||
		fail "the rogue migration failed for another reason"
	before=$(grep -c '^epoch [0-9]*:' /tmp/cp.err)
	wait_for 60 sh -c "[ \$(grep -c '^epoch [0-9]*:' /tmp/cp.err) -gt $((before + 1)) ]" ||
		fail "protection stopped after the rogue peers"

	step "host 0: stop hagctl checkpoint (SIGSTOP) past the failover timeout"
	kill -STOP "$cp"
	sleep 8
	kill -CONT "$cp"
	rc=0
	wait "$cp" || rc=$?
	cat /tmp/cp.err /tmp/cp.out
	expect_eq "hagctl checkpoint exit status (fenced)" "$rc" 1
	grep -q '"outcome":"fenced"' /tmp/cp.out || fail "the stalled primary was not fenced"
	rc=0
	wait "$vm" || rc=$?
	cat /tmp/vm.out
	! grep -q '^PASS frames\|^FAIL frames' /tmp/vm.out || fail "the fenced primary printed a result"
	last=$(grep -o '^frames: iteration [0-9]*' /tmp/vm.out | tail -n 1 | cut -d' ' -f3)
	first=""
	for _ in $(seq 300); do
		first=$(nc "$(host_ip 1)" 7300 </dev/null 2>/dev/null) && [ -n "$first" ] && break
		sleep 1
	done
	echo "host 0 released up to iteration ${last:-none}; host 1 from ${first:-?}"
	[ -n "$first" ] || fail "host 1 did not say where it began"
	[ "${last:-0}" -lt "$first" ] || fail "host 0 released iteration $last, host 1 began at $first: contradicted"
fi
