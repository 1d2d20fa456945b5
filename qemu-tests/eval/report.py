"""The evaluation's report: checks a results.json (`check`) and draws
report.md and the plots from it (`render`), with matplotlib.

Used by qemu-tests/eval/run after a run, by `run --report-only` to redraw,
and by qemu-tests/eval/selftest on the stored fixture. Everything here
reads results.json only: a report can be redrawn on any machine.
"""

import math
import statistics
import subprocess
from pathlib import Path

# The original work (gHA/HAG on gVirt) and hag's targets, as ARCHITECTURE.md
# gives them.
REFERENCE = {
    "original_downtime_ms": [224, 411],
    "original_throughput_pct": [77, 92],
    "original_throughput_interval": "a backup every few seconds",
    "original_replication_mbit_s": [80, 170],
    "target_downtime": "within 2x of the floor (final dirty bytes + context over link bandwidth)",
    "target_throughput_pct_at_2s": 95,
    "target_replication": "at most the audited dirty bytes, compressed",
    "target_precision": "reported per workload; never a missed write",
    "target_takeover": "resumed from the last epoch, nothing acknowledged lost",
}

VARIANT_LABEL = {
    "audit": "hag (audited dirty log)",
    "full": "no GPU dirty tracking (full copy)",
    "hash": "page hashing",
    "audit-nocompress": "hag without compression",
    "unprotected": "unprotected",
}
VARIANT_ORDER = ["audit", "full", "hash", "audit-nocompress"]
COLORS = {"audit": "#1f77b4", "full": "#d62728", "hash": "#ff7f0e", "audit-nocompress": "#2ca02c"}

# Every field each section's records must carry (None allowed only where
# OPTIONAL says so), for `check`.
FIELDS = {
    "precision": ["workload", "commands", "written_pages", "dirty_pages", "missed", "audited_bytes",
                  "gpu_bytes_written", "page_precision", "byte_precision"],
    "migration": ["id", "workload", "dirty_pages_per_iter", "variant", "mode", "compress", "downtime_ms",
                  "quiesce_ms", "floor_ms", "downtime_bytes", "total_bytes", "rounds", "stop_pages",
                  "stop_zero_pages", "stop_gpu_pages", "stop_cpu_pages", "hashed_pages", "hash_ms",
                  "stop_hash_ms", "gtt_pages", "iterations_per_s", "gpu_write_mib_s", "verified"],
    "checkpoint_unprotected": ["id", "workload", "dirty_pages_per_iter", "mode", "variant", "interval_ms",
                               "iterations", "run_ips", "steady_ips", "baseline_steady_ips", "throughput_pct"],
    "checkpoint": ["id", "workload", "dirty_pages_per_iter", "mode", "compress", "variant", "interval_ms",
                   "iterations", "run_ips", "steady_ips", "baseline_steady_ips", "throughput_pct",
                   "throughput_run_pct", "epochs", "steady_epochs", "sync_bytes", "pause_ms_mean", "pause_ms_max",
                   "quiesce_ms_mean", "ack_ms_mean", "floor_ms_mean", "wire_bytes_per_epoch", "raw_bytes_per_epoch",
                   "audited_gpu_bytes_per_epoch", "cpu_pages_per_epoch", "gpu_pages_per_epoch",
                   "changed_bytes_per_epoch", "gpu_bytes_written_per_epoch", "hash_ms_mean",
                   "replication_mbit_s", "per_epoch"],
    "takeover": ["kind", "reason", "epoch", "generation", "takeover_ms", "start_vm_ms", "fill_ms", "restore_ms",
                 "pages", "detection_ms", "total_ms", "verified"],
}
OPTIONAL = {"interval_ms", "baseline_steady_ips"}
EPOCH_FIELDS = ["epoch", "pause_ms", "quiesce_ms", "pages", "cpu_dirty", "gpu_dirty", "bytes", "raw_bytes",
                "ack_ms", "iteration", "gpu_bytes_written", "hashed_pages", "hash_ms", "changed_pages",
                "floor_ms", "paused_at_s"]
PLOTS = ["throughput", "downtime", "epoch_pause", "bandwidth", "bytes_per_epoch", "precision", "dirty_sweep",
         "takeover"]


