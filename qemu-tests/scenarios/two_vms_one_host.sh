# hosts: 2
# timeout: 600
# Two VMs protected at once between the same two hosts, each under its own
# name (issue 22, item 2; issue 20, item 3): hag-vmm VMs a and b on host 0,
# `hagctl checkpoint --name a|b`, two `hagctl backup --name a|b` on host 1.
# Their files never meet: /run/hag/a/ and /run/hag/b/ for runtime files,
# /var/lib/hag/a/ and /var/lib/hag/b/ for state. `hagctl status --json`
# on host 0 lists both protections by name. Then VM a's host processes die
# (its VMM and its hagctl checkpoint, SIGKILL): backup a takes over on
# silence and stores generation 1 in /var/lib/hag/a/ only. Backup b is then
# killed and restarted: it reads its own generation back (0), so primary b
# resyncs and stays protected; a backup host with one generation for every
# VM would have fenced it, a healthy VM stopped for another VM's takeover;
# backup a, restarted after VM a ended there, reads its generation 1 back.
# VM b's pair runs as its units would, `hagctl checkpoint --name b` and
# `hagctl backup --name b` with every setting in /etc/hag/b.conf; `hagctl
# job --name b` shows it on each host, and `hagctl abort --name b` finally
# ends its protection cleanly (the backup confirms, the VM runs on).
# VM a's workload verifies on host 1, VM b's on host 0.
ITERATIONS_A=20000
ITERATIONS_B=40000
load_hag
ha_key
peer=$(host_ip $((1 - HAG_HOST)))
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
ua=$(new_uuid)
ub=$(new_uuid)
mdev_create "$ua"
mdev_create "$ub"
backup_a=$(host_ip 1):7200
backup_b=$(host_ip 1):7210

# generation_in NAME: the generation backup NAME stored durably (0 if it
# stored none: it never took over).
generation_in() {
	if [ -f "/var/lib/hag/$1/generation.json" ]; then
		sed -n 's/.*"generation":\([0-9]*\).*/\1/p' "/var/lib/hag/$1/generation.json"
	else
		echo 0
	fi
}

# VM b's pair reads its settings from its configuration file, as the units
# hag-checkpoint@b.service and hag-backup@b.service run it.
mkdir -p /etc/hag
cat >/etc/hag/b.conf <<EOF
[checkpoint]
vm = /tmp/b.sock
backup = $backup_b
interval = 1s
json = true
[backup]
listen = $backup_b
mdev = $ub
failover-timeout = 3
json = true
EOF

if [ "$HAG_HOST" = 1 ]; then
	start_backup_b() {
		hagctl backup --name b >>/tmp/backup-b.out 2>>/tmp/backup-b.err &
		bk_b=$!
	}
	step "host 1: backups a on $backup_a and b on $backup_b"
	hagctl backup --name a --listen "$backup_a" --mdev "$ua" --failover-timeout 3 --json \
		>/tmp/backup-a.out 2>/tmp/backup-a.err &
	bk_a=$!
	finish_after_takeover /run/hag/a/hag-vmm.sock /tmp/backup-a.err
	start_backup_b
	wait_for 120 grep -q 'epoch 3 applied' /tmp/backup-a.err || fail "a: no epoch 3: $(cat /tmp/backup-a.err)"
	wait_for 120 grep -q 'epoch 3 applied' /tmp/backup-b.err || fail "b: no epoch 3: $(cat /tmp/backup-b.err)"
	ls -l /run/hag/a /run/hag/b
	[ ! -e /run/hag/backup.json ] && [ ! -e /var/lib/hag/generation.json ] ||
		fail "a named backup wrote the host-wide state"
	expect_eq "backup b's stored generation" "$(generation_in b)" 0
	hagctl job --name b | tee /tmp/job-b.txt
	grep -q '^backup: standby (pid [0-9]*), listening on' /tmp/job-b.txt || fail "hagctl job does not show backup b standing by"
	signal_ready 7300
	step "host 1: waiting for backup a's takeover"
	wait_for 120 grep -q '"generation":1' /tmp/backup-a.out ||
		fail "backup a did not take over: $(cat /tmp/backup-a.err)"
	expect_eq "backup a's stored generation" "$(generation_in a)" 1
	expect_eq "backup b's stored generation after a's takeover" "$(generation_in b)" 0
	step "host 1: backup b killed and restarted"
	kill -KILL "$bk_b"
	wait "$bk_b" 2>/dev/null || true
	start_backup_b
	wait_for 60 sh -c "[ \$(grep -c 'backup listening' /tmp/backup-b.err) -ge 2 ]" ||
		fail "the restarted backup b did not start: $(cat /tmp/backup-b.err)"
	grep 'backup listening' /tmp/backup-b.err | tail -1 | grep -q 'generation 0)' ||
		fail "the restarted backup b did not start at its own generation 0: $(grep 'backup listening' /tmp/backup-b.err)"
	rc=0
	wait "$bk_a" || rc=$?
	cat /tmp/backup-a.err /tmp/backup-a.out
	expect_eq "backup a's exit status" "$rc" 0
	grep -q '"reason":"the primary was silent for' /tmp/backup-a.out || fail "a: no takeover on silence"
	cat /tmp/finish.out
	grep -q "^PASS frames: [1-9][0-9]* iterations verified" /tmp/backup-a.out ||
		fail "VM a's workload did not verify on host 1"
	step "host 1: backup a restarted after its takeover reads generation 1 back"
	hagctl backup --name a --listen "$backup_a" --mdev "$ua" >/tmp/backup-a2.out 2>/tmp/backup-a2.err &
	bk_a2=$!
	wait_for 60 grep -q 'backup listening' /tmp/backup-a2.err || fail "backup a did not restart: $(cat /tmp/backup-a2.err)"
	grep 'backup listening' /tmp/backup-a2.err | grep -q 'generation 1)' ||
		fail "the restarted backup a forgot its takeover: $(grep 'backup listening' /tmp/backup-a2.err)"
	kill "$bk_a2"
	wait "$bk_a2" 2>/dev/null || true
	rc=0
	wait "$bk_b" || rc=$?
	cat /tmp/backup-b.err /tmp/backup-b.out
	expect_eq "the restarted backup b's exit status" "$rc" 0
	! grep -q '"generation":1' /tmp/backup-b.out || fail "backup b took over: $(cat /tmp/backup-b.out)"
	expect_eq "backup b's stored generation at the end" "$(generation_in b)" 0
