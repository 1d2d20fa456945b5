//! A QEMU VM that hagctl checkpoints itself ([`CopyVm`]): QEMU cannot
//! checkpoint a VM with a VFIO device incrementally (COLO re-saves VFIO
//! state on a data fd that stays open only for one migration;
//! background-snapshot refuses VFIO), so hagctl copies guest RAM itself
//! and asks QEMU only for the rest:
//! - guest RAM: the VM's shared file memory backend
//!   (`memory-backend-file,share=on`: QEMU leaves only a named file out
//!   of an `x-ignore-shared` stream, not a memfd), mapped here
//!   ([`super::shared_ram`]);
//! - CPU dirty pages: the soft-dirty bits of QEMU's mapping of it, read and
//!   cleared only while the VM is paused (a read and a clear are two
//!   calls: a running VM could write between them), so a collection while
//!   it runs pauses it for that long;
//! - GPU dirty pages: hag's own log on `/dev/hag`, as for hag-vmm;
//! - device state: a migration with `x-ignore-shared` into a pipe while
//!   the VM is paused: vCPUs, devices and the vGPU's VFIO migration data,
//!   without RAM. QEMU's `stop` already moved the vGPU to VFIO's STOP
//!   (it waits for the engine to go idle), so hag's quiesce is not used;
//!   the save moves it STOP → STOP_COPY → STOP and `cont` back to RUNNING;
//! - output: [`OutputGate`]s on the network its packets leave by
//!   ([`PlugGate`]) and on its console ([`crate::console::ConsoleGate`]).
//!
//! `x-ignore-shared` is set only around each save, never left on between
//! epochs: a migration of the VM started by anyone else (`virsh migrate`)
//! must carry its RAM, and a hagctl killed between epochs leaves nothing
//! behind that would make it leave RAM out.

use crate::log::{info, warning};
use std::io::Read;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use guest_ram::GuestRam;
use serde_json::{json, Value};

use super::copy::{CopyVm, DiskSink, OutputGate, VmStatus};
use super::dirty_source;
use super::qemu::{self, Qemu};
use super::qemu_disks::{DeltaStats, DiskEpochs};
use super::shared_ram::Mapping;
use super::{Feature, MigrationSettings, RunKind, RunState, Vmm, VmmError};
use crate::vm_shape::VmShape;
use crate::wire::{DiskInfo, VmmKind, MAX_PAYLOAD};

/// What a QEMU epoch's VM_STATE holds: QEMU's stream, and the id of the
/// memory backend it leaves out, which a standby's RAM must carry too (QEMU
/// matches RAM blocks by id: "Unknown ramblock").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpochState<'a> {
    /// The memory backend's id (`ram0`; libvirt's `pc.ram`).
    pub ram_id: &'a str,
    /// QEMU's migration stream without that RAM.
    pub stream: &'a [u8],
}

/// `EpochState`'s magic.
const EPOCH_STATE_MAGIC: &[u8; 8] = b"HAGQEMU1";
/// The longest memory backend id accepted.
const RAM_ID_MAX: usize = 64;

impl EpochState<'_> {
    /// `magic | id length u8 | id | stream`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(9 + self.ram_id.len() + self.stream.len());
        out.extend_from_slice(EPOCH_STATE_MAGIC);
        out.push(self.ram_id.len() as u8);
        out.extend_from_slice(self.ram_id.as_bytes());
        out.extend_from_slice(self.stream);
        out
    }

    /// Checks and splits what [`EpochState::encode`] made.
    pub fn decode(bytes: &[u8]) -> Result<EpochState<'_>, String> {
        let rest = bytes
            .strip_prefix(EPOCH_STATE_MAGIC.as_slice())
            .ok_or("not a QEMU epoch state (bad magic)")?;
        let (&n, rest) = rest.split_first().ok_or("QEMU epoch state cut short")?;
        let n = usize::from(n);
        if n == 0 || n > RAM_ID_MAX || rest.len() < n {
            return Err(format!("QEMU epoch state: a RAM backend id of {n} bytes"));
        }
        let (id, stream) = rest.split_at(n);
        let ram_id = std::str::from_utf8(id)
            .ok()
            .filter(|id| {
                id.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            })
            .ok_or("QEMU epoch state: the RAM backend id is not a QEMU id")?;
        if stream.is_empty() {
            return Err("QEMU epoch state without a stream".into());
        }
        Ok(EpochState { ram_id, stream })
    }
}

/// A QEMU VM under hagctl's own copy loop.
pub struct QemuVm {
    qemu: Qemu,
    ram: Mapping,
    /// Its memory backend's id.
    ram_id: String,
    gates: Vec<Box<dyn OutputGate>>,
    holding: bool,
    /// For tests: the CPU dirty log is withheld (always empty).
    withhold_cpu_dirty: bool,
    /// The file behind guest RAM, which only QEMU and hagctl may hold.
    ram_file: RamFile,
    /// How many memory backends QEMU had when protection started.
    memdevs: usize,
    /// When [`QemuVm::recheck`] next looks.
    next_recheck: Instant,
    /// Its verdict, once it found the VM unprotectable: kept.
    unprotectable: Option<String>,
    /// Its writable disks' epochs.
    disks: DiskEpochs,
    /// The next save's capabilities, asked for by [`Vmm::pause`] while
    /// the VM still ran (a QMP round trip less in the pause).
    save_caps: Option<SaveCapabilities>,
}

