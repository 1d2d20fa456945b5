"""The block method the real-VM benchmarks share (issue 24): each
protected item between two unprotected ones, the protected modes in a
random order; a block's ratio is its protected figure over the mean of its
two baselines; a block is dropped, and the reason said, when its baselines
differ by more than 3 % or more than 2 % of the VM's core went elsewhere
in one of its three windows (eval/placement.py). A run that loses a test
host goes on in boots of fresh ones from the lost item's block, so that
a block's three items always come from one boot (in_boots).
"""

import random
import re
import statistics

import placement

MAX_BASELINE_DIFF = 0.03
MAX_INTERFERENCE = 0.02


def plan(blocks, modes, seed):
    """The block items' modes: a baseline, then each protected item
    followed by another baseline, the protected modes (each `blocks` times)
    in an order drawn from `seed`."""
    protected = [m for m in modes for _ in range(blocks)]
    random.Random(seed).shuffle(protected)
    seq = ["none"]
    for m in protected:
        seq += [m, "none"]
    return seq


def resume(items, done, protected):
    """After a run that did not finish (test hosts under TCG are sometimes
    lost to an emulation fault): (kept, again), the items whose figures
    stand and the modes to run again on fresh test hosts. `items` is the
    run's [(id, mode)] in order, `done` the ids that finished. A block's
    three items must come from one boot, so a protected item runs again
    with the baseline before it, and a lost second baseline takes its
    protected item with it; nothing after the first unfinished item
    stands."""
    first = next((k for k, (i, _) in enumerate(items) if i not in done), None)
    if first is None:
        return list(items), []
    keep = first
    if items[first][1] == "none" and first > 0 and items[first - 1][1] in protected:
        keep = first - 1
    start = keep - 1 if items[keep][1] in protected and keep > 0 else keep
    return list(items[:keep]), [m for _, m in items[start:]]


def finished(log0, log1, items, tag):
    """The ids of `items` both test hosts finished (their TAGDONE lines;
    a host-loss item: host 1's alone, host 0 being gone by design)."""
    done0, done1 = (set(map(int, re.findall(rf"^{tag}DONE (\d+)", log, re.M))) for log in (log0, log1))
    return {i for i, m in items if i in done1 and (m == "loss" or i in done0)}


def in_boots(items, protected, retries, boot, tag, say):
    """Runs `items` on one boot of fresh test hosts, and on up to `retries`
    more if one does not finish them (resume: the rest of the plan from
    the lost item's block, numbered on from the last id). `boot(items)`
    runs a boot and returns (harness Result, anything of its own).
    Returns [(result, its own, the items whose figures it stands for)]
    and a record of the boots for the results; `say` tells the user."""
    out, record, todo = [], [], items
    while todo:
        result, own = boot(todo)
        log0, log1 = (h.text() for h in result.hosts)
        kept, again = resume(todo, finished(log0, log1, todo, tag), protected)
        # The last boot allowed reports its unfinished items as such.
        last = not again or len(record) >= retries
        out.append((result, own, todo if last else kept))
        kept_ids = {i for i, _ in kept}
        record.append({"items": todo, "reasons": result.reasons, "lost": [i for i, _ in todo if i not in kept_ids]})
        if last:
            break
        # Kept for reading (the next boot's logs take these names), and
        # read from there when the caller parses this boot.
        for h in result.hosts:
            kept_as = h.log.with_suffix(f".boot{len(record)}.log")
            h.log.replace(kept_as)
            h.log = kept_as
        first = max(i for i, _ in todo) + 1
        todo = [(first + k, m) for k, m in enumerate(again)]
        say(f"items {record[-1]['lost']} lost ({'; '.join(result.reasons) or 'unfinished'}): "
            f"{', '.join(again)} again on fresh test hosts as items {first}-{todo[-1][0]}")
    return out, record


def reboots(boots):
    """What a run lost to its test hosts and ran again, in words (empty
    for a run that needed one boot)."""
    said = [f"items {', '.join(map(str, b['lost']))} lost ({'; '.join(b['reasons']) or 'unfinished'})"
            for b in boots[:-1] if b["lost"]]
    if not said:
        return ""
    return f"; test hosts booted {len(boots)} times: " + "; ".join(said) + ", each run again from its block on fresh ones"


