# hosts: 2
# timeout: 3600
# vms: yes
# debian: yes
# memory: 4096
# The database benchmark's scenario (not a test: qemu-tests/eval/qemu-database
# runs it, with PLAN, WINDOW and WARM set in front of this text). One
# Debian guest after another (QEMU 10/KVM, 512 MiB in a shared file,
# systemd, PostgreSQL 15, hag-guest's GPU workload as a service, ext4 root
# on a qcow2 overlay of the cached image) on host 0, once per PLAN line
# "ID MODE":
#   none       unprotected
#   500ms, 2s  protected by hagctl checkpoint --qmp --plug eth1 at that
#              interval to hagctl backup on host 1, its disk replicated to
#              a replica that starts as a copy of the template image (both
#              hosts hold it); then SIGTERM ends protection (no takeover)
# Every VM gets the same warm-up: its window of WINDOW s starts WARM s
# after the load started, or once epoch 2 is acknowledged if that is later.
#   bare       protected at 2 s to a backup whose replica starts empty:
#              the first synchronisation without a template; ends at
#              epoch 2
#   loss       protected at 2 s; host 0 is lost at a random point after
#              epoch 3: host 1 takes over after its 3 s failover timeout,
#              then asks the database for every acknowledged commit. Last
#              in a PLAN
# The load, in every mode: pgbench's TPC-B-like transactions from two
# clients inside the guest (started through PostgreSQL's COPY TO PROGRAM:
# their replies are local, never held), and db_client.py on host 1
# committing one row after another over the VMs' network, each INSERT its
# own transaction (one round trip), its replies held by output commit when
# protected: what a user of the service sees. Host 1 measures both on its
# own clock: pgbench's rate from pgbench_history's rows, counted again and
# again on one open connection (a query's time is when it was sent: its
# reply may be held, its execution is not), the client's commit latencies
# from its log.
# With the benchmarks' placement (bench_place) the VM's vCPU thread is
# alone on host 0's CPU 1.
# Lines for the driver, host 0: QDBSYNC id SECONDS (hagctl checkpoint
# started to epoch 1 acknowledged), QDBEPOCHS id FIRST LAST (the epochs
# acknowledged in the window), QDBW0 id / QDBW1 id as the window starts and
# ends (live), QDBINRAW and QDBNET (bench_cpu1), QDBCP id {checkpoint json};
# host 1: QDBWIN id
# T0 T1, QDBTPS id SAMPLES RATE, QDBLAT id N P50 P99 MAX (- when there is
# none), QDBTAKE id {backup json}, QDBCHECK id STATUS; both QDBDONE id.
CLIENT=203.0.113.1
VM_ADDR=203.0.113.50
VM_NET=1 VM_DEBIAN=1 VM_MIB=512
VM_APPEND="hag_vm_ip=$VM_ADDR/24 hag_vm_neigh=$CLIENT,52:54:00:4a:48:01"
GUEST_ARGS="--seconds=3600,--mib=8,--cpu-mib=8,--progress=1,--report,$CLIENT:7400,--disk,/var/lib/hag-guest-records"
PGBENCH=/usr/lib/postgresql/15/bin/pgbench
peer=$(host_ip $((1 - HAG_HOST)))
bhost=$(host_ip 1)
load_hag
bench_hosts_up "$CLIENT"

# item_says TEXT: a progress line the driver shows (item and mode from
# the caller's $id and $mode).
item_says() { echo "item $id ($mode): $*"; }

interval() {
	case $1 in
	none) echo - ;;
	bare | loss) echo 2s ;;
	*) echo "$1" ;;
	esac
}

# sql QUERY: the guest's PostgreSQL's answer, unaligned.
sql() { in_root psql -h "$VM_ADDR" -U postgres -qAt -c "$1"; }

# in_guest COMMAND: runs COMMAND in the guest as its postgres user (the
# superuser's COPY TO PROGRAM; the guest has no other way in). The shell
# reads the row first: had it exited before PostgreSQL wrote it (COMMAND
# run in the background), the COPY would fail with a broken pipe.
in_guest() { sql "COPY (SELECT 1) TO PROGRAM 'cat >/dev/null; $1'" >/dev/null; }

# acked_epochs ID: the number of the last epoch item ID's hagctl checkpoint
# had acknowledged (0 if none; numbers may skip one spent but never
# acknowledged).
acked_epochs() {
	last=$(sed -n 's/^epoch \([0-9]*\):.*/\1/p' "/tmp/cp$1.err" 2>/dev/null | tail -1)
	echo "${last:-0}"
}