/// How often, while protected, hagctl checks again that the dirty source
/// is still complete (nothing else holds guest RAM's file, no memory was
/// hot-plugged): the one check scans every process here, too much for
/// every epoch.
const RECHECK_EVERY: Duration = Duration::from_secs(10);

/// Guest RAM's file, as `(device, inode)`, and who may hold it.
struct RamFile {
    dev: u64,
    ino: u64,
    /// QEMU and this process.
    allowed: [i32; 2],
    path: String,
}

impl RamFile {
    fn of(map: &Mapping, ram: &GuestRam) -> Result<RamFile, String> {
        let fd = ram.fd().ok_or("guest RAM's mapping has no file")?;
        let st = nix::sys::stat::fstat(fd).map_err(|e| format!("{}: {e}", map.name))?;
        Ok(RamFile {
            dev: st.st_dev,
            ino: st.st_ino,
            allowed: [map.pid, std::process::id() as i32],
            path: map.name.clone(),
        })
    }

    /// Why another process's hold on the file defeats soft-dirty bits,
    /// if one holds it.
    fn shared_with_others(&self) -> Option<String> {
        let others = dirty_source::other_holders(self.dev, self.ino, &self.allowed);
        (!others.is_empty()).then(|| {
            format!(
                "another process holds guest RAM's file {} ({}): its writes set no soft-dirty bit of QEMU's, \
                 so hagctl would never copy them (virtiofsd, vhost-user back ends and ivshmem are not supported)",
                self.path,
                others.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
            )
        })
    }
}

/// What [`QemuVm::open`] found.
pub struct Opened {
    /// The VM.
    pub vm: QemuVm,
    /// Its guest RAM, mapped here.
    pub ram: GuestRam,
    /// The mdev UUID of its hag vGPU (its vfio-pci device's `sysfsdev`).
    pub vgpu_uuid: String,
    /// What its guest sees: the backup's standby must be the same.
    pub shape: VmShape,
}

/// The shared memory backend among `query-memdev`'s answer: `(id, size)`.
pub fn shared_backend(memdevs: &Value) -> Result<(String, u64), String> {
    let list = memdevs
        .as_array()
        .ok_or_else(|| format!("query-memdev returned {memdevs}"))?;
    let shared: Vec<_> = list
        .iter()
        .filter(|m| m.get("share").and_then(Value::as_bool) == Some(true))
        .collect();
    let name = |m: &Value| {
        m.get("id")
            .and_then(Value::as_str)
            .unwrap_or("(no id)")
            .to_owned()
    };
    match shared.as_slice() {
        [m] if list.len() > 1 => Err(format!(
            "QEMU has memory backends besides guest RAM's {} ({}): hagctl copies one, so the others' \
             memory (NUMA nodes, hot-plugged DIMMs) would not be protected",
            name(m),
            list.iter()
                .map(name)
                .filter(|n| *n != name(m))
                .collect::<Vec<_>>()
                .join(", ")
        )),
        [m] => {
            let size = m
                .get("size")
                .and_then(Value::as_u64)
                .ok_or_else(|| format!("memory backend {} has no size", name(m)))?;
            Ok((name(m), size))
        }
        [] => Err(format!(
            "QEMU's guest RAM is private ({}): hagctl copies RAM from a shared file backend: \
             -object memory-backend-file,id=ram0,mem-path=FILE,size=SIZE,share=on -machine memory-backend=ram0 \
             (libvirt: <memoryBacking><source type='file'/><access mode='shared'/></memoryBacking>)",
            if list.is_empty() {
                "no memory backend".to_owned()
            } else {
                list.iter().map(name).collect::<Vec<_>>().join(", ")
            }
        )),
        more => Err(format!(
            "QEMU has {} shared memory backends ({}); hagctl checkpoints a VM with one (no NUMA nodes, no hotplugged memory)",
            more.len(),
            more.iter().map(|m| name(m)).collect::<Vec<_>>().join(", ")
        )),
    }
}

