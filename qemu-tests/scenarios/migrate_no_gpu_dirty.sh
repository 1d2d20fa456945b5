# hosts: 2
# timeout: 400
# The same migration as migrate_workload, but hagctl ignores hag's GPU dirty
# log (--no-gpu-dirty): pages only the GPU wrote during pre-copy are never
# sent again, and the workload's own verification on host 1 must catch it.
# This proves migrate_workload would see a missed GPU write.
ITERATIONS=30000
MIGRATE_FLAGS="--no-gpu-dirty"
check_result() {
	[ "$1" != 0 ] || fail "the workload passed although GPU-written pages were not migrated"
	grep -q '^FAIL frames: ' /tmp/vm.out || fail "the workload did not report what it found wrong"
}
. /hag/migrate_once.sh