def check(res):
    """Problems with a results dict: missing sections or fields, and figures
    that cannot be right (negative times, ratios out of range, a missed
    write, a variant or takeover that never ran). Empty when well formed."""
    out = []
    for key in ("meta", "link", "rates", "precision", "migration", "checkpoint", "takeover", "reference"):
        if key not in res:
            out.append(f"section '{key}' missing")
    if out:
        return out
    if not (res["link"].get("bytes_per_s") or 0) > 0:
        out.append("link: no bandwidth measured")
    if not res["rates"] or any(not (r.get("iterations_per_s") or 0) > 0 for r in res["rates"]):
        out.append("rates: a workload was not calibrated")

    def fields(section, rec, names, where):
        for f in names:
            if f not in rec:
                out.append(f"{where}: field '{f}' missing")
            elif rec[f] is None and f not in OPTIONAL:
                out.append(f"{where}: field '{f}' is null")

    prec = res["precision"]
    if {p.get("workload") for p in prec} < {"stores", "blit", "batch"}:
        out.append("precision: stores, blit and batch must all be measured")
    for p in prec:
        w = f"precision {p.get('workload')}"
        fields("precision", p, FIELDS["precision"], w)
        if p.get("missed") != 0:
            out.append(f"{w}: {p.get('missed')} missed writes")
        if p.get("page_precision") is not None and not 0 < p["page_precision"] <= 1:
            out.append(f"{w}: page precision {p['page_precision']} outside (0, 1]")
        if p.get("byte_precision") is not None and not p["byte_precision"] > 0:
            out.append(f"{w}: byte precision {p['byte_precision']} not positive")

    plan = res["meta"].get("plan", [])
    want_mig = {(i["d"], i["mode"], bool(i["compress"])) for i in plan if i["kind"] == "mig"}
    have_mig = {(m.get("dirty_pages_per_iter"), m.get("mode"), m.get("compress")) for m in res["migration"]}
    for miss in sorted(want_mig - have_mig, key=str):
        out.append(f"migration {miss}: not in the results")
    for m in res["migration"]:
        w = f"migration {m.get('id')} ({m.get('workload')}, {m.get('variant')})"
        fields("migration", m, FIELDS["migration"], w)
        if not (m.get("downtime_ms") or 0) > 0 or not (m.get("floor_ms") or 0) > 0:
            out.append(f"{w}: downtime or floor not positive")
        if m.get("verified") is not True:
            out.append(f"{w}: the migrated workload did not verify")
        if m.get("mode") == "hash" and not (m.get("hashed_pages") or 0) > 0:
            out.append(f"{w}: hash mode hashed no page")
        if m.get("mode") == "audit" and m.get("hashed_pages"):
            out.append(f"{w}: audit mode hashed pages")
        if m.get("mode") == "full" and not (m.get("gtt_pages") or 0) > 0:
            out.append(f"{w}: full copy saw no GTT-mapped page")

    want_cp = {i["id"] for i in plan if i["kind"] == "cp"}
    have_cp = {c.get("id") for c in res["checkpoint"]}
    for miss in sorted(want_cp - have_cp):
        out.append(f"checkpoint item {miss}: not in the results")
    for c in res["checkpoint"]:
        w = f"checkpoint {c.get('id')} ({c.get('workload')}, {c.get('variant')}, {c.get('interval_ms')} ms)"
        if c.get("mode") == "none":
            fields("checkpoint", c, FIELDS["checkpoint_unprotected"], w)
            continue
        fields("checkpoint", c, FIELDS["checkpoint"], w)
        if (c.get("steady_epochs") or 0) < 1:
            out.append(f"{w}: no steady-state epoch")
        tp = c.get("throughput_pct")
        # Loose on purpose: a loaded machine moves the unprotected baseline.
        if tp is not None and not 0 < tp <= 400:
            out.append(f"{w}: throughput {tp:.0f} % of unprotected is implausible")
        for k in ("pause_ms_mean", "ack_ms_mean", "wire_bytes_per_epoch", "raw_bytes_per_epoch"):
            if c.get(k) is not None and not c[k] > 0:
                out.append(f"{w}: {k} not positive")
        if c.get("mode") == "hash" and not (c.get("hash_ms_mean") or 0) > 0:
            out.append(f"{w}: hash mode spent no time hashing")
        ch, raw = c.get("changed_bytes_per_epoch"), c.get("raw_bytes_per_epoch")
        if ch is not None and raw is not None and ch > raw:
            out.append(f"{w}: more changed bytes than sent")
        for e in c.get("per_epoch") or []:
            missing = [f for f in EPOCH_FIELDS if f not in e]
            if missing:
                out.append(f"{w} epoch {e.get('epoch')}: fields {missing} missing")
                break
    kinds = {t.get("kind") for t in res["takeover"]}
    for k in ("gpu-hang", "host-loss"):
        if k not in kinds:
            out.append(f"takeover after {k}: not measured")
    for t in res["takeover"]:
        w = f"takeover {t.get('kind')}"
        fields("takeover", t, FIELDS["takeover"], w)
        if not (t.get("takeover_ms") or 0) > 0:
            out.append(f"{w}: takeover time not positive")
    return out