primary() {
	id=$1 mode=$2
	iv=$(interval "$mode")
	uuid=$(new_uuid)
	mdev_create "$uuid"
	rm -f /tmp/vm-disk.qcow2
	debian_disk /tmp/vm-disk.qcow2
	VM_THREAD_NAMES=1 VM_DISK=/tmp/vm-disk.qcow2 VM_SHARED_RAM=1 vm_start "vm$id" "$uuid" "$GUEST_ARGS"
	qpid=$(cat "/tmp/vm$id.pid")
	vm_wait_console "vm$id" 600 HAG-GUEST-READY
	bench_place "$qpid"
	item_says "the guest is ready; waiting for host 1"
	await_ready "$bhost" $((7600 + id)) 600
	# Host 1 has loaded the database and started the load.
	signal_ready $((7700 + id))
	loaded=$(up)
	cp=
	if [ "$iv" != - ]; then
		rm -rf /tmp/hag-deltas
		t=$(up)
		item_says "hagctl checkpoint --interval $iv: first synchronisation"
		hagctl checkpoint --qmp "/tmp/vm$id.qmp" --backup "$bhost:$((7200 + id))" --plug eth1 \
			--interval "$iv" --delta-dir /tmp/hag-deltas --json >"/tmp/cp$id.out" 2>"/tmp/cp$id.err" &
		cp=$!
		# What the first synchronisation says, as it says it.
		# (busybox sed has no -u: a read loop passes each line on at once.)
		tail -f "/tmp/cp$id.err" 2>/dev/null | while IFS= read -r line; do echo "item $id ($mode): $line"; done &
		said=$!
		wait_for 900 grep -q '^epoch 1:' "/tmp/cp$id.err" || {
			cat "/tmp/cp$id.err"
			fail "item $id ($mode): no epoch 1"
		}
		kill "$said" 2>/dev/null || true
		echo "QDBSYNC $id $(echo "$(up) $t" | awk '{print $1 - $2}')"
		wait_for 300 grep -q '^epoch 2:' "/tmp/cp$id.err" || {
			cat "/tmp/cp$id.err"
			fail "item $id ($mode): no epoch 2"
		}
	fi
	case $mode in
	loss)
		wait_for 300 grep -q '^epoch 3:' "/tmp/cp$id.err" || fail "item $id: no epoch 3"
		ms=$(($(od -An -N2 -tu2 /dev/urandom) % 2000))
		usleep $((ms * 1000))
		echo "QDBLOSS $id ${ms} ms after epoch 3"
		lose_this_host
		;;
	bare) ;;
	*)
		# The same warm-up for every VM, protected or not.
		sleep "$(awk -v l="$loaded" -v n="$(up)" -v w="$WARM" 'BEGIN { d = l + w - n; print (d > 0 ? d : 0) }')"
		await_ready "$bhost" $((7900 + id)) 60
		first=$(($(acked_epochs "$id") + 1))
		echo "QDBW0 $id"
		bench_cpu1 QDB "$id" start "$qpid"
		sleep "$WINDOW"
		echo "QDBW1 $id"
		bench_cpu1 QDB "$id" end "$qpid"
		last=$(acked_epochs "$id")
		await_ready "$bhost" $((8000 + id)) 60
		[ -z "$cp" ] || echo "QDBEPOCHS $id $first $last"
		;;
	esac
	# Host 1 has read what it measures: the item may end.
	await_ready "$bhost" $((7800 + id)) 900
	if [ -n "$cp" ]; then
		kill -TERM "$cp" 2>/dev/null || true
		rc=0
		wait "$cp" || rc=$?
		[ "$rc" = 0 ] || { echo "item $id: hagctl checkpoint exited $rc:"; tail -5 "/tmp/cp$id.err"; }
		echo "QDBCP $id $(cat "/tmp/cp$id.out")"
	fi
	bench_item_ends "$id" "$uuid" "$qpid"
	rm -f "/tmp/vm$id.ram" /tmp/vm-disk.qcow2
}

