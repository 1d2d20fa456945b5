# The host-loss failover scenario, shared by its variants: a hag-vmm VM
# running the frames workload on host 0 is protected by checkpoints to
# host 1. After some epochs host 0 is lost for real: the harness kills its
# QEMU process (lose_this_host) KILL_AFTER_MS milliseconds after an epoch
# was acknowledged. Host 1 hears nothing past --failover-timeout, takes over
# from the last acknowledged epoch and the workload must verify there.
# Set by the caller: KILL_AFTER_MS; and, to run host 1's side itself, a
# function backup_host (the backup's address in $backup, the VM's control
# socket $sock, this host's mdev $uuid; ITERATIONS the workload's longest
# length: host 1 asks it to end 3 s after the takeover, finish_after_takeover).
ITERATIONS=30000
ha_pair

if [ "$HAG_HOST" = 1 ] && command -v backup_host >/dev/null; then
	backup_host
elif [ "$HAG_HOST" = 1 ]; then
	step "host 1: backup on $backup"
	finish_after_takeover "$sock"
	rc=0
	hagctl backup --listen "$backup" --mdev "$uuid" --control "$sock" --failover-timeout 3 --json \
		>/tmp/backup.out 2>/tmp/backup.err || rc=$?
	cat /tmp/backup.err /tmp/backup.out
	expect_eq "hagctl backup exit status" "$rc" 0
	grep -q '"reason":"the primary was silent for' /tmp/backup.out || fail "no takeover on silence"
	grep -q '"generation":1' /tmp/backup.out || fail "the takeover did not raise the generation"
	cat /tmp/finish.out
	grep -q "^PASS frames: [1-9][0-9]* iterations verified" /tmp/backup.out ||
		fail "the workload did not verify on host 1"
else
	step "host 0: VM with the frames workload, protected by $backup"
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" --progress 2000 \
		>/tmp/vm.out 2>/tmp/vm.err &
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat /tmp/vm.err)"
	hagctl checkpoint --vm "$sock" --backup "$backup" --interval 1s >/tmp/cp.out 2>/tmp/cp.err &
	wait_for 120 grep -q '^epoch 3:' /tmp/cp.err || fail "no 3 epochs: $(cat /tmp/cp.err)"
	cat /tmp/cp.err
	step "host 0: lost ${KILL_AFTER_MS} ms after epoch 3 was acknowledged"
	usleep $((KILL_AFTER_MS * 1000))
	lose_this_host
fi
