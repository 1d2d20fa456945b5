# hosts: 2
# timeout: 500
# Partition: a hag-vmm VM running the frames workload on host 0 is protected
# by checkpoints to host 1, with heartbeats on both networks (the checkpoint
# stream and its heartbeats on eth0, more heartbeats on eth1). After some
# epochs host 0 cuts its data link (ip link set eth0 down) until it reports
# running unprotected, and 2 s more (longer than --failover-timeout): host 0
# runs on unprotected, host 1 still hears it on eth1 and does not take over
# (the VM never runs on both). When the link is back, the pair
# resynchronises without stopping the VM, epochs resume, and the workload
# finishes on host 0 only.
ITERATIONS=20000
uuid=$(new_uuid)
backup=$(host_ip 1):7200
heartbeat=$(host_ip2 1):7201
other=$((1 - HAG_HOST))
sock=/tmp/vm.sock
load_hag
ha_key
mdev_create "$uuid"
wait_for 60 ping -c 1 -W 1 "$(host_ip $other)" || fail "$(host_ip $other) unreachable"
wait_for 60 ping -c 1 -W 1 "$(host_ip2 $other)" || fail "$(host_ip2 $other) unreachable"

if [ "$HAG_HOST" = 1 ]; then
	step "host 1: backup on $backup, heartbeats also on $heartbeat"
	rc=0
	hagctl backup --listen "$backup" --heartbeat-listen "$heartbeat" --mdev "$uuid" --control "$sock" \
		--failover-timeout 3 --json >/tmp/backup.out 2>/tmp/backup.err || rc=$?
	cat /tmp/backup.err /tmp/backup.out
	cat /run/hag/backup.json
	expect_eq "hagctl backup exit status" "$rc" 0
	grep -q "primary alive via $heartbeat, data link down: not taking over" /tmp/backup.err ||
		fail "the backup did not notice the partition"
	! grep -q 'takeover' /tmp/backup.out /tmp/backup.err || fail "the backup took over during a partition"
	! grep -q 'took-over' /run/hag/backup.json || fail "the backup's state says it took over"
	[ ! -e "$sock" ] || fail "the backup started its incoming VM"
	! grep -q "^PASS frames" /tmp/backup.out || fail "the workload ran on host 1 too"
	[ "$(grep -c 'checkpoint stream from' /tmp/backup.err)" -ge 2 ] ||
		fail "the primary did not reconnect its checkpoint stream"
	grep -q 'backup done: protection ends: finished' /tmp/backup.err || fail "protection did not end cleanly"
else
	step "host 0: VM with the frames workload, protected by $backup (heartbeats also to $heartbeat)"
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" --progress 2000 \
		>/tmp/vm.out 2>/tmp/vm.err &
	vm=$!
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat /tmp/vm.err)"
	hagctl checkpoint --vm "$sock" --backup "$backup" --heartbeat-addr "$heartbeat" --interval 1s \
		--failover-timeout 3 --json >/tmp/cp.out 2>/tmp/cp.err &
	cp=$!
	wait_for 120 grep -q '^epoch 4:' /tmp/cp.err || fail "no 4 epochs: $(cat /tmp/cp.err)"
	hagctl status | grep -q "^protection: vGPU [0-9]* protected, last epoch [0-9]* acked" ||
		fail "hagctl status does not show the protection: $(hagctl status)"

	step "host 0: cut the data link (eth0) until the primary runs unprotected"
	ip link set eth0 down
	# The cut lasts until the primary has said so (3 s of silence, then
	# its status), however slow the host, and 2 s more.
	unprotected() { hagctl status | grep -q "^protection: vGPU [0-9]* unprotected: backup $backup unreachable"; }
	wait_for 60 unprotected || fail "hagctl status does not say unprotected during the cut: $(hagctl status)"
	hagctl status | tee /tmp/status.cut
	before=$(grep '^epoch [0-9]*:' /tmp/cp.err | tail -n 1 | cut -d' ' -f2 | tr -d :)
	sleep 2
	ip link set eth0 up
	step "host 0: data link back after epoch $before; resynchronising"
	wait_for 60 sh -c "hagctl status | grep -q '^protection: vGPU [0-9]* protected'" ||
		fail "not protected again after the heal: $(hagctl status; cat /tmp/cp.err)"
	hagctl status
	wait_for 60 grep -q "^epoch $((before + 2)):" /tmp/cp.err ||
		fail "epochs did not resume after epoch $before: $(cat /tmp/cp.err)"
	# Protected again: the workload may end (ITERATIONS is its longest run).
	vm_finish "$sock"

	rc=0
	wait "$cp" || rc=$?
	cat /tmp/cp.err /tmp/cp.out
	expect_eq "hagctl checkpoint exit status" "$rc" 0
	grep -q '"outcome":"finished"' /tmp/cp.out || fail "protection did not end with the VM finished"
	grep -q '"syncs":2' /tmp/cp.out || fail "not exactly one resynchronisation"
	grep -q 'unprotected: backup .* unreachable' /tmp/cp.err || fail "the primary never ran unprotected"
	rc=0
	wait "$vm" || rc=$?
	cat /tmp/vm.err /tmp/vm.out
	expect_eq "primary VM exit status" "$rc" 0
	grep -q "^PASS frames: [1-9][0-9]* iterations verified" /tmp/vm.out ||
		fail "the workload did not verify on host 0"
fi