# ---- helpers ----------------------------------------------------------------

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec=".0f", none="–"):
    return none if x is None else format(x, spec)


def kib(x):
    return fmt(None if x is None else x / 1024)


def interval_label(ms):
    if ms is None:
        return "–"
    return f"{ms / 1000:g} s" if ms >= 1000 else f"{ms:g} ms"


def cp_rows(res, d=None, variant=None, interval=None):
    rows = res["checkpoint"]
    if d is not None:
        rows = [r for r in rows if r["dirty_pages_per_iter"] == d]
    if variant is not None:
        rows = [r for r in rows if r["variant"] == variant]
    if interval is not None:
        rows = [r for r in rows if r["interval_ms"] == interval]
    return rows


def agg(rows, key):
    return med(r.get(key) for r in rows)


def series(res, variant, key, d=0):
    """(interval in s, median of `key`) of one variant, by interval."""
    ivs = sorted({r["interval_ms"] for r in cp_rows(res, d=d, variant=variant)})
    pts = [(i / 1000, agg(cp_rows(res, d=d, variant=variant, interval=i), key)) for i in ivs]
    return [p for p in pts if p[1] is not None]


def headline_interval(res):
    """The interval the headline quotes: 2 s if measured, else the nearest."""
    ivs = sorted({r["interval_ms"] for r in cp_rows(res, d=0, variant="audit")})
    if not ivs:
        return None
    return min(ivs, key=lambda x: abs(math.log(x / 2000)))


# ---- plots ------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"svg.hashsalt": "hag-eval", "font.size": 9, "figure.dpi": 110})
    return plt


def _finish_interval_axes(ax, ylabel, title, ylog=True):
    """Axes of a plot against the checkpoint interval."""
    ax.set_xscale("log")
    if ylog:
        ax.set_yscale("log")
    ax.set_xlabel("checkpoint interval (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3)


def _save(plt, fig, out, name):
    fig.tight_layout()
    fig.savefig(out / f"{name}.svg", metadata={"Date": None}, bbox_inches="tight")
    fig.savefig(out / f"{name}.png", bbox_inches="tight")
    plt.close(fig)


def plot_throughput(plt, res, out):
    fig, ax = plt.subplots(figsize=(8.4, 3.8))
    lo, hi = res["reference"]["original_throughput_pct"]
    ax.axhspan(lo, hi, color="0.85", label=f"original work, {lo}–{hi} % (backup every few s)")
    ax.axhline(res["reference"]["target_throughput_pct_at_2s"], color="0.3", ls=":", lw=1,
               label="hag target at 2 s (95 %)")
    for v in VARIANT_ORDER:
        pts = series(res, v, "throughput_pct")
        if pts:
            ax.plot(*zip(*pts), marker="o", color=COLORS[v], label=VARIANT_LABEL[v])
    top = max([y for v in VARIANT_ORDER for _, y in series(res, v, "throughput_pct")] + [100])
    ax.set_ylim(0, top + 10)
    _finish_interval_axes(ax, "throughput, % of unprotected", "frames workload under continuous checkpointing",
                          ylog=False)
    _save(plt, fig, out, "throughput")


def plot_downtime(plt, res, out):
    mig = res["migration"]
    workloads = sorted({m["dirty_pages_per_iter"] for m in mig})
    fig, ax = plt.subplots(figsize=(8.4, 3.8))
    width = 0.8 / len(VARIANT_ORDER)
    for k, v in enumerate(VARIANT_ORDER):
        xs, ys, fl = [], [], []
        for j, d in enumerate(workloads):
            rows = [m for m in mig if m["dirty_pages_per_iter"] == d and m["variant"] == v]
            if rows:
                xs.append(j + (k - 1.5) * width)
                ys.append(med(m["downtime_ms"] for m in rows))
                fl.append(med(m["floor_ms"] for m in rows))
        ax.bar(xs, ys, width, color=COLORS[v], label=VARIANT_LABEL[v])
        ax.scatter(xs, fl, marker="_", s=120, color="black", zorder=3,
                   label="floor (paused bytes / link)" if k == 0 else None)
    lo, hi = res["reference"]["original_downtime_ms"]
    ax.axhspan(lo, hi, color="0.85", zorder=0, label=f"original work, {lo}–{hi} ms")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(["frames" if d == 0 else f"synthetic\n+{d} pages/it" for d in workloads])
    ax.set_yscale("log")
    ax.set_ylabel("migration downtime (ms)")
    ax.set_title("live migration: downtime and its floor")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3, axis="y")
    _save(plt, fig, out, "downtime")