impl QemuVm {
    /// Opens the VM behind `qemu` for copying: finds its shared RAM, its
    /// hag vGPU and its writable disks (their deltas' files go in a
    /// directory of `delta_dir` of its own), and turns off what a save
    /// into a pipe cannot use (return path, multifd, postcopy).
    pub fn open(
        mut qemu: Qemu,
        gates: Vec<Box<dyn OutputGate>>,
        delta_dir: &std::path::Path,
    ) -> Result<Opened, VmmError> {
        let protocol = |q: &Qemu, what: String| VmmError::Protocol {
            vmm: q.describe(),
            what,
        };
        dirty_source::self_test().map_err(|e| {
            protocol(
                &qemu,
                format!("this host cannot tell which pages the guest's CPU writes: {e}"),
            )
        })?;
        let memdevs = qemu.qmp().execute("query-memdev", None)?;
        let (id, size) = shared_backend(&memdevs).map_err(|e| protocol(&qemu, e))?;
        let path = qemu
            .qmp()
            .execute(
                "qom-get",
                Some(json!({ "path": format!("/objects/{id}"), "property": "mem-path" })),
            )
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned));
        // QEMU leaves RAM out of a migration with x-ignore-shared only if
        // it is a named file (since 8.1): a memfd's would be copied whole
        // into every epoch's device state.
        let Some(path) = path else {
            return Err(protocol(
                &qemu,
                format!(
                    "guest RAM ({id}) is shared but not a file: QEMU would copy it into every epoch's device state; \
                     use -object memory-backend-file,id={id},mem-path=FILE,size=SIZE,share=on \
                     (libvirt: <memoryBacking><source type='file'/><access mode='shared'/></memoryBacking>)"
                ),
            ));
        };
        let peer = qemu.qmp().peer_pid()?;
        let pid = super::shared_ram::vm_process(peer, size).map_err(|e| protocol(&qemu, e))?;
        // A disk written past QEMU's block layer first: its back end also
        // maps guest RAM, which the checks below would name instead.
        let disks = DiskEpochs::open(qemu.qmp(), &delta_dir.join(format!("qemu-{pid}")))
            .map_err(|e| protocol(&qemu, e))?;
        let (ram_map, ram) =
            Mapping::open(pid, size, Some(&path)).map_err(|e| protocol(&qemu, e))?;
        let ram_file = RamFile::of(&ram_map, &ram).map_err(|e| protocol(&qemu, e))?;
        let vma = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
            .map_err(|e| format!("/proc/{pid}/smaps: {e}"))
            .and_then(|smaps| dirty_source::ram_vma(&smaps, ram_map.start))
            .map_err(|e| protocol(&qemu, e))?;
        if let Some(why) = vma.refusal() {
            return Err(protocol(&qemu, format!("{why} ({path})")));
        }
        if let Some(why) = ram_file.shared_with_others() {
            return Err(protocol(&qemu, why));
        }
        // Every epoch's device state is a migration: one QEMU refuses
        // would fail each time, the VM's output held meanwhile.
        let blockers = qemu.migration_blockers()?;
        if !blockers.is_empty() {
            return Err(protocol(
                &qemu,
                format!(
                    "QEMU refuses to migrate this VM ({}), and each epoch saves its state by migration",
                    blockers.join("; ")
                ),
            ));
        }
        let vgpu_uuid = vgpu_of(&mut qemu)?;
        let shape = VmShape::read(qemu.qmp())
            .map_err(|e| protocol(&qemu, format!("cannot read the VM's devices: {e}")))?;
        // An epoch's save goes into a pipe: no return path there (a VM
        // that arrived by migration may have it set), nothing that needs
        // more channels; its end is said by a MIGRATION event (as libvirt
        // has QEMU send them) rather than found by polling.
        qemu.apply(&MigrationSettings {
            capabilities: vec![
                ("return-path".into(), false),
                ("multifd".into(), false),
                ("postcopy-ram".into(), false),
                ("events".into(), true),
            ],
            ..MigrationSettings::default()
        })?;
        Ok(Opened {
            vm: QemuVm {
                qemu,
                ram: ram_map,
                ram_id: id,
                gates,
                holding: false,
                withhold_cpu_dirty: false,
                ram_file,
                memdevs: memdevs.as_array().map_or(0, Vec::len),
                next_recheck: Instant::now() + RECHECK_EVERY,
                unprotectable: None,
                disks,
                save_caps: None,
            },
            ram,
            vgpu_uuid,
            shape,
        })
    }

    /// For tests: report no CPU dirty pages at all.
    pub fn withhold_cpu_dirty(&mut self) {
        self.withhold_cpu_dirty = true;
    }

    /// For tests: send the disks' full copy but no epoch's delta.
    pub fn withhold_disk_delta(&mut self) {
        self.disks.withheld = true;
    }

    fn disk_error(&self, what: String) -> VmmError {
        VmmError::Protocol {
            vmm: self.qemu.describe(),
            what,
        }
    }

    /// The guest RAM mapping in QEMU.
    pub fn mapping(&self) -> &Mapping {
        &self.ram
    }

    /// After `x-ignore-shared` could not be turned off: a migration that
    /// another client (libvirt) started while it was on for this save (QEMU
    /// refuses capability changes while one runs) would leave guest RAM
    /// out, and is cancelled; the caller's epoch fails, saying so, and the
    /// VM runs on here, protected. (Its destination would most likely
    /// refuse the stream too: without the capability it does not expect
    /// the RAM blocks' addresses that the source sends with it.)
    fn cancel_foreign_migration(&mut self) -> Result<(), VmmError> {
        let Some(why) = self.migrating_away_now("paused")? else {
            return Ok(());
        };
        let _ = self.qemu.cancel_migration();
        // QEMU refuses capability changes until the cancel is done.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let status = self.qemu.migration_info()?.status;
            let ended = status != "cancelling" && qemu::migrating_away("paused", &status).is_none();
            if ended || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.qemu.apply(&ignore_shared(false))?;
        Err(VmmError::Protocol {
            vmm: self.qemu.describe(),
            what: format!(
                "{why}, begun while this epoch's save had x-ignore-shared on: cancelled, since it would have left \
                 guest RAM out (migrate again: hagctl turns x-ignore-shared off as soon as each save ends)"
            ),
        })
    }

    /// [`qemu::migrating_away`] at run state `run_state`, asking QEMU
    /// for its migration's status.
    fn migrating_away_now(&mut self, run_state: &str) -> Result<Option<String>, VmmError> {
        let migration = self.qemu.migration_info()?.status;
        Ok(qemu::migrating_away(run_state, &migration))
    }

    /// Why the dirty source is no longer complete (memory hot-plugged,
    /// another process holding guest RAM's file), looked at once every
    /// [`RECHECK_EVERY`]; a verdict, once found, stays. A query that fails
    /// gives none (the status query that follows says what is wrong).
    fn recheck(&mut self) -> Option<String> {
        if self.unprotectable.is_none() && Instant::now() >= self.next_recheck {
            self.next_recheck = Instant::now() + RECHECK_EVERY;
            let memdevs = self.qemu.qmp().execute("query-memdev", None).ok();
            let n = memdevs.as_ref().and_then(Value::as_array).map(Vec::len);
            self.unprotectable = match n {
                Some(n) if n != self.memdevs => Some(format!(
                    "it has {n} memory backends, {} when protection started: hagctl copies only guest RAM's, \
                     so hot-plugged memory would not be protected",
                    self.memdevs
                )),
                _ => self.ram_file.shared_with_others(),
            };
        }
        self.unprotectable.clone()
    }
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        self.disks.close(self.qemu.qmp());
        let _ = self.qemu.apply(&ignore_shared(false));
    }
}

