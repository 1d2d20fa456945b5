# hosts: 2
# timeout: 3600
# vms: yes
# The QEMU checkpoint benchmark's scenario (not a test:
# qemu-tests/eval/qemu-checkpoint runs it, with PLAN, WINDOW and WARM set
# in front of this text). One real VM after another (QEMU 10/KVM, Linux
# guest running hag-guest on a hag-sim vGPU, RAM in a shared file, its
# progress sent over UDP to a client on host 1) on host 0, once per PLAN
# line "ID MODE". Every VM gets the same warm-up: its window of WINDOW s
# starts WARM s after the guest is ready, or once epoch 2 is acknowledged
# if that is later (epoch 1 closes the first synchronisation).
#   none       unprotected
#   100ms, 500ms, 2s, 5s
#              protected by hagctl checkpoint --qmp --plug eth1 at that
#              interval to hagctl backup on host 1; after the window
#              SIGTERM ends protection (ABORT, the backup confirms, no
#              takeover)
#   pause, send
#              ablations at 2 s (hagctl checkpoint --test-ablation): from
#              epoch 3 on, pause-only (stop, dirty logs, device state,
#              page copy, cont; nothing sent) or send-only (no pause: the
#              dirty pages read and sent while the VM runs)
#   idle       protected at 2 s, but hag-guest ends (verified) before
#              protection starts and the guest stays up idle
#              (hag_vm_stay=1): epochs with almost nothing dirty, the pause
#              floor
#   hang       protected at 2 s; after epoch 2 a GPU hang is injected:
#              host 1 takes over and the guest must verify there
#   loss       protected at 2 s; host 0 is lost at a random point of an
#              interval after epoch 2 (the harness kills it): host 1 takes
#              over after its 3 s failover timeout. Last in a PLAN
# Throughput is read on host 0's own clock (/proc/uptime), not the guest's:
# each line of the VM's serial console (a file QEMU writes, never held) is
# stamped as it appears, so "hag-guest: iteration N" lines give iterations
# per host second; the guest's clock stops while QEMU has the VM stopped
# and would hide the pauses.
# With the benchmark's placement (bench_place) the VM's vCPU thread is
# pinned to this host's CPU 1, alone there.
# Lines for the driver, host 0: QCPLINK MBIT (the link's speed, once),
# QCPW0 id / QCPW1 id as the window starts and ends (printed live),
# QCPINRAW and QCPNET (bench_cpu1: this host's CPU 1, who ran there, TCP
# retransmits), QCPCON id
# UPTIME LINE (progress lines), QCPEPOCH id UPTIME LINE (hagctl
# checkpoint's epoch lines), QCPWIN id T0 T1, QCPCP id {checkpoint json};
# host 1: QCPTAKE id {backup json}, QCPGUEST id RESULT-LINE; both QCPDONE
# id.
CLIENT=203.0.113.1
PORT=7400
VM_NET=1
VM_APPEND="hag_vm_ip=203.0.113.50/24 hag_vm_neigh=$CLIENT,52:54:00:4a:48:01"
WORK="--mib=8,--cpu-mib=8,--progress=1,--report,$CLIENT:$PORT"
bhost=$(host_ip 1)
# Hang injection is allowed on host 0 for the whole boot (it only permits
# hagctl inject-hang).
if [ "$HAG_HOST" = 0 ]; then
	load_hag allow_hang_injection=1
else
	load_hag
fi
bench_hosts_up "$CLIENT"

# The data link's speed, once: 64 MiB from host 0 to host 1 over TCP.
cat >/tmp/link.py <<'PY'
import socket, sys, time
if sys.argv[1] == "recv":
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 7599))
    s.listen(1)
    c, _ = s.accept()
    while c.recv(1 << 20):
        pass
else:
    buf, n = bytes(1 << 20), 64
    for _ in range(600):
        try:
            c = socket.create_connection((sys.argv[2], 7599), timeout=5)
            break
        except OSError:
            time.sleep(0.2)
    t = time.monotonic()
    for _ in range(n):
        c.sendall(buf)
    c.shutdown(socket.SHUT_WR)
    c.recv(1)
    print("QCPLINK %.1f" % (n * 8 * 1.048576 / (time.monotonic() - t)))
