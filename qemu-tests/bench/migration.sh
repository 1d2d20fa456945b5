# hosts: 2
# timeout: 900
# Benchmark (not a test scenario: qemu-tests/bench-migration runs it, with
# RUNS and ITERATIONS set in front of this text). First the link bandwidth:
# host 0 sends BW_MIB MiB of random bytes to host 1 with busybox nc, timed
# on host 0 (twice; the faster counts). Then, RUNS times per mode, a fresh
# frames VM on host 0 migrates to host 1 mid-run: mode "dirty" uses hag's
# GPU dirty log, mode "full" (hagctl migrate --gpu-dirty full) copies every
# page the vGPU's GTT maps at stop time instead. host 1 lets each VM run to
# the end and checks PASS, so both modes are also checked for correctness.
# host 0 prints `BENCH-BW bytes centiseconds` and `BENCH-RESULT mode run
# {hagctl migrate --json report}` lines for the script to read.
: "${RUNS:=3}"
: "${ITERATIONS:=8000}"
: "${BW_MIB:=8}"
load_hag
ha_key
peer=$(host_ip $((1 - HAG_HOST)))
me=$(host_ip "$HAG_HOST")
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
. /hag/bandwidth.sh
measure_bandwidth "$BW_MIB" BENCH-BW

if [ "$HAG_HOST" = 1 ]; then
	k=0
	for mode in dirty full; do
		for run in $(seq "$RUNS"); do
			k=$((k + 1))
			uuid=$(new_uuid)
			mdev_create "$uuid"
			sock=/tmp/in$k.sock
			hag-vmm serve --mdev "$uuid" --control "$sock" --incoming >/tmp/in$k.out 2>/tmp/in$k.err &
			vm=$!
			wait_for 30 test -S "$sock" || fail "incoming VM $k did not start: $(cat /tmp/in$k.err)"
			hagctl receive --listen "$me:$((7300 + k))" --vm "$sock" --json >/tmp/recv$k.out 2>/tmp/recv$k.err ||
				fail "receive $k ($mode) failed: $(cat /tmp/recv$k.err)"
			rc=0
			wait "$vm" || rc=$?
			expect_eq "VM $k ($mode) exit status" "$rc" 0
			grep -q "^PASS frames: $ITERATIONS iterations verified" /tmp/in$k.out ||
				fail "run $k ($mode): the workload did not verify on host 1: $(cat /tmp/in$k.out)"
			echo "run $k ($mode): PASS on host 1"
			mdev_remove "$uuid"
		done
	done
else
	k=0
	for mode in dirty full; do
		flags=""
		[ "$mode" = full ] && flags="--gpu-dirty full"
		for run in $(seq "$RUNS"); do
			k=$((k + 1))
			uuid=$(new_uuid)
			mdev_create "$uuid"
			sock=/tmp/vm$k.sock
			hag-vmm serve --mdev "$uuid" --control "$sock" --iterations "$ITERATIONS" >/tmp/vm$k.out 2>/tmp/vm$k.err &
			vm=$!
			wait_for 30 test -S "$sock" || fail "VM $k did not start: $(cat /tmp/vm$k.err)"
			sleep 3
			# shellcheck disable=SC2086
			hagctl migrate --vm "$sock" --to "$peer:$((7300 + k))" $flags --connect-timeout 120 --json \
				>/tmp/mig$k.out 2>/tmp/mig$k.err || fail "migration $k ($mode) failed: $(cat /tmp/mig$k.err)"
			echo "BENCH-RESULT $mode $run $(cat /tmp/mig$k.out)"
			rc=0
			wait "$vm" || rc=$?
			expect_eq "source VM $k exit status" "$rc" 0
			mdev_remove "$uuid"
		done
	done
fi