else
	step "host 0: VMs a and b, protected by $backup_a and $backup_b"
	hag-vmm serve --mdev "$ua" --control /tmp/a.sock --iterations "$ITERATIONS_A" --progress 2000 \
		>/tmp/vm-a.out 2>/tmp/vm-a.err &
	vm_a=$!
	hag-vmm serve --mdev "$ub" --control /tmp/b.sock --iterations "$ITERATIONS_B" --progress 2000 \
		>/tmp/vm-b.out 2>/tmp/vm-b.err &
	vm_b=$!
	wait_for 30 test -S /tmp/a.sock || fail "VM a did not start: $(cat /tmp/vm-a.err)"
	wait_for 30 test -S /tmp/b.sock || fail "VM b did not start: $(cat /tmp/vm-b.err)"
	hagctl checkpoint --name a --vm /tmp/a.sock --backup "$backup_a" --interval 1s >/tmp/cp-a.out 2>/tmp/cp-a.err &
	cp_a=$!
	hagctl checkpoint --name b >/tmp/cp-b.out 2>/tmp/cp-b.err &
	cp_b=$!
	wait_for 120 grep -q '^epoch 3:' /tmp/cp-a.err || fail "a: no 3 epochs: $(cat /tmp/cp-a.err)"
	wait_for 120 grep -q '^epoch 3:' /tmp/cp-b.err || fail "b: no 3 epochs: $(cat /tmp/cp-b.err)"
	ls -l /run/hag/a /run/hag/b
	step "host 0: hagctl status names both protections"
	hagctl status >/tmp/status.txt || fail "hagctl status failed"
	cat /tmp/status.txt
	grep -q '^protection of VM a: vGPU [0-9]* protected' /tmp/status.txt || fail "status does not show VM a protected"
	grep -q '^protection of VM b: vGPU [0-9]* protected' /tmp/status.txt || fail "status does not show VM b protected"
	hagctl status --json >/tmp/status.json || fail "hagctl status --json failed"
	for vm in a b; do
		grep -q "\"vm\":\"$vm\"" /tmp/status.json || fail "hagctl status --json does not name VM $vm: $(cat /tmp/status.json)"
	done
	await_ready "$peer" 7300 120
	! grep -q '^PASS frames' /tmp/vm-a.out || fail "VM a finished before its loss (make ITERATIONS_A larger)"
	step "host 0: VM a's VMM and hagctl checkpoint killed"
	kill -KILL "$cp_a" "$vm_a"
	wait "$cp_a" "$vm_a" 2>/dev/null || true
	step "host 0: waiting for b to resynchronise with its restarted backup"
	# Two epochs acknowledged after the second synchronisation.
	wait_for 180 awk '/synchronising with the backup/ { n++; e = 0 } /^epoch / { if (n >= 2) e++ } END { exit !(e >= 2) }' /tmp/cp-b.err ||
		fail "b did not resync with its restarted backup: $(cat /tmp/cp-b.err)"
	hagctl job --name b --json | tee /tmp/job-b.json
	grep -q '"state":"protected"' /tmp/job-b.json || fail "hagctl job --json does not show b protected"
	step "host 0: hagctl abort --name b"
	hagctl abort --name b || fail "hagctl abort --name b failed"
	rc=0
	wait "$cp_b" || rc=$?
	cat /tmp/cp-b.err /tmp/cp-b.out
	expect_eq "hagctl checkpoint b's exit status" "$rc" 0
	grep -q '"outcome":"ended"' /tmp/cp-b.out || fail "b's protection did not end on hagctl abort"
	grep -q '"syncs":[2-9]' /tmp/cp-b.out || fail "the report counts no resync"
	# Seen as it must be: VM b may end (ITERATIONS_B is its longest run).
	vm_finish /tmp/b.sock
	rc=0
	wait "$vm_b" || rc=$?
	expect_eq "VM b's exit status" "$rc" 0
	grep -q "^PASS frames: [1-9][0-9]* iterations verified" /tmp/vm-b.out ||
		fail "VM b's workload did not verify on host 0, where it ran on unprotected"
fi
