# One trial of `qemu-tests/chaos --qemu` for the faults no scenario plays
# on a real VM: qemu_protect_once.sh (a QEMU/KVM guest with a hag vGPU on
# host 0 under `hagctl checkpoint --qmp`, the backup and the client on
# host 1) with FAULT=chaos, and CHAOS_FAULT played once epoch FAULT_EPOCH
# is acknowledged (applied, on host 1), FAULT_DELAY_MS later:
#   none                 nothing: the guest finishes on host 0
#   backup-restart       host 1's hagctl backup killed (SIGKILL) and
#                        started again 8 s later with its state directory:
#                        the primary holds its output, resynchronises and
#                        must not be fenced
#   backup-stop          host 1's hagctl backup stopped (SIGSTOP) for 8 s,
#                        past the failover timeout
#   flood                unauthenticated peers on the backup's port: plain
#                        TCP bytes and 24 idle connections; protection goes
#                        on (two more epochs acknowledged)
#   cut-all              every path between the hosts cut for 8 s (eth0 and
#                        eth1 down on host 0): the backup takes over, the
#                        primary is fenced when a path heals
#   kill-primary-hagctl  host 0's hagctl checkpoint killed (SIGKILL): its VM
#                        runs on muted, the backup takes over
# Each host prints what it saw for qemu-tests/chaos to judge with both
# hosts' logs (the acknowledged epochs are host 0's "[checkpoint] epoch N:"
# lines):
#   CHAOS-PRIMARY fault=F rc=N outcome=O acked=EPOCH plug=gone|left
#   CHAOS-FACTS fault=F takeover=EPOCH|none client=ok|broken pass=0|1|2 backup_rc=N refused=yes|no
# and fails only if the trial could not run; the invariants are the judge's.
FAULT=chaos
# The console, for during_backup's account (its own output goes to a file).
exec 3>&1
# 40 s of work; 80 s where the backup restarts or stops, so that the primary's full
# resynchronisation (about 20 s here) ends while the guest still runs.
seconds=40
case $CHAOS_FAULT in backup-restart | backup-stop) seconds=80 ;; esac
GUEST_ARGS=${GUEST_ARGS:-"--seconds=$seconds,--mib=8,--cpu-mib=8,--progress=1"}
CHAOS_SECONDS=8

# chaos_wait_applied: on host 1, until epoch FAULT_EPOCH is applied, then
# FAULT_DELAY_MS more.
chaos_wait_applied() {
	wait_for 600 grep -q "epoch ${FAULT_EPOCH:-4} applied" /tmp/backup.err || return 1
	usleep $((${FAULT_DELAY_MS:-0} * 1000))
}

case $CHAOS_FAULT in
backup-restart)
	during_backup() {
		chaos_wait_applied || return 0
		pid=$(pidof hagctl)
		step "host 1: chaos: hagctl backup (pid $pid) killed, restarted in $CHAOS_SECONDS s" >&3
		touch /tmp/backup.restarting
		kill -KILL "$pid"
		sleep "$CHAOS_SECONDS"
		touch /tmp/backup.restart
	}
	;;
backup-stop)
	during_backup() {
		chaos_wait_applied || return 0
		pid=$(pidof hagctl)
		step "host 1: chaos: hagctl backup (pid $pid) stopped for $CHAOS_SECONDS s" >&3
		kill -STOP "$pid"
		sleep "$CHAOS_SECONDS"
		kill -CONT "$pid"
		step "host 1: chaos: hagctl backup (pid $pid) continued" >&3
	}
	;;
flood | cut-all | kill-primary-hagctl)
	before_fault() {
		usleep $((${FAULT_DELAY_MS:-0} * 1000))
		step "host 0: chaos: $CHAOS_FAULT"
		case $CHAOS_FAULT in
		flood)
			printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 2 "$(host_ip 1)" 7200 >/dev/null 2>&1 || true
			for _ in $(seq 24); do
				sleep 5 | nc "$(host_ip 1)" 7200 >/dev/null 2>&1 &
			done
			n=$(grep -c '^epoch ' /tmp/cp.err)
			wait_for 120 sh -c "[ \$(grep -c '^epoch ' /tmp/cp.err) -ge $((n + 2)) ]" ||
				echo "chaos: no two epochs acknowledged after the flood"
			;;
		cut-all)
			ip link set eth0 down
			ip link set eth1 down
			sleep "$CHAOS_SECONDS"
			ip link set eth0 up
			ip link set eth1 up
			;;
		kill-primary-hagctl) kill -KILL "$cp" ;;
		esac
	}
	;;
none) ;;
*) fail "unknown chaos fault $CHAOS_FAULT" ;;
esac

check_primary() {
	plug=gone
	case $(in_root tc qdisc show dev eth1) in
	*plug*) plug=left ;;
	esac
	outcome=$(sed -n 's/.*"outcome":"\([a-z-]*\)".*/\1/p' /tmp/cp.out | tail -n 1)
	acked=$(sed -n 's/^epoch \([0-9]*\):.*/\1/p' /tmp/cp.err | tail -n 1)
	echo "CHAOS-PRIMARY fault=$CHAOS_FAULT rc=$1 outcome=${outcome:-none} acked=${acked:-0} plug=$plug"
}

check_backup() {
	tk=$(sed -n 's/.*taking over from epoch \([0-9]*\).*/\1/p' /tmp/backup.err | tail -n 1)
	# The takeover that happened is the last one begun: one given up
	# (the primary heard again) is said so.
	grep -q '"generation":1' /tmp/backup.out || tk=
	# After a takeover, the output of the epoch the backup resumed but the
	# primary never saw acknowledged (a partition, a killed hagctl) is
	# lost, never released: the one gap client_check allows a lost host.
	lost=
	[ -z "$tk" ] || lost=--host-lost
	client=ok
	# shellcheck disable=SC2086
	in_root python3 /hag/client_check.py $lost /tmp/client.log || client=broken
	pass=0
	grep -q 'HAG-GUEST-RESULT PASS' /tmp/client.log && pass=1
	grep -q 'HAG-GUEST-RESULT FAIL' /tmp/client.log && pass=2
	refused=no
	grep -q 'refused a connection from .*not authenticated' /tmp/backup.err &&
		grep -q 'refused a connection from .*under way already' /tmp/backup.err && refused=yes
	echo "CHAOS-FACTS fault=$CHAOS_FAULT takeover=${tk:-none} client=$client pass=$pass backup_rc=$1 refused=$refused"
}
. /hag/qemu_protect_once.sh
