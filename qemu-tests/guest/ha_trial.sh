# One trial of the randomized fault test (issue 12): sourced by scenario
# ha_faults and by the trials qemu-tests/chaos writes. Runs on both hosts:
# host 0 is the primary (a hag-vmm VM with the frames workload under
# hagctl checkpoint), host 1 the backup. After epoch 3 and AT more seconds
# one FAULT is played, then the trial runs to its end and host 0 checks
# the invariants from what the outside saw (each host's released console
# lines) and the hosts' logs, and prints one line
#   CHAOS-RESULT trial=N fault=F at=S outcome=O invariants=ok|broken:WHY
# Every line either host released is also echoed to the serial console as
#   [tN vmH] LINE      (and host 0's epochs as [tN cp] LINE)
# so that qemu-tests/chaos can check a trial whose host was lost.
#
# ha_trial TRIAL FAULT AT UUID   (UUID: this host's hag-sim mdev)
#
# Faults: none, rogue (a peer without the key, one speaking plain TCP and a
# flood of idle connections on the backup's port), kill-primary-hagctl, stop-primary-hagctl (SIGSTOP past
# the failover timeout), kill-backup-hagctl (then restarted: "restart the
# backup"), stop-backup-hagctl, cut-data (eth0), cut-all (eth0 and eth1),
# mute (the backup-to-primary direction: the backup sends nothing), drop-acks,
# kill-primary-host, kill-backup-host.
# (Runs under sh -e, as every scenario: failing commands whose failure is
# an answer are guarded.)
HA_ITERATIONS=${HA_ITERATIONS:-16000}
HA_FAULT_SECONDS=8

# Echoes FILE's lines to the console as they are written, tagged.
ha_stream() {
	tail -n +1 -f "$1" 2>/dev/null | while IFS= read -r l; do echo "[$2] $l"; done &
}

# Waits (at most $2 s) for process $1 to exit; returns 1 if it did not.
ha_wait_pid() {
	ha_w=0
	while kill -0 "$1" 2>/dev/null; do
		ha_w=$((ha_w + 1))
		[ "$ha_w" -le "$(($2 * 5))" ] || return 1
		sleep 0.2
	done
	wait "$1" 2>/dev/null || true
	return 0
}

# The iterations of the 'frames: iteration N' lines in FILE, in order.
ha_iterations() { sed -n 's/^frames: iteration \([0-9]*\)$/\1/p' "$1"; }

# What the outside saw of a VM's console FILE, as variables: ha_first and
# ha_last (iterations released, or empty), ha_increasing (yes/no), ha_pass
# (0 no result, 1 PASS, 2 FAIL).
ha_seen() {
	ha_first=$(ha_iterations "$1" | head -n 1)
	ha_last=$(ha_iterations "$1" | tail -n 1)
	ha_increasing=$(ha_iterations "$1" | awk 'NR > 1 && $1 <= p { bad = 1 } { p = $1 } END { print bad ? "no" : "yes" }')
	ha_pass=0
	grep -q "^PASS frames: $HA_ITERATIONS iterations verified" "$1" && ha_pass=1
	grep -q '^FAIL frames' "$1" && ha_pass=2
	return 0
}

ha_backup_start() {
	hagctl backup --listen "$(host_ip 1):$ha_port" --heartbeat-listen "$(host_ip2 1):$((ha_port + 1))" \
		--mdev "$ha_uuid" --control "$ha_dir/vm.sock" --failover-timeout 3 --status-dir "$ha_dir/run" --state-dir "$ha_dir/run" \
		--test-fault-file "$ha_dir/fault" --vmm-arg=--progress --vmm-arg=500 \
		>>"$ha_dir/backup.out" 2>>"$ha_dir/backup.err" &
	ha_b=$!
}

ha_trial() {
	ha_t=$1 ha_fault=$2 ha_at=$3 ha_uuid=$4
	ha_dir=/tmp/trial$ha_t
	ha_port=$((7200 + 10 * ha_t))
	ha_facts=$((ha_port + 5))
	rm -rf "$ha_dir"
	mkdir -p "$ha_dir/run"
	step "trial $ha_t: fault $ha_fault ${ha_at}s after epoch 3 (host $HAG_HOST)"
	if [ "$HAG_HOST" = 1 ]; then
		ha_trial_backup
	else
		ha_trial_primary
	fi
}

