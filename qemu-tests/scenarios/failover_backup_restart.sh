# hosts: 2
# timeout: 500
# Fencing terms survive a backup's restart (issue 20, item 3). VM A, a
# hag-vmm VM on host 0, is protected by a backup on host 1, both as --name
# vm1. The data link is cut: host 1 hears nothing, takes over at generation
# 1 and stores, with it, which VM instance it took over from (A's VMM
# process). Then host 1's hagctl backup is restarted, as an operator does
# to protect the VM again, and the link heals:
# - A's hagctl, still running and holding A's output, reconnects to the
#   restarted backup and is told it was taken over from: it stops A
#   (exit 3, fenced). A restart must not forget an old primary.
# - VM B, started afresh on host 0 with a new hagctl at generation 0, pairs
#   with the same restarted backup, adopts generation 1 and is protected
#   until its workload verifies. A restart must not fence a healthy new
#   primary, which a generation alone cannot tell from A.
# First, a primary of another VM (--name vm2) pointed at vm1's backup is
# refused, saying so on both sides. The hosts signal each other on eth1,
# which stays up.
ITERATIONS=8000
backup=$(host_ip 1):7200
other=$((1 - HAG_HOST))
load_hag
ha_key
uuid=$(new_uuid)
mdev_create "$uuid"
wait_for 60 ping -c 1 -W 1 "$(host_ip $other)" || fail "$(host_ip $other) unreachable"
wait_for 60 ping -c 1 -W 1 "$(host_ip2 $other)" || fail "$(host_ip2 $other) unreachable"
state=/var/lib/hag/vm1/generation.json

if [ "$HAG_HOST" = 1 ]; then
	sock=/tmp/standby.sock
	step "host 1: backup of vm1 on $backup"
	hagctl backup --name vm1 --listen "$backup" --mdev "$uuid" --control "$sock" --failover-timeout 3 \
		--json >/tmp/backup1.out 2>/tmp/backup1.err &
	bk=$!
	wait_for 300 grep -q 'takeover: generation 1' /tmp/backup1.err ||
		fail "no takeover during the cut: $(cat /tmp/backup1.err)"
	cat /tmp/backup1.err
	grep -q "refused a control connection from .*: this backup stands by for VM 'vm1', the primary protects VM 'vm2'" /tmp/backup1.err ||
		fail "the backup did not refuse the primary of vm2"
	grep -q '"generation":1' "$state" || fail "generation 1 is not stored: $(cat "$state")"
	grep -q '"superseded":\[{"boot":"[0-9a-f]*","pid":[0-9]*,"started":[0-9]*}\]' "$state" ||
		fail "the instance taken over from is not stored: $(cat "$state")"

	step "host 1: the backup restarted (its taken-over VM ends with it)"
	kill -KILL "$bk"
	wait "$bk" || true
	hagctl backup --name vm1 --listen "$backup" --mdev "$uuid" --control "$sock" --failover-timeout 3 \
		--json >/tmp/backup2.out 2>/tmp/backup2.err &
	bk=$!
	wait_for 60 port_listening 7200 || fail "the restarted backup does not listen: $(cat /tmp/backup2.err)"
	signal_ready 7300
	rc=0
	wait "$bk" || rc=$?
	cat /tmp/backup2.err /tmp/backup2.out
	expect_eq "the restarted hagctl backup's exit status" "$rc" 0
	grep -q 'was taken over from (generation 1): told to stop' /tmp/backup2.err ||
		fail "the restarted backup did not tell VM A's primary it was taken over from"
	grep -q 'backup done: protection ends: finished' /tmp/backup2.err ||
		fail "VM B's protection did not end cleanly"
	! grep -q 'takeover' /tmp/backup2.out || fail "the restarted backup took over"
