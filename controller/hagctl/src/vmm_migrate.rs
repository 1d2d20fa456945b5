//! `hagctl migrate --qmp` and `hagctl receive --qmp`: a VMM's own live
//! migration (QEMU's), started, watched and reported by hagctl, written
//! against [`Vmm`].
//!
//! The source side reads the VM's migration blockers first and refuses
//! naming each, sets the migration up (capabilities, `downtime-limit`,
//! `max-bandwidth`, further parameters), starts it, prints progress about
//! once a second, cancels it on SIGINT/SIGTERM or `--timeout` (the VM runs
//! on), and reports QEMU's own figures. The VM must never run twice: the
//! source QEMU is ended once the migration completed, and QEMU completes
//! only when the target said, over the migration's return path, that it
//! loaded everything (which it says after starting its VM). So hagctl turns
//! on `return-path` unless told otherwise, and without it never ends the
//! source (it stays paused in `postmigrate`).
//!
//! The target side has a VMM that waits for a migration (QEMU `-incoming
//! defer`) listen, and waits for it to complete and the VM to run; a
//! failure is QEMU's own message.
//!
//! With `--copy-storage` the VM's local disks move too (see
//! [`crate::vmm::qemu_storage`]): the target serves its disks over NBD
//! before it listens; the source mirrors each disk there and starts the
//! migration only once every mirror is ready; after the migration
//! completed it completes the mirrors (the source staying on its own
//! disks) and lets go of the exports, and only then does the target
//! resume the VM. Before completion, any failure cancels the mirrors: the
//! source VM runs on, on its own disks.

use crate::log::{info, progress, warning};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use serde::Serialize;

use crate::vmm::{
    DiskCopy, Feature, MigrationAddress, MigrationInfo, MigrationSettings, RunKind, RunState, Vmm,
};

/// How often the watch loops ask the VMM.
const POLL: Duration = Duration::from_millis(100);

/// Bytes in a human unit: `512 B`, `3.2 KiB`, `12.3 MiB`, `1.50 GiB`.
pub fn fmt_bytes(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if bytes < 1024 {
        format!("{bytes} B")
    } else if b < KIB * KIB {
        format!("{:.1} KiB", b / KIB)
    } else if b < KIB * KIB * KIB {
        format!("{:.1} MiB", b / (KIB * KIB))
    } else {
        format!("{:.2} GiB", b / (KIB * KIB * KIB))
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// `--capability NAME=on|off` (also true/false, yes/no, 1/0).
pub fn parse_capability(text: &str) -> Result<(String, bool), String> {
    let (name, state) = text
        .split_once('=')
        .ok_or_else(|| format!("'{text}' is not NAME=on|off"))?;
    if !valid_name(name) {
        return Err(format!("'{name}' is not a capability name"));
    }
    let on = match state.to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => true,
        "off" | "false" | "no" | "0" => false,
        _ => return Err(format!("'{text}': the state is on or off")),
    };
    Ok((name.to_owned(), on))
}

/// `--parameter NAME=VALUE`: VALUE as JSON if it is JSON (a number,
/// `true`, `"quoted text"`), else as a string.
pub fn parse_parameter(text: &str) -> Result<(String, serde_json::Value), String> {
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| format!("'{text}' is not NAME=VALUE"))?;
    if !valid_name(name) {
        return Err(format!("'{name}' is not a parameter name"));
    }
    let value = serde_json::from_str(value).unwrap_or_else(|_| value.into());
    Ok((name.to_owned(), value))
}

/// Why QEMU will not migrate the VM, each blocker named.
pub fn blocked_message(vmm: &str, reasons: &[String]) -> String {
    let list: Vec<String> = reasons.iter().map(|r| format!("\"{r}\"")).collect();
    format!(
        "{vmm} cannot migrate this VM: {} {}: {}",
        reasons.len(),
        if reasons.len() == 1 {
            "blocker"
        } else {
            "blockers"
        },
        list.join("; ")
    )
}

/// A progress line: what the VMM says of the migration under way.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Progress {
    /// The VMM's migration status.
    pub status: String,
    /// Since hagctl started it, ms.
    pub elapsed_ms: u64,
    /// Bytes sent.
    pub transferred: Option<u64>,
    /// RAM bytes left.
    pub remaining: Option<u64>,
    /// Guest RAM bytes.
    pub total: Option<u64>,
    /// Pages dirtied per second.
    pub dirty_pages_rate: Option<u64>,
    /// Rounds so far (`dirty-sync-count`).
    pub rounds: Option<u64>,
    /// The pause the VMM expects, ms.
    pub expected_downtime_ms: Option<u64>,
    /// Throughput, Mbit/s.
    pub mbps: Option<f64>,
}

impl Progress {
    /// From the VMM's view, `elapsed` after the start.
    pub fn new(info: &MigrationInfo, elapsed: Duration) -> Progress {
        let ram = info.ram.clone().unwrap_or_default();
        Progress {
            status: info.status.clone(),
            elapsed_ms: elapsed.as_millis() as u64,
            transferred: ram.transferred,
            remaining: ram.remaining,
            total: ram.total,
            dirty_pages_rate: ram.dirty_pages_rate,
            rounds: ram.dirty_sync_count,
            expected_downtime_ms: info.expected_downtime_ms,
            mbps: ram.mbps,
        }
    }

    /// One line; what the VMM did not say is left out.
    pub fn text(&self) -> String {
        let mut parts = Vec::new();
        if let Some(t) = self.transferred {
            parts.push(format!("{} sent", fmt_bytes(t)));
        }
        match (self.remaining, self.total) {
            (Some(r), Some(t)) => parts.push(format!("{} of {} left", fmt_bytes(r), fmt_bytes(t))),
            (Some(r), None) => parts.push(format!("{} left", fmt_bytes(r))),
            (None, Some(t)) => parts.push(format!("RAM {}", fmt_bytes(t))),
            (None, None) => {}
        }
        if let Some(d) = self.dirty_pages_rate {
            parts.push(format!("dirtying {d} pages/s"));
        }
        if let Some(r) = self.rounds {
            parts.push(format!("round {r}"));
        }
        if let Some(d) = self.expected_downtime_ms {
            parts.push(format!("expected downtime {d} ms"));
        }
        if let Some(m) = self.mbps {
            parts.push(format!("{m:.1} Mbit/s"));
        }
        let head = format!(
            "migration {} at {:.1} s",
            self.status,
            self.elapsed_ms as f64 / 1e3
        );
        if parts.is_empty() {
            head
        } else {
            format!("{head}: {}", parts.join(", "))
        }
    }

    /// One JSON object, one line.
    pub fn json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// A mirror progress line: each disk's copy (`--copy-storage`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MirrorProgress {
    /// Since hagctl started, ms.
    pub elapsed_ms: u64,
    /// Each disk's mirror.
    pub mirror: Vec<DiskCopy>,
}

impl MirrorProgress {
    /// One line: `mirror at 1.2 s: vda 2.0 MiB of 8.0 MiB (running), …`.
    pub fn text(&self) -> String {
        let disks: Vec<String> = self
            .mirror
            .iter()
            .map(|c| {
                format!(
                    "{} {} of {} ({})",
                    c.disk,
                    fmt_bytes(c.copied),
                    fmt_bytes(c.total),
                    c.status
                )
            })
            .collect();
        format!(
            "mirror at {:.1} s: {}",
            self.elapsed_ms as f64 / 1e3,
            disks.join(", ")
        )
    }

    /// One JSON object, one line.
    pub fn json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// What became of the source VM after a completed migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SourceOutcome {
    /// hagctl ended the source VMM (`quit`).
    Quit,
    /// `--keep-source`: left paused (QEMU: `postmigrate`).
    KeptPaused,
    /// Left paused because the return path was off: QEMU could not know
    /// that the target loaded the state.
    PausedNoReturnPath,
}

