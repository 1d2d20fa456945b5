# hosts: 2
# timeout: 900
# The randomized fault test's short form (issue 12; qemu-tests/chaos runs
# many trials, host losses included): three trials of a protected VM on
# one boot of two hosts (guest/ha_trial.sh), invariants only, no timings:
#   1. rogue peers on the backup's port (no key; plain TCP): refused and
#      logged, protection goes on;
#   2. the primary's hagctl stopped (SIGSTOP) past the failover timeout:
#      the backup takes over and the primary, continued, is fenced;
#   3. one fault drawn at random: cut one direction (the backup mute),
#      drop acknowledgements, cut the data link, cut every path, kill or
#      stop hagctl on either side (a killed backup is restarted).
# Each trial checks: what the outside saw (each host's released console
# lines) is one run's output, never contradicted; at most one copy printed
# a result; every acknowledged epoch survives a takeover; the workload
# verifies wherever it finishes, or the trial says why it was lost.
HA_ITERATIONS=10000
. /hag/ha_trial.sh
uuid=$(new_uuid)
peer=$(host_ip $((1 - HAG_HOST)))
load_hag
ha_key
mdev_create "$uuid"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
wait_for 60 ping -c 1 -W 1 "$(host_ip2 $((1 - HAG_HOST)))" || fail "second network unreachable"

# Trial 3's fault: drawn on host 0, told to host 1.
if [ "$HAG_HOST" = 0 ]; then
	set -- mute drop-acks cut-data cut-all kill-primary-hagctl kill-backup-hagctl stop-backup-hagctl
	n=$(($(od -An -N2 -tu2 /dev/urandom) % $#))
	shift "$n"
	drawn="$1 $(($(od -An -N1 -tu1 /dev/urandom) % 4))"
	echo "$drawn" >/tmp/drawn
	timeout 120 nc -l -p 7190 </tmp/drawn >/dev/null || fail "host 1 did not ask for trial 3's fault"
else
	drawn=""
	for _ in $(seq 120); do
		drawn=$(nc "$(host_ip 0)" 7190 </dev/null 2>/dev/null) && [ -n "$drawn" ] && break
		sleep 1
	done
	[ -n "$drawn" ] || fail "no fault drawn for trial 3"
fi
set -- $drawn
ha_trial 1 rogue 1 "$uuid"
ha_trial 2 stop-primary-hagctl 0 "$uuid"
ha_trial 3 "$1" "$2" "$uuid"

if [ "$HAG_HOST" = 0 ]; then
	step "results"
	cat /tmp/chaos-results
	[ "$(grep -c 'invariants=ok$' /tmp/chaos-results)" = 3 ] || fail "an invariant broke"
	grep -q '^CHAOS-RESULT trial=1 .*outcome=finished on host 0' /tmp/chaos-results ||
		fail "protection did not go on past the rogue peers"
	grep -q '^CHAOS-RESULT trial=2 .*outcome=taken over from epoch' /tmp/chaos-results ||
		fail "the stalled primary was not taken over"
fi