backup() {
	id=$1 mode=$2
	iv=$(interval "$mode")
	uuid=$(new_uuid)
	mdev_create "$uuid"
	hag-guest listen --port 7400 >"/tmp/client$id.log" 2>/dev/null &
	client=$!
	bk=
	rm -rf /tmp/hag-replicas
	mkdir -p /tmp/hag-replicas
	if [ "$iv" != - ]; then
		# The template both hosts hold, except for a bare backup.
		[ "$mode" = bare ] || item_says "the replica starts as the template image"
		[ "$mode" = bare ] || in_root qemu-img convert -O raw "$(debian_image)" /tmp/hag-replicas/vda.raw ||
			fail "item $id: cannot copy the template into the replica"
		eval "set -- $(VM_THREAD_NAMES=1 VM_DISK=/tmp/hag-replicas/vda.raw VM_DISK_FORMAT=raw vm_words "vm$id" "$uuid" "$GUEST_ARGS")"
		hagctl backup --listen "$bhost:$((7200 + id))" --failover-timeout 3 --json \
			--status-dir "/tmp/hag-backup$id" --state-dir "/tmp/hag-backup$id" --replica-dir /tmp/hag-replicas -- chroot "$HOST_ROOT" "$@" \
			>"/tmp/backup$id.out" 2>"/tmp/backup$id.err" &
		bk=$!
		wait_for 60 port_listening $((7200 + id)) || fail "item $id: the backup does not listen"
		item_says "hagctl backup listens"
	fi
	signal_ready $((7600 + id))
	# The guest is up: its database gets pgbench's tables, the load starts.
	wait_for 300 in_root /usr/lib/postgresql/15/bin/pg_isready -q -h "$VM_ADDR" -t 2 ||
		fail "item $id: the guest's PostgreSQL does not answer"
	in_guest "$PGBENCH -i -s 1 -q postgres >/tmp/pgbench-init.log 2>&1" ||
		fail "item $id: pgbench -i in the guest failed"
	in_guest "nohup $PGBENCH -n -c 2 -j 1 -T 3600 postgres >/tmp/pgbench.log 2>&1 &" ||
		fail "item $id: pgbench did not start in the guest"
	: >"/tmp/rows$id.log"
	chroot "$HOST_ROOT" python3 /hag/db_client.py sample --host "$VM_ADDR" --log "/tmp/rows$id.log" \
		>"/tmp/rows$id.err" 2>&1 &
	sampler=$!
	# Both connect before protection starts: connecting takes three round
	# trips, each held for an epoch once the VM is protected.
	wait_for 120 sh -c "awk 'END { exit !(rows > 0) } { rows = \$3 }' /tmp/rows$id.log" || {
		sql "SELECT pg_read_file('/tmp/pgbench.log')" || true
		fail "item $id: pgbench commits nothing in the guest: $(tail -3 "/tmp/rows$id.err")"
	}
	: >"/tmp/db$id.log"
	chroot "$HOST_ROOT" python3 /hag/db_client.py commit --autocommit --host "$VM_ADDR" \
		--log "/tmp/db$id.log" >"/tmp/db$id.err" 2>&1 &
	db=$!
	wait_for 120 grep -q '^acked ' "/tmp/db$id.log" ||
		fail "item $id: the client commits nothing: $(tail -3 "/tmp/db$id.err")"
	item_says "pgbench and the client commit"
	await_ready "$peer" $((7700 + id)) 60
	case $mode in
	loss)
		wait_for 1500 grep -q 'takeover: generation' "/tmp/backup$id.err" || {
			cat "/tmp/backup$id.err"
			fail "item $id ($mode): no takeover"
		}
		# 20 s of the taken-over database serving the client.
		sleep 20
		kill -TERM "$db" 2>/dev/null || true
		wait "$db" 2>/dev/null || true
		rc=0
		in_root python3 /hag/db_client.py check --host "$VM_ADDR" --log "/tmp/db$id.log" || rc=$?
		echo "QDBCHECK $id $rc"
		qemu=$(sed -n 's/.*takeover: QEMU (pid \([0-9]*\)).*/\1/p' "/tmp/backup$id.err")
		[ -z "$qemu" ] || kill -TERM "$qemu" 2>/dev/null || true
		;;
	bare) ;;
	*)
		signal_ready $((7900 + id))
		t0=$(up)
		signal_ready $((8000 + id))
		t1=$(up)
		echo "QDBWIN $id $t0 $t1"
		# The samples up to t1 are in once the next one's reply came.
		sleep 1
		wait_for 30 sh -c "tail -1 /tmp/rows$id.log | awk '{ exit !(\$2 > $t1) }'" ||
			echo "item $id: no row count after the window"
		echo "QDBTPS $id $(in_root python3 /hag/db_client.py rate --log "/tmp/rows$id.log" --from "$t0" --to "$t1" || true)"
		echo "QDBLAT $id $(in_root python3 /hag/db_client.py latency --log "/tmp/db$id.log" --from "$t0" --to "$t1")"
		# What the client and the sampler did (one line each; their errors).
		echo "item $id: client: $(grep -c '^acked' "/tmp/db$id.log" || true) acked, $(grep -c '^lost' "/tmp/db$id.log" || true) lost, last: $(tail -1 "/tmp/db$id.log"); $(tail -2 "/tmp/db$id.err" | tr '\n' ' ')"
		echo "item $id: sampler: $(wc -l <"/tmp/rows$id.log") samples, last: $(tail -1 "/tmp/rows$id.log"); $(tail -2 "/tmp/rows$id.err" | tr '\n' ' ')"
		;;
	esac
	kill -TERM "$db" "$sampler" 2>/dev/null || true
	# Host 0 is done with the item (a lost host 0 never says so).
	[ "$mode" = loss ] || signal_ready $((7800 + id))
	if [ -n "$bk" ]; then
		bench_backup_ended "$id" "$bk" QDB
	fi
	kill "$client" 2>/dev/null || true
	rm -rf /tmp/hag-replicas
	bench_item_ends "$id" "$uuid"
}

bench_plan QDB
