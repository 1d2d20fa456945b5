//! Runs a workload and checks hag's audit against what the GPU really
//! wrote: every guest page whose bytes the GPU changed must be in hag's
//! GPU dirty log.
//!
//! For each submission: the driver writes the commands into the ring, the
//! runner takes a copy of guest RAM, rings the doorbell, waits, and diffs
//! guest RAM against the copy. The CPU writes nothing between copy and
//! diff (ring and batch buffers are written before the copy), so every
//! changed page was written by the GPU. After the workload, the dirty
//! bitmap is read and cleared; `missed` = changed pages not in it.
//!
//! [`run_workload_with`] checks a second log the same way: VFIO's standard
//! DMA log (`VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT`), which an unmodified
//! VMM reads instead of `/dev/hag`; it too must hold every changed page.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use hag_abi::sim_regs as r;
use hag_audit::audit::{self, AuditSink, SinkFull, ValidatedCommand};

use guest_gpu::driver::{gpr_registers, Driver, DriverError, Failure, Registers};
use guest_gpu::workloads::{Expect, Workload};

/// Where the GPU dirty log comes from.
pub trait DirtyLog {
    /// Reads and clears the dirty bitmap: the guest page numbers (relative
    /// to guest physical 0) marked since the last call.
    fn read_clear(&mut self) -> anyhow::Result<BTreeSet<u64>>;
}

/// The outcome of one workload.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Report {
    /// Workload name.
    pub workload: &'static str,
    /// Everything held: expected device outcome, exact values, no missed
    /// page.
    pub passed: bool,
    /// Commands in the workload (ring and batches, as the auditor counts).
    pub commands: u32,
    /// Ring submissions.
    pub submissions: usize,
    /// Guest pages whose bytes the GPU changed.
    pub written_pages: usize,
    /// Guest pages hag's dirty log marked.
    pub dirty_pages: usize,
    /// Changed pages the dirty log did not mark (must be 0).
    pub missed: usize,
    /// Up to 16 of them, as guest physical addresses.
    pub missed_gpas: Vec<String>,
    /// Guest pages VFIO's DMA-logging report marked (absent when VFIO's
    /// log was not checked).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vfio_dirty_pages: Option<usize>,
    /// Changed pages VFIO's report did not mark (must be 0; absent when
    /// VFIO's log was not checked).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vfio_missed: Option<usize>,
    /// Up to 16 of them, as guest physical addresses.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vfio_missed_gpas: Option<Vec<String>>,
    /// written / dirty (`None` when nothing was marked).
    pub precision: Option<f64>,
    /// Bytes the vGPU's engine wrote during the workload (its
    /// `bytes_written` counter; absent when not read): against
    /// `dirty_pages` × 4 KiB, the audit's precision in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_bytes_written: Option<u64>,
    /// MSIs received.
    pub interrupts: u64,
    /// What the device did: "completed", "rejected", "hung", or an error.
    pub outcome: String,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

impl Report {
    /// The one-line summary.
    pub fn summary(&self) -> String {
        let precision = self
            .precision
            .map_or_else(|| "n/a".to_owned(), |p| format!("{p:.2}"));
        let (vfio_dirty, vfio_missed) = match (self.vfio_dirty_pages, self.vfio_missed) {
            (Some(d), Some(m)) => (format!(" (vfio {d})"), format!(" (vfio {m})")),
            _ => (String::new(), String::new()),
        };
        let mut line = format!(
            "{} {}: {} commands, written {} pages, dirty {}{vfio_dirty}, missed {}{vfio_missed}, precision {}",
            if self.passed { "PASS" } else { "FAIL" },
            self.workload,
            self.commands,
            self.written_pages,
            self.dirty_pages,
            self.missed,
            precision
        );
        if self.outcome != "completed" {
            line.push_str(&format!(", {}", self.outcome));
        }
        if let Some(err) = &self.error {
            line.push_str(&format!(" ({err})"));
        }
        line
    }
}

#[derive(Default)]
struct Count(u32);

impl AuditSink for Count {
    fn command(&mut self, _cmd: &ValidatedCommand) -> Result<(), SinkFull> {
        self.0 += 1;
        Ok(())
    }
}

