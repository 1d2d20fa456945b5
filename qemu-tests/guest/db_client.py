#!/usr/bin/env python3
"""The database client of the Debian guest's scenarios (qemu_failover_database,
qemu_checkpoint_no_disk_delta): a user of the guest's PostgreSQL, on another
test host, over the VMs' network.

  db_client.py commit --host ADDR --log FILE
      Commits one row after another, ids increasing, each in its own
      transaction, and logs `acked ID MS AT` for each whose COMMIT
      PostgreSQL acknowledged (the reply reached this host: under hagctl
      checkpoint --plug, only once the epoch that wrote it was acknowledged
      by the backup): MS is the transaction's latency as this client saw
      it (INSERT sent to COMMIT acknowledged), AT this host's uptime at
      the acknowledgement (/proc/uptime's clock, CLOCK_BOOTTIME). A connection lost mid-commit leaves that id in doubt
      (`lost ID: ...`, either outcome is right); the client reconnects and
      goes on with the next id. The log's first line is `postmaster START`,
      PostgreSQL's start time. Runs until SIGTERM.
  db_client.py check --host ADDR --log FILE
      Asks the database, wherever it now runs: every acknowledged id must
      be in the table, PostgreSQL must not have restarted since the log's
      start time, and its log must show no crash recovery. Prints what it
      found; exits 1 if any of that is false.
  db_client.py commit --workers N ...
      N connections commit at once, each its own rows (ids from one
      counter, so an id may be acknowledged after a higher one). A
      protected VM's replies come out once per epoch: one connection
      commits at most once every three epochs; many connections share
      each epoch's release, as a server's many users do.
  db_client.py commit --autocommit ...
      The same, each INSERT committed by itself (autocommit): one round
      trip per commit, its reply the commit's acknowledgement. Without it
      psycopg2 sends BEGIN, the INSERT and COMMIT, three round trips (each
      reply held by output commit when the VM is protected).
  db_client.py latency --log FILE --from T0 --to T1
      The commits acknowledged between uptimes T0 and T1: prints their
      count and latency percentiles, `N P50 P99 MAX` (ms; for the
      benchmark, qemu-tests/eval/qemu-database).
  db_client.py sample --host ADDR --log FILE
      On one connection, counts pgbench_history's rows again and again
      (every 0.5 s, or as fast as held replies come), logging `sample T
      ROWS` with T this host's uptime when the query was sent (it runs in
      the guest then; only its reply may be held), until SIGTERM.
  db_client.py rate --log FILE --from T0 --to T1
      pgbench's transactions per second between T0 and T1, from the
      first and last samples inside: prints `SAMPLES RATE`.

Connects as `postgres` to database `postgres` (the guest's pg_hba.conf
trusts the test network; scripts/build-guest-rootfs.sh).
"""

import argparse
import itertools
import signal
import sys
import threading
import time

import psycopg2

TABLE = "hag_commits"
PG_LOG = "/var/log/postgresql/postgresql-15-main.log"
# What PostgreSQL logs when it starts from a data directory that was not
# shut down cleanly, or when a backend crash made it reinitialise.
RECOVERY_SIGNS = (
    "database system was interrupted",
    "database system was not properly shut down",
    "redo starts at",
    "automatic recovery in progress",
    "terminated by signal",
    "PANIC:",
)


def connect(host, patience):
    """A connection, retried for `patience` seconds (PostgreSQL may still
    be starting, or the VM moving). Each try may take 30 s: connecting is
    three round trips, each reply held for an epoch while the VM is
    protected."""
    deadline = time.monotonic() + patience
    while True:
        try:
            conn = psycopg2.connect(host=host, user="postgres", dbname="postgres", connect_timeout=30,
                                    keepalives=1, keepalives_idle=30)
            conn.autocommit = False
            return conn
        except psycopg2.OperationalError as e:
            if time.monotonic() > deadline:
                raise SystemExit(f"db_client: cannot connect to PostgreSQL on {host}: {e}".strip())
            time.sleep(1)


def commit(args):
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log = Log(args.log)
    conn = connect(args.host, 600)
    with conn.cursor() as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} ("
                    "id bigint PRIMARY KEY, at timestamptz NOT NULL DEFAULT now(), payload text NOT NULL)")
        cur.execute("SELECT pg_postmaster_start_time()::text")
        log.write(f"postmaster {cur.fetchone()[0]}")
        cur.execute(f"SELECT coalesce(max(id), 0) FROM {TABLE}")
        ids = itertools.count(cur.fetchone()[0] + 1)
    conn.commit()
    conn.close()
    print(f"db_client: {args.workers} connections committing to {TABLE} on {args.host} "
          f"from id {next(ids)}", flush=True)
    ids_lock = threading.Lock()

    def next_id():
        with ids_lock:
            return next(ids)

    workers = [threading.Thread(target=commit_rows, args=(args, log, next_id, stop), daemon=True)
               for _ in range(args.workers)]
    for w in workers:
        w.start()
    # The main thread must stay free to run the SIGTERM handler.
    while not stop.wait(0.5):
        pass
    for w in workers:
        w.join(timeout=35)


