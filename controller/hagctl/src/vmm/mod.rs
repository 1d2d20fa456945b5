//! What hagctl needs of a VMM, once, and the drivers that provide it.
//!
//! [`Vmm`] is the interface the controller's migration and checkpoint
//! logic is written against. Two drivers implement it:
//! - [`qemu::Qemu`]: QEMU (10 or later) over QMP ([`qmp`]), for real
//!   deployments. QEMU migrates a VM itself (RAM with KVM's dirty log and
//!   the vGPU's VFIO DMA-logging report, device state, the vGPU's through
//!   VFIO migration v2); hagctl starts, watches and reports that.
//! - [`hagvmm::HagVmm`]: `hag-vmm serve`'s control socket, the test VMM,
//!   which hands hagctl its guest RAM and CPU dirty log so that hagctl
//!   copies them itself (its own migration protocol, `crate::wire`).
//!
//! Not every VMM can do everything. What a driver lacks is said twice, in
//! the types and never by a panic: [`Vmm::features`] lists the
//! [`Feature`]s it has, and each method of a missing feature returns
//! [`VmmError::Unsupported`], naming the VMM, what it cannot do and what to
//! use instead. The default bodies of the trait's methods are exactly that,
//! so a driver only writes what it can do.

pub mod copy;
pub mod dirty_source;
pub mod hagvmm;
pub mod qemu;
pub mod qemu_copy;
pub mod qemu_disks;
pub mod qemu_standby;
pub mod qemu_storage;
pub mod qmp;
pub mod shared_ram;

use std::os::fd::OwnedFd;

use guest_ram::GuestRam;

/// Something a VMM may or may not be able to do for hagctl.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Feature {
    /// [`Vmm::run_state`].
    RunState,
    /// [`Vmm::pause`].
    Pause,
    /// [`Vmm::resume`].
    Resume,
    /// [`Vmm::quit`].
    Quit,
    /// [`Vmm::save_device_state`].
    SaveDeviceState,
    /// [`Vmm::guest_memory`].
    GuestMemory,
    /// [`Vmm::cpu_dirty_log`].
    CpuDirtyLog,
    /// [`Vmm::migration_blockers`], [`Vmm::start_migration`],
    /// [`Vmm::migration_info`] and [`Vmm::cancel_migration`]: the VMM
    /// migrates the VM itself.
    Migrate,
    /// [`Vmm::start_incoming`] (and [`Vmm::migration_info`] on the
    /// target): the VMM receives a migration itself.
    Incoming,
    /// [`Vmm::start_disk_copy`], [`Vmm::disk_copy_progress`],
    /// [`Vmm::finish_disk_copy`], [`Vmm::abort_disk_copy`] on the source,
    /// [`Vmm::starts_paused`], [`Vmm::export_disks`],
    /// [`Vmm::unexport_disks`] on the target: the VMM copies the VM's
    /// local disks along with its migration.
    CopyStorage,
}

impl Feature {
    /// What the feature does, as in "QEMU cannot …".
    pub fn doing(self) -> &'static str {
        match self {
            Feature::RunState => "report its run state",
            Feature::Pause => "pause the VM",
            Feature::Resume => "resume the VM",
            Feature::Quit => "quit",
            Feature::SaveDeviceState => "save the VM's device state into a stream",
            Feature::GuestMemory => "hand over guest memory",
            Feature::CpuDirtyLog => "hand over the CPU dirty log",
            Feature::Migrate => "migrate the VM itself",
            Feature::Incoming => "receive a migration itself",
            Feature::CopyStorage => "copy the VM's local disks with its migration",
        }
    }
}

/// The VM's run state, in hagctl's terms; `name` is the VMM's own word.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RunState {
    /// What it means for hagctl.
    pub kind: RunKind,
    /// The VMM's word for it (QEMU's `query-status` status, hag-vmm's
    /// `status` state).
    pub name: String,
}