/// `x-ignore-shared` on or off, and nothing else.
pub(crate) fn ignore_shared(on: bool) -> MigrationSettings {
    MigrationSettings {
        capabilities: vec![("x-ignore-shared".into(), on)],
        ..MigrationSettings::default()
    }
}

/// Capabilities with which a save into a one-way pipe waits for a peer
/// that is not there, or fails. libvirt turns `pause-before-switchover`
/// and `return-path` on for each migration it starts and off after it;
/// when QEMU refused that migration because an epoch's save was running,
/// it refuses libvirt's reset too, and they stay on: every later save
/// would stop in `pre-switchover`, waiting for a `migrate-continue`, or
/// in `device`, waiting for the peer's reply. QEMU checks a capability
/// set as a whole, so those that need one of these (`postcopy-preempt`,
/// `zero-copy-send`) go off with them.
const PEER_CAPABILITIES: [&str; 9] = [
    "pause-before-switchover",
    "return-path",
    "switchover-ack",
    "postcopy-ram",
    "postcopy-preempt",
    "multifd",
    "zero-copy-send",
    "mapped-ram",
    "background-snapshot",
];

/// The capabilities of one epoch's save, from QEMU's
/// `query-migrate-capabilities` just before it: `x-ignore-shared` on and
/// every one of [`PEER_CAPABILITIES`] QEMU has off (also one another
/// client turns on after the query); [`Self::restore`] sets those that
/// were on at the query back on, so that the other client's next
/// migration runs with its settings as they were then.
struct SaveCapabilities {
    /// Those of [`PEER_CAPABILITIES`] this QEMU has.
    known: Vec<String>,
    /// Those of them that were on.
    left_on: Vec<String>,
}

impl SaveCapabilities {
    fn of(caps: &[(String, bool)]) -> Self {
        let peer = caps
            .iter()
            .filter(|(name, _)| PEER_CAPABILITIES.contains(&name.as_str()));
        Self {
            known: peer.clone().map(|(name, _)| name.clone()).collect(),
            left_on: peer
                .filter(|(_, on)| *on)
                .map(|(name, _)| name.clone())
                .collect(),
        }
    }

    fn during(&self) -> MigrationSettings {
        let mut settings = ignore_shared(true);
        settings
            .capabilities
            .extend(self.known.iter().map(|name| (name.clone(), false)));
        settings
    }

    /// What goes back on after the save (`None`: nothing), in a command
    /// of its own: `x-ignore-shared` must go off whether or not QEMU
    /// accepts these (another client may have changed others since).
    fn restore(&self) -> Option<MigrationSettings> {
        (!self.left_on.is_empty()).then(|| MigrationSettings {
            capabilities: self
                .left_on
                .iter()
                .map(|name| (name.clone(), true))
                .collect(),
            ..MigrationSettings::default()
        })
    }
}

