# hosts: 2
# timeout: 3600
# vms: yes
# The QEMU live-migration benchmark's scenario (not a test:
# qemu-tests/eval/qemu-migration runs it, with PLAN set in front of this
# text). The same guest and workload (hag-guest: CPU pages at a fixed rate,
# plus the GPU workload where there is a vGPU) migrated by QEMU from host 0
# to host 1, once per PLAN line "ID VARIANT":
#   novgpu    no vGPU: hag-guest --no-vgpu (CPU workload alone)
#   hag       a hag-sim vGPU, its dirty pages through VFIO DMA logging
#   fallback  a hag-sim vGPU with x-device-dirty-page-tracking=off: QEMU
#             falls back to type1 tracking, which reports every mapped page
#             dirty on every sync. Such a VM never converges (QEMU's
#             bandwidth estimate, from rounds of mostly zero pages, puts the
#             expected downtime of all of RAM in hours), so it switches over
#             once the link's bandwidth (avail-switchover-bandwidth, 100
#             Mbit/s) says all of it fits in 60 s
# Lines for the driver: QMIG id {hagctl migrate json} (host 0),
# QRECV id {hagctl receive json} and QGUEST id <HAG-GUEST-RESULT line>
# (host 1), QDONE id (both).
RATE=100
GUEST="--seconds=25,--iterations=1,--mib=8,--cpu-mib=16,--cpu-pages=4,--rate=$RATE"
load_hag
host_root_up
peer=$(host_ip $((1 - HAG_HOST)))
target=$(host_ip 1)
wait_for 60 ping -c 1 -W 1 "$peer" || fail "$peer unreachable"

# setup VARIANT: sets uuid (and creates its vGPU), VM_VGPU_OPTS, gargs, flags.
setup() {
	uuid= VM_VGPU_OPTS= gargs=$GUEST flags=
	case $1 in
	novgpu) gargs="$GUEST,--no-vgpu" ;;
	hag) uuid=$(new_uuid) ;;
	fallback)
		uuid=$(new_uuid)
		# enable-migration=on: with the default (auto) QEMU adds a
		# migration blocker for a device without dirty tracking.
		VM_VGPU_OPTS=,x-device-dirty-page-tracking=off,enable-migration=on
		flags="--max-downtime 60000 --parameter avail-switchover-bandwidth=12500000"
		;;
	*) fail "unknown variant $1" ;;
	esac
	[ -z "$uuid" ] || mdev_create "$uuid"
}

echo "$PLAN" | while read -r id variant; do
	[ -n "$id" ] || continue
	setup "$variant"
	port=$((7100 + id))
	if [ "$HAG_HOST" = 1 ]; then
		vm_start "vm$id" "$uuid" "$gargs" -incoming defer
		hagctl receive --qmp "/tmp/vm$id.qmp" --listen "$target:$port" --json >"/tmp/recv$id.out" 2>"/tmp/recv$id.err" &
		recv=$!
		wait_for 60 port_listening "$port" || fail "item $id: QEMU does not listen on $port"
		signal_ready $((7600 + id))
		wait "$recv" || { cat "/tmp/recv$id.err"; fail "item $id: hagctl receive failed"; }
		echo "QRECV $id $(cat "/tmp/recv$id.out")"
		vm_result "vm$id" 600 >/dev/null
		echo "QGUEST $id $(grep HAG-GUEST-RESULT "/tmp/vm$id.console")"
		wait_for 60 sh -c "! kill -0 $(cat "/tmp/vm$id.pid")" || kill "$(cat "/tmp/vm$id.pid")"
	else
		vm_start "vm$id" "$uuid" "$gargs"
		vm_wait_console "vm$id" 120 'hag-guest: iteration'
		# Let the workload reach its steady rate first.
		sleep 4
		await_ready "$target" $((7600 + id))
		# shellcheck disable=SC2086
		hagctl migrate --qmp "/tmp/vm$id.qmp" --to "$target:$port" --json $flags >"/tmp/mig$id.out" 2>"/tmp/mig$id.err" ||
			{ cat "/tmp/mig$id.err"; fail "item $id: hagctl migrate failed"; }
		echo "QMIG $id $(cat "/tmp/mig$id.out")"
	fi
	[ -z "$uuid" ] || wait_for 30 sh -c "echo 1 >/sys/bus/mdev/devices/$uuid/remove" || true
	echo "QDONE $id"
done