/// What a run state means for hagctl.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunKind {
    /// The vCPUs run.
    Running,
    /// Stopped, and can be resumed (QEMU: `paused`, `prelaunch`,
    /// `suspended`, `debug`, …).
    Paused,
    /// Waiting for an incoming migration (QEMU: `inmigrate`).
    Incoming,
    /// Stopped because the VM migrated away (QEMU: `postmigrate`): it
    /// may run elsewhere now and must not run here again unless the
    /// migration failed.
    Migrated,
    /// Stopped while migrating (QEMU: `finish-migrate`, `colo`).
    Migrating,
    /// The guest's work ended (hag-vmm: `finished`).
    Finished,
    /// Gone, shut down or broken (QEMU: `shutdown`, `internal-error`,
    /// `guest-panicked`, `io-error`, …; hag-vmm: `stopped`).
    Stopped,
}

impl RunState {
    /// A run state of `kind` that the VMM calls `name`.
    pub fn new(kind: RunKind, name: &str) -> RunState {
        RunState {
            kind,
            name: name.to_owned(),
        }
    }

    /// The vCPUs run.
    pub fn is_running(&self) -> bool {
        self.kind == RunKind::Running
    }
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

/// What [`Vmm::save_device_state`] wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SavedState {
    /// Bytes written, if the VMM says.
    pub bytes: Option<u64>,
}

/// Where a migration goes (or is received).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MigrationAddress {
    /// A TCP address: a host name or IP address (IPv6 without brackets)
    /// and a port.
    Tcp {
        /// Host name or IP address.
        host: String,
        /// Port (0 on the receiving side: any free port).
        port: u16,
    },
}

impl MigrationAddress {
    /// `HOST:PORT` or `[IPV6]:PORT`.
    pub fn parse_tcp(text: &str) -> Result<MigrationAddress, String> {
        let (host, port) = text
            .rsplit_once(':')
            .ok_or_else(|| format!("'{text}' is not HOST:PORT"))?;
        let host = match host.strip_prefix('[') {
            Some(h) => h
                .strip_suffix(']')
                .ok_or_else(|| format!("'{text}': unbalanced '['"))?,
            None if host.contains(':') => {
                return Err(format!("'{text}': write an IPv6 address as [ADDR]:PORT"))
            }
            None => host,
        };
        if host.is_empty() {
            return Err(format!("'{text}' has no host"));
        }
        let port = port
            .parse()
            .map_err(|_| format!("'{text}': '{port}' is not a port number"))?;
        Ok(MigrationAddress::Tcp {
            host: host.to_owned(),
            port,
        })
    }

    /// QEMU's URI for it: `tcp:HOST:PORT` (`tcp:[ADDR]:PORT` for IPv6).
    pub fn qemu_uri(&self) -> String {
        match self {
            MigrationAddress::Tcp { host, port } if host.contains(':') => {
                format!("tcp:[{host}]:{port}")
            }
            MigrationAddress::Tcp { host, port } => format!("tcp:{host}:{port}"),
        }
    }
}

impl std::fmt::Display for MigrationAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MigrationAddress::Tcp { host, port } if host.contains(':') => {
                write!(f, "[{host}]:{port}")
            }
            MigrationAddress::Tcp { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

/// How a VMM's own migration is to run. The names are QEMU's
/// (`migrate-set-capabilities`, `migrate-set-parameters`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MigrationSettings {
    /// `downtime-limit`: the longest pause allowed for the last round, ms.
    pub downtime_limit_ms: Option<u64>,
    /// `max-bandwidth`: bytes per second.
    pub max_bandwidth: Option<u64>,
    /// Capabilities to set, in order.
    pub capabilities: Vec<(String, bool)>,
    /// Further parameters, in order (set after the two above).
    pub parameters: Vec<(String, serde_json::Value)>,
}

impl MigrationSettings {
    /// The state asked for capability `name`, if any (the last one wins).
    pub fn capability(&self, name: &str) -> Option<bool> {
        self.capabilities
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, on)| *on)
    }
}