/// What `hagctl migrate --qmp` reports: the VMM's own figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct VmmMigrationReport {
    /// The target.
    pub to: String,
    /// Which VMM migrated.
    pub vmm: String,
    /// The VMM's final status (`completed`).
    pub status: String,
    /// How long the VM was paused, ms (QEMU's `downtime`).
    pub downtime_ms: Option<u64>,
    /// The whole migration, ms (QEMU's `total-time`).
    pub total_time_ms: Option<u64>,
    /// Of which setup, ms (QEMU's `setup-time`).
    pub setup_time_ms: Option<u64>,
    /// Bytes sent (QEMU's `ram.transferred`: the whole stream).
    pub transferred_bytes: Option<u64>,
    /// Rounds (QEMU's `ram.dirty-sync-count`).
    pub rounds: Option<u64>,
    /// Throughput, Mbit/s (QEMU's `ram.mbps`: transferred over the time
    /// after setup).
    pub throughput_mbps: Option<f64>,
    /// Guest RAM bytes.
    pub ram_total_bytes: Option<u64>,
    /// Bytes sent while the VM was paused.
    pub downtime_bytes: Option<u64>,
    /// VFIO devices' state bytes (QEMU's `vfio.transferred`; absent
    /// without a VFIO device).
    pub vfio_transferred_bytes: Option<u64>,
    /// `downtime-limit` set, ms.
    pub downtime_limit_ms: Option<u64>,
    /// `max-bandwidth` set, bytes per second.
    pub max_bandwidth: Option<u64>,
    /// Capabilities set, `NAME=on|off`.
    pub capabilities: Vec<String>,
    /// `migrate` attempts (more than one when the target was not yet
    /// listening).
    pub attempts: u32,
    /// What became of the source VM.
    pub source: Option<SourceOutcome>,
    /// `--copy-storage`: each disk's mirror as it was when the migration
    /// started (all `ready`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskCopy>,
}

fn opt_ms(v: Option<u64>) -> String {
    v.map_or_else(|| "?".into(), |ms| format!("{ms} ms"))
}

impl VmmMigrationReport {
    /// From the VMM's final view.
    pub fn new(to: &str, vmm: &str, info: &MigrationInfo, settings: &MigrationSettings) -> Self {
        let ram = info.ram.clone().unwrap_or_default();
        VmmMigrationReport {
            to: to.to_owned(),
            vmm: vmm.to_owned(),
            status: info.status.clone(),
            downtime_ms: info.downtime_ms,
            total_time_ms: info.total_time_ms,
            setup_time_ms: info.setup_time_ms,
            transferred_bytes: ram.transferred,
            rounds: ram.dirty_sync_count,
            throughput_mbps: ram.mbps,
            ram_total_bytes: ram.total,
            downtime_bytes: ram.downtime_bytes,
            vfio_transferred_bytes: info.vfio_transferred,
            downtime_limit_ms: settings.downtime_limit_ms,
            max_bandwidth: settings.max_bandwidth,
            capabilities: settings
                .capabilities
                .iter()
                .map(|(n, on)| format!("{n}={}", if *on { "on" } else { "off" }))
                .collect(),
            attempts: 1,
            source: None,
            disks: Vec::new(),
        }
    }

    /// The text form: two or three lines.
    pub fn text(&self) -> String {
        let mut s = format!(
            "migrated to {} by {}: downtime {}, total time {} (setup {}), {} transferred in {} rounds, {}\n",
            self.to,
            self.vmm,
            opt_ms(self.downtime_ms),
            opt_ms(self.total_time_ms),
            opt_ms(self.setup_time_ms),
            self.transferred_bytes.map_or_else(|| "?".into(), fmt_bytes),
            self.rounds.map_or_else(|| "?".into(), |r| r.to_string()),
            self.throughput_mbps
                .map_or_else(|| "? Mbit/s".into(), |m| format!("{m:.1} Mbit/s")),
        );
        let mut details = Vec::new();
        if let Some(t) = self.ram_total_bytes {
            details.push(format!("RAM {}", fmt_bytes(t)));
        }
        if let Some(d) = self.downtime_bytes {
            details.push(format!("{} sent during downtime", fmt_bytes(d)));
        }
        if let Some(v) = self.vfio_transferred_bytes {
            details.push(format!("VFIO device state {}", fmt_bytes(v)));
        }
        if let Some(l) = self.downtime_limit_ms {
            details.push(format!("downtime limit {l} ms"));
        }
        if let Some(b) = self.max_bandwidth {
            details.push(format!("bandwidth limit {}/s", fmt_bytes(b)));
        }
        if self.attempts > 1 {
            details.push(format!("{} attempts", self.attempts));
        }
        if !self.disks.is_empty() {
            let disks: Vec<String> = self
                .disks
                .iter()
                .map(|c| format!("{} ({})", c.disk, fmt_bytes(c.total)))
                .collect();
            details.push(format!("disks mirrored over NBD: {}", disks.join(", ")));
        }
        if !details.is_empty() {
            s += &format!("  {}\n", details.join(", "));
        }
        match self.source {
            Some(SourceOutcome::Quit) => {
                s += "  source: QEMU ended (quit); the VM runs on the target only\n"
            }
            Some(SourceOutcome::KeptPaused) => {
                s += "  source: kept paused in postmigrate (--keep-source); never resume it while the target runs\n"
            }
            Some(SourceOutcome::PausedNoReturnPath) => {
                s += "  source: kept paused in postmigrate (return-path off: QEMU cannot know the target loaded the state); end it once the target runs\n"
            }
            None => {}
        }
        s
    }
}

/// Options of `hagctl migrate --qmp`.
#[derive(Clone, Debug)]
pub struct VmmMigrateOptions {
    /// Where to.
    pub to: MigrationAddress,
    /// Capabilities and parameters (hagctl adds `return-path=on` unless
    /// it is given).
    pub settings: MigrationSettings,
    /// Leave the source paused after success instead of ending it.
    pub keep_source: bool,
    /// Retry a refused connection (the target not listening yet) this long.
    pub connect_timeout: Duration,
    /// Cancel a migration still running after this long.
    pub timeout: Option<Duration>,
    /// Progress as JSON lines.
    pub json: bool,
    /// Time between progress lines.
    pub progress_every: Duration,
    /// `--copy-storage`: mirror the VM's writable disks to the target's
    /// NBD exports at this address first.
    pub copy_storage: Option<MigrationAddress>,
}

/// Blocks SIGINT and SIGTERM in this thread (call it before any other
/// thread starts, so all inherit the mask) and returns a flag a watcher
/// thread raises when one arrives. A second signal ends hagctl at once
/// (status 130), leaving the VMM to finish the cancel itself.
pub fn watch_stop_signals() -> anyhow::Result<Arc<AtomicBool>> {
    watch_stop_signals_for("cancelling the migration")
}

/// [`watch_stop_signals`], saying `what` it does on the first signal.
pub fn watch_stop_signals_for(what: &'static str) -> anyhow::Result<Arc<AtomicBool>> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block()
        .map_err(|e| anyhow!("cannot block SIGINT/SIGTERM: {e}"))?;
    let flag = Arc::new(AtomicBool::new(false));
    let raised = flag.clone();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            if let Ok(sig) = set.wait() {
                if raised.swap(true, Ordering::SeqCst) {
                    info!("{sig} again: leaving; {what} was already under way");
                    std::process::exit(130);
                }
                info!("{sig}: {what}");
            }
        })
        .map_err(|e| anyhow!("cannot start the signal thread: {e}"))?;
    Ok(flag)
}

/// How a watched migration ended.
enum End {
    Completed(MigrationInfo),
    Failed(MigrationInfo),
    Cancelled,
}

/// A refused connection: the target is not listening (yet).
fn refused(info: &MigrationInfo) -> bool {
    info.error
        .as_deref()
        .is_some_and(|e| e.contains("Connection refused"))
}