def commit_rows(args, log, next_id, stop):
    """One connection's loop: each row in its own transaction, acked or
    in doubt, until `stop`."""
    conn = connect(args.host, 600)
    conn.autocommit = args.autocommit
    while not stop.is_set():
        row = next_id()
        try:
            sent = uptime()
            with conn.cursor() as cur:
                cur.execute(f"INSERT INTO {TABLE} (id, payload) VALUES (%s, repeat(md5(%s::text), 8))",
                            (row, row))
            conn.commit()
            acked = uptime()
            log.write(f"acked {row} {(acked - sent) * 1000:.1f} {acked:.3f}")
        except psycopg2.Error as e:
            log.write(f"lost {row}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
            try:
                conn.close()
            except psycopg2.Error:
                pass
            if stop.is_set():
                return
            conn = connect(args.host, 600)
            conn.autocommit = args.autocommit
    conn.close()


class Log:
    """The commit log, one whole line per write whichever connection
    writes it."""

    def __init__(self, path):
        self.file = open(path, "a", buffering=1)
        self.lock = threading.Lock()

    def write(self, line):
        with self.lock:
            self.file.write(line + "\n")


def read_log(path):
    start, acked, lost = None, [], []
    for line in open(path):
        word, _, rest = line.strip().partition(" ")
        if word == "postmaster" and start is None:
            start = rest
        elif word == "acked":
            acked.append(int(rest.split()[0]))
        elif word == "lost":
            lost.append(rest)
    return start, acked, lost


def check(args):
    start, acked, lost = read_log(args.log)
    if start is None:
        print("db: the client never connected")
        return 1
    problems = []
    conn = connect(args.host, 120)
    with conn.cursor() as cur:
        cur.execute(f"SELECT id FROM {TABLE}")
        present = {row[0] for row in cur.fetchall()}
        cur.execute("SELECT pg_postmaster_start_time()::text")
        now_start = cur.fetchone()[0]
        cur.execute("SELECT pg_read_file(%s)", (PG_LOG,))
        pg_log = cur.fetchone()[0]
    conn.close()
    missing = [i for i in acked if i not in present]
    print(f"db: {len(acked)} commits acknowledged (ids {min(acked) if acked else '-'}..{max(acked) if acked else '-'}), "
          f"{len(lost)} in doubt, {len(present)} rows in {TABLE}")
    for line in lost:
        print(f"db: in doubt: {line}")
    if not acked:
        problems.append("no commit was acknowledged")
    if missing:
        problems.append(f"{len(missing)} acknowledged commits missing (ids {', '.join(map(str, missing[:10]))}"
                        f"{', ...' if len(missing) > 10 else ''})")
    if now_start != start:
        problems.append(f"PostgreSQL restarted: up since {now_start}, not {start}")
    else:
        print(f"db: PostgreSQL up since {start}, never restarted")
    signs = [line for line in pg_log.splitlines() if any(s in line for s in RECOVERY_SIGNS)]
    if signs:
        problems.append("PostgreSQL's log shows crash recovery: " + " | ".join(signs[:5]))
    else:
        print(f"db: {PG_LOG} shows no crash recovery ({len(pg_log.splitlines())} lines)")
    for p in problems:
        print(f"db: FAIL: {p}")
    return 1 if problems else 0


def latency(args):
    lats = []
    for line in open(args.log):
        word, *rest = line.split()
        if word == "acked" and len(rest) == 3 and args.t0 <= float(rest[2]) <= args.t1:
            lats.append(float(rest[1]))
    lats.sort()

    def pct(q):
        return lats[min(len(lats) - 1, int(q * len(lats)))] if lats else 0.0
    if not lats:
        print("0 - - -")
        return 0
    print(f"{len(lats)} {pct(0.5):.1f} {pct(0.99):.1f} {lats[-1]:.1f}")
    return 0


def uptime():
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def sample(args):
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    log = open(args.log, "a", buffering=1)
    conn = connect(args.host, 600)
    conn.autocommit = True
    while not stop:
        sent = uptime()
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pgbench_history")
            log.write(f"sample {sent:.3f} {cur.fetchone()[0]}\n")
        time.sleep(max(0.0, 0.5 - (uptime() - sent)))
    conn.close()


def rate(args):
    inside = []
    for line in open(args.log):
        word, *rest = line.split()
        if word == "sample" and len(rest) == 2 and args.t0 <= float(rest[0]) <= args.t1:
            inside.append((float(rest[0]), int(rest[1])))
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        print(f"{len(inside)} -")
        return 1
    (a, ra), (b, rb) = inside[0], inside[-1]
    print(f"{len(inside)} {(rb - ra) / (b - a):.2f}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("commit", "check", "latency", "sample", "rate"))
    p.add_argument("--host")
    p.add_argument("--log", required=True)
    p.add_argument("--from", dest="t0", type=float, default=0.0)
    p.add_argument("--to", dest="t1", type=float, default=float("inf"))
    p.add_argument("--autocommit", action="store_true")
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args()
    if args.mode not in ("latency", "rate") and not args.host:
        p.error(f"{args.mode} needs --host")
    sys.exit({"commit": commit, "check": check, "latency": latency, "sample": sample,
              "rate": rate}[args.mode](args))


if __name__ == "__main__":
    main()
