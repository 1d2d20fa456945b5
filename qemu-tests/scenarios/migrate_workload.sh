# hosts: 2
# timeout: 400
# A hag-vmm VM running the frames GPU workload on host 0 migrates live, with
# its vGPU, to host 1 mid-run (pre-copy of guest RAM with CPU and GPU dirty
# pages, then stop-and-copy of the last pages, the vGPU context and the VM
# state). The workload must finish on host 1 and verify all of its guest
# RAM; host 0's VM must have stopped after the target acknowledged.
ITERATIONS=30000
MIGRATE_FLAGS=""
check_result() {
	expect_eq "VM exit status on host 1" "$1" 0
	grep -q '^PASS frames: [1-9][0-9]* iterations verified' /tmp/vm.out || fail "the workload did not verify on host 1"
}
. /hag/migrate_once.sh
