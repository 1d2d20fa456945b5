# hosts: 2
# timeout: 500
# A backup that leaves the decision to a cluster manager (issue 21, item
# 2): hagctl backup --on-silence hold --fence-peer CMD, a hag-vmm VM on
# host 0 protected by it. Host 0 is lost for real (the harness kills it)
# after epoch 3. Host 1 must not take over on silence alone: it says it
# holds. `hagctl takeover` then asks it to: first the fence command fails
# (its fence agent finds no power switch), so the takeover is refused with
# that reason and nothing resumes; then the fence succeeds, told the
# primary's address, and the backup takes over from the last acknowledged
# epoch; the workload verifies. The backup runs as --name vm1: its state,
# the raised generation, is in /var/lib/hag/vm1/, and `hagctl takeover
# --name vm1` finds it. Host 0's side is guest/host_loss.sh's.
KILL_AFTER_MS=0
backup_host() {
	# The fence agent: it powers the primary off through a switch that is
	# there only once /tmp/power-switch exists.
	cat >/tmp/fence-agent <<'SH'
#!/bin/sh
echo "fencing $HAG_PEER for generation $HAG_GENERATION (epoch $HAG_EPOCH): $HAG_REASON"
[ -e /tmp/power-switch ] || { echo "no power switch answers"; exit 1; }
echo "$HAG_PEER" >/tmp/fenced
SH
	chmod +x /tmp/fence-agent
	step "host 1: backup on $backup, silence held, fencing by /tmp/fence-agent"
	finish_after_takeover "$sock"
	hagctl backup --listen "$backup" --mdev "$uuid" --control "$sock" --failover-timeout 3 --json \
		--name vm1 --on-silence hold --fence-peer /tmp/fence-agent \
		>/tmp/backup.out 2>/tmp/backup.err &
	bk=$!
	wait_for 300 grep -q 'holding (--on-silence hold)' /tmp/backup.err ||
		fail "the backup did not say it holds: $(cat /tmp/backup.err)"
	sleep 5
	! grep -q 'taking over' /tmp/backup.err || fail "the backup took over on silence"
	step "host 1: hagctl takeover, the fence agent failing"
	rc=0
	hagctl takeover --name vm1 --timeout 60 >/tmp/request1.out 2>&1 || rc=$?
	cat /tmp/request1.out
	expect_eq "hagctl takeover's exit status (6: refused)" "$rc" 6
	grep -q 'fence-peer failed' /tmp/request1.out || fail "the refusal does not say the fence failed"
	[ ! -e /tmp/fenced ] || fail "fenced although the agent failed"
	step "host 1: hagctl takeover, the fence agent working"
	touch /tmp/power-switch
	hagctl takeover --name vm1 --timeout 60 >/tmp/request2.out 2>&1 ||
		fail "hagctl takeover: $(cat /tmp/request2.out)"
	cat /tmp/request2.out
	expect_eq "the address the fence agent was given" "$(cat /tmp/fenced)" "$(host_ip 0)"
	rc=0
	wait "$bk" || rc=$?
	cat /tmp/backup.err /tmp/backup.out
	expect_eq "hagctl backup exit status" "$rc" 0
	grep -q '"reason":"a takeover was requested' /tmp/backup.out || fail "no takeover on request"
	grep -q '"generation":1' /tmp/backup.out || fail "the takeover did not raise the generation"
	grep -q '"state":"took-over".*"generation":1\|"generation":1.*"state":"took-over"' /var/lib/hag/vm1/generation.json ||
		fail "the generation is not stored in vm1's state directory: $(cat /var/lib/hag/vm1/generation.json)"
	grep -q 'no power switch answers' /tmp/backup.err || fail "the fence agent's output is not in the backup's log"
	cat /tmp/finish.out
	grep -q "^PASS frames: [1-9][0-9]* iterations verified" /tmp/backup.out ||
		fail "the workload did not verify on host 1"
}
. /hag/host_loss.sh