/// The mdev UUID of the VM's one vfio-pci device backed by an mdev.
fn vgpu_of(qemu: &mut Qemu) -> Result<String, VmmError> {
    let mut found = Vec::new();
    let mut passed_through = Vec::new();
    for parent in ["/machine/peripheral", "/machine/peripheral-anon"] {
        let Ok(children) = qemu
            .qmp()
            .execute("qom-list", Some(json!({ "path": parent })))
        else {
            continue;
        };
        for c in children.as_array().into_iter().flatten() {
            if c.get("type").and_then(Value::as_str) != Some("child<vfio-pci>") {
                continue;
            }
            let Some(name) = c.get("name").and_then(Value::as_str) else {
                continue;
            };
            let dev = qemu.qmp().execute(
                "qom-get",
                Some(json!({ "path": format!("{parent}/{name}"), "property": "sysfsdev" })),
            )?;
            match dev
                .as_str()
                .and_then(|p| p.strip_prefix("/sys/bus/mdev/devices/"))
            {
                Some(uuid) => found.push(uuid.trim_end_matches('/').to_owned()),
                None => passed_through.push(name.to_owned()),
            }
        }
    }
    if !passed_through.is_empty() {
        return Err(VmmError::Protocol {
            vmm: qemu.describe(),
            what: format!(
                "the VM has a passed-through PCI device ({}): its DMA writes guest RAM behind the page tables \
                 whose soft-dirty bits hagctl reads, so they would never reach the backup",
                passed_through.join(", ")
            ),
        });
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        n => Err(VmmError::Protocol {
            vmm: qemu.describe(),
            what: format!(
                "the VM has {n} mdev vfio-pci devices ({}); hagctl protects a VM with one hag vGPU",
                found.join(", ")
            ),
        }),
    }
}

impl Vmm for QemuVm {
    fn describe(&self) -> String {
        self.qemu.describe()
    }

    fn features(&self) -> &'static [Feature] {
        &[
            Feature::RunState,
            Feature::Pause,
            Feature::Resume,
            Feature::Quit,
            Feature::SaveDeviceState,
            Feature::CpuDirtyLog,
        ]
    }

    fn run_state(&mut self) -> Result<RunState, VmmError> {
        self.qemu.run_state()
    }

    fn pause(&mut self) -> Result<(), VmmError> {
        // A capability another client turns on from here to the save is
        // turned off for it all the same (SaveCapabilities::during); only
        // its restore would be missed.
        self.save_caps = Some(SaveCapabilities::of(&self.qemu.capabilities()?));
        self.qemu.pause()
    }

    fn resume(&mut self) -> Result<(), VmmError> {
        // Asked for a pause that saved nothing: stale by the next one.
        self.save_caps = None;
        self.qemu.resume()
    }

    fn quit(&mut self) -> Result<(), VmmError> {
        self.qemu.quit()
    }

    fn save_device_state(&mut self, into: OwnedFd) -> Result<super::SavedState, VmmError> {
        self.qemu.save_device_state(into)
    }

    /// Soft-dirty bits, read and cleared with the VM paused (paused here
    /// for that long if it runs).
    fn cpu_dirty_log(&mut self) -> Result<Vec<u64>, VmmError> {
        // Paused by this epoch's stop: no need to ask.
        let running = !self.qemu.held_paused() && self.qemu.run_state()?.is_running();
        if running {
            self.qemu.pause()?;
        }
        let result = self
            .ram
            .read_soft_dirty()
            .and_then(|bits| self.ram.clear_soft_dirty().map(|()| bits));
        if running {
            self.qemu.resume()?;
        }
        let mut bits = result.map_err(|what| VmmError::Protocol {
            vmm: self.qemu.describe(),
            what,
        })?;
        if self.withhold_cpu_dirty {
            bits.fill(0);
        }
        Ok(bits)
    }
}

impl CopyVm for QemuVm {
    fn kind(&self) -> VmmKind {
        VmmKind::Qemu
    }

    fn status(&mut self) -> Result<VmStatus, VmmError> {
        let st = match self.qemu.run_state() {
            Ok(st) => st,
            Err(e @ VmmError::Qmp(_)) => {
                let qmp = self.qemu.qmp();
                let broken = qmp.is_broken();
                match qmp.end_seen() {
                    // QEMU closed its end: a crash unless a SHUTDOWN came.
                    Some(shutdown) => {
                        return match qemu::crash(None, shutdown) {
                            Some(why) => Ok(VmStatus::Crashed(format!("{why} ({e})"))),
                            None => Err(e),
                        }
                    }
                    None if !broken => return Err(e),
                    // Open but broken (a reply that never came, a write
                    // that timed out): replaced, else every later epoch
                    // would be skipped on it.
                    None => {
                        qmp.reconnect()?;
                        info!("{}: reconnected after: {e}", qmp.path().display());
                        self.qemu.run_state()?
                    }
                }
            }
            Err(e) => return Err(e),
        };
        if matches!(
            st.kind,
            RunKind::Running | RunKind::Migrating | RunKind::Migrated
        ) {
            if let Some(why) = self.migrating_away_now(&st.name)? {
                return Ok(VmStatus::MigratingAway(why));
            }
        }
        if st.is_running() {
            if let Some(why) = self.recheck() {
                return Ok(VmStatus::Unprotectable(why));
            }
        }
        Ok(if st.is_running() {
            VmStatus::Running { iteration: 0 }
        } else if let Some(why) = qemu::crash(Some(&st.name), false) {
            VmStatus::Crashed(why)
        } else {
            VmStatus::Other(st.name)
        })
    }