ha_trial_backup() {
	: >"$ha_dir/fault"
	: >"$ha_dir/backup.out"
	ha_backup_start
	ha_stream "$ha_dir/backup.out" "t$ha_t vm1"
	case $ha_fault in
	kill-backup-hagctl | stop-backup-hagctl | mute | drop-acks | kill-backup-host)
		wait_for 150 grep -q 'epoch 3 applied' "$ha_dir/backup.err" || echo "trial $ha_t: no epoch 3 here"
		sleep "$ha_at"
		echo "trial $ha_t: playing $ha_fault"
		case $ha_fault in
		kill-backup-hagctl)
			kill -9 "$ha_b"
			sleep "$HA_FAULT_SECONDS"
			echo "trial $ha_t: restarting the backup"
			ha_backup_start
			;;
		stop-backup-hagctl)
			kill -STOP "$ha_b"
			sleep "$HA_FAULT_SECONDS"
			kill -CONT "$ha_b"
			;;
		mute | drop-acks)
			echo "$ha_fault" >"$ha_dir/fault"
			sleep "$HA_FAULT_SECONDS"
			: >"$ha_dir/fault"
			;;
		kill-backup-host) lose_this_host ;;
		esac
		;;
	esac
	ha_wait_pid "$ha_b" 400 || {
		echo "trial $ha_t: the backup did not end; stopping it"
		kill -9 "$ha_b" 2>/dev/null || true
	}
	cat "$ha_dir/backup.err"
	# A VM a takeover started ends with its backup (PDEATHSIG); wait for it.
	sleep 1
	tk=$(sed -n 's/^takeover: generation [0-9]*, resumed from epoch \([0-9]*\) .*/\1/p' "$ha_dir/backup.out" | head -n 1)
	ha_seen "$ha_dir/backup.out"
	refused=no
	grep -q 'refused a connection from .*not authenticated' "$ha_dir/backup.err" &&
		grep -q 'refused a connection from .*under way already (the limit per address)' "$ha_dir/backup.err" &&
		refused=yes
	echo "takeover=${tk:-none} first=${ha_first:-none} increasing=$ha_increasing pass=$ha_pass refused=$refused" >"$ha_dir/facts"
	echo "CHAOS-FACTS trial=$ha_t $(cat "$ha_dir/facts")"
	# Host 0 checks the invariants; a lost host 0 leaves it to qemu-tests/chaos.
	[ "$ha_fault" = kill-primary-host ] ||
		timeout 300 nc -l -p "$ha_facts" <"$ha_dir/facts" >/dev/null || echo "trial $ha_t: host 0 never asked for the facts"
}

