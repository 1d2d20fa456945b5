# hosts: 2
# timeout: 1200
# Benchmark (not a test scenario: qemu-tests/bench-checkpoint runs it, with
# RUNS, ITERATIONS, PROGRESS, INTERVALS and BW_MIB set in front of this
# text). First the link bandwidth: host 0 sends BW_MIB MiB of random bytes to
# host 1 with busybox nc, timed on host 0 (twice; the faster counts). Then,
# RUNS times per mode (modes interleaved: none, 2s, 1s, none, ...), a fresh
# frames VM runs ITERATIONS iterations on host 0: mode "none" unprotected,
# and one mode per interval in INTERVALS (e.g. "2s 1s") protected by hagctl checkpoint --interval to a hagctl backup on
# host 1 (a fresh backup and mdev per run). Every VM must finish with PASS
# on host 0 and every protection must end "finished" without a takeover.
# host 0 prints, for the script to read:
#   BENCH-BW bytes centiseconds
#   BENCH-VM mode run <hag-vmm serve stderr timing line>   (iteration N at T s,
#       last step (iteration N) at T s; T since the VM loop started)
#   BENCH-EPOCH mode run uptime_cs <hagctl checkpoint stderr epoch line>
#   BENCH-CP mode run {hagctl checkpoint --json report}
: "${RUNS:=2}"
: "${ITERATIONS:=30000}"
: "${PROGRESS:=2000}"
: "${INTERVALS:=2s 1s}"
: "${BW_MIB:=4}"
load_hag
ha_key
peer=$(host_ip $((1 - HAG_HOST)))
me=$(host_ip "$HAG_HOST")
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
now_cs() { cut -d' ' -f1 /proc/uptime | tr -d .; }
. /hag/bandwidth.sh
measure_bandwidth "$BW_MIB" BENCH-BW
stamp() { while IFS= read -r l; do echo "$(now_cs) $l"; done; }

if [ "$HAG_HOST" = 1 ]; then
	k=0
	for run in $(seq "$RUNS"); do
		for mode in $INTERVALS; do
			k=$((k + 1))
			uuid=$(new_uuid)
			mdev_create "$uuid"
			rc=0
			hagctl backup --listen "$me:$((7300 + k))" --mdev "$uuid" --control "/tmp/bk$k.sock" \
				--failover-timeout 10 >/tmp/backup$k.out 2>/tmp/backup$k.err || rc=$?
			expect_eq "backup $k ($mode) exit status" "$rc" 0
			! grep -q takeover "/tmp/backup$k.out" || fail "backup $k ($mode) took over: $(cat /tmp/backup$k.out)"
			grep -q 'protection ends: finished' "/tmp/backup$k.err" ||
				fail "backup $k ($mode): protection did not end cleanly: $(cat /tmp/backup$k.err)"
			echo "backup $k ($mode): protection ended, VM finished on host 0"
			mdev_remove "$uuid"
		done
	done
else
	k=0
	for run in $(seq "$RUNS"); do
		for mode in none $INTERVALS; do
			uuid=$(new_uuid)
			mdev_create "$uuid"
			sock=/tmp/vm-$mode-$run.sock
			out=/tmp/vm-$mode-$run
			hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" --progress "$PROGRESS" \
				>"$out.out" 2>"$out.err" &
			vm=$!
			wait_for 30 test -S "$sock" || fail "VM $mode/$run did not start: $(cat "$out.err")"
			if [ "$mode" != none ]; then
				k=$((k + 1))
				cp=/tmp/cp-$mode-$run
				# stderr (the epoch lines) is stamped with the uptime as it comes.
				{
					rc=0
					hagctl checkpoint --vm "$sock" --backup "$peer:$((7300 + k))" --interval "$mode" \
						--failover-timeout 10 --connect-timeout 120 --json || rc=$?
					echo "$rc" >"$cp.rc"
				} 2>&1 >"$cp.out" | stamp >"$cp.err"
				expect_eq "hagctl checkpoint $mode/$run exit status" "$(cat "$cp.rc")" 0
				grep -q '"outcome":"finished"' "$cp.out" ||
					fail "protection $mode/$run did not end with the VM finishing: $(cat "$cp.err" "$cp.out")"
				grep '^[0-9]* epoch [0-9]*:' "$cp.err" | sed "s/^/BENCH-EPOCH $mode $run /"
				echo "BENCH-CP $mode $run $(cat "$cp.out")"
			fi
			rc=0
			wait "$vm" || rc=$?
			expect_eq "VM $mode/$run exit status" "$rc" 0
			grep -q "^PASS frames: $ITERATIONS iterations verified" "$out.out" ||
				fail "VM $mode/$run did not verify: $(cat "$out.out" "$out.err")"
			grep '^hag-vmm: \(iteration [0-9]* at\|last step\)' "$out.err" | sed "s/^/BENCH-VM $mode $run /"
			echo "run $mode/$run: PASS"
			mdev_remove "$uuid"
		done
	done
fi