    fn pause_stops_vgpu(&self) -> bool {
        true
    }

    fn migrating_away(&mut self) -> Option<String> {
        let st = self.qemu.run_state().ok()?;
        self.migrating_away_now(&st.name).ok().flatten()
    }

    /// An `x-ignore-shared` migration into a pipe, read here as QEMU
    /// writes it.
    fn vm_state(&mut self) -> Result<Vec<u8>, VmmError> {
        let io = |what: &str, source| VmmError::Io {
            what: what.to_owned(),
            source,
        };
        let caps = match self.save_caps.take() {
            Some(caps) => caps,
            None => SaveCapabilities::of(&self.qemu.capabilities()?),
        };
        let (r, w) =
            nix::unistd::pipe().map_err(|e| io("a pipe for the device state", e.into()))?;
        let reader = std::thread::spawn(move || {
            let mut state = Vec::new();
            // One byte over the limit is enough to refuse it.
            let got = std::fs::File::from(r)
                .take(u64::from(MAX_PAYLOAD) + 1)
                .read_to_end(&mut state);
            got.map(|_| state)
        });
        // On only for this save (see the module's comment); off again
        // whatever the save did.
        let saved = self
            .qemu
            .apply(&caps.during())
            .and_then(|()| self.qemu.save_device_state(w));
        let off = self.qemu.apply(&ignore_shared(false));
        if off.is_err() {
            self.cancel_foreign_migration()?;
        }
        if let Some(back) = caps.restore() {
            if let Err(e) = self.qemu.apply(&back) {
                warning!(
                    "{} could not be set back on after this epoch's save: {e}",
                    caps.left_on.join(", ")
                );
            }
        }
        let state = reader
            .join()
            .map_err(|_| {
                io(
                    "reading the device state",
                    std::io::Error::other("reader panicked"),
                )
            })?
            .map_err(|e| io("reading QEMU's device state", e))?;
        saved?;
        off?;
        let state = EpochState {
            ram_id: &self.ram_id,
            stream: &state,
        }
        .encode();
        if state.len() > MAX_PAYLOAD as usize {
            // Every epoch would be the same size: retrying would hold the
            // VM's output for ever.
            return Err(VmmError::Unprotectable {
                vmm: self.qemu.describe(),
                what: format!("its device state is over the stream's {MAX_PAYLOAD}-byte limit"),
            });
        }
        Ok(state)
    }

    fn hold_output(&mut self, on: bool) -> Result<(), String> {
        if !on && self.holding {
            for g in &mut self.gates {
                g.release_all()?;
            }
        }
        self.holding = on;
        Ok(())
    }

    fn mark_epoch(&mut self, epoch: u64) -> Result<(), String> {
        self.gates.iter_mut().try_for_each(|g| g.mark(epoch))
    }

    fn discard_output(&mut self) -> Result<(), String> {
        self.gates.iter_mut().try_for_each(|g| g.discard())
    }

    /// How many gates let something out.
    fn release_output(&mut self, epoch: u64) -> Result<u64, String> {
        let mut released = 0;
        for g in &mut self.gates {
            released += u64::from(g.release(epoch)?);
        }
        Ok(released)
    }

    fn disks(&self) -> Vec<DiskInfo> {
        self.disks
            .disks()
            .iter()
            .map(|d| DiskInfo {
                id: d.id.clone(),
                size: d.size,
            })
            .collect()
    }

    fn prepare_disks(&mut self) -> Result<(), VmmError> {
        self.disks
            .prepare(self.qemu.qmp())
            .map_err(|e| self.disk_error(e))
    }

    fn capture_disks(&mut self) -> Result<(), VmmError> {
        self.disks
            .capture(self.qemu.qmp())
            .map_err(|e| self.disk_error(e))
    }

    fn read_disks(&mut self, sink: &mut DiskSink<'_>) -> Result<DeltaStats, VmmError> {
        self.disks
            .read(self.qemu.qmp(), sink)
            .map_err(|e| self.disk_error(e))
    }

    fn disks_acknowledged(&mut self) {
        self.disks.acknowledged(self.qemu.qmp());
    }

    fn restart_disks(&mut self, held: Vec<Vec<[u8; 32]>>) {
        self.disks.restart(self.qemu.qmp(), held);
    }
}

/// `sch_plug` on the interface the VM's packets leave by. It comes off
/// the interface when protection ends with the output released (once what
/// passes has drained) or with the VM stopped for good (what it holds is
/// dropped, never sent); otherwise (a VM whose stop failed, which may
/// still run) it stays and holds.
pub struct PlugGate {
    /// `None` once discarded.
    plug: Option<crate::plug::Plug>,
    /// The epoch buffered in the plug and not yet released. `sch_plug`
    /// counts one buffered epoch: while one is, later output stays in the
    /// plug's open epoch (held, and let out one acknowledgement later).
    buffered: Option<u64>,
    /// The plug lets all through: before the first epoch's boundary, or
    /// once everything was released.
    open: bool,
}

/// How long a released plug may take to drain before it is removed.
const PLUG_DRAIN: Duration = Duration::from_secs(2);

