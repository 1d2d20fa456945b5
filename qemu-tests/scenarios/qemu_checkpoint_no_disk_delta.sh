# hosts: 2
# timeout: 900
# vms: yes
# qemu_failover_disk with every epoch's disk delta withheld
# (--test-withhold-disk-delta; the first synchronisation's full copy still
# goes): the takeover resumes the guest's memory on a replica that lacks the
# records committed since that copy. The guest must not verify on host 1
# (its disk check FAILs naming the missing records): the scenario passes
# only then. It shows that qemu_failover_disk can fail, and that the
# epochs' disk deltas are what keep the replica consistent with memory.
FAULT=host-loss
DISK=1
GUEST_ARGS="--seconds=60,--mib=8,--cpu-mib=8,--progress=1"
CP_ARGS=--test-withhold-disk-delta
check_backup() {
	grep -q '"generation":1' /tmp/backup.out || fail "no takeover after the host loss"
	vm_result vm 600
	if grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console; then
		fail "the guest verified without the disk deltas: the check cannot fail"
	fi
	grep -q 'HAG-GUEST-RESULT FAIL.*disk: [0-9]* of [0-9]* committed records missing' /tmp/vm.console ||
		fail "the guest failed, but not for its disk: $(grep HAG-GUEST-RESULT /tmp/vm.console)"
	echo "as required: the guest's disk check FAILed on host 1"
}
check_primary() {
	grep -q "the epochs' disk deltas are withheld" /tmp/cp.err || fail "the disk deltas were not withheld"
}
. /hag/qemu_protect_once.sh