/// Checks a failure against the expected rejection.
fn check_rejection(
    failure: &Failure,
    want_addr: u64,
    want_header: u32,
    want_reason: u32,
) -> Result<String, String> {
    match failure.error {
        DriverError::Rejected {
            addr,
            header,
            reason,
            ..
        } => {
            if addr != want_addr || header != want_header || reason != want_reason {
                return Err(format!(
                    "{}; expected the command at gfx {want_addr:#x} with header {want_header:#010x}, reason {want_reason}",
                    failure.error
                ));
            }
            if failure.identity & r::INT_COMMAND_ERROR == 0 {
                return Err(format!(
                    "rejected, but INT_IDENTITY {:#x} lacks COMMAND_ERROR",
                    failure.identity
                ));
            }
            Ok(format!(
                "rejected at gfx {addr:#x} header {header:#010x} reason {reason}"
            ))
        }
        ref other => Err(format!(
            "expected a rejection at gfx {want_addr:#x}, got: {other}"
        )),
    }
}

/// Runs `w` on the driver and checks it. Errors are for the machinery
/// (registers, RAM, dirty log, a workload the host auditor refuses); a
/// workload that fails its checks gives a [`Report`] with `passed: false`.
pub fn run_workload<R: Registers>(
    drv: &mut Driver<'_, R>,
    log: &mut dyn DirtyLog,
    w: &mut dyn Workload,
    timeout: Duration,
) -> anyhow::Result<Report> {
    run_workload_with(drv, log, None, w, timeout)
}