def ratios(runs, key, protected):
    """Each item of a mode in `protected` with its two neighbours (by id):
    {"id", "mode", "ratio", "baseline_diff", "paused_frac", "running",
    "running_guest_clock"} or {"id", "mode", "dropped": why}. `key` is the
    throughput figure of a run; a run may carry "paused_frac",
    "guest_clock_ips", "interference_outer" and "interference_inner"."""
    by = {r["id"]: r for r in runs}
    out = []
    for r in runs:
        if r["mode"] not in protected:
            continue
        before, after = by.get(r["id"] - 1), by.get(r["id"] + 1)
        b = {"id": r["id"], "mode": r["mode"]}
        out.append(b)
        trio = [before, r, after]
        if any(x is None or x["mode"] != "none" for x in (before, after)):
            b["dropped"] = "not between two baselines"
            continue
        bad = [x for x in trio if "error" in x or not x.get(key)]
        if bad:
            b["dropped"] = f"item {bad[0]['id']}: {bad[0].get('error', 'no throughput')}"
            continue
        noisy = [(x["id"], k, x[k]) for x in trio for k in ("interference_outer", "interference_inner")
                 if x.get(k) is not None and x[k] > MAX_INTERFERENCE]
        if noisy:
            i, k, v = noisy[0]
            b["dropped"] = f"item {i}: {100 * v:.1f} % of the VM's {k.split('_')[1]} core went elsewhere"
            continue
        base = (before[key] + after[key]) / 2
        b["baseline_diff"] = abs(before[key] - after[key]) / base
        # Said beside a dropped block, never counted.
        b["ratio_unfiltered"] = r[key] / base
        if b["baseline_diff"] > MAX_BASELINE_DIFF:
            b["dropped"] = f"baselines differ by {100 * b['baseline_diff']:.1f} %"
            continue
        b["ratio"] = r[key] / base
        b["paused_frac"] = r.get("paused_frac")
        if b["paused_frac"] is not None and b["paused_frac"] < 1:
            b["running"] = b["ratio"] / (1 - b["paused_frac"])
        gb = [x.get("guest_clock_ips") for x in (before, after)]
        if r.get("guest_clock_ips") and all(gb):
            b["running_guest_clock"] = r["guest_clock_ips"] / (sum(gb) / 2)
    return out


def bootstrap_median(xs, n=2000, seed=1):
    """A 95 % percentile-bootstrap interval of the median of `xs`."""
    if len(xs) < 2:
        return None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def mode_summary(blocks, mode):
    """A mode's kept ratios: median, min-max, bootstrap interval; what
    was dropped and why."""
    mine = [b for b in blocks if b["mode"] == mode]
    kept = [b for b in mine if "ratio" in b]
    xs = [b["ratio"] for b in kept]
    noisy = [b["ratio_unfiltered"] for b in mine if "dropped" in b and "ratio_unfiltered" in b]
    return {"blocks": len(mine), "kept": len(kept), "dropped": [b["dropped"] for b in mine if "dropped" in b],
            "ratio_unfiltered": statistics.median(noisy) if noisy else None,
            "ratio": statistics.median(xs) if xs else None, "ratio_min": min(xs) if xs else None,
            "ratio_max": max(xs) if xs else None, "ratio_ci": bootstrap_median(xs)}


def inner_interference(lines, seconds):
    """The share of a test host's CPU 1 over a window that went to anything
    but the VM's vCPU thread, from the host's bench_cpu1 lines (the part
    after "TAGINRAW ID "): CPU 1's interrupt ticks and the ticks of each
    other task that last ran there."""
    irq, tasks = {}, {"start": {}, "end": {}}
    for line in lines:
        f = line.split()
        if len(f) >= 9 and f[1] == "cpu1":
            irq[f[0]] = int(f[7]) + int(f[8])
        elif len(f) >= 5 and f[1] == "task" and f[-1].isdigit() and f[0] in tasks:
            if " ".join(f[3:-1]) != "CPU 0/KVM":
                tasks[f[0]][int(f[2])] = int(f[-1])
    if "start" not in irq or "end" not in irq:
        return None
    return placement.share(tasks["start"], tasks["end"], irq["start"], irq["end"], seconds)


def retransmits(lines):
    """TCP retransmits between a window's bench_cpu1 start and end lines."""
    vals = {}
    for line in lines:
        f = line.split()
        if len(f) == 2 and f[1].isdigit():
            vals[f[0]] = int(f[1])
    return vals["end"] - vals["start"] if "start" in vals and "end" in vals else None
