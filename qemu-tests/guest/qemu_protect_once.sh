# A real VM (QEMU/KVM, Linux guest, hag-sim vGPU) on host 0 protected by
# continuous checkpoints to host 1: `hagctl checkpoint --qmp` copies its RAM
# from its shared file backend (CPU dirty pages from soft-dirty bits, GPU
# ones from hag's log) and its device state through QEMU's own stream
# (x-ignore-shared); `hagctl backup -- QEMU ARGS` stands by and, at
# takeover, starts QEMU on the standby image and loads the last acknowledged
# epoch into a fresh vGPU. The guest sends its progress and result over UDP
# to a client on host 1 (203.0.113.1, on the VMs' network br0); host 0's
# copy of those packets is held by sch_plug on eth1 until its epoch is
# acknowledged. Shared by the qemu_checkpoint_* and qemu_failover_*
# scenarios. Set by the caller:
#   FAULT        gpu-hang | qemu-crash | host-loss | none (the guest finishes
#                on host 0) | chaos (before_fault plays a fault of
#                qemu_chaos_trial.sh's; then host 0 waits for the guest's
#                end or for protection's)
#   GUEST_ARGS   hag-guest's arguments, commas for spaces
#   CP_ARGS      more hagctl checkpoint arguments (optional)
#   CP_INTERVAL  hagctl checkpoint's --interval (1s unless set)
#   BACKUP_ARGS  more hagctl backup arguments (optional)
#   DISK=1       the VM has a 64 MiB qcow2 disk (vda) that hag-guest commits
#                numbered records to (--disk), replicated to host 1's
#                /tmp/hag-replicas/vda.raw, which its standby QEMU opens
#   DEBIAN=1     the VM is the Debian guest (a `# debian: yes` scenario),
#                512 MiB: its root disk (vda, a qcow2 overlay on the cached
#                image) is replicated to host 1's /tmp/hag-replicas/vda.raw;
#                hag-guest runs as its systemd service and commits records
#                to a file on that disk; a client on host 1 commits rows to
#                its PostgreSQL (db_client.py, log /tmp/db.log). On host 1,
#                once the taken-over guest has reported 20 s of progress,
#                debian_checks asks the database and shuts the guest down
#                (which stops hag-guest: it verifies and reports); the
#                scenario's check_backup then has /tmp/db.verdict and can
#                call replica_fsck. Host 1's replica starts as a raw copy
#                of the image the VM's disk is an overlay on (a template
#                both hosts hold, as a cloud's base images are): the first
#                synchronisation sends only the chunks the VM changed.
#   FAULT_EPOCH  the fault comes once this epoch is acknowledged (4 unless
#                set)
#   FAULT_DELAY_MS  host-loss: this many ms after that acknowledgement
#                (random in 0-999 unless set)
#   CONSOLE=1    the VM's console is a socket chardev that hagctl checkpoint
#                holds too (--console), released to /tmp/vm.console.held;
#                QEMU logs all of it, unheld, to /tmp/vm.console
#   during_backup   if defined: run on host 1 alongside hagctl backup; it
#                   may kill the backup to have it restarted: first
#                   /tmp/backup.restarting, then the kill, then
#                   /tmp/backup.restart when it should start again
#   guest_may_finish  if defined: run on host 1 every second; once it
#                   succeeds the guest is asked to end its run (verified as
#                   at its end; guest_finish): its --seconds is then only
#                   an upper bound
#   during_primary  if defined: run on host 0 alongside hagctl checkpoint
#                   (its output in /tmp/during.out)
#   before_fault    if defined: run on host 0 once epoch FAULT_EPOCH is
#                   acknowledged, before the fault
#   check_backup BACKUP-STATUS    host 1's verdict (/tmp/backup.*,
#                                 /tmp/vm.console, /tmp/client.log)
#   check_primary CHECKPOINT-STATUS  host 0's (/tmp/cp.*, /tmp/vm.console)
# takeover_verified STATUS REASON: host 1's verdict after a takeover: the
# backup ended well, took over at generation 1 for a reason matching REASON
# (a grep pattern), the guest verified there, and the client's view is one
# run, never contradicted. (The Debian guest's verdict is read from the
# client's view alone: its serial console stays silent after a takeover,
# see docs/ha.md.)
takeover_verified() {
	expect_eq "hagctl backup exit status" "$1" 0
	grep -q "\"reason\":\"$2" /tmp/backup.out || fail "no takeover for: $2"
	grep -q '"generation":1' /tmp/backup.out || fail "the takeover did not raise the generation"
	if [ "${DEBIAN:-0}" != 1 ]; then
		vm_result vm 600
		grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console || { vm_show vm; fail "the guest did not verify on host 1"; }
	fi
	# A takeover may lose, never release, the output of one epoch: the
	# one the backup resumed but the primary never saw acknowledged (its
	# host lost, or the hang or crash came while that epoch's ack was on
	# its way). client_check's --host-lost allows that one gap, at the
	# takeover only.
	lost=--host-lost
	# shellcheck disable=SC2086
	in_root python3 /hag/client_check.py --require-pass $lost /tmp/client.log || fail "the client's view"
}
# handed_over STATUS: host 0's verdict after it handed the VM over: the
# backup confirmed generation 1, and the output gate is gone from eth1.
handed_over() {
	expect_eq "hagctl checkpoint exit status" "$1" 0
	grep -q '"outcome":"handed-over"' /tmp/cp.out || fail "the checkpoint did not hand over"
	grep -q 'at generation 1' /tmp/cp.out || fail "the backup did not confirm generation 1"
	plug_gone
}
# plug_gone: hagctl checkpoint took its sch_plug off eth1 (the VM stopped
# for good: what it held dropped, never sent).
# debian_checks: on host 1, the Debian guest's hag-guest has ended: the
# client stops, db_client.py check asks the database (every acknowledged
# commit present, no restart, no crash recovery), pg_amcheck checks its
# tables and indexes, and the guest is shut down cleanly (asked through
# PostgreSQL, scripts/build-guest-rootfs.sh): the replica must then be a
# clean filesystem. Each step's exit
# status goes to /tmp/db.verdict as "STEP STATUS".
debian_checks() {
	local rc
	[ -n "$db_client" ] || echo "the database client never started (the guest never reported)"
	kill -TERM "$db_client" 2>/dev/null || true
	wait "$db_client" 2>/dev/null || true
	sed 's/^/[db client] /' /tmp/db.err
	: >/tmp/db.verdict
	rc=0
	step "host 1: the database's verdict"
	in_root python3 /hag/db_client.py check --host "$VM_ADDR" --log /tmp/db.log || rc=$?
	echo "db-check $rc" >>/tmp/db.verdict
	# Those acknowledged while the VM was protected: their replies were
	# released by an epoch's acknowledgement (this host's clock, to 1 s).
	echo "db: $(in_root python3 /hag/db_client.py latency --log /tmp/db.log --from "${protected_at:-0}" \
		--to "${taken_at:-inf}" | cut -d' ' -f1) commits acknowledged while protected (from epoch 1 applied at ${protected_at:--} s to the takeover at ${taken_at:--} s), $(in_root python3 /hag/db_client.py latency \
		--log /tmp/db.log --from "${taken_at:-inf}" --to inf | cut -d' ' -f1) after the takeover; the last: $(grep '^acked' /tmp/db.log | tail -1)"
	rc=0
	step "host 1: pg_amcheck of the guest's database"
	timeout 600 chroot "$HOST_ROOT" /usr/lib/postgresql/15/bin/pg_amcheck -h "$VM_ADDR" -U postgres \
		-d postgres --install-missing --heapallindexed </dev/null || rc=$?
	echo "pg_amcheck: exit status $rc"
	echo "pg_amcheck $rc" >>/tmp/db.verdict
	rc=0
	step "host 1: the guest shut down (asked over the network, by PostgreSQL's superuser; hag-guest verifies as it stops)"
	in_root psql -h "$VM_ADDR" -U postgres -q -c "COPY (SELECT 1) TO '/var/lib/postgresql/hag-shutdown'" || rc=$?
	guest_went_down || rc=1
	echo "halt $rc" >>/tmp/db.verdict
	cat /tmp/db.verdict
}
# guest_went_down: waits (up to 300 s) until the Debian guest has shut
# down: PostgreSQL no longer answers and the replica the VM runs on has
# not changed for 15 s (the test kernel cannot power the VM off, and after
# a takeover the guest's serial console says nothing: docs/ha.md; an ACPI
# power button press, QMP system_powerdown, did not shut it down there
# either).
guest_went_down() {
	local i=0 quiet=0 last=none now
	while [ "$i" -lt 300 ]; do
		now=$(in_root stat -c %y /tmp/hag-replicas/vda.raw)
		if [ "$now" = "$last" ] && ! in_root /usr/lib/postgresql/15/bin/pg_isready -q -h "$VM_ADDR" -t 2; then
			quiet=$((quiet + 1))
			[ "$quiet" -lt 15 ] || { echo "the guest is down: PostgreSQL gone, its disk last written at $now"; return 0; }
		else
			quiet=0 last=$now
		fi
		i=$((i + 1))
		sleep 1
	done
	echo "the guest did not shut down within 300 s"
	return 1
}
# replica_fsck: e2fsck -fn of host 1's replica of the Debian guest's disk
# (after its QEMU ended); its exit status.
replica_fsck() {
	local rc=0
	in_root e2fsck -fn /tmp/hag-replicas/vda.raw >/tmp/fsck.out 2>&1 || rc=$?
	# Reworded: the harness would take e2fsck's "WARNING:" for this
	# host's kernel's.
	guest_oops_quoted </tmp/fsck.out
	echo "e2fsck -fn of the replica: exit status $rc"
	return "$rc"
}
# db_verdict STEP: STEP's exit status in /tmp/db.verdict (empty if it did
# not run).
db_verdict() { sed -n "s/^$1 //p" /tmp/db.verdict 2>/dev/null; }
plug_gone() {
	qdiscs=$(in_root tc qdisc show dev eth1) || fail "tc cannot show eth1's qdiscs"
	case $qdiscs in
	*plug*) fail "the output gate is still on eth1: $qdiscs" ;;
	esac
}
CLIENT=$GUEST_CLIENT
VM_NET=1
VM_ADDR=203.0.113.50
VM_APPEND=$GUEST_NET_WORDS
GUEST_ARGS="$GUEST_ARGS,$GUEST_REPORT"
if [ "${CONSOLE:-0}" = 1 ]; then
	VM_CONSOLE_SOCKET=1
	CP_ARGS="${CP_ARGS:-} --console /tmp/vm.console.sock --console-log /tmp/vm.console.held"
