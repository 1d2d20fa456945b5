# measure_bandwidth MIB TAG (sourced by the benchmarks and the evaluation):
# the link's bandwidth between host 0 and host 1, as the floor of a
# downtime is computed from it. host 0 sends MIB MiB of random bytes to
# host 1 with busybox nc, twice (ports 7201, 7202; the faster counts), and
# prints "TAG bytes centiseconds" for each, timed on host 0; host 1
# receives them.
measure_bandwidth() {
	if [ "$HAG_HOST" = 1 ]; then
		for t in 1 2; do
			nc -l -p "720$t" >/dev/null || fail "bandwidth receiver $t failed"
		done
		return
	fi
	peer=$(host_ip 1)
	dd if=/dev/urandom of=/tmp/blob bs=1048576 count="$1" 2>/dev/null
	bytes=$(wc -c </tmp/blob)
	for t in 1 2; do
		tries=0
		while :; do
			start=$(cut -d' ' -f1 /proc/uptime | tr -d .)
			if nc "$peer" "720$t" </tmp/blob 2>/dev/null; then
				end=$(cut -d' ' -f1 /proc/uptime | tr -d .)
				break
			fi
			tries=$((tries + 1))
			[ "$tries" -lt 150 ] || fail "bandwidth transfer $t: cannot reach $peer:720$t"
			sleep 0.2
		done
		echo "$2 $bytes $((end - start))"
	done
	rm -f /tmp/blob
}
