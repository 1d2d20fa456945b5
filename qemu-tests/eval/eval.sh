# hosts: 2
# timeout: 3600
# The evaluation's scenario (not a test: qemu-tests/eval runs it, with
# PLAN, BW_MIB and FAILOVER set in front of this text). host 0 is the
# source and primary, host 1 the target and backup. Both walk PLAN, one
# item per line, "ID KIND D MODE COMPRESS INTERVAL SECONDS":
#   cal  ID D               host 0: calibrate, the rate (iterations/s) of the
#                           workload with D synthetic pages (D=0: frames)
#   prec ID                 host 0: hag-vmm run --workload all --json
#   mig  ID D MODE COMPRESS - SECONDS   migrate a VM host 0 -> host 1 after
#                           SECONDS/2 of a run of about 3 x SECONDS
#   cp   ID D MODE COMPRESS INTERVAL SECONDS  a run of about SECONDS (at the
#                           unprotected rate) protected by checkpoints every
#                           INTERVAL; MODE none: unprotected
#   hang ID / loss ID       protected run; a GPU hang injected on host 0 /
#                           host 0 lost (must be the last item): host 1
#                           takes over
# Lines for the driver (host 0 unless said):
#   EVAL-BW bytes centiseconds
#   EVAL-RATE id D iterations seconds
#   EVAL-PREC id {hag-vmm run json}
#   EVAL-MIG id {hagctl migrate json}
#   EVAL-RECV id {hagctl receive json}              (host 1)
#   EVAL-VM id <hag-vmm stderr timing line>
#   EVAL-EPOCH id uptime_cs <hagctl checkpoint stderr epoch line>
#   EVAL-CP id {hagctl checkpoint json}
#   EVAL-APPLIED id <hagctl backup 'epoch N applied' line>   (host 1)
#   EVAL-TAKEOVER id {hagctl backup takeover json}  (host 1)
#   EVAL-DONE id                                    (both)
: "${BW_MIB:=4}"
: "${FAILOVER:=3}"
peer=$(host_ip $((1 - HAG_HOST)))
me=$(host_ip "$HAG_HOST")
if [ "$HAG_HOST" = 0 ]; then
	load_hag allow_hang_injection=1
	ha_key
else
	load_hag
	ha_key
fi
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
now_cs() { cut -d' ' -f1 /proc/uptime | tr -d .; }
stamp() { while IFS= read -r l; do echo "$(now_cs) $l"; done; }
port() { echo $((7300 + $1)); }
# host 1 accepts one connection here when it is ready for migration ID.
ready_port() { echo $((7600 + $1)); }
# host 1: says it is ready for item ID (stdin from /dev/null: nc would send
# the rest of the plan).
signal_ready() { nc -l -p "$(ready_port "$1")" </dev/null >/dev/null || fail "ready signal $1 failed"; }
# host 0: waits for that, before starting a VM that must not finish while
# host 1 still runs the previous item's migrated VM to its end.
await_ready() {
	wait_for 300 sh -c "echo go | nc $peer $(ready_port "$1")" || fail "host 1 never got ready for item $1"
}

# host 0: iterations for SECONDS of workload D at its calibrated rate. The
# load on the machine moves the rate: runs that must outlive a migration or
# three epochs ask for at least MIN_S seconds at an idle host's rate (about
# 1200 frames iterations/s, slower with more synthetic pages).
iterations_for() { # D SECONDS [MIN_S]
	rate=$(cat "/tmp/rate-$1" 2>/dev/null || echo 500)
	awk -v r="$rate" -v s="$2" -v d="$1" -v m="${3:-0}" 'BEGIN {
		n = int(r * s); f = int(m * 1200 / (1 + d / 16)); if (n < f) n = f
		if (n < 50) n = 50; if (n > 65000) n = 65000; print n }'
}

# host 0: starts a VM; sets $vm (pid) and $sock.
start_vm() { # ID D ITERATIONS [PROGRESS]
	uuid=$(new_uuid)
	mdev_create "$uuid"
	sock=/tmp/vm$1.sock
	hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$3" --dirty-pages "$2" \
		--progress "${4:-0}" >"/tmp/vm$1.out" 2>"/tmp/vm$1.err" &
	vm=$!
	wait_for 30 test -S "$sock" || fail "VM $1 did not start: $(cat "/tmp/vm$1.err")"
}

