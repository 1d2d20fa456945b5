# hosts: 2
# timeout: 900
# vms: yes
# As qemu_failover_gpu_hang, but host 0's QEMU dies without shutting the VM
# down: SIGKILL or SIGSEGV (drawn at random, printed), as the OOM killer or
# a QEMU bug would end it. hagctl checkpoint must see a crash, not an end of
# protection (no SHUTDOWN event came before QMP closed), and hand the VM
# over (HANG); host 1 resumes the last acknowledged epoch and the guest
# must verify there. The client's view is one run, never contradicted:
# nothing the dead VM sent after its last acknowledged epoch was released.
FAULT=qemu-crash
GUEST_ARGS="--seconds=60,--mib=8,--cpu-mib=8,--progress=1"
check_backup() {
	takeover_verified "$1" 'the primary handed its VM over: the VM crashed: QEMU exited with no SHUTDOWN event'
}
check_primary() {
	handed_over "$1"
	grep -q '"detail":"the VM crashed: QEMU exited with no SHUTDOWN event' /tmp/cp.out ||
		fail "the checkpoint did not say the VM crashed"
}
. /hag/qemu_protect_once.sh