/// A VMM's view of its migration (QEMU: `query-migrate`). Every field but
/// `status` may be missing: QEMU shows each only in some states.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MigrationInfo {
    /// `none` (never started), `setup`, `active`, `device`,
    /// `pre-switchover`, `cancelling`, `cancelled`, `completed`, `failed`,
    /// or another word of the VMM's.
    pub status: String,
    /// Why it failed (QEMU's `error-desc`).
    pub error: Option<String>,
    /// What blocks an outgoing migration (QEMU's `blocked-reasons`).
    pub blocked_reasons: Vec<String>,
    /// Milliseconds since it started (or in all, once completed).
    pub total_time_ms: Option<u64>,
    /// Milliseconds of setup.
    pub setup_time_ms: Option<u64>,
    /// Once completed: how long the VM was paused, ms.
    pub downtime_ms: Option<u64>,
    /// While running: the pause the VMM expects, ms.
    pub expected_downtime_ms: Option<u64>,
    /// Guest RAM's part.
    pub ram: Option<RamProgress>,
    /// VFIO devices' state bytes sent (QEMU's `vfio.transferred`).
    pub vfio_transferred: Option<u64>,
    /// Where an incoming migration listens (`HOST:PORT`, one per socket).
    pub listening: Vec<String>,
}

/// Guest RAM's part of a migration (QEMU: `query-migrate`'s `ram`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RamProgress {
    /// Bytes sent (all of the stream, device state included).
    pub transferred: Option<u64>,
    /// Bytes of RAM left to send.
    pub remaining: Option<u64>,
    /// Guest RAM bytes.
    pub total: Option<u64>,
    /// Pages dirtied per second.
    pub dirty_pages_rate: Option<u64>,
    /// Dirty-log synchronisations so far: the rounds.
    pub dirty_sync_count: Option<u64>,
    /// Throughput, megabits per second.
    pub mbps: Option<f64>,
    /// Bytes sent while the VM was paused.
    pub downtime_bytes: Option<u64>,
    /// Bytes sent before it was paused.
    pub precopy_bytes: Option<u64>,
    /// Pages sent whole.
    pub normal_pages: Option<u64>,
    /// Zero pages sent as a flag.
    pub zero_pages: Option<u64>,
    /// Target page size.
    pub page_size: Option<u64>,
}

impl MigrationInfo {
    /// Ended, one way or the other.
    pub fn is_finished(&self) -> bool {
        matches!(self.status.as_str(), "completed" | "failed" | "cancelled")
    }

    /// Under way (setup to the last round).
    pub fn is_running(&self) -> bool {
        !self.is_finished() && !matches!(self.status.as_str(), "none" | "")
    }
}

/// One disk's copy to the target (QEMU: a `mirror` job, `query-jobs`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DiskCopy {
    /// The disk's device id (`vda`): also its NBD export's name.
    pub disk: String,
    /// The job's id (`hag-mirror-vda`).
    pub job: String,
    /// The job's status (QEMU's: `created`, `running`, `ready`,
    /// `concluded`, …).
    pub status: String,
    /// Bytes copied so far (QEMU's `current-progress`).
    pub copied: u64,
    /// Bytes to copy in all, as known now (QEMU's `total-progress`: it
    /// grows as the guest writes).
    pub total: u64,
    /// Why the job failed, if it did.
    pub error: Option<String>,
}

impl DiskCopy {
    /// Source and target are in sync, and every guest write goes to both
    /// (QEMU: the mirror is `ready`).
    pub fn is_ready(&self) -> bool {
        self.status == "ready"
    }
}