# host 0: waits for VM ID, checks it verified, prints its timing lines.
end_vm() { # ID
	rc=0
	wait "$vm" || rc=$?
	expect_eq "VM $1 exit status" "$rc" 0
	grep -q '^PASS frames: \|^stopped: quit' "/tmp/vm$1.out" ||
		fail "VM $1 did not verify: $(cat "/tmp/vm$1.out" "/tmp/vm$1.err")"
	grep '^hag-vmm: \(iteration [0-9]* at\|last step\)' "/tmp/vm$1.err" | sed "s/^/EVAL-VM $1 /"
	mdev_remove "$uuid"
}

cp_flags() { # MODE COMPRESS
	f="--gpu-dirty $1"
	[ "$2" = 1 ] || f="$f --no-compress"
	echo "$f"
}

# host 1: how long to wait for host 0 in item ID at most, so that a failure
# there ends this host's script too instead of waiting for the harness's
# timeout.
patience() { echo $(($1 * 10 + 180)); }

# host 1: a backup for item ID; prints what it applied and any takeover.
run_backup() { # ID SECONDS
	buuid=$(new_uuid)
	mdev_create "$buuid"
	signal_ready "$1"
	rc=0
	timeout "$(patience "$2")" hagctl backup --listen "$me:$(port "$1")" --mdev "$buuid" --control "/tmp/bk$1.sock" \
		--failover-timeout "$FAILOVER" --status-dir "/tmp/bkstate$1" --state-dir "/tmp/bkstate$1" --json \
		>"/tmp/backup$1.out" 2>"/tmp/backup$1.err" || rc=$?
	grep 'hagctl: epoch [0-9]* applied' "/tmp/backup$1.err" | sed "s/^.*hagctl: /hagctl: /; s/^/EVAL-APPLIED $1 /"
	if grep -q '^{"reason"' "/tmp/backup$1.out"; then
		echo "EVAL-TAKEOVER $1 $(grep '^{"reason"' "/tmp/backup$1.out")"
		grep -q '^PASS frames: ' "/tmp/backup$1.out" ||
			fail "item $1: the workload did not verify after the takeover: $(tail -5 "/tmp/backup$1.out")"
	fi
	[ "$rc" = 0 ] || fail "backup $1 exited $rc: $(tail -n 15 "/tmp/backup$1.err")"
	mdev_remove "$buuid"
}

. /hag/bandwidth.sh
measure_bandwidth "$BW_MIB" EVAL-BW