fi
if [ "${DEBIAN:-0}" = 1 ]; then
	VM_DEBIAN=1 VM_MIB=512 DISK=1
	GUEST_ARGS="$GUEST_ARGS,--disk,/var/lib/hag-guest-records"
elif [ "${DISK:-0}" = 1 ]; then
	GUEST_ARGS="$GUEST_ARGS,--disk,/dev/vda"
fi
if [ "${DISK:-0}" = 1 ]; then
	if [ "$HAG_HOST" = 0 ]; then
		VM_DISK=/tmp/vm-disk.qcow2
		CP_ARGS="${CP_ARGS:-} --delta-dir /tmp/hag-deltas"
	else
		VM_DISK=/tmp/hag-replicas/vda.raw VM_DISK_FORMAT=raw
		BACKUP_ARGS="${BACKUP_ARGS:-} --replica-dir /tmp/hag-replicas"
	fi
fi
backup=$(host_ip 1):7200
peer=$(host_ip $((1 - HAG_HOST)))
uuid=$(new_uuid)
if [ "$HAG_HOST" = 0 ] && [ "$FAULT" = gpu-hang ]; then
	load_hag allow_hang_injection=1
else
	load_hag
fi
ha_key
host_root_up
mdev_create "$uuid"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

if [ "$HAG_HOST" = 1 ]; then
	vm_net_up "$CLIENT/24"
	step "host 1: client on $CLIENT:$GUEST_CLIENT_PORT, backup on $backup (standby QEMU with vGPU $uuid)"
	guest_client_up
	db_client=
	: >/tmp/db.log
	: >/tmp/db.err
	# db_client_start: the Debian guest's database client, started once
	# the guest's hag-guest reports (the guest has booted), not while it
	# boots: eight workers committing as fast as PostgreSQL answers held
	# the guest's one vCPU so that hag-guest took 70 s more to start.
	# Eight connections: under protection each commits once every three
	# epochs (BEGIN, INSERT, COMMIT, each reply held for one), so one
	# alone would make a handful of commits while protected.
	db_client_start() {
		# chroot itself, not in_root: $! must be the client's own pid.
		chroot "$HOST_ROOT" python3 /hag/db_client.py commit --workers 8 --host "$VM_ADDR" \
			--log /tmp/db.log >/tmp/db.err 2>&1 &
		db_client=$!
	}
	eval "set -- $(vm_words vm "$uuid" "$GUEST_ARGS")"
	# Live in the host's log: the backup's account, and the standby VM's
	# console once a takeover started it.
	: >/tmp/backup.err
	tail -f /tmp/backup.err 2>/dev/null | sed 's/^/[backup] /' &
	live=$!
	# GUEST_MAY_CRASH=1: the standby guest's kernel trouble is expected.
	if [ "${GUEST_MAY_CRASH:-0}" = 1 ]; then
		tail -F /tmp/vm.console 2>/dev/null | guest_oops_quoted | sed 's/^/[standby VM] /' &
	else
		tail -F /tmp/vm.console 2>/dev/null | sed 's/^/[standby VM] /' &
	fi
	live="$live $!"
	if command -v during_backup >/dev/null; then
		during_backup >/tmp/during.out 2>&1 &
	fi
	if [ "${DEBIAN:-0}" = 1 ]; then
		mkdir -p /tmp/hag-replicas
		in_root qemu-img convert -O raw "$(debian_image)" /tmp/hag-replicas/vda.raw ||
			fail "cannot copy the template into the replica"
		step "host 1: the replica starts as a copy of the template"
	fi
	# backup_start QEMU-WORDS...: a restarted backup's account follows its
	# predecessor's.
	backup_start() {
		# shellcheck disable=SC2086
		hagctl backup --listen "$backup" --failover-timeout 3 --json --status-dir /tmp/hag-backup --state-dir /tmp/hag-backup ${BACKUP_ARGS:-} \
			-- chroot "$HOST_ROOT" "$@" >>/tmp/backup.out 2>>/tmp/backup.err &
		bk=$!
	}
	: >/tmp/backup.out
	backup_start "$@"
	# The guest halts when its work ends (the test kernel cannot power
	# off): then its QEMU is ended with SIGTERM, as an operator would, and
	# the backup must end with it.
	n=0 quiet=0 size=0 since= protected_at= taken_at=
	while kill -0 "$bk" 2>/dev/null || [ -e /tmp/backup.restarting ]; do
		n=$((n + 1))
		# A backup killed to be restarted (during_backup made
		# /tmp/backup.restarting, then /tmp/backup.restart): the same
		# command line again, its state directory kept.
		if [ -e /tmp/backup.restart ]; then
			wait "$bk" 2>/dev/null || true
			rm -f /tmp/backup.restart /tmp/backup.restarting
			step "host 1: hagctl backup restarted"
			backup_start "$@"
		fi
		# A taken-over guest that prints and reports nothing for 60 s (it
		# does every second while it runs; one resumed from a broken image
		# may hang) is ended too, as is one that never ends. Its kernel's
		# lines do not count: one resumed from a broken image may print
		# a network watchdog's complaint every 5 s for ever.
		now=$( { grep -v '^\[ *[0-9]*\.[0-9]*\]' /tmp/vm.console 2>/dev/null; cat /tmp/client.log 2>/dev/null; } | wc -c)
		if [ "$now" = "$size" ] && grep -q 'takeover: QEMU (pid' /tmp/backup.err; then
			quiet=$((quiet + 1))
		else
			quiet=0 size=$now
		fi
		# The Debian guest is checked once it has run 20 s after the
		# takeover (reported progress), or once its workload ended; the
		# other guest is asked to end its run (verified as at its end)
		# once it has run 10 s after the takeover: its --seconds is what
		# it may need before the fault comes.
		if [ -z "$since" ] && grep -q 'takeover: generation' /tmp/backup.err; then
			since=$(wc -l </tmp/client.log)
		fi
		if [ "${DEBIAN:-0}" != 1 ] && [ -n "$since" ] && [ ! -e /tmp/guest-finish ] &&
			[ "$(wc -l </tmp/client.log)" -ge $((since + 10)) ]; then
			echo "the guest has run 10 s after the takeover"
			guest_finish
		fi
		if [ ! -e /tmp/guest-finish ] && command -v guest_may_finish >/dev/null && guest_may_finish; then
			guest_finish
		fi
		[ "${DEBIAN:-0}" != 1 ] || [ -n "$db_client" ] || [ ! -s /tmp/client.log ] || db_client_start
		[ -n "$protected_at" ] || ! grep -q 'epoch 1 applied' /tmp/backup.err || protected_at=$(up)
		[ -n "$taken_at" ] || ! grep -q 'taking over from epoch' /tmp/backup.err || taken_at=$(up)
		# A guest whose kernel died or hung where that may happen
		# (GUEST_MAY_CRASH) has shown what the scenario waits for once its
		# report is out, or once it has been silent for 20 s.
		if grep -q HAG-GUEST-EXIT /tmp/vm.console 2>/dev/null || [ "$quiet" -gt 60 ] || [ "$n" -gt 700 ] ||
			{ [ "${GUEST_MAY_CRASH:-0}" = 1 ] && [ "$quiet" -gt 20 ]; } ||
			{ [ "${GUEST_MAY_CRASH:-0}" = 1 ] && [ "$quiet" -gt 5 ] &&
				grep -q 'BUG:\|Oops\|Kernel panic' /tmp/vm.console 2>/dev/null; } ||
			{ [ "${DEBIAN:-0}" = 1 ] && grep -q HAG-GUEST-RESULT /tmp/client.log; } ||
			{ [ "${DEBIAN:-0}" = 1 ] && [ -n "$since" ] && [ "$(wc -l </tmp/client.log)" -ge $((since + 20)) ]; }; then
			[ "${DEBIAN:-0}" != 1 ] || debian_checks
			qemu=$(sed -n 's/.*takeover: QEMU (pid \([0-9]*\)).*/\1/p' /tmp/backup.err)
			[ -z "$qemu" ] || kill -TERM "$qemu" 2>/dev/null || true
			wait_for 30 sh -c "! kill -0 $bk 2>/dev/null" || {
				echo "hagctl backup still runs 30 s after its VM ended:"
				for t in /proc/"$bk"/task/*; do echo "$t $(cat "$t/comm") $(cat "$t/wchan")"; done
				kill "$bk"
			}
			break
		fi
		sleep 1
	done
	rc=0
	wait "$bk" || rc=$?
	# shellcheck disable=SC2086
	kill $live 2>/dev/null || true
	# The live copy above may miss the last lines (tail -f is killed).
	echo "--- hagctl backup's last stderr lines:"
	tail -n 12 /tmp/backup.err
	cat /tmp/backup.out
	for f in /tmp/hag-backup/*.log; do
		[ -s "$f" ] && { echo "--- $f:"; cat "$f"; }
	done
	# The client hears the guest's last packets shortly after it ends.
	sleep 2
	kill "$guest_client" 2>/dev/null || true
	echo "--- what the client saw:"
	cat /tmp/client.log
	check_backup "$rc"
else
	vm_net_up
	step "host 0: VM with hag-guest on vGPU $uuid, RAM in a shared file"
	if [ "${DEBIAN:-0}" = 1 ]; then
		debian_disk "$VM_DISK"
	elif [ -n "${VM_DISK:-}" ]; then
		in_root qemu-img create -q -f qcow2 "$VM_DISK" 64M || fail "cannot make the VM's disk"
	fi
	VM_SHARED_RAM=1 vm_start vm "$uuid" "$GUEST_ARGS"
	vm_wait_console vm 600 HAG-GUEST-READY
	echo "QEMU pid $(cat /tmp/vm.pid)"
	step "host 0: hagctl checkpoint --qmp to $backup, output held on eth1"
	# shellcheck disable=SC2086
	hagctl checkpoint --qmp /tmp/vm.qmp --backup "$backup" --plug eth1 --interval "${CP_INTERVAL:-1s}" \
		--json ${CP_ARGS:-} >/tmp/cp.out 2>/tmp/cp.err &
	cp=$!
	# Live in the host's log: a lost host prints nothing at its end.
	tail -f /tmp/cp.err 2>/dev/null | sed 's/^/[checkpoint] /' &
	live=$!
	if command -v during_primary >/dev/null; then
		during_primary >/tmp/during.out 2>&1 &
		during=$!
	fi
	wait_for 300 grep -q "^epoch ${FAULT_EPOCH:-4}:" /tmp/cp.err || fail "no ${FAULT_EPOCH:-4} epochs: $(cat /tmp/cp.err)"
	hagctl status
	if command -v before_fault >/dev/null; then
		before_fault
	fi
	case "$FAULT" in
	gpu-hang)
		step "host 0: inject a GPU hang"
		hagctl inject-hang --mdev "$uuid"
		;;
	qemu-crash)
		set -- KILL SEGV
		[ $(($(od -An -N1 -tu1 /dev/urandom) % 2)) = 0 ] || shift
		step "host 0: QEMU (pid $(cat /tmp/vm.pid)) killed with SIG$1"
		kill -"$1" "$(cat /tmp/vm.pid)"
		;;
	host-loss)
		# At a random point of an epoch interval (or FAULT_DELAY_MS after
		# the epoch's acknowledgement: qemu-tests/chaos draws it).
		ms=${FAULT_DELAY_MS:-$(($(od -An -N2 -tu2 /dev/urandom) % 1000))}
		step "host 0: lost ${ms} ms after epoch ${FAULT_EPOCH:-4} was acknowledged"
		usleep $((ms * 1000))
		lose_this_host
		;;
	esac
	if [ "$FAULT" = chaos ]; then
		# before_fault played a fault (qemu_chaos_trial.sh): the guest
		# halts at its end, or protection ended first (the primary fenced
		# or stopped: its VM never goes on). A hagctl checkpoint that was
		# killed ends nothing: its VM runs on muted to its end, or stays
		# paused for good if it was killed during an epoch's pause.
		# (A killed hagctl is a zombie until waited for.)
		cp_gone() { [ ! -e "/proc/$cp" ] || grep -q ') Z' "/proc/$cp/stat"; }
		chaos_primary_done() {
			grep -q HAG-GUEST-EXIT /tmp/vm.console || grep -q '"outcome"' /tmp/cp.out && return 0
			cp_gone && [ "$(qmp_status vm)" = paused ]
		}
		wait_for 900 chaos_primary_done ||
			echo "host 0: neither did the guest end nor hagctl checkpoint, in 900 s"
		if cp_gone && [ "$(qmp_status vm)" = paused ]; then
			echo "host 0: the VM stays paused (hagctl checkpoint was killed during an epoch's pause)"
			kill -TERM "$(cat /tmp/vm.pid)" 2>/dev/null || true
		fi
		! grep -q HAG-GUEST-EXIT /tmp/vm.console || kill -TERM "$(cat /tmp/vm.pid)" 2>/dev/null || true
	fi
	if [ "$FAULT" = none ]; then
		# The guest halts at its end; its QEMU is ended as an operator
		# would, and protection ends with it.
		vm_wait_console vm 600 HAG-GUEST-EXIT
		if [ "${CONSOLE:-0}" = 1 ]; then
			# Held: it comes out once its epoch is acknowledged.
			wait_for 60 grep -q HAG-GUEST-EXIT /tmp/vm.console.held ||
				fail "the guest's last console lines were never released: $(tail -3 /tmp/vm.console.held)"
		fi
		kill -TERM "$(cat /tmp/vm.pid)"
	fi
	rc=0
	wait "$cp" || rc=$?
	[ -z "${during:-}" ] || kill "$during" 2>/dev/null || true
	kill "$live" 2>/dev/null || true
	echo "--- hagctl checkpoint's last stderr lines:"
	tail -n 12 /tmp/cp.err
	cat /tmp/cp.out
	vm_show vm
	check_primary "$rc"
fi