/// `hagctl migrate --qmp`: migrates `vm` with its VMM's own migration.
pub fn migrate(
    vm: &mut dyn Vmm,
    opts: &VmmMigrateOptions,
    stop: &AtomicBool,
) -> anyhow::Result<VmmMigrationReport> {
    let name = vm.describe();
    if !vm.supports(Feature::Migrate) {
        return Err(vm.unsupported(Feature::Migrate).into());
    }
    let state = vm.run_state()?;
    match state.kind {
        RunKind::Running | RunKind::Paused => {}
        RunKind::Migrated => bail!(
            "the VM at {name} is {state}: it migrated away already and may run on its target; \
             hagctl will not migrate it again (resume it with QMP 'cont' only if you know the \
             target does not run it)"
        ),
        RunKind::Incoming => bail!(
            "the VM at {name} is {state}: it waits for an incoming migration (use hagctl receive)"
        ),
        _ => bail!("the VM at {name} is {state}, not running or paused"),
    }
    let info = vm.migration_info()?;
    if info.is_running() {
        bail!(
            "{name} is migrating already (status {}); cancel that first",
            info.status
        );
    }
    let blockers = vm.migration_blockers()?;
    if !blockers.is_empty() {
        bail!("{}", blocked_message(&name, &blockers));
    }
    let mut settings = opts.settings.clone();
    if settings.capability("return-path").is_none() {
        settings
            .capabilities
            .insert(0, ("return-path".into(), true));
    }
    // A `hagctl checkpoint` killed before it could reset it leaves
    // x-ignore-shared on: the migration would then leave shared RAM out.
    if settings.capability("x-ignore-shared").is_none() {
        settings
            .capabilities
            .push(("x-ignore-shared".into(), false));
    }
    let return_path = settings.capability("return-path") == Some(true);
    let start = Instant::now();
    let mut disks = Vec::new();
    if let Some(nbd) = &opts.copy_storage {
        if !vm.supports(Feature::CopyStorage) {
            return Err(vm.unsupported(Feature::CopyStorage).into());
        }
        if stop.load(Ordering::SeqCst) {
            bail!("interrupted before the migration started; {name} was not touched");
        }
        disks = mirror_disks(vm, nbd, opts, stop, start)?;
    }
    let copying = opts.copy_storage.is_some();
    let (end, attempts) = match run_migration(vm, opts, stop, &settings, &state, start) {
        Ok(done) => done,
        Err(e) if copying => bail!("{e:#}; {}", abort_mirrors(vm)),
        Err(e) => return Err(e),
    };
    // Before the migration completed, a failure leaves the source on its
    // own disks: the mirrors are cancelled.
    let mirrors_note = |vm: &mut dyn Vmm| {
        if copying {
            format!("; {}", abort_mirrors(vm))
        } else {
            String::new()
        }
    };
    match end {
        End::Completed(info) => {
            if copying {
                vm.finish_disk_copy().map_err(|e| {
                    anyhow!(
                        "the migration to {} completed, but completing the disks' mirrors failed: \
                         {e}; the source QEMU is paused (postmigrate) on its own disks, and the \
                         target waits, paused, until its NBD exports are let go: check its disks \
                         before resuming it there, and never resume both",
                        opts.to
                    )
                })?;
                info!(
                    "every mirror completed (block-job-cancel: the source stays on its \
                     own disks) and the NBD nodes are deleted: the target may resume the VM"
                );
            }
            let mut report = VmmMigrationReport::new(&opts.to.to_string(), &name, &info, &settings);
            report.attempts = attempts;
            report.disks = disks;
            report.source = Some(if !return_path {
                warning!(
                    "return-path is off: QEMU cannot know whether the target \
                     loaded the state, so the source VM stays paused; end it once the target runs"
                );
                SourceOutcome::PausedNoReturnPath
            } else if opts.keep_source {
                SourceOutcome::KeptPaused
            } else {
                // QEMU completed only once the target's return path said
                // it loaded the whole state (it says so after starting its
                // VM): this copy must not run again.
                vm.quit().map_err(|e| {
                    anyhow!(
                        "the migration completed, but ending the source QEMU failed: {e}; \
                         it is paused (postmigrate): never resume it, end it"
                    )
                })?;
                SourceOutcome::Quit
            });
            Ok(report)
        }
        End::Failed(info) => {
            let mirrors = mirrors_note(vm);
            let why = info
                .error
                .clone()
                .unwrap_or_else(|| "QEMU gave no reason".into());
            let hint = if why.contains("Sibling indicated error") {
                " (the target refused what it received: see hagctl receive or the target \
                 QEMU's log)"
            } else if refused(&info) {
                " (nothing listens there: start hagctl receive on the target first)"
            } else {
                ""
            };
            bail!(
                "the migration to {} failed: QEMU: {why}{hint}; {}{mirrors}",
                opts.to,
                source_after(vm, &state.name)
            )
        }
        End::Cancelled => {
            let mirrors = mirrors_note(vm);
            let by = if stop.load(Ordering::SeqCst) {
                "cancelled on a signal".to_owned()
            } else if opts.timeout.is_some_and(|t| start.elapsed() >= t) {
                format!(
                    "cancelled after --timeout {} s",
                    opts.timeout.unwrap_or_default().as_secs_f64()
                )
            } else {
                "cancelled by another QMP client".to_owned()
            };
            bail!(
                "the migration to {} was {by} (migrate_cancel); {}{mirrors}",
                opts.to,
                source_after(vm, &state.name)
            )
        }
    }
}

/// Starts the migration (retrying a refused connection for
/// `--connect-timeout`) and watches it to its end; returns how it ended
/// and the attempts.
fn run_migration(
    vm: &mut dyn Vmm,
    opts: &VmmMigrateOptions,
    stop: &AtomicBool,
    settings: &MigrationSettings,
    state: &RunState,
    start: Instant,
) -> anyhow::Result<(End, u32)> {
    let name = vm.describe();
    let mut attempts = 0u32;
    loop {
        if attempts == 0 && stop.load(Ordering::SeqCst) {
            bail!("interrupted before the migration started; {name} was not migrated");
        }

        attempts += 1;
        if let Err(e) = vm.start_migration(&opts.to, settings) {
            match e.qemu_desc() {
                Some(desc) => bail!("{name} refused to start the migration: {desc}"),
                None => return Err(e.into()),
            }
        }
        if attempts == 1 {
            info!("{name} migrates to {} (state {state})", opts.to);
        }
        let end = watch(vm, opts, stop, start)?;
        match &end {
            End::Failed(info)
                if refused(info)
                    && start.elapsed() < opts.connect_timeout
                    && !stop.load(Ordering::SeqCst) =>
            {
                std::thread::sleep(Duration::from_millis(250));
            }
            _ => return Ok((end, attempts)),
        }
    }
}

/// `--copy-storage`: starts a mirror of each writable disk to the
/// target's NBD exports at `nbd` and waits until every one is ready,
/// printing progress. On a failure, a signal or `--timeout`, cancels the
/// mirrors and says so.
fn mirror_disks(
    vm: &mut dyn Vmm,
    nbd: &MigrationAddress,
    opts: &VmmMigrateOptions,
    stop: &AtomicBool,
    start: Instant,
) -> anyhow::Result<Vec<DiskCopy>> {
    let name = vm.describe();
    let disks = vm
        .start_disk_copy(nbd, opts.connect_timeout)
        .map_err(|e| anyhow!("{e}; nothing is mirrored: the source VM runs on its own disks"))?;
    if disks.is_empty() {
        info!("{name} has no writable disk: nothing to mirror");
        return Ok(Vec::new());
    }
    info!(
        "{name} mirrors disk {} to the NBD exports at {nbd}",
        disks.join(", ")
    );
    let mut last_progress = Instant::now();
    loop {
        let failure = if stop.load(Ordering::SeqCst) {
            Some("interrupted while mirroring the disks, before the migration started".to_owned())
        } else if opts.timeout.is_some_and(|t| start.elapsed() >= t) {
            Some(format!(
                "--timeout {} s passed while mirroring the disks, before the migration started",
                opts.timeout.unwrap_or_default().as_secs_f64()
            ))
        } else {
            match vm.disk_copy_progress() {
                Ok(copies) => {
                    let p = MirrorProgress {
                        elapsed_ms: start.elapsed().as_millis() as u64,
                        mirror: copies,
                    };
                    let ready = p.mirror.iter().all(DiskCopy::is_ready);
                    if ready || last_progress.elapsed() >= opts.progress_every {
                        last_progress = Instant::now();
                        progress!("{}", if opts.json { p.json() } else { p.text() });
                    }
                    if ready {
                        info!("every mirror is ready: starting the migration");
                        return Ok(p.mirror);
                    }
                    None
                }
                Err(e) => Some(format!("{e}")),
            }
        };
        if let Some(why) = failure {
            bail!("{why}; {}", abort_mirrors(vm));
        }
        std::thread::sleep(POLL);
    }
}

/// Cancels the mirrors and says how that went.
fn abort_mirrors(vm: &mut dyn Vmm) -> String {
    match vm.abort_disk_copy() {
        Ok(()) => {
            "the mirrors were cancelled and their NBD nodes deleted: the source VM keeps its \
                   own disks"
                .to_owned()
        }
        Err(e) => format!(
            "cancelling the mirrors failed: {e} (query-jobs and query-named-block-nodes show what \
             is left); the source VM keeps its own disks"
        ),
    }
}

/// Says what the source VM does after a failed or cancelled migration.
fn source_after(vm: &mut dyn Vmm, before: &str) -> String {
    match vm.run_state() {
        Ok(s) if s.is_running() => format!("the source VM runs on (run state {s})"),
        Ok(s) if s.name == before => format!("the source VM is {s}, as before"),
        Ok(s) => format!("the source VM is {s} (it was {before})"),
        Err(e) => format!("and the source VM's run state is unknown: {e}"),
    }
}