ha_trial_primary() {
	sock=$ha_dir/vm.sock
	hag-vmm serve --mdev "$ha_uuid" --control "$sock" --iterations "$HA_ITERATIONS" --progress 500 \
		>"$ha_dir/vm.out" 2>"$ha_dir/vm.err" &
	ha_vm=$!
	wait_for 30 test -S "$sock" || fail "VM did not start: $(cat "$ha_dir/vm.err")"
	: >"$ha_dir/cp.err"
	hagctl checkpoint --vm "$sock" --backup "$(host_ip 1):$ha_port" --heartbeat-addr "$(host_ip2 1):$((ha_port + 1))" \
		--interval 1s --failover-timeout 3 --status-dir "$ha_dir/run" --json \
		>"$ha_dir/cp.out" 2>>"$ha_dir/cp.err" &
	ha_cp=$!
	ha_stream "$ha_dir/vm.out" "t$ha_t vm0"
	ha_stream "$ha_dir/cp.err" "t$ha_t cp"
	lost="" leak=""
	wait_for 150 grep -q '^epoch 3:' "$ha_dir/cp.err" || lost="no epoch 3 (protection never started)"
	sleep "$ha_at"
	echo "trial $ha_t: playing $ha_fault"
	case $ha_fault in
	rogue)
		ha_rogue_key "$ha_dir/rogue.key"
		printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 2 "$(host_ip 1)" "$ha_port" >/dev/null 2>&1
		# (hagctl migrate needs the VM running: an epoch may have it paused.)
		for _ in 1 2 3 4 5; do
			hagctl migrate --vm "$sock" --to "$(host_ip 1):$ha_port" --key "$ha_dir/rogue.key" \
				--connect-timeout 2 >/dev/null 2>"$ha_dir/rogue.err" && leak="a peer without the key got through"
			grep -q 'not running' "$ha_dir/rogue.err" || break
			sleep 0.3
		done
		cat "$ha_dir/rogue.err"
		# A flood of connections that never speak: they wait in the
		# handshake pool (4 at once from one address, the rest refused at
		# once), are dropped 2 s after the accept, and never hold a session
		# slot, so protection goes on beside them.
		for _ in $(seq 24); do
			sleep 5 | nc "$(host_ip 1)" "$ha_port" >/dev/null 2>&1 &
		done
		# (busybox has no pgrep: the flood's nc are the only ones on host 0.)
		wait_for 30 sh -c '! pidof nc >/dev/null' || true
		;;
	kill-primary-hagctl) kill -9 "$ha_cp" ;;
	stop-primary-hagctl)
		kill -STOP "$ha_cp"
		sleep "$HA_FAULT_SECONDS"
		kill -CONT "$ha_cp"
		;;
	cut-data)
		ip link set eth0 down
		sleep "$HA_FAULT_SECONDS"
		ip link set eth0 up
		;;
	cut-all)
		ip link set eth0 down
		ip link set eth1 down
		sleep "$HA_FAULT_SECONDS"
		ip link set eth0 up
		ip link set eth1 up
		;;
	kill-primary-host) lose_this_host ;;
	esac
	# Bounded: a primary that cannot end (its backup is gone: output held,
	# no release on silence) is ended with SIGTERM, as an operator would.
	# (Its VM finished, muted, and 30 s later it still runs: that is the
	# case.)
	n=0
	while kill -0 "$ha_cp" 2>/dev/null && [ "$n" -lt 1200 ]; do
		if grep -q 'last step' "$ha_dir/vm.err"; then
			ha_wait_pid "$ha_cp" 30 || true
			break
		fi
		n=$((n + 1))
		sleep 0.2
	done
	if ! ha_wait_pid "$ha_cp" 0; then
		echo "trial $ha_t: hagctl checkpoint still running: SIGTERM"
		kill -TERM "$ha_cp" 2>/dev/null || true
		ha_wait_pid "$ha_cp" 30 || kill -9 "$ha_cp" 2>/dev/null || true
	fi
	# A VM whose controller is gone runs on muted: stopped by hand.
	if ! ha_wait_pid "$ha_vm" 20; then
		echo "trial $ha_t: the primary VM runs on muted: stopping it"
		kill -9 "$ha_vm" 2>/dev/null || true
		wait "$ha_vm" 2>/dev/null || true
	fi
	sleep 1
	outcome=$(sed -n 's/.*"outcome":"\([a-z-]*\)".*/\1/p' "$ha_dir/cp.out")
	acked=$(sed -n 's/^epoch \([0-9]*\):.*/\1/p' "$ha_dir/cp.err" | tail -n 1)
	ha_seen "$ha_dir/vm.out"
	last=$ha_last inc0=$ha_increasing pass0=$ha_pass
	facts=""
	if [ "$ha_fault" != kill-backup-host ]; then
		n=0
		while [ -z "$facts" ] && [ "$n" -lt 300 ]; do
			facts=$(nc "$(host_ip 1)" "$ha_facts" </dev/null 2>/dev/null || true)
			[ -n "$facts" ] || sleep 1
			n=$((n + 1))
		done
	fi
	echo "host 0: outcome=${outcome:-none} acked=${acked:-0} last=${last:-none} increasing=$inc0 pass=$pass0"
	echo "host 1: ${facts:-unknown}"
	tk=$(echo "$facts" | sed -n 's/.*takeover=\([0-9a-z]*\).*/\1/p')
	first=$(echo "$facts" | sed -n 's/.*first=\([0-9a-z]*\).*/\1/p')
	inc1=$(echo "$facts" | sed -n 's/.*increasing=\([a-z]*\).*/\1/p')
	pass1=$(echo "$facts" | sed -n 's/.*pass=\([0-9]\).*/\1/p')
	broken=""
	# (1) what the outside saw is one run's output, never contradicted.
	[ "$inc0" = yes ] && [ "${inc1:-yes}" = yes ] || broken="$broken released lines out of order;"
	if [ -n "$last" ] && [ -n "$first" ] && [ "$first" != none ] && [ "$last" -ge "$first" ]; then
		broken="$broken host 0 released iteration $last, host 1 resumed at $first;"
	fi
	# (2) at most one copy released a result.
	[ "$pass0" != 0 ] && [ "${pass1:-0}" != 0 ] && broken="$broken both hosts printed a result;"
	# (3) every acknowledged epoch survives a takeover.
	if [ -n "$tk" ] && [ "$tk" != none ] && [ "$tk" -lt "${acked:-0}" ]; then
		broken="$broken takeover from epoch $tk, but epoch $acked was acknowledged;"
	fi
	# (4) the workload verifies wherever it finishes, or the trial says why
	# it was lost.
	[ "$pass0" = 2 ] || [ "${pass1:-0}" = 2 ] && broken="$broken the workload failed its check;"
	if [ "$pass0" = 1 ]; then
		result="finished on host 0"
	elif [ "${pass1:-0}" = 1 ]; then
		result="taken over from epoch $tk, finished on host 1"
	elif [ -n "$lost" ]; then
		result="lost: $lost"
	elif [ "$ha_fault" = kill-backup-host ]; then
		result="lost: the backup host is gone; host 0's output held (never released on silence), VM ${outcome:-stopped}"
	else
		result="lost: no host finished (host 0 ${outcome:-gone}, host 1 ${facts:-silent})"
	fi
	[ -z "$leak" ] || broken="$broken $leak;"
	# Rogue peers are refused and logged.
	if [ "$ha_fault" = rogue ] && [ -z "$lost" ] && ! echo "$facts" | grep -q 'refused=yes'; then
		broken="$broken the backup did not log refusing the rogue peers;"
	fi
	echo "CHAOS-RESULT trial=$ha_t fault=$ha_fault at=$ha_at outcome=$result invariants=${broken:+broken:}${broken:-ok}" |
		tee -a /tmp/chaos-results
}
