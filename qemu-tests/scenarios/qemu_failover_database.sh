# hosts: 2
# timeout: 1500
# vms: yes
# debian: yes
# memory: 3072
# A user's VM: the Debian 12 guest (systemd, PostgreSQL 15, hag-guest's GPU
# workload as a service, ext4 root on a qcow2 disk) under hagctl checkpoint
# --qmp --plug, its disk replicated with its memory, while a client on
# host 1 commits rows to its database and logs each acknowledged COMMIT.
# Host 0 is lost at a random point of an epoch interval. After the
# takeover on host 1: every commit the client saw acknowledged is in the
# table; PostgreSQL did not restart and ran no crash recovery (its log
# says so); pg_amcheck passes; the guest's hag-guest workload (GPU, memory,
# and records it synced to a file on the disk) verifies; and after a clean
# shutdown of the guest, e2fsck -fn finds the replica clean.
FAULT=host-loss
# qemu-tests/chaos --database sets CP_INTERVAL, FAULT_EPOCH and FAULT_DELAY_MS.
FAULT_EPOCH=${FAULT_EPOCH:-6}
DEBIAN=1
GUEST_ARGS="--seconds=900,--mib=8,--cpu-mib=8,--progress=1"
check_backup() {
	takeover_verified "$1" 'the primary was silent for'
	expect_eq "db_client.py check's exit status" "$(db_verdict db-check)" 0
	expect_eq "pg_amcheck's exit status" "$(db_verdict pg_amcheck)" 0
	expect_eq "the guest's clean halt" "$(db_verdict halt)" 0
	replica_fsck || fail "the replica's filesystem is not clean after the guest's clean shutdown"
}
check_primary() {
	:
}
. /hag/qemu_protect_once.sh
