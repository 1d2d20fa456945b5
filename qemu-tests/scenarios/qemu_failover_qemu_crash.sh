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
	expect_eq "hagctl backup exit status" "$1" 0
	grep -q '"reason":"the primary handed its VM over: the VM crashed: QEMU exited with no SHUTDOWN event' /tmp/backup.out ||
		fail "no takeover after the crash"
	grep -q '"generation":1' /tmp/backup.out || fail "the takeover did not raise the generation"
	vm_result vm 600
	grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console || { vm_show vm; fail "the guest did not verify on host 1"; }
	in_root python3 /hag/client_check.py --require-pass /tmp/client.log || fail "the client's view"
}
check_primary() {
	expect_eq "hagctl checkpoint exit status" "$1" 0
	grep -q '"outcome":"handed-over"' /tmp/cp.out || fail "the checkpoint did not hand over"
	grep -q 'the VM crashed' /tmp/cp.out || fail "the checkpoint did not say the VM crashed"
	grep -q 'at generation 1' /tmp/cp.out || fail "the backup did not confirm generation 1"
	! grep -q '"outcome":"vm-stopped"' /tmp/cp.out || fail "the crash was taken for an end of protection"
}
. /hag/qemu_protect_once.sh