def plot_epoch_pause(plt, res, out):
    fig, ax = plt.subplots(figsize=(8.4, 3.8))
    lo, hi = res["reference"]["original_downtime_ms"]
    ax.axhspan(lo, hi, color="0.85", label=f"original work's backup downtime, {lo}–{hi} ms")
    for v in VARIANT_ORDER:
        pts = series(res, v, "pause_ms_mean")
        if pts:
            ax.plot(*zip(*pts), marker="o", color=COLORS[v], label=f"{VARIANT_LABEL[v]}: pause")
        fl = series(res, v, "floor_ms_mean")
        if fl:
            ax.plot(*zip(*fl), ls="--", lw=1, color=COLORS[v])
    ax.plot([], [], ls="--", color="0.3", label="floor (epoch bytes / link), dashed")
    _finish_interval_axes(ax, "VM paused per epoch (ms)", "frames: pause per checkpoint epoch")
    _save(plt, fig, out, "epoch_pause")


def plot_bandwidth(plt, res, out):
    fig, ax = plt.subplots(figsize=(8.4, 3.8))
    lo, hi = res["reference"]["original_replication_mbit_s"]
    ax.axhspan(lo, hi, color="0.85", label=f"original work, {lo}–{hi} Mbit/s")
    for v in VARIANT_ORDER:
        pts = series(res, v, "replication_mbit_s")
        if pts:
            ax.plot(*zip(*pts), marker="o", color=COLORS[v], label=VARIANT_LABEL[v])
    bw = res["link"].get("bytes_per_s")
    if bw:
        ax.axhline(bw * 8 / 1e6, color="black", lw=1, ls=":", label="test hosts' link (measured)")
    _finish_interval_axes(ax, "replication bandwidth (Mbit/s)", "frames: replication traffic")
    _save(plt, fig, out, "bandwidth")


def bytes_rows(res):
    """(label, audit row, {variant: rows}) per workload at its interval."""
    out = []
    hl = headline_interval(res)
    for d in sorted({r["dirty_pages_per_iter"] for r in res["checkpoint"]}):
        ivs = sorted({r["interval_ms"] for r in cp_rows(res, d=d, variant="audit")})
        if not ivs:
            continue
        iv = hl if d == 0 and hl in ivs else ivs[0]
        per = {v: cp_rows(res, d=d, variant=v, interval=iv) for v in VARIANT_ORDER}
        label = ("frames" if d == 0 else f"synthetic +{d}") + f"\n@{interval_label(iv)}"
        out.append((label, d, iv, per))
    return out


def plot_bytes(plt, res, out):
    rows = bytes_rows(res)
    bars = [("audited dirty (CPU + GPU pages)", lambda p: agg(p["audit"], "raw_bytes_per_epoch"), "#9ecae1"),
            ("really changed (backup)", lambda p: agg(p["audit"], "changed_bytes_per_epoch"), "#6baed6"),
            ("GPU bytes written (engine)", lambda p: agg(p["audit"], "gpu_bytes_written_per_epoch"), "#c6dbef"),
            ("hag on the wire (LZ4)", lambda p: agg(p["audit"], "wire_bytes_per_epoch"), COLORS["audit"]),
            ("no compression, wire", lambda p: agg(p["audit-nocompress"], "wire_bytes_per_epoch"),
             COLORS["audit-nocompress"]),
            ("page hashing, wire", lambda p: agg(p["hash"], "wire_bytes_per_epoch"), COLORS["hash"]),
            ("full copy, wire", lambda p: agg(p["full"], "wire_bytes_per_epoch"), COLORS["full"])]
    fig, ax = plt.subplots(figsize=(9.0, 4.0))
    width = 0.8 / len(bars)
    for k, (name, get, color) in enumerate(bars):
        xs, ys = [], []
        for j, (_, _, _, per) in enumerate(rows):
            y = get(per)
            if y:
                xs.append(j + (k - (len(bars) - 1) / 2) * width)
                ys.append(y / 1024)
        ax.bar(xs, ys, width, color=color, label=name)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r[0] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("KiB per epoch")
    ax.set_title("bytes per checkpoint epoch")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3, axis="y")
    _save(plt, fig, out, "bytes_per_epoch")


def precision_rows(res):
    """(workload, audited bytes, bytes written, really changed bytes).
    Per-epoch rows: audited CPU and GPU pages, as the backup's count of
    changed pages covers both."""
    rows = [(p["workload"], p["audited_bytes"], p["gpu_bytes_written"], p["written_pages"] * 4096)
            for p in res["precision"]]
    for label, d, iv, per in bytes_rows(res):
        a = per["audit"]
        rows.append((label.split("\n")[0] + " (per epoch)", agg(a, "raw_bytes_per_epoch"),
                     agg(a, "gpu_bytes_written_per_epoch"), agg(a, "changed_bytes_per_epoch")))
    return rows


