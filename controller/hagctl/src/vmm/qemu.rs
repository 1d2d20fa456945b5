//! The [`Vmm`] driver for QEMU (10 or later), over QMP ([`super::qmp`]).
//!
//! QEMU migrates a VM itself: guest RAM with KVM's dirty log (and, for a
//! hag vGPU, the pages its VFIO DMA-logging report names), then the device
//! state, the vGPU's through VFIO migration v2. This driver sets the
//! migration up (`migrate-set-capabilities`, `migrate-set-parameters`),
//! starts it (`migrate`, `migrate-incoming`), watches it (`query-migrate`)
//! and cancels it (`migrate_cancel`); pause, resume and the run state are
//! `stop`, `cont` and `query-status`. QEMU keeps guest RAM and the CPU dirty
//! log to itself over QMP: those two features are missing here (hagctl's
//! checkpointing gets them from a shared memory backend instead).

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::qemu_storage::{started_paused, Exports, Mirrors};
use super::qmp::{QemuVersion, Qmp};
use super::{
    DiskCopy, Feature, MigrationAddress, MigrationInfo, MigrationSettings, RamProgress, RunKind,
    RunState, SavedState, Vmm, VmmError,
};

/// The oldest QEMU whose `migrate-incoming` takes `exit-on-error`.
const EXIT_ON_ERROR_SINCE: QemuVersion = QemuVersion {
    major: 9,
    minor: 1,
    micro: 0,
};

/// Longest [`Vmm::save_device_state`] before it is cancelled. The VM is
/// paused meanwhile; its device state (RAM left out by `x-ignore-shared`)
/// is under a megabyte, saved in milliseconds natively and under a second
/// in a loaded test host: 30 s is a stuck save, and the epoch is given up
/// (the VM resumes, its output held).
const SAVE_TIMEOUT: Duration = Duration::from_secs(30);

/// A QEMU, through its QMP socket.
pub struct Qemu {
    qmp: Qmp,
    saves: u64,
    /// `--copy-storage` on the source: the disks' mirrors.
    mirrors: Option<Mirrors>,
    /// `--copy-storage` on the target: the disks' NBD exports.
    exports: Option<Exports>,
    /// The `events` capability was set on by [`Qemu::apply`]: QEMU says
    /// each change of a migration's status in a `MIGRATION` event.
    migration_events: bool,
    /// After this connection's `stop`: the `RESUME` events it had read
    /// then ([`Qmp::resumes_seen`]); `None` after its `cont`.
    stopped_at: Option<u64>,
}

/// How long [`Vmm::resume`] retries `cont` while QEMU finishes a save it
/// has announced as completed (its migration thread leaves
/// `finish-migrate` just after the event; `cont` is refused until then).
const FINALIZE_WAIT: Duration = Duration::from_secs(2);

/// While a save runs, how often its status is asked for when QEMU sends
/// no `MIGRATION` events.
const SAVE_POLL: Duration = Duration::from_millis(5);

/// Whether a QEMU VM that no longer answers or runs has crashed: what
/// protection must fail over from rather than end. `status` is
/// `query-status`'s answer, `None` when QMP's connection closed (QEMU
/// exited); `shutdown` whether a `SHUTDOWN` event came first. A SHUTDOWN
/// (the guest powered off, or QEMU was told to quit: SIGTERM, `quit`,
/// `virsh destroy`/`shutdown`) is an end, and so is a guest panic (the
/// guest's own fault: resuming an earlier epoch would replay it, so that
/// is left to the operator); QEMU gone with no SHUTDOWN (SIGKILL, a
/// segfault, the OOM killer) or stopped at `internal-error` (KVM could not
/// run the vCPU) is a crash. Returns why, for a crash.
pub fn crash(status: Option<&str>, shutdown: bool) -> Option<String> {
    match status {
        Some("internal-error") => {
            Some("QEMU stopped the VM at an internal error (KVM could not run it)".into())
        }
        Some(_) => None,
        None if shutdown => None,
        None => Some("QEMU exited with no SHUTDOWN event: it was killed or crashed".into()),
    }
}

/// Whether the VM is migrating away, or has, by a migration hagctl did not
/// start, from its run state and `query-migrate`'s status, read outside
/// hagctl's own saves (libvirt's `virsh migrate` drives QEMU through its
/// own monitor). Returns what it saw. hagctl's own save never leaves a
/// migration under way; one it cancelled after [`SAVE_TIMEOUT`] may still
/// be `cancelling`, which is not counted (a cancelled migration leaves the
/// VM where it was either way).
pub fn migrating_away(run_state: &str, migration: &str) -> Option<String> {
    if matches!(run_state, "postmigrate" | "finish-migrate") {
        return Some(format!(
            "QEMU's run state is {run_state}: the VM migrated away"
        ));
    }
    let under_way = matches!(
        migration,
        "setup"
            | "active"
            | "device"
            | "pre-switchover"
            | "wait-unplug"
            | "colo"
            | "postcopy-active"
            | "postcopy-paused"
            | "postcopy-recover-setup"
            | "postcopy-recover"
    );
    under_way.then(|| {
        format!("a migration hagctl did not start is under way (QEMU: {migration}; libvirt's virsh migrate?)")
    })
}

