#!/usr/bin/env python3
"""Judges what the outside client saw of a guest's network output.

usage: client_check.py [--require-result | --require-pass] [--host-lost] LOG
       client_check.py --self-test

LOG is the stdout of `hag-guest listen` ('-' for stdin): one line per
datagram, `<arrival> <from> <payload>`, the payload being hag-guest's
`HAG-GUEST seq=N ns=T <line>` (see controller/hag-guest/src/report.rs).
What the client saw must be a prefix of one run of the guest:

- the seqs, in arrival order, start at 1 and rise by one with no gap;
- a seq seen again must carry the same bytes (a network duplicate); other
  bytes under a seen seq are output that was shown and then undone, a
  guest re-executing from an earlier state: CONTRADICTED, naming both lines;
- at most one HAG-GUEST-RESULT, and nothing new after it.

--require-result also fails a log without a result; --require-pass one
whose result is not PASS. --host-lost: the primary's host was lost (a
power cut), or it was cut off (a partition, a killed hagctl) while the
backup committed an epoch the primary never saw acknowledged. The datagrams of the epoch whose acknowledgement reached the
primary in its last moments, or whose release had not yet left it
(sch_plug lets a released epoch out asynchronously, as a NIC sends its
queue), are lost with it while the backup resumes after them: as
output commit allows, the network seems to have lost them. So one forward
gap is allowed, and reported, but only at the takeover: where nothing
arrived for at least TAKEOVER_SILENCE seconds (the backup's failover
timeout and the takeover). A gap anywhere else (a receive buffer that
overflowed, say), a second gap, disorder and contradictions still fail.
Prints each problem on a line of its own, then a
one-line summary (`client_check: OK: ...` or `client_check: FAIL: ...`).
Exit status 0 if the log holds, 1 if not, 2 if it could not be read.
"""

import re
import sys

REPORT = re.compile(r"HAG-GUEST seq=(\d+) ns=(\d+) (.*)\Z")

# The least silence, in seconds of arrival time, before the first datagram
# of a VM taken over after a host loss: the failover timeout (3 s in the
# tests) and the takeover itself.
TAKEOVER_SILENCE = 2.0


def check(lines, require_result=False, require_pass=False, host_lost=False):
    """Returns (problems, summary) for the log's lines."""
    problems = []
    gap = None  # (after seq, next seq, silence) of the one gap a lost host allows
    last_arrival = None
    first = {}  # seq -> (line number, payload)
    top = 0
    dups = 0
    result = None  # (line number, seq, text)
    for n, raw in enumerate(lines, 1):
        raw = raw.rstrip("\n")
        if not raw.strip():
            continue
        parts = raw.split(" ", 2)
        if len(parts) < 3:
            problems.append(f"line {n}: not '<arrival> <from> <payload>': {raw!r}")
            continue
        payload = parts[2]
        try:
            arrival = float(parts[0])
        except ValueError:
            problems.append(f"line {n}: not '<arrival> <from> <payload>': {raw!r}")
            continue
        silence = arrival - last_arrival if last_arrival is not None else 0.0
        last_arrival = arrival
        m = REPORT.match(payload)
        if not m:
            problems.append(f"line {n}: not a hag-guest report: {payload!r}")
            continue
        seq, text = int(m.group(1)), m.group(3)
        if seq in first:
            was_n, was = first[seq]
            if was == payload:
                dups += 1
            else:
                problems.append(f"CONTRADICTED: seq {seq}: line {was_n} {was!r} and line {n} {payload!r}")
            continue
        if host_lost and gap is None and top and seq > top + 1 and silence >= TAKEOVER_SILENCE:
            gap = (top, seq, silence)
        elif seq != top + 1:
            after = f"after seq {top}" if top else "as the first"
            problems.append(f"line {n}: seq {seq} {after}: seqs must start at 1 and rise by one")
        if result is not None:
            problems.append(f"line {n}: seq {seq} after the result (line {result[0]}, seq {result[1]})")
        first[seq] = (n, payload)
        top = max(top, seq)
        if text.startswith("HAG-GUEST-RESULT"):
            if result is None:
                result = (n, seq, text)
    if require_pass and result is not None and not result[2].startswith("HAG-GUEST-RESULT PASS"):
        problems.append(f"line {result[0]}: the result is not PASS: {result[2]!r}")
    if (require_result or require_pass) and result is None:
        problems.append("no HAG-GUEST-RESULT")
    seen = f"{len(first)} reports" + (f", seqs 1..{top}" if first else "")
    seen += f", {dups} duplicates"
    if gap is not None:
        seen += (f", seqs {gap[0] + 1}..{gap[1] - 1} lost with the primary's host"
                 f" (nothing arrived for {gap[2]:.1f} s before seq {gap[1]}: the takeover)")
    if result is not None:
        seen += f", result at seq {result[1]}: {' '.join(result[2].split()[:2])}"
    else:
        seen += ", no result"
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return problems, f"client_check: FAIL: {problems[0]}{more}; {seen}"
    return problems, f"client_check: OK: {seen}"


def line(seq, ns, text, at="1700000000.000001", src="192.0.2.10:40000"):
    return f"{at} {src} HAG-GUEST seq={seq} ns={ns} {text}\n"