def plot_precision(plt, res, out):
    rows = precision_rows(res)
    fig, ax = plt.subplots(figsize=(8.4, 3.8))
    xs = range(len(rows))
    ax.bar([x - 0.27 for x in xs], [(r[1] or 0) / 1024 for r in rows], 0.27, color="#9ecae1",
           label="audited dirty (pages × 4 KiB)")
    ax.bar(list(xs), [(r[3] or 0) / 1024 for r in rows], 0.27, color="#6baed6",
           label="pages really changed × 4 KiB")
    ax.bar([x + 0.27 for x in xs], [(r[2] or 0) / 1024 for r in rows], 0.27, color=COLORS["audit"],
           label="bytes the GPU wrote (engine counter)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r[0].replace(" (per epoch)", "\nper epoch").replace("synthetic ", "synth. ")
                        for r in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("KiB")
    ax.set_title("audit precision: what the audit marks vs what the GPU wrote")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3, axis="y")
    _save(plt, fig, out, "precision")


def plot_sweep(plt, res, out):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8.4, 3.6))
    # The synthetic workloads' checkpoint runs share one interval.
    synth = [r["interval_ms"] for r in res["checkpoint"] if r["dirty_pages_per_iter"] > 0 and r["interval_ms"]]
    sweep_iv = med(synth)
    for v in VARIANT_ORDER:
        rows = [m for m in res["migration"] if m["variant"] == v]
        ds = sorted({m["dirty_pages_per_iter"] for m in rows})
        pts = [(med(m["gpu_write_mib_s"] for m in rows if m["dirty_pages_per_iter"] == d),
                med(m["downtime_ms"] for m in rows if m["dirty_pages_per_iter"] == d)) for d in ds]
        pts = [p for p in pts if None not in p]
        if pts:
            a1.plot(*zip(*sorted(pts)), marker="o", color=COLORS[v], label=VARIANT_LABEL[v])
        pts = []
        for d in sorted({r["dirty_pages_per_iter"] for r in res["checkpoint"]}):
            audit = cp_rows(res, d=d, variant="audit", interval=sweep_iv)
            rate = agg(audit, "audited_gpu_bytes_per_epoch")
            pause = agg(cp_rows(res, d=d, variant=v, interval=sweep_iv), "pause_ms_mean")
            if rate and pause and sweep_iv:
                pts.append((rate / (sweep_iv / 1000) / (1 << 20), pause))
        if pts:
            a2.plot(*zip(*sorted(pts)), marker="o", color=COLORS[v], label=VARIANT_LABEL[v])
    a1.set_xlabel("GPU writes (MiB/s at the unprotected rate)")
    a1.set_ylabel("migration downtime (ms)")
    a1.set_yscale("log")
    a1.set_title("migration across dirty rates")
    a2.set_xlabel(f"audited GPU dirty MiB/s (hag, epochs of {interval_label(sweep_iv)})")
    a2.set_ylabel("pause per epoch (ms)")
    a2.set_yscale("log")
    a2.set_title("checkpoint epochs across dirty rates")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    a2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(plt, fig, out, "dirty_sweep")