/// What QEMU's run states (`query-status`'s `status`) mean.
pub fn run_state(status: &str) -> RunState {
    let kind = match status {
        "running" => RunKind::Running,
        "inmigrate" => RunKind::Incoming,
        "postmigrate" => RunKind::Migrated,
        "finish-migrate" | "colo" => RunKind::Migrating,
        "paused" | "prelaunch" | "suspended" | "debug" | "save-vm" | "restore-vm" | "watchdog"
        | "io-error" => RunKind::Paused,
        _ => RunKind::Stopped,
    };
    RunState::new(kind, status)
}

fn uint(v: &Value, key: &str) -> Option<u64> {
    let f = v.get(key)?;
    f.as_u64()
        .or_else(|| f.as_f64().filter(|x| *x >= 0.0).map(|x| x as u64))
}

/// `query-migrate`'s reply, every field but `status` optional (QEMU shows
/// each only in some states; a field of an unexpected type counts as
/// missing). `{}` (no migration yet) is status `none`.
pub fn parse_query_migrate(v: &Value) -> Result<MigrationInfo, String> {
    if !v.is_object() {
        return Err(format!("query-migrate returned {v}, not an object"));
    }
    let text = |key: &str| v.get(key).and_then(Value::as_str).map(str::to_owned);
    let mut blocked_reasons: Vec<String> = v
        .get("blocked-reasons")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    // Older QEMUs said only "blocked": true.
    if blocked_reasons.is_empty() && v.get("blocked").and_then(Value::as_bool) == Some(true) {
        blocked_reasons.push("migration is blocked (QEMU gave no reason)".into());
    }
    let ram = v.get("ram").filter(|r| r.is_object()).map(|r| RamProgress {
        transferred: uint(r, "transferred"),
        remaining: uint(r, "remaining"),
        total: uint(r, "total"),
        dirty_pages_rate: uint(r, "dirty-pages-rate"),
        dirty_sync_count: uint(r, "dirty-sync-count"),
        mbps: r.get("mbps").and_then(Value::as_f64),
        downtime_bytes: uint(r, "downtime-bytes"),
        precopy_bytes: uint(r, "precopy-bytes"),
        normal_pages: uint(r, "normal"),
        zero_pages: uint(r, "duplicate"),
        page_size: uint(r, "page-size"),
    });
    let listening = v
        .get("socket-address")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|s| {
                    let host = s.get("host")?.as_str()?;
                    let port = s.get("port")?;
                    let port = port
                        .as_str()
                        .map(str::to_owned)
                        .or_else(|| port.as_u64().map(|p| p.to_string()))?;
                    Some(if host.contains(':') {
                        format!("[{host}]:{port}")
                    } else {
                        format!("{host}:{port}")
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(MigrationInfo {
        status: text("status").unwrap_or_else(|| "none".into()),
        error: text("error-desc"),
        blocked_reasons,
        total_time_ms: uint(v, "total-time"),
        setup_time_ms: uint(v, "setup-time"),
        downtime_ms: uint(v, "downtime"),
        expected_downtime_ms: uint(v, "expected-downtime"),
        ram,
        vfio_transferred: v.get("vfio").and_then(|f| uint(f, "transferred")),
        listening,
    })
}

/// The capabilities and their states in a `query-migrate-capabilities`
/// reply.
fn capabilities(reply: &Value) -> Vec<(String, bool)> {
    reply
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| Some((c["capability"].as_str()?.to_owned(), c["state"].as_bool()?)))
        .collect()
}

/// `migrate-set-capabilities`' arguments.
pub fn capabilities_args(caps: &[(String, bool)]) -> Value {
    json!({
        "capabilities": caps
            .iter()
            .map(|(name, on)| json!({"capability": name, "state": on}))
            .collect::<Vec<_>>()
    })
}

/// `migrate-set-parameters`' arguments (`None` if there is nothing to set).
pub fn parameters_args(settings: &MigrationSettings) -> Option<Value> {
    let mut args = Map::new();
    if let Some(ms) = settings.downtime_limit_ms {
        args.insert("downtime-limit".into(), ms.into());
    }
    if let Some(bw) = settings.max_bandwidth {
        args.insert("max-bandwidth".into(), bw.into());
    }
    for (name, value) in &settings.parameters {
        args.insert(name.clone(), value.clone());
    }
    (!args.is_empty()).then_some(Value::Object(args))
}

impl Qemu {
    /// Connects to the QMP socket at `path` (greeting and
    /// `qmp_capabilities` within `timeout`, which is also every later
    /// command's deadline).
    pub fn connect(path: &Path, timeout: Duration) -> Result<Qemu, VmmError> {
        Ok(Qemu::from_qmp(Qmp::connect(path, timeout)?))
    }

    /// The driver over a QMP connection in command mode.
    pub fn from_qmp(qmp: Qmp) -> Qemu {
        Qemu {
            qmp,
            saves: 0,
            mirrors: None,
            exports: None,
            migration_events: false,
            stopped_at: None,
        }
    }

    /// Whether the VM is paused by this connection's `stop` and nothing
    /// read since says it ran: what lets a paused epoch skip asking
    /// QEMU's run state. A `cont` from another client shows as a `RESUME`
    /// event read with the next reply; [`Vmm::save_device_state`] checks
    /// again after the save.
    pub fn held_paused(&self) -> bool {
        self.stopped_at == Some(self.qmp.resumes_seen())
    }

    /// QEMU's version.
    pub fn version(&self) -> QemuVersion {
        self.qmp.greeting().version
    }

    /// The QMP connection (its buffered events, other commands).
    pub fn qmp(&mut self) -> &mut Qmp {
        &mut self.qmp
    }

    /// Sets migration capabilities and parameters (capabilities first: a
    /// parameter may need one). Refused while a migration runs.
    pub fn apply(&mut self, settings: &MigrationSettings) -> Result<(), VmmError> {
        if !settings.capabilities.is_empty() {
            self.qmp.execute(
                "migrate-set-capabilities",
                Some(capabilities_args(&settings.capabilities)),
            )?;
            if let Some(on) = settings.capability("events") {
                self.migration_events = on;
            }
        }
        if let Some(args) = parameters_args(settings) {
            self.qmp.execute("migrate-set-parameters", Some(args))?;
        }
        Ok(())
    }

    /// QEMU's migration capabilities and their states.
    pub fn capabilities(&mut self) -> Result<Vec<(String, bool)>, VmmError> {
        let caps = self.qmp.execute("query-migrate-capabilities", None)?;
        Ok(capabilities(&caps))
    }

    /// Runs a migration into `uri` (the VM paused) to its end.
    fn await_save(&mut self, uri: &str) -> Result<SavedState, VmmError> {
        // Earlier migrations' events say nothing of this one.
        self.qmp.discard_events("MIGRATION");
        self.qmp.execute("migrate", Some(json!({ "uri": uri })))?;
        let start = Instant::now();
        // Without events, the first poll is at once.
        let mut first = !self.migration_events;
        loop {
            if !std::mem::take(&mut first) {
                // Its MIGRATION event, when QEMU sends them, ends the wait
                // as the save ends, and no query competes with the save
                // for the CPU meanwhile.
                let wait = if self.migration_events {
                    SAVE_TIMEOUT.saturating_sub(start.elapsed())
                } else {
                    SAVE_POLL
                };
                let ended = self.qmp.wait_event(
                    |e| {
                        e.name == "MIGRATION"
                            && matches!(
                                e.data["status"].as_str(),
                                Some("completed" | "failed" | "cancelled")
                            )
                    },
                    wait,
                )?;
                // "completed" says all there is (the VM is paused in a
                // round trip less); a failure's reason is in query-migrate.
                if ended.is_some_and(|e| e.data["status"] == "completed") {
                    return Ok(SavedState { bytes: None });
                }
            }
            let info = self.migration_info()?;
            match info.status.as_str() {
                "completed" => {
                    return Ok(SavedState {
                        bytes: info.ram.and_then(|r| r.transferred),
                    })
                }
                "failed" | "cancelled" => {
                    return Err(self.protocol(format!(
                        "saving the device state {}: {}",
                        info.status,
                        info.error.unwrap_or_else(|| "QEMU gave no reason".into())
                    )))
                }
                _ if start.elapsed() > SAVE_TIMEOUT => {
                    let _ = self.cancel_migration();
                    return Err(self.protocol(format!(
                        "saving the device state took over {} s; cancelled",
                        SAVE_TIMEOUT.as_secs()
                    )));
                }
                _ => {}
            }
        }
    }

    fn protocol(&self, what: String) -> VmmError {
        VmmError::Protocol {
            vmm: self.describe(),
            what,
        }
    }
}

impl Vmm for Qemu {
    fn describe(&self) -> String {
        format!("QEMU {} at {}", self.version(), self.qmp.path().display())
    }

    fn features(&self) -> &'static [Feature] {
        &[
            Feature::RunState,
            Feature::Pause,
            Feature::Resume,
            Feature::Quit,
            Feature::SaveDeviceState,
            Feature::Migrate,
            Feature::Incoming,
            Feature::CopyStorage,
        ]
    }

    fn unsupported(&self, feature: Feature) -> VmmError {
        VmmError::Unsupported {
            vmm: self.describe(),
            feature,
            hint: match feature {
                Feature::GuestMemory | Feature::CpuDirtyLog => {
                    "QEMU keeps them to itself over QMP; give the VM a shared memory backend \
                     (memory-backend-file/memfd, share=on) to reach its RAM"
                }
                _ => "",
            },
        }
    }

    fn run_state(&mut self) -> Result<RunState, VmmError> {
        let v = self.qmp.execute("query-status", None)?;
        let status = v
            .get("status")
            .and_then(Value::as_str)
            .ok_or_else(|| self.protocol(format!("query-status returned {v}")))?;
        Ok(run_state(status))
    }

    /// `stop`: QEMU returns once the vCPUs are stopped.
    fn pause(&mut self) -> Result<(), VmmError> {
        self.qmp.execute("stop", None)?;
        self.stopped_at = Some(self.qmp.resumes_seen());
        Ok(())
    }

    /// `cont`: also from `postmigrate` (after [`Vmm::save_device_state`], or
    /// a migration that must be undone).
    fn resume(&mut self) -> Result<(), VmmError> {
        let deadline = Instant::now() + FINALIZE_WAIT;
        loop {
            match self.qmp.execute("cont", None) {
                Ok(_) => break,
                Err(e)
                    if e.desc() == Some("Migration is not finalized yet")
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e.into()),
            }
        }
        self.stopped_at = None;
        Ok(())
    }

    /// `quit`: QEMU answers, then exits (closing the socket).
    fn quit(&mut self) -> Result<(), VmmError> {
        match self.qmp.execute("quit", None) {
            Ok(_) => Ok(()),
            // It may be gone before its answer arrives.
            Err(e) if e.is_closed() => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// A migration into `into` (`getfd`, `migrate fd:NAME`), which QEMU
    /// writes from its migration thread; returns when QEMU reports it
    /// completed. Afterwards QEMU's run state is `postmigrate` (paused;
    /// [`Vmm::resume`] continues it). Set `x-ignore-shared` first to leave
    /// out RAM in a shared backend.
    fn save_device_state(&mut self, into: OwnedFd) -> Result<SavedState, VmmError> {
        let held = self.held_paused();
        if !held {
            let state = self.run_state()?;
            if state.kind != RunKind::Paused {
                return Err(VmmError::State {
                    vmm: self.describe(),
                    doing: "save the device state",
                    state: state.name,
                });
            }
        }
        self.saves += 1;
        // A regular file goes through an fd set as file: (QEMU 10 calls fd:
        // to a file deprecated); a pipe or socket as fd:.
        let is_file = std::fs::File::from(into.try_clone().map_err(|source| VmmError::Io {
            what: "duplicating the state fd".into(),
            source,
        })?)
        .metadata()
        .is_ok_and(|m| m.file_type().is_file());
        let (uri, cleanup) = if is_file {
            let added = self.qmp.execute_with_fd("add-fd", None, into.as_fd())?;
            let set = added
                .get("fdset-id")
                .and_then(Value::as_u64)
                .ok_or_else(|| self.protocol(format!("add-fd returned {added}")))?;
            (
                format!("file:/dev/fdset/{set}"),
                ("remove-fd", json!({ "fdset-id": set })),
            )
        } else {
            let name = format!("hagctl-save-{}", self.saves);
            self.qmp
                .execute_with_fd("getfd", Some(json!({ "fdname": name })), into.as_fd())?;
            (format!("fd:{name}"), ("closefd", json!({ "fdname": name })))
        };
        // QEMU has its own copy: the stream ends when QEMU closes it.
        drop(into);
        let result = self.await_save(&uri);
        // An fd set outlives the migration; a getfd name is gone after it.
        if is_file || result.is_err() {
            let _ = self.qmp.execute(cleanup.0, Some(cleanup.1));
        }
        if held && result.is_ok() && !self.held_paused() {
            // The state may be of a moment the caller's other reads
            // (guest RAM, dirty logs) were not. The other client wanted
            // the VM running (libvirt restores a domain that way after a
            // migration QEMU refused during this save), but the save's
            // end stopped it again, in `postmigrate`: left so, it would
            // look migrated away and stay paused. It runs again here.
            let what = "another QMP client resumed the VM while its device state was saved";
            return Err(match self.resume() {
                Ok(()) => self.protocol(format!("{what} (it runs on)")),
                Err(e) => self.protocol(format!(
                    "{what}, and it could not run on after the save: {e}"
                )),
            });
        }
        result
    }

    fn migration_blockers(&mut self) -> Result<Vec<String>, VmmError> {
        Ok(self.migration_info()?.blocked_reasons)
    }

    fn start_migration(
        &mut self,
        to: &MigrationAddress,
        settings: &MigrationSettings,
    ) -> Result<(), VmmError> {
        self.apply(settings)?;
        self.qmp
            .execute("migrate", Some(json!({ "uri": to.qemu_uri() })))?;
        Ok(())
    }

    /// `migrate-incoming` with `exit-on-error: false` (QEMU 9.1 and
    /// later): a failed incoming migration leaves QEMU running, in
    /// `inmigrate`, with its `error-desc` in `query-migrate`, instead of
    /// exiting.
    fn start_incoming(
        &mut self,
        on: &MigrationAddress,
        settings: &MigrationSettings,
    ) -> Result<(), VmmError> {
        self.apply(settings)?;
        let mut args = json!({ "uri": on.qemu_uri() });
        if self.version() >= EXIT_ON_ERROR_SINCE {
            args["exit-on-error"] = false.into();
        }
        self.qmp.execute("migrate-incoming", Some(args))?;
        Ok(())
    }

    fn migration_info(&mut self) -> Result<MigrationInfo, VmmError> {
        let v = self.qmp.execute("query-migrate", None)?;
        parse_query_migrate(&v).map_err(|what| self.protocol(what))
    }

    fn cancel_migration(&mut self) -> Result<(), VmmError> {
        self.qmp.execute("migrate_cancel", None)?;
        Ok(())
    }

    /// See [`super::qemu_storage`].
    fn start_disk_copy(
        &mut self,
        nbd: &MigrationAddress,
        connect_timeout: Duration,
    ) -> Result<Vec<String>, VmmError> {
        if self.mirrors.is_some() {
            return Err(self.protocol("the disks are being mirrored already".into()));
        }
        let m =
            Mirrors::start(&mut self.qmp, nbd, connect_timeout).map_err(|w| self.protocol(w))?;
        let disks = m.disks().to_vec();
        self.mirrors = Some(m);
        Ok(disks)
    }

    fn disk_copy_progress(&mut self) -> Result<Vec<DiskCopy>, VmmError> {
        match &self.mirrors {
            Some(m) => m.progress(&mut self.qmp).map_err(|w| self.protocol(w)),
            None => Ok(Vec::new()),
        }
    }

    /// `block-job-cancel` on each ready mirror: completed without pivoting.
    fn finish_disk_copy(&mut self) -> Result<(), VmmError> {
        match self.mirrors.take() {
            Some(m) => m.finish(&mut self.qmp).map_err(|w| self.protocol(w)),
            None => Ok(()),
        }
    }

    fn abort_disk_copy(&mut self) -> Result<(), VmmError> {
        let Some(mut m) = self.mirrors.take() else {
            return Ok(());
        };
        let left = m.abort(&mut self.qmp);
        if left.is_empty() {
            Ok(())
        } else {
            Err(self.protocol(left.join("; ")))
        }
    }

    /// Reads QEMU's command line (`/proc/PID/cmdline`, the pid from the
    /// QMP socket's peer credentials): QMP does not say whether `-S` was
    /// given.
    fn starts_paused(&mut self) -> Result<bool, VmmError> {
        let pid = self.qmp.peer_pid()?;
        let path = format!("/proc/{pid}/cmdline");
        let cmdline = std::fs::read(&path).map_err(|source| VmmError::Io {
            what: format!(
                "cannot tell whether {} was started with -S: {path}",
                self.describe()
            ),
            source,
        })?;
        Ok(started_paused(&cmdline))
    }

    fn export_disks(&mut self, nbd: &MigrationAddress) -> Result<Vec<String>, VmmError> {
        if self.exports.is_some() {
            return Err(self.protocol("the disks are exported already".into()));
        }
        let (x, disks) = Exports::start(&mut self.qmp, nbd).map_err(|w| self.protocol(w))?;
        self.exports = Some(x);
        Ok(disks)
    }

    fn unexport_disks(&mut self, force: bool) -> Result<Vec<String>, VmmError> {
        let Some(x) = self.exports.as_mut() else {
            return Ok(Vec::new());
        };
        let busy = x.remove(&mut self.qmp, force);
        if busy.as_ref().is_ok_and(Vec::is_empty) {
            self.exports = None;
        }
        busy.map_err(|w| self.protocol(w))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::qmp::tests::{fake_qemu, ret};
    use super::*;

    #[test]
    fn crashes_and_ends() {
        assert!(crash(None, false).is_some(), "SIGKILL is a crash");
        assert!(crash(Some("internal-error"), false).is_some());
        assert_eq!(
            crash(None, true),
            None,
            "a SHUTDOWN, then the exit, is an end"
        );
        for s in ["shutdown", "guest-panicked", "paused", "running"] {
            assert_eq!(crash(Some(s), false), None, "{s}");
        }
    }

    #[test]
    fn a_migration_hagctl_did_not_start_is_seen_in_every_phase() {
        for m in [
            "setup",
            "active",
            "device",
            "pre-switchover",
            "postcopy-active",
        ] {
            let why = migrating_away("running", m).unwrap_or_default();
            assert!(why.contains(m), "{m}: {why}");
        }
        for st in ["postmigrate", "finish-migrate"] {
            assert!(migrating_away(st, "completed").is_some(), "{st}");
        }
        // Nothing under way, or only the end of one: hagctl's own save
        // (completed, failed) or one it cancelled.
        for m in ["none", "completed", "failed", "cancelled", "cancelling"] {
            assert_eq!(migrating_away("running", m), None, "{m}");
            assert_eq!(migrating_away("paused", m), None, "{m}");
        }
    }

    #[test]
    fn capabilities_are_read_with_their_states() {
        let reply = json!([
            {"capability": "events", "state": true},
            {"capability": "multifd", "state": false},
            {"capability": "no-state"},
        ]);
        assert_eq!(
            capabilities(&reply),
            [("events".to_owned(), true), ("multifd".to_owned(), false)]
        );
        assert!(capabilities(&json!({})).is_empty());
    }

    #[test]
    fn run_states_map() {
        assert!(run_state("running").is_running());
        assert_eq!(run_state("inmigrate").kind, RunKind::Incoming);
        assert_eq!(run_state("postmigrate").kind, RunKind::Migrated);
        assert_eq!(run_state("finish-migrate").kind, RunKind::Migrating);
        for s in ["paused", "prelaunch", "suspended", "io-error"] {
            assert_eq!(run_state(s).kind, RunKind::Paused, "{s}");
        }
        for s in [
            "shutdown",
            "internal-error",
            "guest-panicked",
            "something-new",
        ] {
            assert_eq!(run_state(s).kind, RunKind::Stopped, "{s}");
        }
        assert_eq!(run_state("prelaunch").to_string(), "prelaunch");
    }

    #[test]
    fn a_completed_migration_parses() {
        // QEMU 10.0.2, a 64 MiB TCG guest.
        let v: Value = serde_json::from_str(r#"{"status": "completed", "setup-time": 5, "downtime": 15, "total-time": 48, "ram": {"total": 67641344, "postcopy-requests": 0, "dirty-sync-count": 2, "multifd-bytes": 0, "pages-per-second": 0, "downtime-bytes": 12319, "page-size": 4096, "remaining": 0, "postcopy-bytes": 0, "mbps": 136.42120930232559, "transferred": 733264, "dirty-sync-missed-zero-copy": 0, "precopy-bytes": 644213, "duplicate": 16393, "dirty-pages-rate": 0, "normal-bytes": 507904, "normal": 124}, "vfio": {"transferred": 4096}}"#).unwrap();
        let info = parse_query_migrate(&v).unwrap();
        assert_eq!(info.status, "completed");
        assert!(info.is_finished());
        assert_eq!(
            (info.setup_time_ms, info.downtime_ms, info.total_time_ms),
            (Some(5), Some(15), Some(48))
        );
        assert_eq!(info.expected_downtime_ms, None);
        let ram = info.ram.unwrap();
        assert_eq!(ram.transferred, Some(733264));
        assert_eq!(ram.total, Some(67641344));
        assert_eq!(ram.dirty_sync_count, Some(2));
        assert_eq!(ram.downtime_bytes, Some(12319));
        assert_eq!(ram.zero_pages, Some(16393));
        assert!((ram.mbps.unwrap() - 136.42).abs() < 0.01);
        assert_eq!(info.vfio_transferred, Some(4096));
        assert!(info.blocked_reasons.is_empty() && info.error.is_none());
    }

    #[test]
    fn partial_and_odd_replies_parse() {
        let info = parse_query_migrate(&json!({})).unwrap();
        assert_eq!(info.status, "none");
        assert!(!info.is_running() && info.ram.is_none());
        let info = parse_query_migrate(&json!({"status": "setup"})).unwrap();
        assert!(info.is_running());
        assert_eq!(info.total_time_ms, None);
        // A field of a surprising type is just missing.
        let info = parse_query_migrate(&json!({"status": "active", "expected-downtime": "soon",
            "total-time": 1200, "ram": {"transferred": 10, "remaining": -1}}))
        .unwrap();
        assert_eq!(info.expected_downtime_ms, None);
        assert_eq!(info.total_time_ms, Some(1200));
        let ram = info.ram.unwrap();
        assert_eq!(
            (ram.transferred, ram.remaining, ram.total),
            (Some(10), None, None)
        );
        assert!(parse_query_migrate(&json!([])).is_err());
    }

    #[test]
    fn failures_blockers_and_listeners_parse() {
        let info = parse_query_migrate(&json!({"status": "failed",
            "error-desc": "Failed to connect to '127.0.0.1:7312': Connection refused"}))
        .unwrap();
        assert!(info.is_finished());
        assert_eq!(
            info.error.as_deref(),
            Some("Failed to connect to '127.0.0.1:7312': Connection refused")
        );
        let info = parse_query_migrate(&json!({"blocked-reasons": [
            "Migration is disabled when using feature 'peer mode' in device 'ivshmem'",
            "another"]}))
        .unwrap();
        assert_eq!(info.status, "none");
        assert_eq!(info.blocked_reasons.len(), 2);
        let info = parse_query_migrate(&json!({"blocked": true})).unwrap();
        assert_eq!(
            info.blocked_reasons,
            ["migration is blocked (QEMU gave no reason)"]
        );
        let info = parse_query_migrate(&json!({"status": "setup", "socket-address": [
            {"port": "40961", "ipv4": true, "host": "127.0.0.1", "type": "inet"},
            {"port": "7100", "host": "::1", "type": "inet"}]}))
        .unwrap();
        assert_eq!(info.listening, ["127.0.0.1:40961", "[::1]:7100"]);
    }

    #[test]
    fn settings_become_qmp_arguments() {
        let s = MigrationSettings {
            downtime_limit_ms: Some(300),
            max_bandwidth: Some(100 << 20),
            capabilities: vec![("return-path".into(), true), ("events".into(), false)],
            parameters: vec![("multifd-channels".into(), 4.into())],
        };
        assert_eq!(
            capabilities_args(&s.capabilities),
            json!({"capabilities": [{"capability": "return-path", "state": true},
                                    {"capability": "events", "state": false}]})
        );
        assert_eq!(
            parameters_args(&s).unwrap(),
            json!({"downtime-limit": 300, "max-bandwidth": 104857600, "multifd-channels": 4})
        );
        assert_eq!(parameters_args(&MigrationSettings::default()), None);
    }

    #[test]
    fn starts_a_migration_in_qemus_order() {
        let (qmp, server) = fake_qemu(|req| {
            let cmd = req["execute"].as_str().unwrap_or_default();
            Some(match cmd {
                "query-migrate" => vec![ret(req, json!({"blocked-reasons": ["no, because"]}))],
                "migrate" if req["arguments"]["uri"] == "tcp:h:2" => {
                    vec![json!({"id": req["id"], "error": {"class": "GenericError",
                        "desc": "no, because"}})
                    .to_string()]
                }
                "quit" => vec![ret(req, json!({}))],
                _ => vec![ret(req, json!({}))],
            })
        });
        let mut vm = Qemu::from_qmp(qmp);
        assert_eq!(vm.version().to_string(), "10.0.2");
        assert!(vm.describe().starts_with("QEMU 10.0.2 at "));
        assert_eq!(vm.migration_blockers().unwrap(), ["no, because"]);
        let s = MigrationSettings {
            downtime_limit_ms: Some(300),
            capabilities: vec![("return-path".into(), true)],
            ..MigrationSettings::default()
        };
        vm.start_migration(&MigrationAddress::parse_tcp("h:1").unwrap(), &s)
            .unwrap();
        let e = vm
            .start_migration(
                &MigrationAddress::parse_tcp("h:2").unwrap(),
                &MigrationSettings::default(),
            )
            .unwrap_err();
        assert_eq!(e.qemu_desc(), Some("no, because"));
        vm.start_incoming(
            &MigrationAddress::parse_tcp("127.0.0.1:0").unwrap(),
            &MigrationSettings::default(),
        )
        .unwrap();
        vm.cancel_migration().unwrap();
        assert!(vm.guest_memory().is_err());
        let e = vm.cpu_dirty_log().unwrap_err().to_string();
        assert!(e.contains("cannot hand over the CPU dirty log"), "{e}");
        vm.quit().unwrap();
        drop(vm);
        let seen: Vec<Value> = server.join().unwrap();
        let cmds: Vec<&str> = seen
            .iter()
            .map(|r| r["execute"].as_str().unwrap())
            .collect();
        assert_eq!(
            cmds,
            [
                "qmp_capabilities",
                "query-migrate",
                "migrate-set-capabilities",
                "migrate-set-parameters",
                "migrate",
                "migrate",
                "migrate-incoming",
                "migrate_cancel",
                "quit"
            ]
        );
        assert_eq!(seen[3]["arguments"], json!({"downtime-limit": 300}));
        assert_eq!(seen[4]["arguments"], json!({"uri": "tcp:h:1"}));
        assert_eq!(
            seen[6]["arguments"],
            json!({"uri": "tcp:127.0.0.1:0", "exit-on-error": false})
        );
    }

    /// An epoch's save with the VM paused by this connection: no
    /// `query-status` before it, no `query-migrate` after its "completed"
    /// event; a `RESUME` seen meanwhile (another client's `cont`) fails
    /// it and runs the VM again, as that client left it; `cont` waits out
    /// QEMU's "not finalized yet".
    #[test]
    fn a_save_under_its_own_stop_asks_nothing_it_knows() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let event = |name: &str, data: Value| {
            json!({"timestamp": {"seconds": 1, "microseconds": 0}, "event": name, "data": data})
                .to_string()
        };
        let migrates = AtomicUsize::new(0);
        let conts = AtomicUsize::new(0);
        let (qmp, server) = fake_qemu(move |req| {
            Some(match req["execute"].as_str().unwrap_or_default() {
                "migrate" => {
                    let mut out = vec![ret(req, json!({}))];
                    if migrates.fetch_add(1, SeqCst) == 1 {
                        out.push(event("RESUME", json!({})));
                    }
                    out.push(event("MIGRATION", json!({"status": "completed"})));
                    out
                }
                "cont" if conts.fetch_add(1, SeqCst) == 0 => vec![json!({"id": req["id"],
                    "error": {"class": "GenericError", "desc": "Migration is not finalized yet"}})
                .to_string()],
                _ => vec![ret(req, json!({}))],
            })
        });
        let mut vm = Qemu::from_qmp(qmp);
        vm.apply(&MigrationSettings {
            capabilities: vec![("events".into(), true)],
            ..MigrationSettings::default()
        })
        .unwrap();
        assert!(!vm.held_paused());
        vm.pause().unwrap();
        assert!(vm.held_paused());
        let (_r, w) = nix::unistd::pipe().unwrap();
        assert_eq!(vm.save_device_state(w).unwrap(), SavedState { bytes: None });
        vm.resume().unwrap();
        assert!(!vm.held_paused());
        vm.pause().unwrap();
        let (_r, w) = nix::unistd::pipe().unwrap();
        let e = vm.save_device_state(w).unwrap_err().to_string();
        assert!(e.contains("another QMP client resumed the VM"), "{e}");
        assert!(e.contains("(it runs on)"), "{e}");
        assert!(!vm.held_paused());
        drop(vm);
        let cmds: Vec<String> = server
            .join()
            .unwrap()
            .iter()
            .map(|r| r["execute"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            cmds,
            [
                "qmp_capabilities",
                "migrate-set-capabilities",
                "stop",
                "getfd",
                "migrate",
                "cont",
                "cont",
                "stop",
                "getfd",
                "migrate",
                "cont"
            ]
        );
    }

    /// A connection to the QMP socket `sock` of QEMU `child`, once it
    /// listens (within 20 s; `child` killed if not).
    pub(crate) fn connect_when_up(sock: &Path, child: &mut std::process::Child) -> Qemu {
        let t = Instant::now();
        loop {
            match Qemu::connect(sock, Duration::from_secs(10)) {
                Ok(vm) => return vm,
                Err(_) if t.elapsed() < Duration::from_secs(20) => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => {
                    let _ = child.kill();
                    panic!("{e}");
                }
            }
        }
    }

    /// `qemu-system-x86_64`, if it is QEMU 10 or later.
    pub(crate) fn qemu_10() -> Option<String> {
        let out = std::process::Command::new("qemu-system-x86_64")
            .arg("--version")
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let version = text.split("version ").nth(1)?;
        let major: u32 = version.split('.').next()?.trim().parse().ok()?;
        (major >= 10).then(|| version.split_whitespace().next().unwrap_or("").to_owned())
    }

    /// A real QEMU (TCG, no guest but its firmware): pause, events, save
    /// the device state into a file, resume, quit. Run with `cargo test --
    /// --ignored`; skips itself without QEMU 10.
    #[test]
    #[ignore = "starts QEMU"]
    fn a_real_qemu_saves_its_state_and_runs_on() {
        let Some(version) = qemu_10() else {
            eprintln!("skipped: no qemu-system-x86_64 10 or later");
            return;
        };
        let dir = std::env::temp_dir().join(format!("hagctl-qemu-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("vm.qmp");
        let mut child = std::process::Command::new("qemu-system-x86_64")
            .args([
                "-accel",
                "tcg",
                "-machine",
                "q35",
                "-m",
                "64",
                "-nodefaults",
            ])
            .args(["-display", "none", "-qmp"])
            .arg(format!("unix:{},server=on,wait=off", sock.display()))
            .stdin(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        let mut vm = connect_when_up(&sock, &mut child);
        assert_eq!(vm.version().to_string(), version);
        assert!(vm.run_state().unwrap().is_running());
        // Saving needs a paused VM.
        let file = std::fs::File::create(dir.join("state")).unwrap();
        let e = vm.save_device_state(file.into()).unwrap_err();
        assert!(matches!(e, VmmError::State { .. }), "{e}");
        vm.pause().unwrap();
        assert_eq!(vm.run_state().unwrap().kind, RunKind::Paused);
        let stop = vm
            .qmp()
            .wait_event(|e| e.name == "STOP", Duration::from_secs(5))
            .unwrap();
        assert!(stop.is_some(), "no STOP event");
        let file = std::fs::File::create(dir.join("state")).unwrap();
        let saved = vm.save_device_state(file.into()).unwrap();
        let bytes = std::fs::read(dir.join("state")).unwrap();
        eprintln!(
            "saved {} bytes (QEMU says {:?}) in {:?}",
            bytes.len(),
            saved.bytes,
            t.elapsed()
        );
        assert!(bytes.starts_with(b"QEVM"), "not a QEMU migration stream");
        assert!(saved.bytes.unwrap_or(0) > 0);
        assert_eq!(vm.run_state().unwrap().name, "postmigrate");
        vm.resume().unwrap();
        assert!(vm.run_state().unwrap().is_running());
        // Again, into a pipe that a thread drains.
        vm.pause().unwrap();
        let (r, w) = nix::unistd::pipe().unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            std::io::Read::read_to_end(&mut std::fs::File::from(r), &mut got).unwrap();
            got
        });
        let saved = vm.save_device_state(w).unwrap();
        let piped = reader.join().unwrap();
        assert!(piped.starts_with(b"QEVM"));
        assert_eq!(Some(piped.len() as u64), saved.bytes);
        vm.resume().unwrap();
        assert!(vm.run_state().unwrap().is_running());
        vm.quit().unwrap();
        let t = Instant::now();
        while child.try_wait().unwrap().is_none() {
            assert!(t.elapsed() < Duration::from_secs(10), "QEMU did not quit");
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