/// Watches the migration to its end, printing progress and cancelling
/// on a signal or the timeout.
fn watch(
    vm: &mut dyn Vmm,
    opts: &VmmMigrateOptions,
    stop: &AtomicBool,
    start: Instant,
) -> anyhow::Result<End> {
    let mut last_progress = Instant::now();
    let mut cancelled = false;
    loop {
        let timed_out = opts.timeout.is_some_and(|t| start.elapsed() >= t);
        if !cancelled && (stop.load(Ordering::SeqCst) || timed_out) {
            if timed_out {
                info!("--timeout passed: cancelling the migration (migrate_cancel)");
            }
            cancelled = true;
            if let Err(e) = vm.cancel_migration() {
                info!("migrate_cancel: {e}");
            }
        }
        let info = vm
            .migration_info()
            .map_err(|e| anyhow!("watching the migration: {e}"))?;
        match info.status.as_str() {
            "completed" => return Ok(End::Completed(info)),
            "failed" => return Ok(End::Failed(info)),
            "cancelled" => return Ok(End::Cancelled),
            _ => {}
        }
        if last_progress.elapsed() >= opts.progress_every {
            last_progress = Instant::now();
            let p = Progress::new(&info, start.elapsed());
            progress!("{}", if opts.json { p.json() } else { p.text() });
        }
        std::thread::sleep(POLL);
    }
}

/// Options of `hagctl receive --qmp`.
#[derive(Clone, Debug)]
pub struct VmmReceiveOptions {
    /// Where the VMM listens.
    pub listen: MigrationAddress,
    /// Capabilities and parameters of the target side.
    pub settings: MigrationSettings,
    /// Give up waiting after this long.
    pub timeout: Option<Duration>,
    /// Resume a VM that arrives paused (QEMU started with `-S`).
    pub cont: bool,
    /// Leave a failed incoming VMM running instead of ending it.
    pub keep_failed: bool,
    /// `--copy-storage`: serve the VM's writable disks over NBD at this
    /// address for the source's mirrors, and resume the VM once the source
    /// let go of them.
    pub copy_storage: Option<MigrationAddress>,
}

/// What `hagctl receive --qmp` reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct VmmReceiveReport {
    /// Where the VMM listened (with the port it got for port 0).
    pub listen: String,
    /// Which VMM received.
    pub vmm: String,
    /// The VMM's final migration status (`completed`).
    pub status: String,
    /// The VM's run state at the end.
    pub run_state: String,
    /// hagctl resumed it (`--cont`).
    pub resumed: bool,
    /// From listening to completed, ms.
    pub waited_ms: u64,
    /// From the source's first data (status `active`) to completed, ms
    /// (to within hagctl's polling, 100 ms).
    pub transfer_ms: Option<u64>,
    /// From listening to the VM running, ms.
    pub running_ms: u64,
    /// `--copy-storage`: the disks served over NBD for the source's
    /// mirrors (their device ids).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<String>,
}

impl VmmReceiveReport {
    /// The text form, one line.
    pub fn text(&self) -> String {
        format!(
            "received on {} by {}: migration {} {:.1} s after listening{}{}, VM {} here{}\n",
            self.listen,
            self.vmm,
            self.status,
            self.waited_ms as f64 / 1e3,
            self.transfer_ms
                .map_or_else(String::new, |t| format!(" ({t} ms after the source began)")),
            if self.disks.is_empty() {
                String::new()
            } else {
                format!(", disks {} mirrored here over NBD", self.disks.join(", "))
            },
            self.run_state,
            if self.resumed {
                " (resumed by hagctl)"
            } else {
                ""
            }
        )
    }
}

/// `hagctl receive --qmp`: has `vm`, waiting for an incoming migration,
/// receive one.
pub fn receive(vm: &mut dyn Vmm, opts: &VmmReceiveOptions) -> anyhow::Result<VmmReceiveReport> {
    let name = vm.describe();
    if !vm.supports(Feature::Incoming) {
        return Err(vm.unsupported(Feature::Incoming).into());
    }
    let state = vm.run_state()?;
    if state.kind != RunKind::Incoming {
        bail!(
            "the VM at {name} is {state}, not waiting for an incoming migration \
             (start QEMU with -incoming defer)"
        );
    }
    let info = vm.migration_info()?;
    if info.status != "none" || !info.listening.is_empty() {
        bail!(
            "{name} has an incoming migration already (status {}{}): was it started with \
             -incoming URI instead of -incoming defer?",
            info.status,
            if info.listening.is_empty() {
                String::new()
            } else {
                format!(", listening on {}", info.listening.join(", "))
            }
        );
    }
    let copying = opts.copy_storage.is_some();
    let mut disks = Vec::new();
    if let Some(nbd) = &opts.copy_storage {
        disks = export_disks(vm, nbd)?;
    }
    if let Err(e) = vm.start_incoming(&opts.listen, &opts.settings) {
        if copying {
            let _ = vm.unexport_disks(true);
        }
        match e.qemu_desc() {
            Some(desc) => bail!("{name} cannot listen on {}: {desc}", opts.listen),
            None => return Err(e.into()),
        }
    }
    let start = Instant::now();
    let info = vm.migration_info()?;
    let listen = info
        .listening
        .first()
        .cloned()
        .unwrap_or_else(|| opts.listen.to_string());
    info!("{name} waits for a migration on {listen}");
    let left = |start: Instant| opts.timeout.map(|t| t.saturating_sub(start.elapsed()));
    let mut active_at = None;
    let gone = |e: crate::vmm::VmmError| {
        if e.is_gone() {
            anyhow!("QEMU exited during the incoming migration on {listen} (its own log says why)")
        } else {
            anyhow!("watching the incoming migration: {e}")
        }
    };
    let info = loop {
        let info = vm.migration_info().map_err(gone)?;
        match info.status.as_str() {
            "completed" => break info,
            "failed" | "cancelled" => {
                let why = info.error.unwrap_or_else(|| "QEMU gave no reason".into());
                if copying {
                    let _ = vm.unexport_disks(true);
                }
                let discarded = if opts.keep_failed {
                    "the incoming QEMU is left as it is (--keep-failed)".to_owned()
                } else {
                    match vm.quit() {
                        Ok(()) => "the incoming QEMU was ended (quit)".to_owned(),
                        Err(e) => format!("and ending the incoming QEMU failed too: {e}"),
                    }
                };
                bail!(
                    "the incoming migration on {listen} {}: QEMU: {why} (QEMU's own log names \
                     the device); {discarded}",
                    info.status
                );
            }
            "setup" => {}
            _ => {
                active_at.get_or_insert_with(Instant::now);
            }
        }
        if left(start).is_some_and(|l| l.is_zero()) {
            bail!(
                "no completed migration on {listen} within {:.1} s (status {}); QEMU is left as \
                 it is",
                opts.timeout.unwrap_or_default().as_secs_f64(),
                info.status
            );
        }
        std::thread::sleep(POLL);
    };
    let completed_at = Instant::now();
    if copying {
        // The source completes its mirrors only now: until it let go of
        // every export the disks may still change, so the VM stays paused.
        loop {
            let busy = vm.unexport_disks(false).map_err(gone)?;
            if busy.is_empty() {
                break;
            }
            if left(start).is_some_and(|l| l.is_zero()) {
                bail!(
                    "the migration on {listen} completed, but the source still uses the NBD \
                     export of disk {} (its mirror has not ended) after {:.1} s; the VM here \
                     stays paused: resume it (QMP cont) only once the source QEMU has ended",
                    busy.join(", "),
                    opts.timeout.unwrap_or_default().as_secs_f64()
                );
            }
            std::thread::sleep(POLL);
        }
        if !disks.is_empty() {
            info!("the source let go of every NBD export; the NBD server is stopped");
        }
    }
    let mut resumed = false;
    let run = loop {
        let s = vm.run_state().map_err(gone)?;
        if s.is_running() {
            break s;
        }
        if s.kind == RunKind::Paused && (opts.cont || copying) && !resumed {
            vm.resume()?;
            resumed = true;
            continue;
        }
        if left(start).is_some_and(|l| l.is_zero()) {
            bail!(
                "the migration on {listen} completed, but the VM here is {s} (QEMU started \
                 with -S? --cont resumes it); it is left as it is",
            );
        }
        std::thread::sleep(POLL);
    };
    Ok(VmmReceiveReport {
        listen,
        vmm: name,
        status: info.status,
        run_state: run.name,
        resumed,
        waited_ms: (completed_at - start).as_millis() as u64,
        transfer_ms: active_at.map(|a| (completed_at - a).as_millis() as u64),
        running_ms: start.elapsed().as_millis() as u64,
        disks,
    })
}

