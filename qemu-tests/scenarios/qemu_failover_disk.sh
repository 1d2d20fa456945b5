# hosts: 2
# timeout: 900
# vms: yes
# qemu_failover_host_loss with a disk: the VM's qcow2 disk (vda), to which
# hag-guest commits a numbered record about every 10 ms, each synced before
# it counts (a database's commit in small), is captured at every epoch's
# pause as a point-in-time delta (QEMU's dirty bitmaps and a backup job),
# sent in the epoch and applied on host 1's replica (/tmp/hag-replicas/
# vda.raw) at its EPOCH_END, synced before the acknowledgement. Host 0 is
# lost at a random point after epoch 4; the standby QEMU resumes the last
# acknowledged epoch on the replica, and the guest must verify there:
# every record its memory counts must be on the disk it resumed with, and
# what the client saw (records included) is never contradicted.
FAULT=host-loss
DISK=1
GUEST_ARGS="--seconds=60,--mib=8,--cpu-mib=8,--progress=1"
check_backup() {
	takeover_verified "$1" 'the primary was silent for'
	grep -q 'hag-guest: disk: [1-9][0-9]* records committed and read back' /tmp/vm.console ||
		fail "the guest committed no disk record"
	grep -q 'epoch [0-9]* applied' /tmp/backup.err || fail "no epoch applied"
}
check_primary() { :; }
. /hag/qemu_protect_once.sh