/// [`run_workload`], also checking `vfio_log` (VFIO's DMA log) when given:
/// every changed page must be in it too.
pub fn run_workload_with<R: Registers>(
    drv: &mut Driver<'_, R>,
    log: &mut dyn DirtyLog,
    mut vfio_log: Option<&mut dyn DirtyLog>,
    w: &mut dyn Workload,
    timeout: Duration,
) -> anyhow::Result<Report> {
    let name = w.name();
    // Start from a clear bitmap: setup and earlier workloads do not count.
    log.read_clear().context("clearing the dirty log")?;
    if let Some(vfio) = vfio_log.as_deref_mut() {
        vfio.read_clear().context("clearing VFIO's DMA log")?;
    }
    let subs = w
        .prepare(&mut drv.setup())
        .with_context(|| format!("preparing workload {name}"))?;
    let registers = gpr_registers();
    let mut report = Report {
        workload: name,
        passed: false,
        commands: 0,
        submissions: subs.len(),
        written_pages: 0,
        dirty_pages: 0,
        missed: 0,
        missed_gpas: Vec::new(),
        vfio_dirty_pages: None,
        vfio_missed: None,
        vfio_missed_gpas: None,
        gpu_bytes_written: None,
        precision: None,
        interrupts: 0,
        outcome: "completed".to_owned(),
        error: None,
    };
    let mut written = BTreeSet::new();
    let mut before = Vec::new();
    let mut failure: Option<String> = None;
    let mut reset_needed = false;

    for (n, sub) in subs.iter().enumerate() {
        let pending = drv.write_commands(&sub.commands)?;

        // The host runs the same auditor first, on the same runs of ring
        // the device audits: a workload it refuses is a bug here, not a
        // finding about the device.
        let cfg = drv.audit_config(&registers);
        let mut count = Count::default();
        let mut host = Ok(());
        for (off, dwords) in &pending.parts {
            let at = drv.ring_gfx() + u64::from(*off);
            if let Err(e) = audit::audit(dwords, at, &cfg, &mut drv.mem(), &mut count) {
                host = Err(e);
                break;
            }
        }
        let mut want_reason = 0;
        match (sub.expect, host) {
            (Expect::Rejected { command }, Err(e))
                if e.gfx_addr == drv.ring_addr(u64::from(pending.offsets[command])) =>
            {
                want_reason = e.reason.code();
                report.commands += count.0 + 1;
            }
            (Expect::Rejected { .. }, Err(e)) => {
                bail!("workload {name} submission {n}: the host auditor rejects the wrong command: {e}")
            }
            (Expect::Rejected { .. }, Ok(())) => {
                bail!("workload {name} submission {n}: the host auditor accepts what should be rejected")
            }
            (_, Err(e)) => bail!("workload {name} submission {n} is invalid: {e}"),
            (_, Ok(())) => report.commands += count.0,
        }

        drv.ram().snapshot_into(&mut before);
        drv.doorbell(&pending)?;
        let result = drv.wait(timeout);
        written.extend(drv.ram().changed_since(&before));

        let verdict: Result<String, String> = match (sub.expect, result) {
            (Expect::Complete { user_interrupt }, Ok(done)) => {
                report.interrupts += done.interrupts;
                if user_interrupt && done.identity & r::INT_USER == 0 {
                    Err(format!(
                        "completed, but INT_IDENTITY {:#x} lacks USER_INTERRUPT",
                        done.identity
                    ))
                } else {
                    Ok("completed".to_owned())
                }
            }
            (Expect::Complete { .. }, Err(f)) => {
                report.interrupts += f.interrupts;
                reset_needed = true;
                Err(f.error.to_string())
            }
            (Expect::Rejected { command }, Err(f)) => {
                report.interrupts += f.interrupts;
                reset_needed = true;
                let want_addr = drv.ring_addr(u64::from(pending.offsets[command]));
                check_rejection(&f, want_addr, sub.commands[command][0], want_reason)
            }
            (Expect::Hang, Err(f)) => {
                report.interrupts += f.interrupts;
                reset_needed = true;
                match f.error {
                    DriverError::Hung { .. } if f.identity & r::INT_HANG != 0 => {
                        Ok("hung".to_owned())
                    }
                    DriverError::Hung { .. } => Err(format!(
                        "hung, but INT_IDENTITY {:#x} lacks HANG",
                        f.identity
                    )),
                    other => Err(format!("expected a hang, got: {other}")),
                }
            }
            (expect, Ok(_)) => Err(format!(
                "submission {n} completed, expected {}",
                match expect {
                    Expect::Hang => "a hang",
                    _ => "a rejection",
                }
            )),
        };
        match verdict {
            Ok(outcome) => report.outcome = outcome,
            Err(why) => {
                report.outcome = "error".to_owned();
                failure = Some(format!("submission {n}: {why}"));
                break;
            }
        }
    }

    let dirty = log.read_clear().context("reading the dirty log")?;
    let missed: Vec<u64> = written.difference(&dirty).copied().collect();
    report.written_pages = written.len();
    report.dirty_pages = dirty.len();
    report.missed = missed.len();
    report.missed_gpas = missed
        .iter()
        .take(16)
        .map(|p| format!("{:#x}", p * guest_ram::PAGE_SIZE))
        .collect();
    report.precision = (!dirty.is_empty()).then(|| written.len() as f64 / dirty.len() as f64);
    let mut vfio_missed = Vec::new();
    if let Some(vfio) = vfio_log {
        let vfio_dirty = vfio.read_clear().context("reading VFIO's DMA log")?;
        vfio_missed = written.difference(&vfio_dirty).copied().collect();
        report.vfio_dirty_pages = Some(vfio_dirty.len());
        report.vfio_missed = Some(vfio_missed.len());
        report.vfio_missed_gpas = Some(
            vfio_missed
                .iter()
                .take(16)
                .map(|p| format!("{:#x}", p * guest_ram::PAGE_SIZE))
                .collect(),
        );
    }

    if failure.is_none() {
        if let Err(e) = w.verify(&drv.mem()) {
            failure = Some(format!("{e:#}"));
        }
    }
    if failure.is_none() && !missed.is_empty() {
        failure = Some(format!(
            "{} guest pages written by the GPU are not in hag's dirty log (first: {})",
            missed.len(),
            report.missed_gpas.join(", ")
        ));
    }
    if failure.is_none() && !vfio_missed.is_empty() {
        failure = Some(format!(
            "{} guest pages written by the GPU are not in VFIO's DMA-logging report (first: {})",
            vfio_missed.len(),
            report
                .vfio_missed_gpas
                .as_deref()
                .unwrap_or_default()
                .join(", ")
        ));
    }
    if reset_needed {
        drv.reset()
            .map_err(|e| anyhow!(e))
            .context("resetting the vGPU after the workload")?;
    }
    report.passed = failure.is_none();
    report.error = failure;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use guest_gpu::driver::{DriverConfig, GttLayout};
    use guest_gpu::fake::FakeGpu;
    use guest_gpu::workloads::{by_name, NAMES};
    use guest_ram::GuestRam;

    /// The fake's own dirty bits, as hag's log would report them.
    struct FakeLog<'a, 'b>(&'b FakeGpu<'a>);

    impl DirtyLog for FakeLog<'_, '_> {
        fn read_clear(&mut self) -> anyhow::Result<BTreeSet<u64>> {
            Ok(self.0.take_dirty())
        }
    }

    struct NoLog;

    impl DirtyLog for NoLog {
        fn read_clear(&mut self) -> anyhow::Result<BTreeSet<u64>> {
            Ok(BTreeSet::new())
        }
    }

    fn run(
        names: &[&str],
        layout: GttLayout,
        tweak: impl Fn(&FakeGpu<'_>),
        no_log: bool,
    ) -> Vec<Report> {
        let ram = GuestRam::with_mib(16).unwrap();
        let gpu = FakeGpu::new(&ram);
        tweak(&gpu);
        let cfg = DriverConfig {
            ring_pages: 2,
            gtt_layout: layout,
        };
        let mut drv = Driver::init(&gpu, &ram, cfg).unwrap();
        let mut out = Vec::new();
        for name in names {
            let mut w = by_name(name).unwrap();
            let mut log: Box<dyn DirtyLog> = if no_log {
                Box::new(NoLog)
            } else {
                Box::new(FakeLog(&gpu))
            };
            out.push(
                run_workload(&mut drv, log.as_mut(), w.as_mut(), Duration::from_secs(1)).unwrap(),
            );
        }
        out
    }

    #[test]
    fn every_workload_passes_on_the_fake_device() {
        for layout in [GttLayout::Identity, GttLayout::Scattered] {
            for r in run(&NAMES, layout, |_| {}, false) {
                println!("{layout:?}: {}", r.summary());
                assert!(r.passed, "{layout:?}: {}", r.summary());
                assert_eq!(r.missed, 0);
                assert!(r.written_pages <= r.dirty_pages, "{}", r.summary());
            }
        }
    }

    #[test]
    fn summaries_have_the_documented_shape() {
        let reports = run(
            &["stores", "batch", "hang", "reject"],
            GttLayout::Scattered,
            |_| {},
            false,
        );
        // 512 stores + 8 × (store index + user interrupt); 128 pages + the
        // status page, all marked, none more.
        assert_eq!(
            reports[0].summary(),
            "PASS stores: 528 commands, written 129 pages, dirty 129, missed 0, precision 1.00"
        );
        assert_eq!(reports[0].submissions, 8);
        // data, counters, post-sync page, status page.
        assert_eq!(reports[1].written_pages, 4);
        assert!(
            reports[2].summary().ends_with(", hung"),
            "{}",
            reports[2].summary()
        );
        assert!(reports[3]
            .summary()
            .starts_with("PASS reject: 2 commands, written 0 pages, dirty 0, missed 0, precision n/a, rejected at gfx 0x"));
    }

    #[test]
    fn a_page_missing_from_the_dirty_log_fails_the_workload() {
        // Break the fake's audit for one page the batch workload writes
        // (its data page: the 3rd page allocated after status page and
        // ring), through the identity GTT.
        let reports = run(
            &["batch"],
            GttLayout::Identity,
            |gpu| gpu.forget_page(3),
            false,
        );
        let r = &reports[0];
        assert!(!r.passed);
        assert_eq!(r.missed, 1);
        assert_eq!(r.missed_gpas, vec!["0x3000".to_owned()]);
        assert_eq!(
            r.error.as_deref(),
            Some("1 guest pages written by the GPU are not in hag's dirty log (first: 0x3000)")
        );
    }

    #[test]
    fn without_a_dirty_log_every_written_page_is_missed() {
        let reports = run(&["stores"], GttLayout::Scattered, |_| {}, true);
        assert!(!reports[0].passed);
        assert_eq!(reports[0].missed, 129);
        assert_eq!(reports[0].dirty_pages, 0);
        assert_eq!(reports[0].precision, None);
    }

    /// hag's log from the fake, with a copy kept for [`VfioCopy`].
    struct TeeLog<'a, 'b, 'c>(&'b FakeGpu<'a>, &'c std::cell::RefCell<BTreeSet<u64>>);

    impl DirtyLog for TeeLog<'_, '_, '_> {
        fn read_clear(&mut self) -> anyhow::Result<BTreeSet<u64>> {
            let pages = self.0.take_dirty();
            self.1.borrow_mut().extend(pages.iter().copied());
            Ok(pages)
        }
    }

    /// VFIO's DMA log as the fake would report it: the same pages, minus
    /// `drop` (a broken VFIO report).
    struct VfioCopy<'c> {
        pages: &'c std::cell::RefCell<BTreeSet<u64>>,
        drop: Option<u64>,
    }

    impl DirtyLog for VfioCopy<'_> {
        fn read_clear(&mut self) -> anyhow::Result<BTreeSet<u64>> {
            let mut pages = std::mem::take(&mut *self.pages.borrow_mut());
            if let Some(page) = self.drop {
                pages.remove(&page);
            }
            Ok(pages)
        }
    }

    fn run_with_vfio(name: &str, drop: Option<u64>) -> Report {
        let ram = GuestRam::with_mib(16).unwrap();
        let gpu = FakeGpu::new(&ram);
        let cfg = DriverConfig {
            ring_pages: 2,
            gtt_layout: GttLayout::Identity,
        };
        let mut drv = Driver::init(&gpu, &ram, cfg).unwrap();
        let copy = std::cell::RefCell::new(BTreeSet::new());
        let mut hag = TeeLog(&gpu, &copy);
        let mut vfio = VfioCopy { pages: &copy, drop };
        let mut w = by_name(name).unwrap();
        run_workload_with(
            &mut drv,
            &mut hag,
            Some(&mut vfio),
            w.as_mut(),
            Duration::from_secs(1),
        )
        .unwrap()
    }

    #[test]
    fn the_vfio_log_is_checked_and_reported_too() {
        let r = run_with_vfio("stores", None);
        assert!(r.passed, "{}", r.summary());
        assert_eq!(
            r.summary(),
            "PASS stores: 528 commands, written 129 pages, dirty 129 (vfio 129), missed 0 (vfio 0), precision 1.00"
        );
        assert_eq!((r.vfio_dirty_pages, r.vfio_missed), (Some(129), Some(0)));
        let json = serde_json::to_string(&r).unwrap();
        assert!(
            json.contains(r#""vfio_dirty_pages":129,"vfio_missed":0,"vfio_missed_gpas":[]"#),
            "{json}"
        );
        // Without a VFIO log the fields are left out.
        let plain = run(&["stores"], GttLayout::Identity, |_| {}, false);
        let json = serde_json::to_string(&plain[0]).unwrap();
        assert!(!json.contains("vfio"), "{json}");
    }

    #[test]
    fn a_page_missing_from_the_vfio_log_fails_the_workload() {
        // The batch workload's data page (guest page 3 through the
        // identity GTT) is in hag's log but not in VFIO's report.
        let r = run_with_vfio("batch", Some(3));
        assert!(!r.passed);
        assert_eq!((r.missed, r.vfio_missed), (0, Some(1)));
        assert_eq!(r.vfio_missed_gpas, Some(vec!["0x3000".to_owned()]));
        assert_eq!(
            r.error.as_deref(),
            Some("1 guest pages written by the GPU are not in VFIO's DMA-logging report (first: 0x3000)")
        );
        assert!(
            r.summary().contains(", missed 0 (vfio 1), "),
            "{}",
            r.summary()
        );
    }

    #[test]
    fn a_wrong_value_fails_verification() {
        // Verification checks exact values: corrupt one after the fact.
        let ram = GuestRam::with_mib(16).unwrap();
        let mut drv = Driver::init(FakeGpu::new(&ram), &ram, DriverConfig::default()).unwrap();
        let mut w = by_name("stores").unwrap();
        let subs = w.prepare(&mut drv.setup()).unwrap();
        for s in &subs {
            drv.submit(&s.commands, Duration::from_secs(1)).unwrap();
        }
        w.verify(&drv.mem()).unwrap();
        // Store 0 goes to page 0 of the buffer, after status page and ring.
        let gfx = 3 * 4096;
        drv.mem().write_u32(gfx, 0).unwrap();
        let err = w.verify(&drv.mem()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "store 0 at gfx 0x3000 is 0x00000000, expected 0x57000000"
        );
    }
}
