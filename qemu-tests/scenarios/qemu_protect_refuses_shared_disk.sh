# hosts: 1
# timeout: 600
# vms: yes
# A backup whose replica of a disk would be the primary's own disk image
# (storage both hosts share; here, one host's /tmp/shared for both) is
# refused before anything is protected: hagctl checkpoint leaves a marker
# beside each image it protects (IMAGE.hag-primary), and hagctl backup,
# finding one beside a replica its standby would open, refuses the
# pairing naming the disk. The VM runs on, unprotected, its disk untouched
# by the backup, and the marker is gone once hagctl checkpoint has ended.
ha_key
load_hag
host_root_up
vm_uuid=$(new_uuid)
standby_uuid=$(new_uuid)
mdev_create "$vm_uuid"
mdev_create "$standby_uuid"
mkdir -p /tmp/shared
in_root qemu-img create -q -f raw /tmp/shared/vda.raw 16M || fail "qemu-img create"
VM_DISK=/tmp/shared/vda.raw VM_DISK_FORMAT=raw

step "the VM, its disk in /tmp/shared; a backup whose replicas are in /tmp/shared too"
VM_SHARED_RAM=1 vm_start vm "$vm_uuid" "--seconds=600"
eval "set -- $(vm_words standby "$standby_uuid" "--seconds=600")"
hagctl backup --listen 127.0.0.1:7200 --json --status-dir /tmp/hag-backup --state-dir /tmp/hag-backup --replica-dir /tmp/shared \
	-- chroot "$HOST_ROOT" "$@" >/tmp/backup.out 2>/tmp/backup.err &
bk=$!
sleep 1

step "hagctl checkpoint is refused, naming the disk"
rc=0
hagctl checkpoint --qmp /tmp/vm.qmp --backup 127.0.0.1:7200 --delta-dir /tmp/hag-deltas \
	--connect-timeout 5 --json >/tmp/cp.out 2>/tmp/cp.err || rc=$?
cat /tmp/cp.err /tmp/backup.err
[ "$rc" != 0 ] || fail "hagctl checkpoint protected the VM onto its own disk"
grep -q "disk vda's replica /tmp/shared/vda.raw is the primary's own disk image" /tmp/cp.err ||
	fail "the refusal does not name the shared disk"
expect_eq "the VM's state after the refusal" "$(qmp_status vm)" running
[ ! -e /tmp/shared/vda.raw.hag-primary ] || fail "the primary's marker outlived hagctl checkpoint"
kill "$bk" 2>/dev/null || true
kill "$(cat /tmp/vm.pid)"