impl PlugGate {
    /// A gate on `plug` that lets everything through until the first
    /// epoch's boundary ([`OutputGate::mark`]). Until an epoch is
    /// acknowledged the backup has nothing to take over (a primary lost
    /// then is not failed over), so nothing the VM says meanwhile can be
    /// contradicted; holding it would cut the VM off its network for the
    /// whole first synchronisation (a minute or more), and a client's
    /// connection made then would wait an epoch per round trip.
    pub fn new(mut plug: crate::plug::Plug) -> Result<PlugGate, crate::plug::PlugError> {
        plug.release_indefinite()?;
        Ok(PlugGate {
            plug: Some(plug),
            buffered: None,
            open: true,
        })
    }

    fn plug(&mut self) -> Result<&mut crate::plug::Plug, String> {
        self.plug
            .as_mut()
            .ok_or_else(|| "the output gate was discarded".to_owned())
    }
}

impl Drop for PlugGate {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        let Some(mut plug) = self.plug.take() else {
            return;
        };
        let deadline = Instant::now() + PLUG_DRAIN;
        while plug.stats().is_ok_and(|s| s.backlog_packets > 0) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = plug.detach();
    }
}

impl OutputGate for PlugGate {
    fn mark(&mut self, epoch: u64) -> Result<(), String> {
        if self.buffered.is_none() {
            self.plug()?.buffer().map_err(|e| e.to_string())?;
            self.buffered = Some(epoch);
            self.open = false;
        }
        Ok(())
    }

