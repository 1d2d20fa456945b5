# hosts: 2
# timeout: 1500
# vms: yes
# debian: yes
# memory: 3072
# qemu_failover_database with every epoch's disk delta withheld
# (--test-withhold-disk-delta; the first synchronisation's full copy still
# goes): the takeover resumes the guest's memory on a replica that lacks
# everything written since that copy. Its checks must FAIL (the scenario
# passes only then): the records hag-guest synced to its file are not on
# the disk, and the database, its log or the filesystem show the damage.
# It shows that qemu_failover_database can fail, and that the epochs' disk
# deltas are what keep the replica consistent with memory. A second
# Debian boot and first synchronisation: about 8 minutes of make test.
FAULT=host-loss
FAULT_EPOCH=6
DEBIAN=1
GUEST_ARGS="--seconds=900,--mib=8,--cpu-mib=8,--progress=1"
CP_ARGS=--test-withhold-disk-delta
check_backup() {
	grep -q '"generation":1' /tmp/backup.out || fail "no takeover after the host loss"
	failed=
	# The guest's verdict as it reported it over the network (its console
	# is silent after a takeover: docs/ha.md).
	grep -q 'HAG-GUEST-RESULT PASS' /tmp/client.log || failed="$failed hag-guest"
	for step in db-check pg_amcheck halt; do
		[ "$(db_verdict "$step")" = 0 ] || failed="$failed $step"
	done
	replica_fsck || failed="$failed e2fsck"
	[ -n "$failed" ] || fail "every check passed without the disk deltas: the checks cannot fail"
	# hag-guest, if the broken guest got as far as verifying, must have
	# found its records missing, not failed for something else.
	if grep -q 'HAG-GUEST-RESULT FAIL' /tmp/client.log; then
		grep -q 'HAG-GUEST-RESULT FAIL.*disk: [0-9]* of [0-9]* committed records missing' /tmp/client.log ||
			fail "hag-guest failed, but not for its disk: $(grep HAG-GUEST-RESULT /tmp/client.log)"
	fi
	echo "as required, these checks FAILed on host 1:$failed"
}
check_primary() {
	grep -q "the epochs' disk deltas are withheld" /tmp/cp.err || fail "the disk deltas were not withheld"
}
. /hag/qemu_protect_once.sh