/// `--copy-storage` on the target: checks that the VM will not run before
/// told (QEMU `-S`), then serves its writable disks over NBD at `nbd`.
fn export_disks(vm: &mut dyn Vmm, nbd: &MigrationAddress) -> anyhow::Result<Vec<String>> {
    let name = vm.describe();
    if !vm.supports(Feature::CopyStorage) {
        return Err(vm.unsupported(Feature::CopyStorage).into());
    }
    match vm.starts_paused() {
        Ok(true) => {}
        Ok(false) => bail!(
            "{name} was not started with -S: with --copy-storage it would run the VM the moment \
             its RAM arrived, before the source finished mirroring the disks; start it with -S \
             -incoming defer"
        ),
        Err(e) => bail!("{e}; --copy-storage needs a QEMU started with -S -incoming defer"),
    }
    let disks = vm.export_disks(nbd).map_err(|e| {
        anyhow!("{e}; nothing is exported and no migration is awaited: QEMU is left as it is")
    })?;
    if disks.is_empty() {
        info!("{name} has no writable disk: nothing to receive over NBD");
    } else {
        info!(
            "{name} serves disk {} as NBD exports on {nbd}",
            disks.join(", ")
        );
    }
    Ok(disks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmm::{RamProgress, VmmError};
    use std::collections::VecDeque;

    #[test]
    fn bytes_format() {
        assert_eq!(fmt_bytes(0), "0 B");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(733264), "716.1 KiB");
        assert_eq!(fmt_bytes(67641344), "64.5 MiB");
        assert_eq!(fmt_bytes(3 << 30), "3.00 GiB");
    }

    #[test]
    fn capabilities_and_parameters_parse() {
        assert_eq!(
            parse_capability("x-ignore-shared=on"),
            Ok(("x-ignore-shared".into(), true))
        );
        assert_eq!(parse_capability("events=off"), Ok(("events".into(), false)));
        assert_eq!(
            parse_capability("multifd=TRUE"),
            Ok(("multifd".into(), true))
        );
        for bad in ["events", "events=maybe", "=on", "a b=on"] {
            assert!(parse_capability(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_parameter("multifd-channels=4"),
            Ok(("multifd-channels".into(), 4.into()))
        );
        assert_eq!(
            parse_parameter("tls-creds=tls0"),
            Ok(("tls-creds".into(), "tls0".into()))
        );
        assert_eq!(
            parse_parameter(r#"tls-hostname="42""#),
            Ok(("tls-hostname".into(), "42".into()))
        );
        assert_eq!(
            parse_parameter("cpu-throttle-tailslow=true"),
            Ok(("cpu-throttle-tailslow".into(), true.into()))
        );
        assert!(parse_parameter("noequals").is_err());
    }

    #[test]
    fn blockers_are_named() {
        assert_eq!(
            blocked_message(
                "QEMU 10.0.2 at vm.qmp",
                &[
                    "Migration is disabled when using feature 'peer mode' in device 'ivshmem'"
                        .into()
                ]
            ),
            "QEMU 10.0.2 at vm.qmp cannot migrate this VM: 1 blocker: \"Migration is disabled \
             when using feature 'peer mode' in device 'ivshmem'\""
        );
        assert_eq!(
            blocked_message("Q", &["a".into(), "b".into()]),
            "Q cannot migrate this VM: 2 blockers: \"a\"; \"b\""
        );
    }

    fn active() -> MigrationInfo {
        MigrationInfo {
            status: "active".into(),
            total_time_ms: Some(3200),
            expected_downtime_ms: Some(120),
            ram: Some(RamProgress {
                transferred: Some(12 << 20),
                remaining: Some(40 << 20),
                total: Some(64 << 20),
                dirty_pages_rate: Some(1200),
                dirty_sync_count: Some(3),
                mbps: Some(136.42),
                ..RamProgress::default()
            }),
            ..MigrationInfo::default()
        }
    }

    #[test]
    fn progress_lines() {
        let p = Progress::new(&active(), Duration::from_millis(3250));
        assert_eq!(
            p.text(),
            "migration active at 3.2 s: 12.0 MiB sent, 40.0 MiB of 64.0 MiB left, dirtying 1200 \
             pages/s, round 3, expected downtime 120 ms, 136.4 Mbit/s"
        );
        assert_eq!(
            p.json(),
            r#"{"status":"active","elapsed_ms":3250,"transferred":12582912,"remaining":41943040,"total":67108864,"dirty_pages_rate":1200,"rounds":3,"expected_downtime_ms":120,"mbps":136.42}"#
        );
        // Setup: QEMU says nothing yet.
        let setup = MigrationInfo {
            status: "setup".into(),
            ..MigrationInfo::default()
        };
        let p = Progress::new(&setup, Duration::from_millis(400));
        assert_eq!(p.text(), "migration setup at 0.4 s");
        assert_eq!(
            p.json(),
            r#"{"status":"setup","elapsed_ms":400,"transferred":null,"remaining":null,"total":null,"dirty_pages_rate":null,"rounds":null,"expected_downtime_ms":null,"mbps":null}"#
        );
    }

    fn completed() -> MigrationInfo {
        MigrationInfo {
            status: "completed".into(),
            total_time_ms: Some(48),
            setup_time_ms: Some(5),
            downtime_ms: Some(15),
            ram: Some(RamProgress {
                transferred: Some(733264),
                remaining: Some(0),
                total: Some(67641344),
                dirty_sync_count: Some(2),
                mbps: Some(136.421_209_302_325_6),
                downtime_bytes: Some(12319),
                ..RamProgress::default()
            }),
            ..MigrationInfo::default()
        }
    }

    fn settings() -> MigrationSettings {
        MigrationSettings {
            downtime_limit_ms: Some(300),
            capabilities: vec![("return-path".into(), true)],
            ..MigrationSettings::default()
        }
    }

    #[test]
    fn reports_in_text_and_json() {
        let mut r = VmmMigrationReport::new(
            "127.0.0.1:7400",
            "QEMU 10.0.2 at src.qmp",
            &completed(),
            &settings(),
        );
        r.source = Some(SourceOutcome::Quit);
        assert_eq!(
            r.text(),
            "migrated to 127.0.0.1:7400 by QEMU 10.0.2 at src.qmp: downtime 15 ms, total time 48 ms (setup 5 ms), 716.1 KiB transferred in 2 rounds, 136.4 Mbit/s\n\
             \x20 RAM 64.5 MiB, 12.0 KiB sent during downtime, downtime limit 300 ms\n\
             \x20 source: QEMU ended (quit); the VM runs on the target only\n"
        );
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"to":"127.0.0.1:7400","vmm":"QEMU 10.0.2 at src.qmp","status":"completed","downtime_ms":15,"total_time_ms":48,"setup_time_ms":5,"transferred_bytes":733264,"rounds":2,"throughput_mbps":136.4212093023256,"ram_total_bytes":67641344,"downtime_bytes":12319,"vfio_transferred_bytes":null,"downtime_limit_ms":300,"max_bandwidth":null,"capabilities":["return-path=on"],"attempts":1,"source":"quit"}"#
        );
        // What QEMU leaves out shows as unknown, not as zero.
        let bare = MigrationInfo {
            status: "completed".into(),
            ..MigrationInfo::default()
        };
        let mut r = VmmMigrationReport::new("h:1", "Q", &bare, &MigrationSettings::default());
        r.source = Some(SourceOutcome::KeptPaused);
        r.vfio_transferred_bytes = Some(8192);
        r.attempts = 3;
        assert_eq!(
            r.text(),
            "migrated to h:1 by Q: downtime ?, total time ? (setup ?), ? transferred in ? rounds, ? Mbit/s\n\
             \x20 VFIO device state 8.0 KiB, 3 attempts\n\
             \x20 source: kept paused in postmigrate (--keep-source); never resume it while the target runs\n"
        );
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["downtime_ms"], serde_json::Value::Null);
        assert_eq!(json["source"], "kept-paused");
    }

    #[test]
    fn receive_report_text() {
        let r = VmmReceiveReport {
            listen: "127.0.0.1:40961".into(),
            vmm: "QEMU 10.0.2 at dst.qmp".into(),
            status: "completed".into(),
            run_state: "running".into(),
            resumed: false,
            waited_ms: 1234,
            transfer_ms: Some(48),
            running_ms: 1240,
            disks: Vec::new(),
        };
        assert_eq!(
            r.text(),
            "received on 127.0.0.1:40961 by QEMU 10.0.2 at dst.qmp: migration completed 1.2 s after listening (48 ms after the source began), VM running here\n"
        );
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"listen":"127.0.0.1:40961","vmm":"QEMU 10.0.2 at dst.qmp","status":"completed","run_state":"running","resumed":false,"waited_ms":1234,"transfer_ms":48,"running_ms":1240}"#
        );
    }

    /// A scripted VMM: each `migration_info` pops the next state (the last
    /// one repeats); it records what it was asked.
    struct Scripted {
        infos: VecDeque<MigrationInfo>,
        state: RunState,
        after: RunState,
        blockers: Vec<String>,
        calls: Vec<String>,
        /// Raised when the migration starts (a signal arriving then).
        signal_on_start: Option<Arc<AtomicBool>>,
        /// `--copy-storage`: progress polls before the mirror is ready.
        mirror_polls: u32,
        /// `--copy-storage`: the mirror fails at its first poll.
        mirror_fails: bool,
        /// `--copy-storage`: the target QEMU was started with -S.
        starts_paused: bool,
        /// `--copy-storage`: polls while the source still uses an export.
        exports_busy: u32,
    }

    impl Scripted {
        fn new(infos: Vec<MigrationInfo>) -> Scripted {
            Scripted {
                infos: infos.into(),
                state: RunState::new(RunKind::Running, "running"),
                after: RunState::new(RunKind::Migrated, "postmigrate"),
                blockers: Vec::new(),
                calls: Vec::new(),
                signal_on_start: None,
                mirror_polls: 2,
                mirror_fails: false,
                starts_paused: true,
                exports_busy: 2,
            }
        }
    }

    impl Vmm for Scripted {
        fn describe(&self) -> String {
            "scripted".into()
        }
        fn features(&self) -> &'static [Feature] {
            &[
                Feature::RunState,
                Feature::Resume,
                Feature::Migrate,
                Feature::Incoming,
                Feature::Quit,
                Feature::CopyStorage,
            ]
        }
        fn run_state(&mut self) -> Result<RunState, VmmError> {
            Ok(self.state.clone())
        }
        fn quit(&mut self) -> Result<(), VmmError> {
            self.calls.push("quit".into());
            Ok(())
        }
        fn migration_blockers(&mut self) -> Result<Vec<String>, VmmError> {
            Ok(self.blockers.clone())
        }
        fn start_migration(
            &mut self,
            to: &MigrationAddress,
            s: &MigrationSettings,
        ) -> Result<(), VmmError> {
            self.calls.push(format!(
                "migrate {} {:?}",
                to.qemu_uri(),
                s.capability("return-path")
            ));
            if let Some(flag) = &self.signal_on_start {
                flag.store(true, Ordering::SeqCst);
            }
            // Running now: the first info is popped by the watch loop.
            Ok(())
        }
        fn migration_info(&mut self) -> Result<MigrationInfo, VmmError> {
            if self
                .calls
                .iter()
                .any(|c| c.starts_with("migrate") || c == "incoming")
            {
                let info = if self.infos.len() > 1 {
                    self.infos.pop_front().unwrap_or_default()
                } else {
                    self.infos.front().cloned().unwrap_or_default()
                };
                if info.status == "completed" {
                    self.state = self.after.clone();
                }
                Ok(info)
            } else {
                Ok(MigrationInfo {
                    status: "none".into(),
                    ..MigrationInfo::default()
                })
            }
        }
        fn cancel_migration(&mut self) -> Result<(), VmmError> {
            self.calls.push("cancel".into());
            Ok(())
        }
        fn resume(&mut self) -> Result<(), VmmError> {
            self.calls.push("cont".into());
            self.state = RunState::new(RunKind::Running, "running");
            Ok(())
        }
        fn start_incoming(
            &mut self,
            _: &MigrationAddress,
            _: &MigrationSettings,
        ) -> Result<(), VmmError> {
            self.calls.push("incoming".into());
            Ok(())
        }
        fn start_disk_copy(
            &mut self,
            nbd: &MigrationAddress,
            _: Duration,
        ) -> Result<Vec<String>, VmmError> {
            self.calls.push(format!("mirror to {nbd}"));
            Ok(vec!["vda".into()])
        }
        fn disk_copy_progress(&mut self) -> Result<Vec<DiskCopy>, VmmError> {
            if self.mirror_fails {
                return Err(VmmError::Protocol {
                    vmm: "scripted".into(),
                    what: "the mirror of disk vda (job hag-mirror-vda) failed: QEMU: \
                           Input/output error"
                        .into(),
                });
            }
            let ready = self.mirror_polls == 0;
            self.mirror_polls = self.mirror_polls.saturating_sub(1);
            Ok(vec![DiskCopy {
                disk: "vda".into(),
                job: "hag-mirror-vda".into(),
                status: if ready { "ready" } else { "running" }.into(),
                copied: if ready { 8 << 20 } else { 1 << 20 },
                total: 8 << 20,
                error: None,
            }])
        }
        fn finish_disk_copy(&mut self) -> Result<(), VmmError> {
            self.calls.push("finish mirror".into());
            Ok(())
        }
        fn abort_disk_copy(&mut self) -> Result<(), VmmError> {
            self.calls.push("abort mirror".into());
            Ok(())
        }
        fn starts_paused(&mut self) -> Result<bool, VmmError> {
            Ok(self.starts_paused)
        }
        fn export_disks(&mut self, nbd: &MigrationAddress) -> Result<Vec<String>, VmmError> {
            self.calls.push(format!("export on {nbd}"));
            Ok(vec!["vda".into()])
        }
        fn unexport_disks(&mut self, force: bool) -> Result<Vec<String>, VmmError> {
            self.calls
                .push(if force { "unexport hard" } else { "unexport" }.into());
            if force || self.exports_busy == 0 {
                return Ok(Vec::new());
            }
            self.exports_busy -= 1;
            Ok(vec!["vda".into()])
        }
    }

    fn copying() -> VmmMigrateOptions {
        VmmMigrateOptions {
            copy_storage: Some(MigrationAddress::parse_tcp("127.0.0.1:10809").unwrap()),
            progress_every: Duration::ZERO,
            ..opts()
        }
    }

    #[test]
    fn disks_are_mirrored_before_and_completed_after_the_migration() {
        let stop = AtomicBool::new(false);
        let mut vm = Scripted::new(vec![status("active"), completed()]);
        let r = migrate(&mut vm, &copying(), &stop).unwrap();
        assert_eq!(
            vm.calls,
            [
                "mirror to 127.0.0.1:10809",
                "migrate tcp:127.0.0.1:7400 Some(true)",
                "finish mirror",
                "quit"
            ]
        );
        assert_eq!(r.disks.len(), 1);
        assert!(r.disks[0].is_ready());
        assert!(
            r.text().contains("disks mirrored over NBD: vda (8.0 MiB)"),
            "{}",
            r.text()
        );
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["disks"][0]["status"], "ready");
        // Without --copy-storage the report's JSON is as it was.
        let mut vm = Scripted::new(vec![completed()]);
        let r = migrate(&mut vm, &opts(), &stop).unwrap();
        assert!(serde_json::to_value(&r).unwrap().get("disks").is_none());
    }

    #[test]
    fn a_failure_before_completion_cancels_the_mirrors() {
        let stop = AtomicBool::new(false);
        // The migration fails: the mirrors are cancelled, the source runs.
        let mut vm = failing("Unable to write to socket: Broken pipe");
        let e = migrate(&mut vm, &copying(), &stop).unwrap_err().to_string();
        assert!(
            e.ends_with(
                "the source VM runs on (run state running); the mirrors were cancelled and \
                 their NBD nodes deleted: the source VM keeps its own disks"
            ),
            "{e}"
        );
        assert_eq!(vm.calls.last().unwrap(), "abort mirror");
        assert!(!vm.calls.iter().any(|c| c == "quit" || c == "finish mirror"));
        // A mirror fails: no migration is started.
        let mut vm = Scripted::new(vec![completed()]);
        vm.mirror_fails = true;
        let e = migrate(&mut vm, &copying(), &stop).unwrap_err().to_string();
        assert!(e.contains("the mirror of disk vda"), "{e}");
        assert_eq!(vm.calls, ["mirror to 127.0.0.1:10809", "abort mirror"]);
        // A signal while mirroring.
        let stop = Arc::new(AtomicBool::new(false));
        let mut vm = Scripted::new(vec![completed()]);
        vm.mirror_polls = u32::MAX;
        let raise = stop.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            raise.store(true, Ordering::SeqCst);
        });
        let e = migrate(&mut vm, &copying(), &stop).unwrap_err().to_string();
        t.join().unwrap();
        assert!(
            e.starts_with("interrupted while mirroring the disks"),
            "{e}"
        );
        assert_eq!(vm.calls, ["mirror to 127.0.0.1:10809", "abort mirror"]);
    }

    fn receiving() -> VmmReceiveOptions {
        VmmReceiveOptions {
            listen: MigrationAddress::parse_tcp("0.0.0.0:7400").unwrap(),
            settings: MigrationSettings::default(),
            timeout: Some(Duration::from_secs(5)),
            cont: false,
            keep_failed: false,
            copy_storage: Some(MigrationAddress::parse_tcp("0.0.0.0:10809").unwrap()),
        }
    }

    fn incoming(infos: Vec<MigrationInfo>) -> Scripted {
        let mut vm = Scripted::new(infos);
        vm.state = RunState::new(RunKind::Incoming, "inmigrate");
        vm.after = RunState::new(RunKind::Paused, "paused");
        vm
    }

    #[test]
    fn the_target_resumes_only_once_the_source_let_go_of_its_disks() {
        let mut vm = incoming(vec![status("active"), completed()]);
        let r = receive(&mut vm, &receiving()).unwrap();
        assert_eq!(
            vm.calls,
            [
                "export on 0.0.0.0:10809",
                "incoming",
                "unexport",
                "unexport",
                "unexport",
                "cont"
            ]
        );
        assert!(r.resumed);
        assert_eq!(r.disks, ["vda"]);
        assert!(
            r.text().contains(
                ", disks vda mirrored here over NBD, VM running here (resumed by hagctl)"
            ),
            "{}",
            r.text()
        );
        // A source that never lets go: the VM stays paused.
        let mut vm = incoming(vec![completed()]);
        vm.exports_busy = u32::MAX;
        let o = VmmReceiveOptions {
            timeout: Some(Duration::from_millis(300)),
            ..receiving()
        };
        let e = receive(&mut vm, &o).unwrap_err().to_string();
        assert!(e.contains("still uses the NBD export of disk vda"), "{e}");
        assert!(!vm.calls.contains(&"cont".to_owned()));
    }

    #[test]
    fn the_target_must_start_paused() {
        let mut vm = incoming(vec![completed()]);
        vm.starts_paused = false;
        let e = receive(&mut vm, &receiving()).unwrap_err().to_string();
        assert_eq!(
            e,
            "scripted was not started with -S: with --copy-storage it would run the VM the \
             moment its RAM arrived, before the source finished mirroring the disks; start it \
             with -S -incoming defer"
        );
        assert!(vm.calls.is_empty());
        // A failed incoming migration removes the exports.
        let mut vm = incoming(vec![status("failed")]);
        vm.starts_paused = true;
        let e = receive(&mut vm, &receiving()).unwrap_err().to_string();
        assert!(e.contains("failed"), "{e}");
        assert_eq!(
            vm.calls,
            [
                "export on 0.0.0.0:10809",
                "incoming",
                "unexport hard",
                "quit"
            ]
        );
    }

    fn opts() -> VmmMigrateOptions {
        VmmMigrateOptions {
            to: MigrationAddress::parse_tcp("127.0.0.1:7400").unwrap(),
            settings: MigrationSettings::default(),
            keep_source: false,
            connect_timeout: Duration::from_secs(5),
            timeout: None,
            json: false,
            progress_every: Duration::from_secs(1),
            copy_storage: None,
        }
    }

    fn status(s: &str) -> MigrationInfo {
        MigrationInfo {
            status: s.into(),
            ..MigrationInfo::default()
        }
    }

    #[test]
    fn a_completed_migration_ends_the_source() {
        let mut vm = Scripted::new(vec![status("active"), completed()]);
        let stop = AtomicBool::new(false);
        let r = migrate(&mut vm, &opts(), &stop).unwrap();
        assert_eq!(r.source, Some(SourceOutcome::Quit));
        assert_eq!(r.downtime_ms, Some(15));
        // x-ignore-shared off unless asked: a killed checkpoint's leftover
        // would leave shared RAM out.
        assert_eq!(r.capabilities, ["return-path=on", "x-ignore-shared=off"]);
        assert_eq!(vm.calls, ["migrate tcp:127.0.0.1:7400 Some(true)", "quit"]);
        // --keep-source, or return-path off: the source stays.
        let mut vm = Scripted::new(vec![completed()]);
        let o = VmmMigrateOptions {
            keep_source: true,
            ..opts()
        };
        let r = migrate(&mut vm, &o, &stop).unwrap();
        assert_eq!(r.source, Some(SourceOutcome::KeptPaused));
        let mut vm = Scripted::new(vec![completed()]);
        let mut o = opts();
        o.settings.capabilities.push(("return-path".into(), false));
        let r = migrate(&mut vm, &o, &stop).unwrap();
        assert_eq!(r.source, Some(SourceOutcome::PausedNoReturnPath));
        assert_eq!(vm.calls, ["migrate tcp:127.0.0.1:7400 Some(false)"]);
    }

    #[test]
    fn blockers_and_bad_states_refuse_before_starting() {
        let stop = AtomicBool::new(false);
        let mut vm = Scripted::new(vec![completed()]);
        vm.blockers = vec!["device X says no".into()];
        let e = migrate(&mut vm, &opts(), &stop).unwrap_err().to_string();
        assert_eq!(
            e,
            "scripted cannot migrate this VM: 1 blocker: \"device X says no\""
        );
        assert!(vm.calls.is_empty());
        let mut vm = Scripted::new(vec![completed()]);
        vm.state = RunState::new(RunKind::Migrated, "postmigrate");
        let e = migrate(&mut vm, &opts(), &stop).unwrap_err().to_string();
        assert!(e.contains("migrated away already"), "{e}");
        assert!(vm.calls.is_empty());
    }

    /// A migration that fails with QEMU's `error`; the source runs on.
    fn failing(error: &str) -> Scripted {
        let mut failed = status("failed");
        failed.error = Some(error.into());
        let mut vm = Scripted::new(vec![status("active"), failed]);
        vm.after = RunState::new(RunKind::Running, "running");
        vm
    }

    #[test]
    fn failures_name_qemus_error_and_the_source_state() {
        let stop = AtomicBool::new(false);
        let mut vm = failing("Sibling indicated error 1");
        let e = migrate(&mut vm, &opts(), &stop).unwrap_err().to_string();
        assert!(
            e.starts_with("the migration to 127.0.0.1:7400 failed: QEMU: Sibling indicated error 1 (the target refused"),
            "{e}"
        );
        assert!(
            e.ends_with("the source VM runs on (run state running)"),
            "{e}"
        );
        assert!(!vm.calls.contains(&"quit".to_owned()));
    }

    #[test]
    fn a_refused_connection_is_retried() {
        let stop = AtomicBool::new(false);
        let mut refused = status("failed");
        refused.error = Some("Failed to connect to '127.0.0.1:7400': Connection refused".into());
        let mut vm = Scripted::new(vec![refused, completed()]);
        let r = migrate(&mut vm, &opts(), &stop).unwrap();
        assert_eq!(r.attempts, 2);
        assert_eq!(vm.calls.len(), 3, "{:?}", vm.calls);
        // Past --connect-timeout it is the failure it is.
        let mut refused = status("failed");
        refused.error = Some("Failed to connect to '127.0.0.1:7400': Connection refused".into());
        let mut vm = Scripted::new(vec![refused]);
        let o = VmmMigrateOptions {
            connect_timeout: Duration::from_millis(600),
            ..opts()
        };
        let e = migrate(&mut vm, &o, &stop).unwrap_err().to_string();
        assert!(e.contains("nothing listens there"), "{e}");
    }

    #[test]
    fn a_signal_cancels() {
        let stop = Arc::new(AtomicBool::new(false));
        let mut vm = Scripted::new(vec![
            status("active"),
            status("cancelling"),
            status("cancelled"),
        ]);
        vm.after = RunState::new(RunKind::Running, "running");
        vm.signal_on_start = Some(stop.clone());
        let e = migrate(&mut vm, &opts(), &stop).unwrap_err().to_string();
        assert_eq!(
            e,
            "the migration to 127.0.0.1:7400 was cancelled on a signal (migrate_cancel); the source VM runs on (run state running)"
        );
        assert_eq!(vm.calls[1], "cancel");
        // A cancel that loses the race to completion is a completion.
        let stop = Arc::new(AtomicBool::new(false));
        let mut vm = Scripted::new(vec![status("device"), completed()]);
        vm.signal_on_start = Some(stop.clone());
        let r = migrate(&mut vm, &opts(), &stop).unwrap();
        assert_eq!(r.source, Some(SourceOutcome::Quit));
        // A signal before the start: nothing is started.
        let mut vm = Scripted::new(vec![completed()]);
        let e = migrate(&mut vm, &opts(), &stop).unwrap_err().to_string();
        assert!(
            e.starts_with("interrupted before the migration started"),
            "{e}"
        );
        assert!(vm.calls.is_empty());
    }

    /// A free TCP port on 127.0.0.1 (free when this returns).
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// A QEMU process, killed when dropped.
    struct Kill(std::process::Child);

    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    impl Kill {
        /// Whether it exited within 10 s.
        fn ended(&mut self) -> bool {
            let t = Instant::now();
            while self.0.try_wait().unwrap().is_none() {
                if t.elapsed() > Duration::from_secs(10) {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            true
        }
    }

    /// Runs a command that must succeed.
    fn run(cmd: &mut std::process::Command) {
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{cmd:?}: {out:?}");
    }

    /// A QEMU 10 (TCG, no guest) in `dir` with qcow2 `image` as disk
    /// device `id` and an empty CD-ROM, QMP on `dir/qmp`, then `extra`.
    fn qemu_with_disk(
        dir: &std::path::Path,
        image: &str,
        id: &str,
        qmp: &str,
        extra: &[&str],
    ) -> Kill {
        Kill(
            std::process::Command::new("qemu-system-x86_64")
                .args(["-accel", "tcg", "-machine", "q35", "-nodefaults"])
                .args(["-display", "none", "-m", "64"])
                .arg("-blockdev")
                .arg(format!(
                    "driver=file,filename={},node-name=f0",
                    dir.join(image).display()
                ))
                .args(["-blockdev", "driver=qcow2,file=f0,node-name=d0"])
                .arg("-device")
                .arg(format!("virtio-blk-pci,drive=d0,id={id}"))
                // An empty CD-ROM: nothing to mirror.
                .args(["-device", "ide-cd,bus=ide.1,id=cd0"])
                .arg("-qmp")
                .arg(format!(
                    "unix:{},server=on,wait=off",
                    dir.join(qmp).display()
                ))
                .args(extra)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        )
    }

    /// QMP to the QEMU at `dir/qmp`, once it listens.
    fn connect(dir: &std::path::Path, qmp: &str) -> crate::vmm::qemu::Qemu {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match crate::vmm::qemu::Qemu::connect(&dir.join(qmp), Duration::from_secs(10)) {
                Ok(q) => break q,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// A fresh directory with qcow2 images of `size` named `names`.
    fn images(test: &str, names: &[(&str, &str)]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("hag-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, size) in names {
            run(std::process::Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2"])
                .arg(dir.join(name))
                .arg(size));
        }
        run(std::process::Command::new("qemu-io")
            .args([
                "-f",
                "qcow2",
                "-c",
                "write -P 0x5a 0 1M",
                "-c",
                "write -P 0xa5 3M 512k",
            ])
            .arg(dir.join("src.qcow2")));
        dir
    }

    fn receiving_on(nbd: &MigrationAddress, timeout: Duration) -> VmmReceiveOptions {
        VmmReceiveOptions {
            listen: MigrationAddress::parse_tcp(&format!("127.0.0.1:{}", free_port())).unwrap(),
            timeout: Some(timeout),
            copy_storage: Some(nbd.clone()),
            ..receiving()
        }
    }

    /// `--copy-storage` between two real QEMU 10 processes on this
    /// machine (TCG, no guest): a source with data on its qcow2 disk and
    /// an empty CD-ROM, a target with an empty qcow2 of the same size
    /// started with `-S -incoming defer`. Afterwards the source QEMU is
    /// gone, the target runs, and the two images hold the same data.
    /// `cargo test -p hagctl qemu_disk_copy_storage -- --ignored`.
    #[test]
    #[ignore]
    fn qemu_disk_copy_storage() {
        let dir = images("copy-storage", &[("src.qcow2", "8M"), ("dst.qcow2", "8M")]);
        let mut src = qemu_with_disk(&dir, "src.qcow2", "vda", "src.qmp", &[]);
        let mut dst = qemu_with_disk(
            &dir,
            "dst.qcow2",
            "vda",
            "dst.qmp",
            &["-S", "-incoming", "defer"],
        );
        let nbd = MigrationAddress::parse_tcp(&format!("127.0.0.1:{}", free_port())).unwrap();
        let ropts = receiving_on(&nbd, Duration::from_secs(60));
        let mut target = connect(&dir, "dst.qmp");
        let opts = VmmMigrateOptions {
            to: ropts.listen.clone(),
            timeout: Some(Duration::from_secs(60)),
            connect_timeout: Duration::from_secs(20),
            copy_storage: Some(nbd),
            ..opts()
        };
        let receiver = std::thread::spawn(move || {
            let r = receive(&mut target, &ropts);
            (r, target)
        });
        let mut source = connect(&dir, "src.qmp");
        let report = migrate(&mut source, &opts, &AtomicBool::new(false));
        let (received, mut target) = receiver.join().unwrap();
        let (report, received) = (report.unwrap(), received.unwrap());
        eprint!("{}{}", report.text(), received.text());
        assert_eq!(report.source, Some(SourceOutcome::Quit));
        assert_eq!(report.disks.len(), 1);
        assert_eq!(
            (report.disks[0].disk.as_str(), report.disks[0].total),
            ("vda", 8 << 20)
        );
        assert_eq!(received.disks, ["vda"]);
        assert!(received.resumed);
        assert!(target.run_state().unwrap().is_running());
        assert!(src.ended(), "the source QEMU runs on");
        target.quit().unwrap();
        assert!(dst.ended(), "the target QEMU runs on");
        run(std::process::Command::new("qemu-img")
            .arg("compare")
            .arg(dir.join("src.qcow2"))
            .arg(dir.join("dst.qcow2")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// What `--copy-storage` refuses, against real QEMU 10 processes: a
    /// target not started with -S, a target disk of another size, a target
    /// with no disk of that name. The source runs on each time, with
    /// nothing of hagctl's left in it.
    #[test]
    #[ignore]
    fn qemu_disk_copy_storage_refusals() {
        let dir = images(
            "copy-storage-refusals",
            &[
                ("src.qcow2", "8M"),
                ("small.qcow2", "4M"),
                ("other.qcow2", "8M"),
            ],
        );
        let _src = qemu_with_disk(&dir, "src.qcow2", "vda", "src.qmp", &[]);
        let mut source = connect(&dir, "src.qmp");
        let nbd = MigrationAddress::parse_tcp(&format!("127.0.0.1:{}", free_port())).unwrap();
        // No -S.
        let _running = qemu_with_disk(
            &dir,
            "other.qcow2",
            "vda",
            "run.qmp",
            &["-incoming", "defer"],
        );
        let e = receive(
            &mut connect(&dir, "run.qmp"),
            &receiving_on(&nbd, Duration::from_secs(5)),
        )
        .unwrap_err()
        .to_string();
        eprintln!("refused: {e}");
        assert!(e.contains("was not started with -S"), "{e}");
        // Of another size; then without a disk vda.
        for (image, id, says) in [
            (
                "small.qcow2",
                "vda",
                "is 8388608 bytes here but the target's NBD export 'vda'",
            ),
            ("other.qcow2", "vdb", "the target exports no disk vda"),
        ] {
            let qmp = format!("{id}-{image}.qmp");
            let _dst = qemu_with_disk(&dir, image, id, &qmp, &["-S", "-incoming", "defer"]);
            let mut target = connect(&dir, &qmp);
            let ropts = receiving_on(&nbd, Duration::from_secs(3));
            let opts = VmmMigrateOptions {
                to: ropts.listen.clone(),
                connect_timeout: Duration::from_secs(2),
                copy_storage: Some(nbd.clone()),
                ..opts()
            };
            let receiver = std::thread::spawn(move || receive(&mut target, &ropts));
            let e = migrate(&mut source, &opts, &AtomicBool::new(false))
                .unwrap_err()
                .to_string();
            eprintln!("refused: {e}");
            assert!(e.contains(says), "{e}");
            assert!(
                e.contains("nothing is mirrored: the source VM runs on its own disks"),
                "{e}"
            );
            assert!(receiver.join().unwrap().is_err());
            assert!(source.run_state().unwrap().is_running());
            let nodes = source
                .qmp()
                .execute(
                    "query-named-block-nodes",
                    Some(serde_json::json!({ "flat": true })),
                )
                .unwrap();
            for n in nodes.as_array().unwrap() {
                let name = n["node-name"].as_str().unwrap();
                assert!(!name.starts_with("hag-"), "node {name} is left");
            }
            let jobs = source.qmp().execute("query-jobs", None).unwrap();
            assert_eq!(jobs, serde_json::json!([]));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