echo "$PLAN" | while read -r id kind d mode compress interval seconds; do
	[ -n "$id" ] || continue
	step "item $id: $kind $d $mode $compress $interval $seconds"
	if [ "$HAG_HOST" = 1 ]; then
		case $kind in
		mig)
			uuid=$(new_uuid)
			mdev_create "$uuid"
			sock=/tmp/in$id.sock
			hag-vmm serve --mdev "$uuid" --control "$sock" --incoming >"/tmp/in$id.out" 2>"/tmp/in$id.err" &
			vm=$!
			wait_for 30 test -S "$sock" || fail "incoming VM $id did not start: $(cat "/tmp/in$id.err")"
			signal_ready "$id"
			timeout "$(patience "$seconds")" hagctl receive --listen "$me:$(port "$id")" --vm "$sock" --json >"/tmp/recv$id.out" 2>"/tmp/recv$id.err" ||
				fail "receive $id failed: $(cat "/tmp/recv$id.err")"
			echo "EVAL-RECV $id $(cat "/tmp/recv$id.out")"
			rc=0
			wait "$vm" || rc=$?
			expect_eq "incoming VM $id exit status" "$rc" 0
			grep -q '^PASS frames: ' "/tmp/in$id.out" ||
				fail "item $id: the workload did not verify on host 1: $(cat "/tmp/in$id.out")"
			mdev_remove "$uuid"
			;;
		cp)
			[ "$mode" = none ] || run_backup "$id" "$seconds"
			;;
		hang | loss)
			run_backup "$id" "$seconds"
			;;
		esac
		echo "EVAL-DONE $id"
		continue
	fi
	case $kind in
	cal)
		start_vm "$id" "$d" 65000 20
		sleep "$seconds"
		kill "$vm"
		wait "$vm" || true
		mdev_remove "$uuid"
		# The rate after the first second: the first iterations touch
		# fresh guest pages and run slower.
		span=$(grep '^hag-vmm: iteration [0-9]* at' "/tmp/vm$id.err" |
			awk '$5 >= 1 { if (!n0) { n0 = $3; t0 = $5 } n = $3; t = $5 } END { if (t > t0) print n - n0, t - t0 }')
		[ -n "$span" ] || fail "calibration $id: too few progress lines: $(cat "/tmp/vm$id.err")"
		echo "$span" | awk '{ printf "%.1f\n", $1 / $2 }' >"/tmp/rate-$d"
		echo "EVAL-RATE $id $d $span"
		;;
	prec)
		uuid=$(new_uuid)
		mdev_create "$uuid"
		hag-vmm run --mdev "$uuid" --workload all --json >"/tmp/prec$id.out" 2>"/tmp/prec$id.err" ||
			fail "precision run failed: $(cat "/tmp/prec$id.out" "/tmp/prec$id.err")"
		sed "s/^/EVAL-PREC $id /" "/tmp/prec$id.out"
		mdev_remove "$uuid"
		;;
	mig)
		# Start the VM only once host 1 listens: it may still be running
		# the previous item's migrated VM to its end, and this VM must not
		# finish before the migration pauses it.
		await_ready "$id"
		# Three times the iterations: the VM must still run when the
		# migration pauses it, even if it runs faster than calibrated and
		# pre-copy is slow (hashing); at most 5 rounds.
		start_vm "$id" "$d" "$(iterations_for "$d" $((seconds * 3)) 5)"
		sleep "$(awk -v s="$seconds" 'BEGIN { print s / 2 }')"
		# shellcheck disable=SC2046
		hagctl migrate --vm "$sock" --to "$peer:$(port "$id")" $(cp_flags "$mode" "$compress") \
			--max-rounds 5 --connect-timeout 120 --json >"/tmp/mig$id.out" 2>"/tmp/mig$id.err" ||
			fail "migration $id failed: $(cat "/tmp/mig$id.err"); the VM said: $(tail -n 3 "/tmp/vm$id.err" "/tmp/vm$id.out")"
		echo "EVAL-MIG $id $(cat "/tmp/mig$id.out")"
		end_vm "$id"
		;;
	cp)
		[ "$mode" = none ] || await_ready "$id"
		start_vm "$id" "$d" "$(iterations_for "$d" "$seconds" 5)" 20
		if [ "$mode" != none ]; then
			cpo=/tmp/cp$id
			{
				rc=0
				# shellcheck disable=SC2046
				hagctl checkpoint --vm "$sock" --backup "$peer:$(port "$id")" --interval "$interval" \
					$(cp_flags "$mode" "$compress") --failover-timeout 10 --connect-timeout 120 \
					--status-dir "/tmp/cpstate$id" --json || rc=$?
				echo "$rc" >"$cpo.rc"
			} 2>&1 >"$cpo.out" | stamp >"$cpo.err"
			[ "$(cat "$cpo.rc")" = 0 ] ||
				fail "checkpoint $id exited $(cat "$cpo.rc"): $(tail -n 15 "$cpo.err"; cat "$cpo.out")"
			grep -q '"outcome":"finished"' "$cpo.out" ||
				fail "protection $id did not end with the VM finishing: $(cat "$cpo.err" "$cpo.out")"
			grep '^[0-9]* epoch [0-9]*:' "$cpo.err" | sed "s/^/EVAL-EPOCH $id /"
			echo "EVAL-CP $id $(cat "$cpo.out")"
		fi
		end_vm "$id"
		;;
	hang | loss)
		# Four times the iterations: the VM must outlive three epochs even
		# if it runs faster than calibrated; the backup runs the rest.
		await_ready "$id"
		start_vm "$id" "$d" "$(iterations_for "$d" $((seconds * 4)) 7)" 20
		cpo=/tmp/cp$id
		hagctl checkpoint --vm "$sock" --backup "$peer:$(port "$id")" --interval "$interval" \
			--failover-timeout "$FAILOVER" --connect-timeout 120 --status-dir "/tmp/cpstate$id" --json \
			>"$cpo.out" 2>"$cpo.err" &
		cp=$!
		wait_for 120 grep -q '^epoch 3:' "$cpo.err" || fail "item $id: no 3 epochs: $(cat "$cpo.err")"
		if [ "$kind" = loss ]; then
			echo "EVAL-DONE $id"
			lose_this_host
		fi
		hagctl inject-hang --mdev "$uuid"
		rc=0
		wait "$cp" || rc=$?
		expect_eq "checkpoint $id exit status" "$rc" 0
		grep -q '"outcome":"handed-over"' "$cpo.out" || fail "item $id: no hand-over: $(cat "$cpo.out" "$cpo.err")"
		echo "EVAL-CP $id $(cat "$cpo.out")"
		rc=0
		wait "$vm" || rc=$?
		mdev_remove "$uuid"
		;;
	esac
	echo "EVAL-DONE $id"
done