/// Why a VMM call failed.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// The VMM does not have this feature.
    #[error("{vmm} cannot {}{}", feature.doing(), hint_text(.hint))]
    Unsupported {
        /// Which VMM.
        vmm: String,
        /// What it lacks.
        feature: Feature,
        /// What to do instead (may be empty).
        hint: &'static str,
    },
    /// hag-vmm's control socket.
    #[error(transparent)]
    HagVmm(#[from] vmm_control::ControlError),
    /// QMP.
    #[error(transparent)]
    Qmp(#[from] qmp::QmpError),
    /// The VMM answered something hagctl cannot use.
    #[error("{vmm}: {what}")]
    Protocol {
        /// Which VMM.
        vmm: String,
        /// What was wrong.
        what: String,
    },
    /// The VM runs, but cannot be protected (its state is over the
    /// stream's limit, QEMU refuses to migrate it).
    #[error("{vmm}: the VM cannot be protected: {what}")]
    Unprotectable {
        /// Which VMM.
        vmm: String,
        /// Why.
        what: String,
    },
    /// The VM is in the wrong state for this.
    #[error("{vmm}: cannot {doing} while the VM is {state}")]
    State {
        /// Which VMM.
        vmm: String,
        /// What was asked.
        doing: &'static str,
        /// The VM's run state.
        state: String,
    },
    /// Writing a stream.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

fn hint_text(hint: &str) -> String {
    if hint.is_empty() {
        String::new()
    } else {
        format!(" ({hint})")
    }
}

impl VmmError {
    /// QEMU's error description, if QEMU refused a command.
    pub fn qemu_desc(&self) -> Option<&str> {
        match self {
            VmmError::Qmp(e) => e.desc(),
            _ => None,
        }
    }

    /// The VMM went away (closed its socket).
    pub fn is_gone(&self) -> bool {
        match self {
            VmmError::Qmp(e) => e.is_closed(),
            _ => false,
        }
    }
}

/// What hagctl needs of a VMM. Every method acts on the one VM the VMM
/// runs, synchronously: when it returns `Ok`, what it promises has
/// happened (or, for the `start_*` methods, has begun).
pub trait Vmm {
    /// Which VMM this is, for messages ("QEMU 10.0.2 at vm.qmp").
    fn describe(&self) -> String;

    /// What this driver can do; every method of a [`Feature`] not listed
    /// returns [`VmmError::Unsupported`].
    fn features(&self) -> &'static [Feature];

    /// Whether [`Vmm::features`] lists `feature`.
    fn supports(&self, feature: Feature) -> bool {
        self.features().contains(&feature)
    }

    /// The [`VmmError::Unsupported`] for `feature`.
    fn unsupported(&self, feature: Feature) -> VmmError {
        VmmError::Unsupported {
            vmm: self.describe(),
            feature,
            hint: "",
        }
    }

    /// The VM's run state now.
    fn run_state(&mut self) -> Result<RunState, VmmError> {
        Err(self.unsupported(Feature::RunState))
    }

    /// Stops the vCPUs (and the VMM's own device emulation) and returns
    /// once they are stopped. The vGPU itself is not quiesced: work it
    /// already has may still run (hag's quiesce ioctl waits for that).
    fn pause(&mut self) -> Result<(), VmmError> {
        Err(self.unsupported(Feature::Pause))
    }

    /// Lets a paused VM run again; returns once it runs.
    fn resume(&mut self) -> Result<(), VmmError> {
        Err(self.unsupported(Feature::Resume))
    }

    /// Ends the VMM: the VM stops for good and its vGPU is closed. Returns
    /// once the VMM has accepted (QEMU: it then exits on its own).
    fn quit(&mut self) -> Result<(), VmmError> {
        Err(self.unsupported(Feature::Quit))
    }

    /// With the VM paused, writes its device state (vCPUs and devices, the
    /// vGPU's included where the VMM carries it) into `into` and returns
    /// once all is written; the VM stays paused. For checkpointing: QEMU
    /// writes a migration stream (without RAM in a shared backend when
    /// the caller set `x-ignore-shared`), hag-vmm its VM state bytes.
    /// `into` is written to while this runs: a pipe needs a reader.
    fn save_device_state(&mut self, into: OwnedFd) -> Result<SavedState, VmmError> {
        drop(into);
        Err(self.unsupported(Feature::SaveDeviceState))
    }

    /// The VM's guest RAM, mapped into hagctl, where the VMM hands it over.
    fn guest_memory(&mut self) -> Result<GuestRam, VmmError> {
        Err(self.unsupported(Feature::GuestMemory))
    }

    /// Reads and clears the log of guest pages the CPU (the VMM's side)
    /// wrote since the last call, as bitmap words (bit `i % 64` of word
    /// `i / 64` is guest page `i`), where the VMM hands it over.
    fn cpu_dirty_log(&mut self) -> Result<Vec<u64>, VmmError> {
        Err(self.unsupported(Feature::CpuDirtyLog))
    }

    /// What blocks migrating this VM now, in the VMM's words (empty: no
    /// blocker known; the VMM may still refuse when asked).
    fn migration_blockers(&mut self) -> Result<Vec<String>, VmmError> {
        Err(self.unsupported(Feature::Migrate))
    }

    /// Applies `settings` and starts the VMM's own migration of the VM to
    /// `to`; returns once it has begun (watch it with
    /// [`Vmm::migration_info`]). On success the VM ends paused here
    /// (QEMU: `postmigrate`); on failure or cancel it runs on.
    fn start_migration(
        &mut self,
        to: &MigrationAddress,
        settings: &MigrationSettings,
    ) -> Result<(), VmmError> {
        let _ = (to, settings);
        Err(self.unsupported(Feature::Migrate))
    }

    /// Applies `settings` and has a VMM waiting for an incoming migration
    /// listen on `on`; returns once it listens.
    fn start_incoming(
        &mut self,
        on: &MigrationAddress,
        settings: &MigrationSettings,
    ) -> Result<(), VmmError> {
        let _ = (on, settings);
        Err(self.unsupported(Feature::Incoming))
    }

    /// The state of the current (or last) migration, either way.
    fn migration_info(&mut self) -> Result<MigrationInfo, VmmError> {
        Err(self.unsupported(Feature::Migrate))
    }

    /// Asks the VMM to cancel its outgoing migration; returns once asked
    /// (it may still complete: watch [`Vmm::migration_info`]).
    fn cancel_migration(&mut self) -> Result<(), VmmError> {
        Err(self.unsupported(Feature::Migrate))
    }

    /// Source, before [`Vmm::start_migration`]: starts copying each
    /// writable disk to the target's export of the same name at `nbd`
    /// (retrying a refused connection for `connect_timeout`); returns the
    /// disks' ids once every copy has begun. On failure nothing of it is
    /// left and the VM runs on its own disks.
    fn start_disk_copy(
        &mut self,
        nbd: &MigrationAddress,
        connect_timeout: std::time::Duration,
    ) -> Result<Vec<String>, VmmError> {
        let _ = (nbd, connect_timeout);
        Err(self.unsupported(Feature::CopyStorage))
    }

    /// Source: each disk copy's progress. A copy that failed is an error
    /// naming the disk.
    fn disk_copy_progress(&mut self) -> Result<Vec<DiskCopy>, VmmError> {
        Err(self.unsupported(Feature::CopyStorage))
    }

    /// Source, after the migration completed (the VM paused here): ends
    /// each copy with the target holding what the source holds, the VM
    /// staying on its own disks here, and lets go of the target's
    /// exports.
    fn finish_disk_copy(&mut self) -> Result<(), VmmError> {
        Err(self.unsupported(Feature::CopyStorage))
    }

    /// Source, on any failure before the migration completed: cancels the
    /// copies and lets go of the target's exports; the VM keeps its own
    /// disks. Does nothing if no copy was started.
    fn abort_disk_copy(&mut self) -> Result<(), VmmError> {
        Err(self.unsupported(Feature::CopyStorage))
    }

    /// Target: whether the VMM keeps the VM paused once its migration
    /// arrived (QEMU: started with `-S`), so that it runs only when told.
    fn starts_paused(&mut self) -> Result<bool, VmmError> {
        Err(self.unsupported(Feature::CopyStorage))
    }

    /// Target, before [`Vmm::start_incoming`]: serves each writable disk,
    /// writable, at `nbd` under its device id; returns the ids.
    fn export_disks(&mut self, nbd: &MigrationAddress) -> Result<Vec<String>, VmmError> {
        let _ = nbd;
        Err(self.unsupported(Feature::CopyStorage))
    }

    /// Target: removes each export no client uses any more and, once none
    /// is left, stops serving; returns the ids still in use (empty: all
    /// done). `force` removes them whatever uses them (after a failure).
    fn unexport_disks(&mut self, force: bool) -> Result<Vec<String>, VmmError> {
        let _ = force;
        Err(self.unsupported(Feature::CopyStorage))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_addresses_parse() {
        let a = MigrationAddress::parse_tcp("192.0.2.11:7100").unwrap();
        assert_eq!(a.qemu_uri(), "tcp:192.0.2.11:7100");
        assert_eq!(a.to_string(), "192.0.2.11:7100");
        let a = MigrationAddress::parse_tcp("[::1]:7100").unwrap();
        assert_eq!(
            a,
            MigrationAddress::Tcp {
                host: "::1".into(),
                port: 7100
            }
        );
        assert_eq!(a.qemu_uri(), "tcp:[::1]:7100");
        assert_eq!(a.to_string(), "[::1]:7100");
        assert_eq!(
            MigrationAddress::parse_tcp("target:0").unwrap().qemu_uri(),
            "tcp:target:0"
        );
        for bad in [
            "target",
            ":7100",
            "target:port",
            "::1:7100",
            "[::1:7100",
            "h:70000",
        ] {
            assert!(MigrationAddress::parse_tcp(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn settings_find_the_last_capability() {
        let s = MigrationSettings {
            capabilities: vec![
                ("return-path".into(), false),
                ("events".into(), true),
                ("return-path".into(), true),
            ],
            ..MigrationSettings::default()
        };
        assert_eq!(s.capability("return-path"), Some(true));
        assert_eq!(s.capability("events"), Some(true));
        assert_eq!(s.capability("multifd"), None);
    }

    #[test]
    fn migration_info_states() {
        let info = |s: &str| MigrationInfo {
            status: s.into(),
            ..MigrationInfo::default()
        };
        assert!(!info("none").is_running() && !info("none").is_finished());
        assert!(!info("").is_running());
        for s in ["setup", "active", "device", "pre-switchover", "cancelling"] {
            assert!(info(s).is_running() && !info(s).is_finished(), "{s}");
        }
        for s in ["completed", "failed", "cancelled"] {
            assert!(info(s).is_finished() && !info(s).is_running(), "{s}");
        }
    }

    /// A VMM that can do nothing: every method says so, naming it.
    struct Nothing;

    impl Vmm for Nothing {
        fn describe(&self) -> String {
            "the null VMM".into()
        }
        fn features(&self) -> &'static [Feature] {
            &[]
        }
    }

    #[test]
    fn missing_features_are_errors_not_panics() {
        let mut vm = Nothing;
        let addr = MigrationAddress::parse_tcp("h:1").unwrap();
        let settings = MigrationSettings::default();
        let (r, _w) = nix::unistd::pipe().unwrap();
        let errors = [
            vm.run_state().map(|_| ()).unwrap_err(),
            vm.pause().unwrap_err(),
            vm.resume().unwrap_err(),
            vm.quit().unwrap_err(),
            vm.save_device_state(r).map(|_| ()).unwrap_err(),
            vm.guest_memory().map(|_| ()).unwrap_err(),
            vm.cpu_dirty_log().map(|_| ()).unwrap_err(),
            vm.migration_blockers().map(|_| ()).unwrap_err(),
            vm.start_migration(&addr, &settings).unwrap_err(),
            vm.start_incoming(&addr, &settings).unwrap_err(),
            vm.migration_info().map(|_| ()).unwrap_err(),
            vm.cancel_migration().unwrap_err(),
        ];
        for e in &errors {
            assert!(matches!(e, VmmError::Unsupported { .. }), "{e}");
            assert!(e.to_string().starts_with("the null VMM cannot "), "{e}");
        }
        assert_eq!(errors[1].to_string(), "the null VMM cannot pause the VM");
        assert!(!vm.supports(Feature::Pause));
    }
}