PY
if [ "$HAG_HOST" = 0 ]; then
	in_root python3 /tmp/link.py send "$bhost" || echo "QCPLINK -"
else
	timeout 180 chroot "$HOST_ROOT" python3 /tmp/link.py recv || true
fi

# stamp FILE PID: FILE's lines as they are written, each after this host's
# uptime (/proc/uptime, as `up`), until process PID ends: the host root's
# Python polls it every 50 ms.
cat >/tmp/stamp.py <<'PY'
import os, sys, time
path, pid = sys.argv[1], sys.argv[2]
def up():
    with open("/proc/uptime") as u:
        return u.read().split()[0]
f = open(path, "rb")
rest = b""
while True:
    alive = os.path.exists("/proc/" + pid)
    data = f.read()
    if data:
        t = up()
        *lines, rest = (rest + data).split(b"\n")
        for line in lines:
            sys.stdout.write(t + " " + line.decode(errors="replace").rstrip() + "\n")
        sys.stdout.flush()
    elif not alive:
        break
    else:
        time.sleep(0.05)
PY
stamp() {
	: >>"$1"
	in_root python3 /tmp/stamp.py "$1" "$2"
}

# guest MODE: hag-guest's arguments.
guest() {
	case $1 in
	idle) echo "--seconds=1,--iterations=1,$WORK" ;;
	hang | loss) echo "--seconds=120,$WORK" ;;
	*) echo "--seconds=$GUEST_SECONDS,$WORK" ;;
	esac
}

interval() {
	case $1 in
	none) echo - ;;
	idle | hang | loss | pause | send) echo 2s ;;
	*) echo "$1" ;;
	esac
}

ablation() {
	case $1 in
	pause) echo "--test-ablation pause-only" ;;
	send) echo "--test-ablation send-only" ;;
	esac
}

primary() {
	id=$1 mode=$2
	iv=$(interval "$mode")
	uuid=$(new_uuid)
	mdev_create "$uuid"
	stay=
	[ "$mode" != idle ] || stay=hag_vm_stay=1
	VM_APPEND="$VM_APPEND $stay" VM_THREAD_NAMES=1 VM_SHARED_RAM=1 vm_start "vm$id" "$uuid" "$(guest "$mode")"
	qpid=$(cat "/tmp/vm$id.pid")
	stamp "/tmp/vm$id.console" "$qpid" >"/tmp/con$id.st" &
	vm_wait_console "vm$id" 180 HAG-GUEST-READY
	bench_place "$qpid"
	[ "$mode" != idle ] || vm_wait_console "vm$id" 120 HAG-GUEST-EXIT
	await_ready "$bhost" $((7600 + id)) 600
	ready=$(up)
	cp=
	if [ "$iv" != - ]; then
		# shellcheck disable=SC2046
		hagctl checkpoint --qmp "/tmp/vm$id.qmp" --backup "$bhost:$((7200 + id))" --plug eth1 \
			--interval "$iv" $(ablation "$mode") --json >"/tmp/cp$id.out" 2>"/tmp/cp$id.err" &
		cp=$!
		stamp "/tmp/cp$id.err" "$cp" >"/tmp/ep$id.st" &
		wait_for 300 grep -q '^epoch 2:' "/tmp/cp$id.err" || {
			cat "/tmp/cp$id.err"
			fail "item $id ($mode): no epoch 2"
		}
	fi
	case $mode in
	hang | loss)
		if [ "$mode" = hang ]; then
			echo "QCPHANG $id $(up)"
			hagctl inject-hang --mdev "$uuid"
		else
			ms=$(($(od -An -N2 -tu2 /dev/urandom) % 2000))
			usleep $((ms * 1000))
			echo "QCPLOSS $id $(up) ${ms} ms after epoch 2"
			lose_this_host
		fi
		;;
	*)
		# The same warm-up for every VM, protected or not.
		rest=$(awk -v r="$ready" -v n="$(up)" -v w="$WARM" 'BEGIN { d = r + w - n; print (d > 0 ? d : 0) }')
		sleep "$rest"
		echo "QCPW0 $id"
		bench_cpu1 QCP "$id" start "$qpid"
		t0=$(up)
		if [ "$mode" = idle ]; then sleep "$IDLE_WINDOW"; else sleep "$WINDOW"; fi
		t1=$(up)
		echo "QCPW1 $id"
		bench_cpu1 QCP "$id" end "$qpid"
		echo "QCPWIN $id $t0 $t1"
		[ -z "$cp" ] || kill -TERM "$cp" 2>/dev/null || true
		;;
	esac
	if [ -n "$cp" ]; then
		rc=0
		wait "$cp" || rc=$?
		[ "$rc" = 0 ] || { echo "item $id: hagctl checkpoint exited $rc:"; tail -5 "/tmp/cp$id.err"; }
		echo "QCPCP $id $(cat "/tmp/cp$id.out")"
	fi
	bench_item_ends "$id" "$uuid" "$qpid"
	sleep 0.5
	grep 'hag-guest: iteration' "/tmp/con$id.st" | sed "s/^/QCPCON $id /"
	[ ! -s "/tmp/ep$id.st" ] || grep ' epoch [0-9]*:' "/tmp/ep$id.st" | sed "s/^/QCPEPOCH $id /"
	grep HAG-GUEST-RESULT "/tmp/vm$id.console" | sed "s/^/QCPGUEST $id /" || true
	rm -f "/tmp/vm$id.ram"
	await_ready "$bhost" $((7800 + id)) 900
}