def plot_takeover(plt, res, out):
    fig, ax = plt.subplots(figsize=(6.0, 2.8))
    labels = []
    for j, t in enumerate(res["takeover"]):
        labels.append("after a GPU hang" if t["kind"] == "gpu-hang" else "after host loss")
        left = 0
        parts = [("detection (failover timeout)", t["detection_ms"], "0.7"),
                 ("start VM", t["start_vm_ms"], "#6baed6"), ("fill RAM", t["fill_ms"], "#3182bd"),
                 ("restore + resume", t["restore_ms"], "#08519c"),
                 ("other", max(t["takeover_ms"] - t["start_vm_ms"] - t["fill_ms"] - t["restore_ms"], 0), "#c6dbef")]
        for name, ms, color in parts:
            ax.barh(j, ms, left=left, color=color, label=name if j == 0 else None)
            left += ms
        ax.text(left, j, f" {t['total_ms']:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    ax.set_xlabel("ms from the fault to the VM resumed on the backup")
    ax.set_title("takeover")
    ax.legend(fontsize=6.5, loc="lower right")
    ax.set_xlim(0, max([t["total_ms"] for t in res["takeover"]] + [1]) * 1.3)
    _save(plt, fig, out, "takeover")


# ---- the report -------------------------------------------------------------

def headline(res):
    """Rows: what, original work, hag target, measured, verdict."""
    ref = res["reference"]
    rows = []
    mig = [m for m in res["migration"] if m["variant"] == "audit"]
    frames_mig = [m for m in mig if m["dirty_pages_per_iter"] == 0] or mig
    dt, fl = med(m["downtime_ms"] for m in frames_mig), med(m["floor_ms"] for m in frames_mig)
    ratio = dt / fl if dt and fl else None
    worst = max((m["downtime_ms"] / m["floor_ms"] for m in mig if m["floor_ms"]), default=None)
    rows.append(("migration downtime (frames)", f"{ref['original_downtime_ms'][0]}–{ref['original_downtime_ms'][1]} ms",
                 "≤ 2× floor", f"{fmt(dt)} ms, floor {fmt(fl, '.1f')} ms ({fmt(ratio, '.0f')}×; "
                 f"worst workload {fmt(worst, '.0f')}×)", "met" if ratio and ratio <= 2 else "**missed**"))
    hl = headline_interval(res)
    a = cp_rows(res, d=0, variant="audit", interval=hl)
    pause = agg(a, "pause_ms_mean")
    rows.append((f"checkpoint pause per epoch (frames, {interval_label(hl)})",
                 f"{ref['original_downtime_ms'][0]}–{ref['original_downtime_ms'][1]} ms",
                 "(same floor rule)", f"{fmt(pause, '.0f')} ms, floor {fmt(agg(a, 'floor_ms_mean'), '.1f')} ms; "
                 f"output held {fmt(agg(a, 'ack_ms_mean'), '.0f')} ms more until the ack", "–"))
    tp = agg(a, "throughput_pct")
    base = [r["steady_ips"] for r in cp_rows(res, d=0, variant="unprotected") if r["steady_ips"]]
    spread = f" (unprotected runs {min(base):.0f}–{max(base):.0f} it/s)" if base else ""
    if tp and tp > 105:
        # More than unprotected: the baseline runs were slowed by the
        # machine's load, not the protected one sped up.
        verdict = "unclear: baseline disturbed"
    else:
        verdict = "met" if tp and tp >= ref["target_throughput_pct_at_2s"] else "**missed**"
    rows.append((f"throughput with a backup every {interval_label(hl)} (frames)",
                 f"{ref['original_throughput_pct'][0]}–{ref['original_throughput_pct'][1]} %",
                 f"≥ {ref['target_throughput_pct_at_2s']} %", f"{fmt(tp)} % of unprotected{spread}", verdict))
    mb = agg(a, "replication_mbit_s")
    wire, raw = agg(a, "wire_bytes_per_epoch"), agg(a, "raw_bytes_per_epoch")
    rows.append((f"replication bandwidth (frames, {interval_label(hl)})",
                 f"{ref['original_replication_mbit_s'][0]}–{ref['original_replication_mbit_s'][1]} Mbit/s",
                 "≤ audited dirty bytes, compressed", f"{fmt(mb, '.2f')} Mbit/s; {kib(wire)} KiB on the wire of "
                 f"{kib(raw)} KiB audited per epoch", "met" if wire and raw and wire <= raw else "**missed**"))
    prec = res["precision"]
    missed = sum(p["missed"] for p in prec)
    pp = ", ".join(f"{p['workload']} {fmt(p['page_precision'], '.2f')}" for p in prec)
    rows.append(("audit precision (written / audited pages)", "not given", "reported; never a missed write",
                 f"{pp}; missed {missed}", "met" if missed == 0 else "**missed**"))
    for t in res["takeover"]:
        what = "takeover after a GPU hang" if t["kind"] == "gpu-hang" else "takeover after host loss"
        extra = "" if t["kind"] == "gpu-hang" else f" ({t['detection_ms'] / 1000:g} s failover timeout + takeover)"
        rows.append((what, "not given", ref["target_takeover"],
                     f"{fmt(t['total_ms'])} ms{extra}, from epoch {t['epoch']}; workload verified",
                     "met" if t["verified"] else "**missed**"))
    return rows


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def report_md(res):
    meta = res["meta"]
    m = meta["machine"]
    bw = res["link"]["bytes_per_s"]
    s = [f"# hag evaluation ({meta['profile']})", ""]
    s.append(f"Run {meta['date_utc']} UTC at commit {meta['commit']} with `{meta['command']}` in "
             f"{meta['seconds']} s. Machine: {m['cores']} cores ({m['cpu']}), "
             f"{(m['memory_bytes'] or 0) / 2**30:.0f} GiB, load {m['load_at_start']} at start. "
             f"Test hosts: {m['test_hosts']}; link measured at {fmt(bw and bw * 8 / 1e6, '.0f')} Mbit/s. "
             "Times under TCG are those of emulated CPUs: absolute numbers are not those of real hardware.")
    s += ["", "## Headline", "", table(["what", "original work", "hag target", "hag measured", "target"],
                                       headline(res)), ""]
    s += ["## Throughput under protection", "", "![throughput](throughput.svg)", ""]
    rows = []
    for r in sorted(res["checkpoint"], key=lambda r: (r["dirty_pages_per_iter"], r["interval_ms"] or 0, r["variant"])):
        rows.append((r["workload"], VARIANT_LABEL[r["variant"]], interval_label(r["interval_ms"]),
                     fmt(r["steady_ips"]), fmt(r.get("throughput_pct")), fmt(r.get("throughput_run_pct")),
                     fmt(r.get("pause_ms_mean"), ".1f"), fmt(r.get("floor_ms_mean"), ".1f"),
                     fmt(r.get("ack_ms_mean"), ".1f"), fmt(r.get("hash_ms_mean"), ".1f"),
                     kib(r.get("raw_bytes_per_epoch")), kib(r.get("changed_bytes_per_epoch")),
                     kib(r.get("gpu_bytes_written_per_epoch")), kib(r.get("wire_bytes_per_epoch")),
                     fmt(r.get("replication_mbit_s"), ".2f")))
    s += [table(["workload", "variant", "interval", "it/s steady", "% of unprotected", "% (whole run)",
                 "pause ms", "floor ms", "ack ms", "hash ms", "audited KiB/epoch", "changed KiB",
                 "GPU-written KiB", "wire KiB", "Mbit/s"], rows), ""]
    s += ["Steady throughput counts iterations between the first and the last epoch's pause; the whole-run "
          "figure includes the first synchronisation. Audited KiB: pages sent (CPU and GPU dirty logs, or "
          "the baseline's choice) × 4 KiB; changed: pages whose bytes the backup found different; "
          "GPU-written: the engine's byte counter (rewrites counted each time).", ""]
    s += ["![pause per epoch](epoch_pause.svg)", "", "![replication bandwidth](bandwidth.svg)", "",
          "![bytes per epoch](bytes_per_epoch.svg)", ""]
    s += ["## Migration", "", "![downtime](downtime.svg)", ""]
    rows = [(m["workload"], VARIANT_LABEL[m["variant"]], fmt(m["downtime_ms"], ".1f"), fmt(m["floor_ms"], ".1f"),
             fmt(m["downtime_ms"] / m["floor_ms"] if m["floor_ms"] else None, ".1f"), kib(m["downtime_bytes"]),
             f"{m['stop_pages']} ({m['stop_zero_pages']})", fmt(m["stop_hash_ms"], ".1f"), m["rounds"],
             kib(m["total_bytes"]), fmt(m["gpu_write_mib_s"], ".1f"))
            for m in sorted(res["migration"], key=lambda m: (m["dirty_pages_per_iter"], m["variant"]))]
    s += [table(["workload", "variant", "downtime ms", "floor ms", "× floor", "paused KiB", "stop pages (zero)",
                 "hash ms at stop", "rounds", "total KiB", "GPU MiB/s"], rows), ""]
    s += ["The floor is the bytes sent while paused over the link bandwidth measured in the same run.", "",
          "![dirty-rate sweep](dirty_sweep.svg)", ""]
    s += ["## Audit precision", "", "![precision](precision.svg)", ""]
    rows = [(w, kib(a), kib(c), kib(g), fmt(g / a if a and g is not None else None, ".3f"),
             fmt(c / a if a and c is not None else None, ".2f")) for w, a, g, c in precision_rows(res)]
    s += [table(["workload", "audited KiB", "really changed KiB", "GPU-written KiB", "written / audited bytes",
                 "changed / audited pages"], rows), ""]
    s += ["hag-vmm run (stores, blit, batch) compares every guest page before and after; `missed` was "
          f"{sum(p['missed'] for p in res['precision'])} for all. The audit marks whole 4 KiB pages, so a "
          "dword store costs a page: byte precision is low by design and page precision is what replication "
          "pays. Per-epoch rows count rewrites in the engine's bytes, so they can exceed the audited bytes.", ""]
    s += ["## Takeover", "", "![takeover](takeover.svg)", ""]
    rows = [(t["kind"], t["epoch"], fmt(t["detection_ms"]), fmt(t["takeover_ms"], ".1f"), fmt(t["start_vm_ms"], ".1f"),
             fmt(t["fill_ms"], ".1f"), f"{t['pages']}", fmt(t["restore_ms"], ".1f"), fmt(t["total_ms"]))
            for t in res["takeover"]]
    s += [table(["fault", "from epoch", "detection ms", "takeover ms", "start VM", "fill RAM", "pages",
                 "restore", "total ms"], rows), ""]
    s += ["A GPU hang is reported at once (netlink event → HANG to the backup); a lost host is declared after "
          "the failover timeout of silence on every heartbeat path.", ""]
    s += [f"Raw figures: results.json. Redraw: `qemu-tests/eval/run --report-only --out DIR`.", ""]
    return "\n".join(s)


README_BEGIN = "<!-- eval:headline:begin (written by qemu-tests/eval/run --readme) -->"
README_END = "<!-- eval:headline:end -->"


def readme_block(res):
    """The README's headline: the table and where it was measured."""
    meta = res["meta"]
    m = meta["machine"]
    bw = res["link"]["bytes_per_s"]
    return "\n".join([
        table(["what", "original work", "hag target", "hag measured", "target"], headline(res)), "",
        f"Measured by `{meta['command']}` on {meta['date_utc']} UTC (commit {meta['commit']}, "
        f"{meta['seconds']} s): {m['cores']} cores ({m['cpu']}), load {m['load_at_start'][0]} at the start; "
        f"test hosts {m['test_hosts']}; link {fmt(bw and bw * 8 / 1e6, '.0f')} Mbit/s.",
    ])


def update_readme(res, path):
    """Replaces the README's block between the eval markers; returns
    whether the markers were found."""
    path = Path(path)
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        return False
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    path.write_text(f"{head}{README_BEGIN}\n{readme_block(res)}\n{README_END}{tail}")
    return True


QEMU_MIGRATION_BEGIN = "<!-- qemu-migration:begin (written by qemu-tests/eval/qemu-migration) -->"
QEMU_MIGRATION_END = "<!-- qemu-migration:end -->"


def included_section(out, name, begin, end):
    """DIR/NAME (a benchmark's own section of the report) between its
    markers, or nothing if it is not there."""
    part = Path(out) / name
    if not part.exists():
        return ""
    return f"\n{begin}\n{part.read_text()}{end}\n"


def qemu_migration_section(out):
    """The real-VM migration benchmark's section (qemu-tests/eval/qemu-migration
    writes qemu-migration.md), between its markers, or nothing."""
    return included_section(out, "qemu-migration.md", QEMU_MIGRATION_BEGIN, QEMU_MIGRATION_END)


QEMU_CHECKPOINT_BEGIN = "<!-- qemu-checkpoint:begin (written by qemu-tests/eval/qemu-checkpoint) -->"
QEMU_CHECKPOINT_END = "<!-- qemu-checkpoint:end -->"


def qemu_checkpoint_section(out):
    """The real-VM checkpoint benchmark's section (qemu-tests/eval/qemu-checkpoint
    writes qemu-checkpoint.md), between its markers, or nothing."""
    return included_section(out, "qemu-checkpoint.md", QEMU_CHECKPOINT_BEGIN, QEMU_CHECKPOINT_END)


QEMU_DATABASE_BEGIN = "<!-- qemu-database:begin (written by qemu-tests/eval/qemu-database) -->"
QEMU_DATABASE_END = "<!-- qemu-database:end -->"


def qemu_database_section(out):
    """The Debian guest's database benchmark's section (qemu-tests/eval/qemu-database
    writes qemu-database.md), between its markers, or nothing."""
    return included_section(out, "qemu-database.md", QEMU_DATABASE_BEGIN, QEMU_DATABASE_END)


def put_section(out, section, begin, end):
    """Puts a benchmark's section (with its markers) into DIR/report.md,
    in place of its previous one or at the end, as render() does when it
    redraws report.md."""
    path = Path(out) / "report.md"
    text = path.read_text() if path.exists() else "# hag evaluation\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head.rstrip("\n") + "\n" + section + tail.lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n" + section
    path.write_text(text)


def put_readme_block(path, begin, end, block, who):
    """Rewrites the README's text between `begin` and `end` (a benchmark's
    table); says so, or that the markers are missing."""
    text = Path(path).read_text()
    if begin not in text or end not in text:
        print(f"{who}: {path} has no {who} markers; left as it is")
        return
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    Path(path).write_text(f"{head}{begin}\n{block}\n{end}{tail}")
    print(f"{who}: table in {path} rewritten")


def git_commit():
    """This tree's commit, short (what a benchmark ran)."""
    r = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def render(res, out):
    """Writes report.md and every plot (SVG and PNG) into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plt = _plt()
    for name, fn in [("throughput", plot_throughput), ("downtime", plot_downtime), ("epoch_pause", plot_epoch_pause),
                     ("bandwidth", plot_bandwidth), ("bytes_per_epoch", plot_bytes), ("precision", plot_precision),
                     ("dirty_sweep", plot_sweep), ("takeover", plot_takeover)]:
        fn(plt, res, out)
    (out / "report.md").write_text(report_md(res) + qemu_migration_section(out) + qemu_checkpoint_section(out)
                                   + qemu_database_section(out))
