# hosts: 2
# timeout: 900
# vms: yes
# qemu_failover_gpu_hang with the CPU dirty log withheld from hagctl
# (--test-withhold-cpu-dirty): epochs after the first copy carry only the
# pages the GPU wrote, so the takeover resumes a guest whose CPU-written
# memory is stale. The guest must not verify on host 1 (it FAILs its check,
# or its kernel dies on the stale memory): the scenario passes only then.
# It shows that qemu_failover_gpu_hang can fail, and that soft-dirty bits
# are what carries the guest's CPU writes.
FAULT=gpu-hang
GUEST_ARGS="--seconds=60,--mib=8,--cpu-mib=8,--progress=1"
CP_ARGS=--test-withhold-cpu-dirty
GUEST_MAY_CRASH=1
check_backup() {
	grep -q '"generation":1' /tmp/backup.out || fail "no takeover after the hang"
	echo "--- console of VM vm:"
	guest_oops_quoted </tmp/vm.console
	if grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console; then
		fail "the guest verified without the CPU dirty log: the check cannot fail"
	fi
	if grep -q 'HAG-GUEST-RESULT FAIL' /tmp/vm.console; then
		echo "as required: the guest's own check FAILed on host 1"
	else
		echo "as required: the guest did not verify on host 1 (no verdict: $(tail -2 /tmp/vm.console | guest_oops_quoted))"
	fi
}
check_primary() {
	grep -q 'the CPU dirty log is withheld' /tmp/cp.err || fail "the CPU dirty log was not withheld"
}
. /hag/qemu_protect_once.sh