else
	step "host 0: a primary of VM vm2 pointed at vm1's backup"
	uuid_x=$(new_uuid)
	mdev_create "$uuid_x"
	hag-vmm serve --mdev "$uuid_x" --control /tmp/x.sock --iterations 262144 >/tmp/x.out 2>/tmp/x.err &
	vm_x=$!
	wait_for 30 test -S /tmp/x.sock || fail "VM X did not start: $(cat /tmp/x.err)"
	hagctl checkpoint --name vm2 --vm /tmp/x.sock --backup "$backup" --interval 1s >/tmp/cp_x.out 2>/tmp/cp_x.err &
	cp_x=$!
	wait_for 120 grep -q "the backup refused: this backup stands by for VM 'vm1', the primary protects VM 'vm2' (--name)" /tmp/cp_x.err ||
		fail "the primary of vm2 was not refused: $(cat /tmp/cp_x.err)"
	# Refused at its first pairing, it ends (nothing was ever protected).
	rc=0
	wait "$cp_x" || rc=$?
	[ "$rc" != 0 ] || fail "the refused primary of vm2 exited 0: $(cat /tmp/cp_x.err)"
	kill -KILL "$vm_x"
	wait "$vm_x" 2>/dev/null || true
	mdev_remove "$uuid_x"

	step "host 0: VM A with the frames workload, protected by $backup"
	hag-vmm serve --mdev "$uuid" --control /tmp/a.sock --iterations 262144 --progress 20000 \
		>/tmp/a.out 2>/tmp/a.err &
	vm_a=$!
	wait_for 30 test -S /tmp/a.sock || fail "VM A did not start: $(cat /tmp/a.err)"
	hagctl checkpoint --name vm1 --vm /tmp/a.sock --backup "$backup" --interval 1s --failover-timeout 3 \
		--json >/tmp/cp_a.out 2>/tmp/cp_a.err &
	cp_a=$!
	wait_for 120 grep -q '^epoch 3:' /tmp/cp_a.err || fail "no 3 epochs: $(cat /tmp/cp_a.err)"

	step "host 0: the data link (eth0) cut until host 1 took over and restarted its backup"
	ip link set eth0 down
	await_ready "$(host_ip2 1)" 7300
	ip link set eth0 up
	rc=0
	wait "$cp_a" || rc=$?
	cat /tmp/cp_a.err /tmp/cp_a.out
	expect_eq "VM A's hagctl checkpoint exit status (3: fenced)" "$rc" 3
	grep -q '"outcome":"fenced"' /tmp/cp_a.out || fail "VM A's protection did not end fenced"
	wait_for 30 sh -c "! kill -0 $vm_a 2>/dev/null" || fail "VM A still runs after its primary was fenced"
	! grep -q '^PASS frames' /tmp/a.out || fail "VM A's workload ran to its end"

	step "host 0: VM B, started afresh, protected by the same restarted backup"
	uuid_b=$(new_uuid)
	mdev_create "$uuid_b"
	hag-vmm serve --mdev "$uuid_b" --control /tmp/b.sock --iterations "$ITERATIONS" --progress 2000 \
		>/tmp/b.out 2>/tmp/b.err &
	vm_b=$!
	wait_for 30 test -S /tmp/b.sock || fail "VM B did not start: $(cat /tmp/b.err)"
	rc=0
	hagctl checkpoint --name vm1 --vm /tmp/b.sock --backup "$backup" --interval 1s --failover-timeout 3 \
		--json >/tmp/cp_b.out 2>/tmp/cp_b.err || rc=$?
	cat /tmp/cp_b.err /tmp/cp_b.out
	expect_eq "VM B's hagctl checkpoint exit status" "$rc" 0
	grep -q 'the backup is at generation 1, from a takeover of another instance of this VM: this one (pid [0-9]*.*) adopts it' /tmp/cp_b.err ||
		fail "VM B's primary did not adopt the backup's generation"
	grep -q '"outcome":"finished"' /tmp/cp_b.out || fail "VM B's protection did not end with the VM finished"
	grep -q '"generation":1' /tmp/cp_b.out || fail "VM B's report does not say generation 1"
	grep -q '^epoch 3:' /tmp/cp_b.err || fail "VM B had fewer than 3 acknowledged epochs"
	rc=0
	wait "$vm_b" || rc=$?
	cat /tmp/b.err /tmp/b.out
	expect_eq "VM B's exit status" "$rc" 0
	grep -q "^PASS frames: $ITERATIONS iterations verified" /tmp/b.out || fail "VM B's workload did not verify"
fi
