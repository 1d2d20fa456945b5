# hosts: 2
# timeout: 900
# vms: yes
# An end of protection that arrives while the backup takes over must not
# be confirmed: the backup is made to decide (host 0's hagctl checkpoint
# stopped with SIGSTOP: silent past the failover timeout), its takeover
# held by a test fault once its QEMU is started and loaded, before the
# fence; then host 0's hagctl checkpoint gets SIGTERM (and SIGCONT) and
# sends ABORT. The backup refuses to confirm it (it takes over), so the
# primary stops its VM with its output held and ends vm-stopped; only then
# is the takeover let go. Exactly one VM runs: host 0's QEMU is gone before
# host 1's resumes, the guest verifies on host 1, and the client's view is
# one run, never contradicted.
FAULT=abort-during-takeover
GUEST_ARGS="--seconds=100,--mib=8,--cpu-mib=8,--progress=1"
BACKUP_ARGS="--test-fault-file /tmp/fault"
# Epochs every 6 s (each takes 1-3 s here): the primary is stopped between
# two, so that on waking it handles the SIGTERM at once. Stopped within an
# epoch, it would wake to an epoch the backup (taking over) never
# acknowledges, lose the link, and send its ABORT nowhere; the backup,
# hearing it, would rightly give that takeover up and take over once it
# is silent again, and this scenario would test nothing.
CP_INTERVAL=6s
[ "$HAG_HOST" = 1 ] && echo hold-takeover >/tmp/fault
host0=$(host_ip 0)
host1=$(host_ip 1)
during_backup() {
	wait_for 600 grep -q 'TEST: the takeover holds before the fence' /tmp/backup.err ||
		fail "the backup never took over"
	# Host 0 learns that the takeover is under way, ends its primary, and
	# says when its VM is gone.
	await_ready "$host0" 7501
	signal_ready 7502
	echo none >/tmp/fault
}
before_fault() {
	qemu=$(cat /tmp/vm.pid)
	n=$(grep -c '^epoch ' /tmp/cp.err)
	wait_for 60 sh -c "[ \$(grep -c '^epoch ' /tmp/cp.err) -gt $n ]" || fail "no epoch after epoch 4"
	step "host 0: hagctl checkpoint stopped (SIGSTOP) after epoch $((n + 1)): the backup hears nothing from it"
	kill -STOP "$cp"
	signal_ready 7501
	step "host 0: the backup takes over; SIGTERM (and SIGCONT) to hagctl checkpoint"
	kill -TERM "$cp"
	kill -CONT "$cp"
	wait_for 120 grep -q '"outcome"' /tmp/cp.out || fail "hagctl checkpoint did not end after SIGTERM"
	# Gone, or a zombie that init has not reaped yet.
	wait_for 30 sh -c "[ ! -e /proc/$qemu ] || grep -q '^State:[[:space:]]*Z' /proc/$qemu/status" ||
		fail "host 0's VM (QEMU pid $qemu) still runs while host 1 takes over"
	echo "host 0's VM (QEMU pid $qemu) is gone; the takeover may go on"
	await_ready "$host1" 7502
}
check_primary() {
	grep -q '"outcome":"vm-stopped"' /tmp/cp.out ||
		fail "hagctl checkpoint did not end vm-stopped (its ABORT must not be confirmed)"
	plug_gone
}
check_backup() {
	grep -q 'while this backup takes over: not confirmed' /tmp/backup.err ||
		fail "the backup did not refuse the primary's ABORT during its takeover"
	takeover_verified "$1" 'the primary was silent for'
}
. /hag/qemu_protect_once.sh
