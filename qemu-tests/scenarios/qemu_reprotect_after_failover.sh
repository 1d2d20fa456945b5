# hosts: 2
# timeout: 1200
# vms: yes
# Protected again after a takeover, and a second failover back. Host 0's
# VM (QEMU/KVM, hag-sim vGPU, RAM in a shared file) is protected by host
# 1's `hagctl backup --reprotect HOST0:7200`; host 0's QEMU is killed
# (SIGKILL): host 1 takes over at generation 1 and, as --reprotect says,
# protects the VM it now runs with the backup on host 0, which stands by
# again once its old primary has handed over (the old primary's host
# rejoining, its old VM's RAM file given as --ram-seed): the
# resynchronisation sends only the pages whose hash differs from the seed's,
# which must be under a third of what a full copy sends (the guest's
# workload rewrites 8 MiB all the time; the rest of its memory is as the
# seed holds it). Then host 1's
# QEMU is killed: the re-protecting checkpoint hands the VM over and host
# 0's backup takes over at generation 2, from an epoch of host 1's run; the
# guest must verify all of its memory there (asked to end its run then:
# guest_finish, through its client on host 1).
GUEST_ARGS="--seconds=300,--mib=4,--cpu-mib=4,--progress=1,$GUEST_REPORT"
VM_NET=1
VM_APPEND=$GUEST_NET_WORDS
backup0=$(host_ip 0):7200
backup1=$(host_ip 1):7200
peer=$(host_ip $((1 - HAG_HOST)))
uuid=$(new_uuid)
load_hag
ha_key
host_root_up
mdev_create "$uuid"
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"
guest_net_up
# The standby's command line: the VM's, with this host's vGPU and its RAM
# locked as the primary's (hagctl adds the RAM backend itself).
eval "set -- $(vm_words vm "$uuid" "$GUEST_ARGS") -overcommit mem-lock=on"

# standby LISTEN [BACKUP-ARGS...]: hagctl backup on LISTEN in the
# background (pid $bk), live in the host's log (pid $live), its reports in
# /tmp/backup.out and /tmp/backup.err.
standby() {
	local listen=$1
	shift
	: >/tmp/backup.err
	tail -f /tmp/backup.err 2>/dev/null | sed 's/^/[backup] /' &
	live=$!
	hagctl backup --listen "$listen" --failover-timeout 3 --json --status-dir /tmp/hag-backup \
		--state-dir /tmp/hag-backup "$@" >/tmp/backup.out 2>>/tmp/backup.err &
	bk=$!
}

if [ "$HAG_HOST" = 1 ]; then
	step "host 1: backup on $backup1, re-protecting with $backup0 after a takeover"
	standby "$backup1" --reprotect "$backup0" --reprotect-args "--interval 1s" -- chroot "$HOST_ROOT" "$@"
	wait_for 600 grep -q 'takeover: generation 1' /tmp/backup.err || fail "no takeover on host 1"
	step "host 1: took over; re-protection with host 0's backup"
	wait_for 600 grep -q 'epoch 3: pause' /tmp/backup.err ||
		{ kill "$bk"; fail "the VM taken over here was not protected again (no 3 epochs acknowledged)"; }
	grep 'synchronising with the backup\|re-protecting the VM' /tmp/backup.err || true
	held=$(grep -m1 'the peer holds' /tmp/backup.err) || fail "the re-protection's first copy compared no hashes"
	echo "$held"
	sent=$(echo "$held" | sed -n 's/.*: \([0-9]*\) to send, where a full copy sends \([0-9]*\).*/\1 \2/p')
	set -- $sent
	[ $# = 2 ] && [ $(($1 * 3)) -lt "$2" ] || fail "the resynchronisation sent $1 pages, a full copy $2: not far below"
	qemu=$(sed -n 's/.*takeover: QEMU (pid \([0-9]*\)).*/\1/p' /tmp/backup.err)
	step "host 1: the VM taken over here (QEMU pid $qemu) killed with SIGKILL"
	kill -KILL "$qemu"
	rc=0
	wait_for 120 sh -c "! kill -0 $bk" || fail "hagctl backup did not end after its VM was killed"
	wait "$bk" || rc=$?
	kill "$live" 2>/dev/null || true
	cat /tmp/backup.out
	tail -n 15 /tmp/backup.err
	expect_eq "hagctl backup exit status (its VM killed)" "$rc" 7
	grep -q 'handed-over' /tmp/backup.out || fail "the re-protecting checkpoint did not hand the VM over"
	await_ready "$(host_ip 0)" 7103 600
	guest_finish
	await_ready "$(host_ip 0)" 7102
else
	step "host 0: VM with hag-guest on vGPU $uuid, protected by $backup1"
	VM_SHARED_RAM=1 vm_start vm "$uuid" "$GUEST_ARGS"
	vm_wait_console vm 600 HAG-GUEST-READY
	hagctl checkpoint --qmp /tmp/vm.qmp --backup "$backup1" --interval 1s --json >/tmp/cp.out 2>/tmp/cp.err &
	cp=$!
	wait_for 300 grep -q '^epoch 3:' /tmp/cp.err || fail "no 3 epochs: $(cat /tmp/cp.err)"
	step "host 0: QEMU (pid $(cat /tmp/vm.pid)) killed with SIGKILL"
	kill -KILL "$(cat /tmp/vm.pid)"
	rc=0
	wait "$cp" || rc=$?
	tail -n 5 /tmp/cp.err
	cat /tmp/cp.out
	expect_eq "hagctl checkpoint exit status" "$rc" 0
	grep -q '"outcome":"handed-over"' /tmp/cp.out || fail "the checkpoint did not hand over"
	# The old VM's console is kept; a takeover here writes a new one.
	mv /tmp/vm.console /tmp/vm.console.first
	step "host 0: stands by again as the VM's backup on $backup0"
	standby "$backup0" --ram-seed /tmp/vm.ram -- chroot "$HOST_ROOT" "$@"
	wait_for 600 grep -q 'epoch [0-9]* applied' /tmp/backup.err || fail "host 1's re-protection never reached this host"
	grep -m1 'synchronised\|first checkpoint\|epoch 1 applied' /tmp/backup.err || true
	wait_for 600 grep -q 'takeover: generation 2' /tmp/backup.err || fail "no takeover on host 0"
	step "host 0: took over again; the guest's verdict"
	signal_ready 7103
	vm_result vm 600
	grep -q 'HAG-GUEST-RESULT PASS' /tmp/vm.console || { vm_show vm; fail "the guest did not verify on host 0"; }
	qemu=$(sed -n 's/.*takeover: QEMU (pid \([0-9]*\)).*/\1/p' /tmp/backup.err)
	kill -TERM "$qemu" 2>/dev/null || true
	rc=0
	wait_for 60 sh -c "! kill -0 $bk" || kill "$bk"
	wait "$bk" || rc=$?
	kill "$live" 2>/dev/null || true
	cat /tmp/backup.out
	expect_eq "hagctl backup exit status" "$rc" 0
	grep -q '"generation":2' /tmp/backup.out || fail "the second takeover was not at generation 2"
	signal_ready 7102
fi