backup() {
	id=$1 mode=$2
	iv=$(interval "$mode")
	uuid=$(new_uuid)
	mdev_create "$uuid"
	hag-guest listen --port "$PORT" >"/tmp/client$id.log" 2>/dev/null &
	client=$!
	bk=
	if [ "$iv" != - ]; then
		stay=
		[ "$mode" != idle ] || stay=hag_vm_stay=1
		eval "set -- $(VM_APPEND="$VM_APPEND $stay" VM_THREAD_NAMES=1 vm_words "vm$id" "$uuid" "$(guest "$mode")")"
		hagctl backup --listen "$bhost:$((7200 + id))" --failover-timeout 3 --json \
			--status-dir "/tmp/hag-backup$id" --state-dir "/tmp/hag-backup$id" -- chroot "$HOST_ROOT" "$@" \
			>"/tmp/backup$id.out" 2>"/tmp/backup$id.err" &
		bk=$!
		wait_for 60 port_listening $((7200 + id)) || fail "item $id: the backup does not listen"
	fi
	timeout 600 nc -l -p $((7600 + id)) </dev/null >/dev/null || fail "item $id: host 0 never started"
	case $mode in
	hang | loss)
		wait_for 300 grep -q 'takeover: epoch .* loaded' "/tmp/backup$id.err" || {
			cat "/tmp/backup$id.err"
			fail "item $id ($mode): no takeover"
		}
		wait_for 300 grep -q HAG-GUEST-EXIT "/tmp/vm$id.console" ||
			echo "item $id: the taken-over guest did not end: $(grep 'hag-guest: iteration' "/tmp/vm$id.console" | tail -1)"
		grep HAG-GUEST-RESULT "/tmp/vm$id.console" | sed "s/^/QCPGUEST $id /" || true
		qemu=$(sed -n 's/.*takeover: QEMU (pid \([0-9]*\)).*/\1/p' "/tmp/backup$id.err")
		[ -z "$qemu" ] || kill -TERM "$qemu" 2>/dev/null || true
		;;
	esac
	# Host 0 is done with the item (a lost host 0 never says so).
	[ "$mode" = loss ] || timeout 900 nc -l -p $((7800 + id)) </dev/null >/dev/null || echo "item $id: no end from host 0"
	if [ -n "$bk" ]; then
		bench_backup_ended "$id" "$bk" QCP
		grep 'takeover' "/tmp/backup$id.err" | sed "s/^/QCPTAKELOG $id /" || true
	fi
	kill "$client" 2>/dev/null || true
	bench_item_ends "$id" "$uuid"
}

bench_plan QCP