def self_test():
    p1 = "hag-guest: iteration 10, 2.0 s"
    p2 = "hag-guest: iteration 20, 4.0 s"
    res = "HAG-GUEST-RESULT PASS iterations=30 seconds=6.0"
    cases = [
        # (name, lines, options, ok?, words the summary must have)
        ("a whole run", [line(1, 10, p1), line(2, 20, p2), line(3, 30, res)], {}, True,
         ["3 reports, seqs 1..3", "result at seq 3: HAG-GUEST-RESULT PASS"]),
        ("an empty log", [], {}, True, ["0 reports"]),
        ("an empty log needing a result", [], {"require_result": True}, False, ["no HAG-GUEST-RESULT"]),
        ("a prefix", [line(1, 10, p1)], {}, True, ["1 reports, seqs 1..1", "no result"]),
        ("a network duplicate", [line(1, 10, p1), line(1, 10, p1, at="1700000001.0"), line(2, 20, p2)],
         {}, True, ["1 duplicates"]),
        ("re-executed: same seq, other clock", [line(1, 10, p1), line(2, 20, p2), line(2, 25, p2)], {},
         False, ["CONTRADICTED: seq 2: line 2", "and line 3"]),
        ("re-executed: same seq, other line", [line(1, 10, p1), line(1, 10, p2)], {}, False,
         ["CONTRADICTED: seq 1"]),
        ("a gap", [line(1, 10, p1), line(3, 30, p2)], {}, False, ["seq 3 after seq 1"]),
        ("a gap at the takeover after a host loss",
         [line(1, 10, p1), line(4, 30, p2, at="1700000005.5"), line(5, 40, res, at="1700000006.5")],
         {"host_lost": True, "require_pass": True}, True,
         ["seqs 2..3 lost with the primary's host", "nothing arrived for 5.5 s"]),
        ("a gap without the takeover's silence: not the lost host's",
         [line(1, 10, p1), line(4, 30, p2, at="1700000000.5")], {"host_lost": True}, False,
         ["seq 4 after seq 1"]),
        ("two gaps after a host loss",
         [line(1, 10, p1), line(3, 30, p2, at="1700000005.0"), line(5, 40, res, at="1700000009.0")],
         {"host_lost": True}, False, ["seq 5 after seq 3"]),
        ("a host loss does not excuse a contradiction",
         [line(1, 10, p1), line(3, 30, p2, at="1700000005.0"), line(3, 35, p2, at="1700000006.0")],
         {"host_lost": True}, False, ["CONTRADICTED"]),
        ("nor going back",
         [line(1, 10, p1), line(3, 30, p2, at="1700000005.0"), line(2, 20, p2, at="1700000006.0")],
         {"host_lost": True}, False, ["seq 2 after seq 3"]),
        ("not starting at 1", [line(2, 10, p1)], {}, False, ["seq 2 as the first"]),
        ("two results", [line(1, 10, res), line(2, 20, res)], {}, False, ["after the result"]),
        ("output after the result", [line(1, 10, res), line(2, 20, p1)], {}, False,
         ["seq 2 after the result (line 1, seq 1)"]),
        ("a FAIL result needing PASS", [line(1, 10, "HAG-GUEST-RESULT FAIL x; iterations=1 seconds=1.0")],
         {"require_pass": True}, False, ["the result is not PASS"]),
        ("a stray datagram", [line(1, 10, p1), "1700000000.5 192.0.2.10:1 hello\n"], {}, False,
         ["line 2: not a hag-guest report"]),
        ("a cut line", [line(1, 10, p1), "1700000000.5\n"], {}, False, ["line 2: not '<arrival>"]),
    ]
    failed = 0
    for name, lines, opts, ok, words in cases:
        problems, summary = check(lines, **opts)
        good = (not problems) == ok and summary.startswith("client_check: OK" if ok else "client_check: FAIL")
        good = good and all(w in summary or any(w in p for p in problems) for w in words)
        if not good:
            failed += 1
            print(f"client_check: self-test case '{name}' wrong: {summary} {problems}")
    print(f"client_check: self-test: {len(cases) - failed} passed, {failed} failed")
    return 0 if failed == 0 else 1


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    opts = {"require_result": False, "require_pass": False}
    paths = []
    for a in argv:
        if a in ("-h", "--help"):
            print(__doc__.strip())
            return 0
        if a == "--require-result":
            opts["require_result"] = True
        elif a == "--require-pass":
            opts["require_pass"] = True
        elif a == "--host-lost":
            opts["host_lost"] = True
        elif a.startswith("--") or paths:
            print(f"client_check: {__doc__.strip().splitlines()[2]}", file=sys.stderr)
            return 2
        else:
            paths.append(a)
    if not paths:
        print("client_check: no LOG (see --help)", file=sys.stderr)
        return 2
    try:
        if paths[0] == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(paths[0], encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
    except OSError as e:
        print(f"client_check: {paths[0]}: {e}", file=sys.stderr)
        return 2
    problems, summary = check(lines, **opts)
    for p in problems:
        print(p)
    print(summary)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