    fn release(&mut self, epoch: u64) -> Result<bool, String> {
        match self.buffered {
            Some(b) if b <= epoch => {
                self.plug()?.release_one().map_err(|e| e.to_string())?;
                self.buffered = None;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn release_all(&mut self) -> Result<(), String> {
        self.buffered = None;
        self.plug()?
            .release_indefinite()
            .map_err(|e| e.to_string())?;
        self.open = true;
        Ok(())
    }

    fn discard(&mut self) -> Result<(), String> {
        self.buffered = None;
        match self.plug.take() {
            Some(plug) => plug.detach().map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }
}

/// Waits up to `timeout` for `qemu` to reach a state where `ok` holds.
pub fn wait_state(
    qemu: &mut Qemu,
    timeout: Duration,
    ok: impl Fn(&RunState) -> bool,
) -> Result<RunState, VmmError> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let st = qemu.run_state()?;
        if ok(&st) || std::time::Instant::now() >= deadline {
            return Ok(st);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_states_carry_the_ram_id_and_refuse_damage() {
        let bytes = EpochState {
            ram_id: "pc.ram",
            stream: b"QEVM\0\0\0\x03",
        }
        .encode();
        let st = EpochState::decode(&bytes).unwrap();
        assert_eq!((st.ram_id, st.stream), ("pc.ram", &b"QEVM\0\0\0\x03"[..]));
        assert!(EpochState::decode(b"QEVM")
            .unwrap_err()
            .contains("bad magic"));
        let mut bad = bytes.clone();
        bad[8] = 200;
        assert!(EpochState::decode(&bad).unwrap_err().contains("200 bytes"));
        let mut bad = bytes.clone();
        bad[9] = b'/';
        assert!(EpochState::decode(&bad)
            .unwrap_err()
            .contains("not a QEMU id"));
        assert!(EpochState::decode(&bytes[..15])
            .unwrap_err()
            .contains("without a stream"));
    }

    #[test]
    fn a_save_turns_off_what_another_client_left_on_and_sets_it_back() {
        let reply = [
            ("xbzrle".to_owned(), true),
            ("return-path".to_owned(), true),
            ("pause-before-switchover".to_owned(), true),
            ("multifd".to_owned(), false),
            ("x-ignore-shared".to_owned(), false),
        ];
        let caps = SaveCapabilities::of(&reply);
        // Every one QEMU has goes off, also one that was off at the query.
        assert_eq!(
            caps.during().capabilities,
            [
                ("x-ignore-shared".to_owned(), true),
                ("return-path".to_owned(), false),
                ("pause-before-switchover".to_owned(), false),
                ("multifd".to_owned(), false),
            ]
        );
        // Only those that were on go back on; xbzrle was never touched.
        assert_eq!(
            caps.restore().unwrap().capabilities,
            [
                ("return-path".to_owned(), true),
                ("pause-before-switchover".to_owned(), true),
            ]
        );
        let none = SaveCapabilities::of(&[("multifd".to_owned(), false)]);
        assert!(none.restore().is_none());
    }

    #[test]
    fn the_shared_backend_is_found_or_its_absence_explained() {
        let one = json!([{"id": "ram0", "size": 268435456u64, "share": true}]);
        assert_eq!(shared_backend(&one).unwrap(), ("ram0".into(), 256 << 20));
        let more = json!([
            {"id": "ram0", "size": 268435456u64, "share": true},
            {"id": "dimm1", "size": 134217728u64, "share": false}
        ]);
        let e = shared_backend(&more).unwrap_err();
        assert!(e.contains("besides guest RAM's ram0 (dimm1)"), "{e}");
        let private = json!([{"id": "pc.ram", "size": 268435456u64, "share": false}]);
        let e = shared_backend(&private).unwrap_err();
        assert!(
            e.contains("private (pc.ram)") && e.contains("memory-backend-file"),
            "{e}"
        );
        let two = json!([
            {"id": "a", "size": 1u64, "share": true},
            {"id": "b", "size": 1u64, "share": true}
        ]);
        assert!(shared_backend(&two)
            .unwrap_err()
            .contains("2 shared memory backends (a, b)"));
    }

    /// A native estimate of an epoch's pause (`cargo test --release -p
    /// hagctl native_pause_steps -- --ignored --nocapture`): a QEMU 10
    /// shaped as the checkpoint benchmark's VM but for its vGPU (q35, 256
    /// MiB in a shared file, virtio-net with its option ROM, a serial
    /// port; TCG, its guest idle in the firmware: KVM cannot run here)
    /// through the pause's own code, 30 times: `stop`, the soft-dirty
    /// read and clear, the device-state save, a copy of 2354 pages (the
    /// 2 s benchmark's median), `cont`. Prints each step's median; asserts
    /// only that the steps work. What a test host cannot show: the same
    /// code at the hardware's speed (without KVM's dirty-log switches and
    /// the vGPU's 131 KB, which a real host adds).
    #[test]
    #[ignore = "starts QEMU; a measurement"]
    fn native_pause_steps() {
        use super::super::qemu::tests::{connect_when_up, qemu_10};
        use crate::vmm::copy::CopyVm;
        let Some(_) = qemu_10() else {
            eprintln!("skipped: no qemu-system-x86_64 10 or later");
            return;
        };
        let dir = std::env::temp_dir().join(format!("hagctl-native-pause-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("vm.qmp");
        let ram_path = dir.join("vm.ram");
        let mut child = std::process::Command::new("qemu-system-x86_64")
            .args([
                "-accel",
                "tcg",
                "-machine",
                "q35,memory-backend=ram0",
                "-m",
                "256",
            ])
            .arg("-object")
            .arg(format!(
                "memory-backend-file,id=ram0,size=256M,mem-path={},share=on",
                ram_path.display()
            ))
            .args(["-nodefaults", "-no-user-config", "-display", "none"])
            .args([
                "-netdev",
                "socket,id=net0,udp=127.0.0.1:9,localaddr=127.0.0.1:0",
            ])
            .args(["-device", "virtio-net-pci,netdev=net0"])
            .arg("-serial")
            .arg(format!("file:{}", dir.join("console").display()))
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", sock.display()))
            .stdin(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut qemu = connect_when_up(&sock, &mut child);
        qemu.apply(&MigrationSettings {
            capabilities: vec![("events".into(), true)],
            ..MigrationSettings::default()
        })
        .unwrap();
        let pid = qemu.qmp().peer_pid().unwrap();
        let (ram_map, ram) = Mapping::open(pid, 256 << 20, None).unwrap();
        let ram_file = RamFile::of(&ram_map, &ram).unwrap();
        let disks = DiskEpochs::open(qemu.qmp(), &dir.join("deltas")).unwrap();
        let mut vm = QemuVm {
            qemu,
            ram: ram_map,
            ram_id: "ram0".into(),
            gates: Vec::new(),
            holding: false,
            withhold_cpu_dirty: false,
            ram_file,
            memdevs: 1,
            next_recheck: Instant::now() + RECHECK_EVERY,
            unprotectable: None,
            disks,
            save_caps: None,
        };
        // Let the firmware settle (it finds nothing to boot and waits).
        std::thread::sleep(Duration::from_secs(2));
        let pages: Vec<u64> = (0..2354u64).map(|i| (i * 27) % (256 << 8)).collect();
        let mut buf = vec![0u8; pages.len() * 4096];
        let names = [
            "stop",
            "dirty logs",
            "device state",
            "copy pages",
            "cont",
            "pause",
        ];
        let mut steps: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
        let mut state_len = 0;
        for _ in 0..30 {
            let t0 = Instant::now();
            let mut last = t0;
            let mut lap = |steps: &mut Vec<Vec<f64>>, i: usize| {
                let now = Instant::now();
                steps[i].push((now - last).as_secs_f64() * 1e3);
                last = now;
            };
            vm.pause().unwrap();
            lap(&mut steps, 0);
            vm.cpu_dirty_log().unwrap();
            lap(&mut steps, 1);
            state_len = vm.vm_state().unwrap().len();
            lap(&mut steps, 2);
            for (p, page) in pages.iter().zip(buf.chunks_exact_mut(4096)) {
                ram.read(p * 4096, page).unwrap();
            }
            lap(&mut steps, 3);
            vm.resume().unwrap();
            lap(&mut steps, 4);
            steps[5].push(t0.elapsed().as_secs_f64() * 1e3);
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("native pause steps, median of 30 epochs (device state {state_len} bytes):");
        for (name, mut v) in names.iter().zip(steps) {
            v.sort_by(f64::total_cmp);
            eprintln!("  {name:<13} {:7.2} ms", v[v.len() / 2]);
        }
        drop(vm);
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
