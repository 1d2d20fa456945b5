//! `hagctl checkpoint`: continuous checkpointing of a `hag-vmm serve` VM
//! with its vGPU to a `hagctl backup` (Remus-style).
//!
//! The first checkpoint is the migration's pre-copy ([`crate::migrate`]:
//! rounds while the VM runs) and then one epoch. Every `--interval` after
//! that, an epoch: pause the VM, quiesce the vGPU, collect the pages the CPU
//! and the GPU dirtied since the last epoch, copy them, save the vGPU
//! context and the VM state, tag the VM's held console output with the
//! epoch, resume vGPU and VM — and only then stream the epoch (a
//! stop-and-copy round closed by EPOCH_END, see [`crate::wire`]) and wait
//! for the backup's EPOCH_ACK, after which the epoch's output is released
//! (output commit). A second connection carries heartbeats both ways.
//!
//! - On a `vgpu-hung` event for its vGPU (netlink, or the vGPU's hang
//!   counter seen at an epoch), the primary stops its VM and sends HANG:
//!   the backup takes over from the last acknowledged epoch.
//! - A backup that answers with a newer generation took over: the primary
//!   stops its VM and says why.
//! - A lost backup (silent past `--failover-timeout`, or the stream fails)
//!   leaves the VM running unprotected; the primary keeps retrying and
//!   resynchronises (a new full copy while the VM runs) when the backup is
//!   back. Its output is released once the backup is silent on every path;
//!   while another path still hears it, output stays held until an epoch is
//!   acknowledged again, since that backup could still take over from its
//!   older checkpoint.
//! - `--heartbeat-addr`: more heartbeat paths (other networks), kept up
//!   for as long as the primary runs, protected or not. A backup that still
//!   hears the primary on one of them while the data link is down (a
//!   partition) does not take over: the VM runs here, unprotected, until
//!   the data link heals and the pair resynchronises. A hang is reported
//!   (HANG) and the end of protection (ABORT) announced on every path.
//!
//! The protection state goes to `STATUS_DIR/checkpoint-vgpuN.json`, which
//! `hagctl status` shows.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Shutdown, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hag_abi::abi;
use hag_vmm::control::VmClient;
use hag_vmm::ram::PAGE_SIZE;

use crate::backup::HEARTBEAT;
use crate::migrate::{
    connect, gtt_guest_pages, open_running, tune, GpuDirty, MigrateError, MigrateOptions,
    MigrationReport, Source,
};
use crate::pagehash::PageHashes;
use crate::vmm::Vmm;
use crate::wire::{read_msg, write_msg, Msg, PageData, PAGE, PAGES_PER_FRAME};

/// Options of `hagctl checkpoint`.
#[derive(Clone, Debug)]
pub struct CheckpointOptions {
    /// The VM's control socket.
    pub vm: PathBuf,
    /// `HOST:PORT` of `hagctl backup`.
    pub backup: String,
    /// More `HOST:PORT`s of the backup for heartbeats (other paths).
    pub heartbeat_addrs: Vec<String>,
    /// Time between epochs.
    pub interval: Duration,
    /// Backup silence before the primary calls it lost.
    pub failover_timeout: Duration,
    /// This primary's generation.
    pub generation: u64,
    /// vGPU quiesce timeout per epoch.
    pub quiesce_timeout_ms: u32,
    /// Pre-copy rounds at most for the first checkpoint.
    pub max_rounds: u32,
    /// Pre-copy ends at this many dirty pages.
    pub threshold_pages: u64,
    /// Where the GPU's dirty pages come from (audit, or a baseline).
    pub gpu_dirty: GpuDirty,
    /// LZ4-compress pages.
    pub compress: bool,
    /// How long to try reaching the backup at start.
    pub connect_timeout: Duration,
    /// Where the status file goes.
    pub status_dir: PathBuf,
}

/// One epoch.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct EpochReport {
    /// Epoch number.
    pub epoch: u64,
    /// VM paused, milliseconds.
    pub pause_ms: f64,
    /// Of which: waiting for the vGPU to go idle.
    pub quiesce_ms: f64,
    /// Pages sent.
    pub pages: u64,
    /// Dirtied by the CPU.
    pub cpu_dirty: u64,
    /// Dirtied by the GPU.
    pub gpu_dirty: u64,
    /// Bytes on the wire.
    pub bytes: u64,
    /// VM resumed → EPOCH_ACK, milliseconds.
    pub ack_ms: f64,
    /// The workload's iteration at the pause.
    pub iteration: u32,
    /// Console lines released after the ack.
    pub released: u64,
    /// Page bytes before compression (pages × 4 KiB).
    pub raw_bytes: u64,
    /// Bytes the vGPU's engine wrote to guest memory since the last epoch
    /// (hag-sim's counter; rewrites counted each time).
    pub gpu_bytes_written: u64,
    /// `--gpu-dirty hash`: pages hashed at this epoch.
    pub hashed_pages: u64,
    /// `--gpu-dirty hash`: milliseconds spent hashing (inside the pause).
    pub hash_ms: f64,
}

/// What `hagctl checkpoint` reports.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CheckpointReport {
    /// The backup.
    pub backup: String,
    /// How it ended: `finished`, `handed-over`, `fenced`, `vm-stopped`.
    pub outcome: String,
    /// In words.
    pub detail: String,
    /// Generation (the backup's after a handover).
    pub generation: u64,
    /// Epochs acknowledged.
    pub epochs: u64,
    /// Full synchronisations (pre-copy, then an epoch).
    pub syncs: u32,
    /// Bytes of the synchronisations' pre-copy rounds.
    pub sync_bytes: u64,
    /// Mean / max pause per epoch, milliseconds.
    pub pause_ms_mean: f64,
    /// Max pause.
    pub pause_ms_max: f64,
    /// Mean ack latency, milliseconds.
    pub ack_ms_mean: f64,
    /// Bytes of all epochs.
    pub epoch_bytes: u64,
    /// Where the GPU's dirty pages came from.
    pub gpu_dirty_mode: GpuDirty,
    /// Pages were LZ4-compressed.
    pub compress: bool,
    /// Every epoch.
    pub per_epoch: Vec<EpochReport>,
}

impl CheckpointReport {
    /// The text form.
    pub fn text(&self) -> String {
        format!(
            "checkpoint to {}: {} ({}); generation {}, {} epochs, pause mean {:.1} ms max {:.1} ms, ack mean {:.1} ms, {:.1} MiB in epochs, {} sync(s) with {:.1} MiB of pre-copy\n",
            self.backup,
            self.outcome,
            self.detail,
            self.generation,
            self.epochs,
            self.pause_ms_mean,
            self.pause_ms_max,
            self.ack_ms_mean,
            self.epoch_bytes as f64 / f64::from(1 << 20),
            self.syncs,
            self.sync_bytes as f64 / f64::from(1 << 20)
        )
    }

    fn finish(&mut self) {
        let n = self.per_epoch.len().max(1) as f64;
        self.epochs = self.per_epoch.len() as u64;
        self.pause_ms_mean = self.per_epoch.iter().map(|e| e.pause_ms).sum::<f64>() / n;
        self.pause_ms_max = self
            .per_epoch
            .iter()
            .map(|e| e.pause_ms)
            .fold(0.0, f64::max);
        self.ack_ms_mean = self.per_epoch.iter().map(|e| e.ack_ms).sum::<f64>() / n;
        self.epoch_bytes = self.per_epoch.iter().map(|e| e.bytes).sum();
    }
}

/// What the threads share.
struct Shared {
    /// The vGPU hung (reason).
    hung: Option<String>,
    /// The VM was stopped (after a hang or a newer generation).
    vm_stopped: bool,
    /// A newer generation seen from the backup.
    newer: Option<u64>,
    /// Last heartbeat from the backup on the data link.
    heard: Instant,
    /// Last heartbeat from the backup on any path.
    heard_any: Instant,
    /// Connected to the backup.
    connected: bool,
    /// Why the link was cut by the heartbeat thread.
    lost: Option<String>,
    control: Option<TcpStream>,
    data: Option<TcpStream>,
    /// Last acknowledged epoch.
    acked: u64,
    /// The extra heartbeat paths' connections, by address.
    paths: BTreeMap<String, TcpStream>,
}

struct Link {
    shared: Mutex<Shared>,
    vm_path: PathBuf,
    generation: u64,
    timeout: Duration,
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn hung(&self) -> Option<String> {
        self.lock().hung.clone()
    }

    fn newer(&self) -> Option<u64> {
        self.lock().newer
    }

    /// Stops the VM (once), from any thread, on its own connection.
    fn stop_vm(&self, why: &str) {
        if std::mem::replace(&mut self.lock().vm_stopped, true) {
            return;
        }
        eprintln!("hagctl: stopping the VM: {why}");
        match VmClient::connect(&self.vm_path).and_then(|mut vm| vm.quit()) {
            Ok(()) => eprintln!("hagctl: the VM is stopped"),
            Err(e) => eprintln!("hagctl: stopping the VM: {e}"),
        }
    }

    fn cut(g: &mut Shared) {
        for s in [g.control.take(), g.data.take()].into_iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
        g.connected = false;
    }

    /// A hang of our vGPU: stop the VM first (it must never run twice),
    /// then tell the backup to take over.
    fn hang(&self, reason: String) {
        {
            let mut g = self.lock();
            if g.hung.is_some() {
                return;
            }
            g.hung = Some(reason.clone());
        }
        eprintln!("hagctl: {reason}");
        self.stop_vm("its vGPU hung");
        let mut g = self.lock();
        let sent = match g.control.as_mut() {
            Some(c) => write_msg(
                c,
                &Msg::Hang {
                    reason: reason.clone(),
                },
            )
            .is_ok(),
            None => false,
        };
        if sent {
            eprintln!("hagctl: told the backup to take over (HANG)");
        } else {
            eprintln!("hagctl: cannot reach the backup to report the hang; it takes over when the failover timeout passes");
        }
        if let Some(d) = g.data.take() {
            let _ = d.shutdown(Shutdown::Both);
        }
    }
}

fn events_thread(link: Arc<Link>, vgpu_id: u32) {
    let mut socket = match crate::events::EventSocket::subscribe() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("hagctl: warning: no hang events ({e}); hangs are seen at the next epoch");
            return;
        }
    };
    loop {
        let events = match socket.receive(Some(Duration::from_millis(500))) {
            Ok(Some(ev)) => ev,
            Ok(None) => continue,
            Err(e) => {
                eprintln!("hagctl: warning: hang events: {e}");
                continue;
            }
        };
        for ev in events {
            if ev.kind == abi::EVENT_VGPU_HUNG && ev.vgpu_id == Some(vgpu_id) {
                let msg = ev.message.unwrap_or_default();
                link.hang(format!("vgpu-hung vgpu={vgpu_id}: {msg}"));
            }
        }
    }
}

fn heartbeat_thread(link: Arc<Link>) {
    loop {
        std::thread::sleep(HEARTBEAT);
        let mut g = link.lock();
        if !g.connected {
            continue;
        }
        let msg = Msg::Heartbeat {
            generation: link.generation,
            epoch: g.acked,
        };
        let ok = g
            .control
            .as_mut()
            .is_some_and(|c| write_msg(c, &msg).is_ok());
        let silent = g.heard.elapsed();
        if !ok || silent > link.timeout {
            let why = if ok {
                format!(
                    "no heartbeat from the backup for {:.1} s",
                    silent.as_secs_f64()
                )
            } else {
                "the control connection failed".to_owned()
            };
            g.lost = Some(why);
            Link::cut(&mut g);
        }
    }
}

/// Reads the backup's heartbeats on a control connection: on the data
/// link's (`data_link`) they keep the link alive; on every path, a newer
/// generation stops the VM.
fn control_reader(link: Arc<Link>, mut stream: TcpStream, data_link: bool) {
    loop {
        match read_msg(&mut stream) {
            Ok((Msg::Heartbeat { generation, .. }, _)) => {
                let newer = {
                    let mut g = link.lock();
                    if data_link {
                        g.heard = Instant::now();
                    }
                    g.heard_any = Instant::now();
                    if generation > link.generation && g.newer.is_none() {
                        g.newer = Some(generation);
                        true
                    } else {
                        false
                    }
                };
                if newer && link.lock().hung.is_none() {
                    link.stop_vm(&format!(
                        "the backup took over (generation {generation}, this primary is at {}): only one copy may run",
                        link.generation
                    ));
                    Link::cut(&mut link.lock());
                }
            }
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

/// An extra heartbeat path to the backup at `addr`: connected (and
/// reconnected) for as long as the primary runs, whatever the data link
/// does. It carries heartbeats, or HANG once the vGPU hung.
fn heartbeat_path(link: Arc<Link>, addr: String) {
    loop {
        let stream = match connect(&addr, Duration::ZERO) {
            Ok(s) => s,
            Err(_) => {
                std::thread::sleep(HEARTBEAT);
                continue;
            }
        };
        tune(&stream);
        let Ok(reader) = stream.try_clone() else {
            continue;
        };
        {
            let link = link.clone();
            std::thread::spawn(move || control_reader(link, reader, false));
        }
        eprintln!("hagctl: heartbeat path to {addr} up");
        link.lock().paths.insert(addr.clone(), stream);
        loop {
            let mut g = link.lock();
            let msg = match &g.hung {
                Some(reason) => Msg::Hang {
                    reason: reason.clone(),
                },
                None => Msg::Heartbeat {
                    generation: link.generation,
                    epoch: g.acked,
                },
            };
            let Some(s) = g.paths.get_mut(&addr) else {
                break;
            };
            if write_msg(s, &msg).is_err() {
                if let Some(s) = g.paths.remove(&addr) {
                    let _ = s.shutdown(Shutdown::Both);
                }
                break;
            }
            drop(g);
            std::thread::sleep(HEARTBEAT);
        }
        eprintln!("hagctl: heartbeat path to {addr} down, reconnecting");
        std::thread::sleep(HEARTBEAT);
    }
}

/// The status file `hagctl status` reads.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct StatusFile {
    /// The checkpoint process.
    pub pid: u32,
    /// The vGPU protected.
    pub vgpu_id: u32,
    /// The backup.
    pub backup: String,
    /// `syncing`, `protected`, `unprotected`, `handed-over`, `fenced`.
    pub state: String,
    /// Last acknowledged epoch.
    pub last_epoch: u64,
    /// When it was acknowledged (Unix ms).
    pub last_ack_unix_ms: u64,
    /// Since when the state holds (Unix ms).
    pub since_unix_ms: u64,
    /// Why (unprotected, handed over).
    pub reason: String,
    /// Generation.
    pub generation: u64,
    /// The last epoch's pause, bytes, ack latency.
    pub last_pause_ms: f64,
    /// Bytes.
    pub last_bytes: u64,
    /// Ack latency.
    pub last_ack_ms: f64,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The status file of vGPU `vgpu_id` under `dir`.
pub fn status_path(dir: &Path, vgpu_id: u32) -> PathBuf {
    dir.join(format!("checkpoint-vgpu{vgpu_id}.json"))
}

fn write_status(dir: &Path, st: &StatusFile) {
    let _ = std::fs::create_dir_all(dir);
    let path = status_path(dir, st.vgpu_id);
    let tmp = path.with_extension("json.tmp");
    if let Ok(text) = serde_json::to_string(st) {
        if std::fs::write(&tmp, text + "\n").is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
}

/// The protection lines `hagctl status` prints, one per status file.
pub fn protection_lines(dir: &Path) -> Vec<(StatusFile, String)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("checkpoint-vgpu") && n.ends_with(".json"))
        })
        .collect();
    paths.sort();
    let now = unix_ms();
    for p in paths {
        let Ok(text) = std::fs::read_to_string(&p) else {
            continue;
        };
        let Ok(st) = serde_json::from_str::<StatusFile>(&text) else {
            continue;
        };
        let ago = |ms: u64| now.saturating_sub(ms) as f64 / 1e3;
        let alive = Path::new(&format!("/proc/{}", st.pid)).exists();
        let mut line = match st.state.as_str() {
            "protected" => format!(
                "vGPU {} protected, last epoch {} acked {:.1} s ago, backup {} (generation {}, pause {:.1} ms, {} bytes, ack {:.1} ms)",
                st.vgpu_id,
                st.last_epoch,
                ago(st.last_ack_unix_ms),
                st.backup,
                st.generation,
                st.last_pause_ms,
                st.last_bytes,
                st.last_ack_ms
            ),
            "unprotected" => format!(
                "vGPU {} unprotected: backup {} unreachable since {:.1} s ago ({}); last epoch {}",
                st.vgpu_id,
                st.backup,
                ago(st.since_unix_ms),
                st.reason,
                st.last_epoch
            ),
            "syncing" => format!(
                "vGPU {} synchronising with backup {} (started {:.1} s ago)",
                st.vgpu_id,
                st.backup,
                ago(st.since_unix_ms)
            ),
            other => format!(
                "vGPU {} {other}: {} (backup {}, last epoch {})",
                st.vgpu_id, st.reason, st.backup, st.last_epoch
            ),
        };
        if !alive {
            line += &format!(" [checkpoint process {} is gone]", st.pid);
        }
        out.push((st, line));
    }
    out
}

/// Why an epoch failed.
enum EpochError {
    /// The backup link failed: run unprotected.
    Link(String),
    /// The vGPU hung.
    Hung(String),
    /// The backup is of a newer generation.
    Newer(u64),
    /// The VM finished with a failure, stopped, or its control failed.
    Vm(String),
    /// Capturing failed (the VM was resumed); try again next interval.
    Retry(String),
}

impl From<hag_dev::DirtyError> for EpochError {
    fn from(e: hag_dev::DirtyError) -> Self {
        EpochError::Retry(e.to_string())
    }
}

impl From<hag_vmm::ram::RamError> for EpochError {
    fn from(e: hag_vmm::ram::RamError) -> Self {
        EpochError::Retry(e.to_string())
    }
}

impl From<MigrateError> for EpochError {
    fn from(e: MigrateError) -> Self {
        match e {
            MigrateError::Wire { .. }
            | MigrateError::Refused { .. }
            | MigrateError::Unexpected { .. } => EpochError::Link(e.to_string()),
            MigrateError::Vm(_) => EpochError::Vm(e.to_string()),
            other => EpochError::Retry(other.to_string()),
        }
    }
}

/// What the epoch took while the VM was paused.
struct Captured {
    pages: Vec<u64>,
    raw: Vec<u8>,
    context: Vec<u8>,
    vm_state: Vec<u8>,
    finished: bool,
    report: EpochReport,
    resumed_at: Instant,
}

struct Primary {
    src: Source,
    link: Arc<Link>,
    opts: CheckpointOptions,
    hangs0: u64,
    /// The engine's bytes-written counter at the last epoch.
    written0: u64,
    carry: BTreeSet<u64>,
    round: u32,
    epoch: u64,
    /// The first data connection, made at start.
    first: Option<TcpStream>,
    status: StatusFile,
    report: CheckpointReport,
}

impl Primary {
    fn save_status(&mut self, state: &str, reason: &str) {
        if self.status.state != state {
            self.status.since_unix_ms = unix_ms();
        }
        self.status.state = state.to_owned();
        self.status.reason = reason.to_owned();
        write_status(&self.opts.status_dir, &self.status);
    }

    /// Connects both connections and runs the first checkpoint: pre-copy
    /// rounds, then an epoch.
    fn sync(&mut self) -> Result<(), EpochError> {
        let stream = match self.first.take() {
            Some(s) => s,
            None => connect(&self.opts.backup, Duration::from_secs(1))?,
        };
        tune(&stream);
        let mut control = connect(&self.opts.backup, Duration::from_secs(1))?;
        tune(&control);
        write_msg(
            &mut control,
            &Msg::Heartbeat {
                generation: self.opts.generation,
                epoch: 0,
            },
        )
        .map_err(|e| EpochError::Link(format!("control connection: {e}")))?;
        {
            let mut g = self.link.lock();
            g.heard = Instant::now();
            g.lost = None;
            g.data = stream.try_clone().ok();
            g.control = control.try_clone().ok();
            g.connected = true;
        }
        {
            let link = self.link.clone();
            std::thread::spawn(move || control_reader(link, control, true));
        }
        self.src.stream = stream;
        self.save_status("syncing", "");
        self.src
            .vm
            .client()
            .hold_output(true)
            .map_err(|e| EpochError::Vm(e.to_string()))?;
        eprintln!(
            "hagctl: synchronising with the backup {} (pre-copy while the VM runs)",
            self.opts.backup
        );
        self.src.handshake()?;
        if self.src.hashes.is_some() {
            // A new session replaces the backup's image: it starts from zero.
            self.src.hashes = Some(PageHashes::new(self.src.ram.pages()));
        }
        let mut rep = MigrationReport::default();
        let (round, pending, _) = self.src.precopy(&mut rep)?;
        self.report.syncs += 1;
        self.report.sync_bytes += rep.per_round.iter().map(|r| r.wire_bytes).sum::<u64>();
        self.round = round;
        self.carry = pending;
        self.epoch_once()
    }

    /// Pause, capture, resume.
    fn capture(&mut self) -> Result<Captured, EpochError> {
        let t0 = Instant::now();
        let st = self
            .src
            .vm
            .client()
            .status()
            .map_err(|e| EpochError::Vm(e.to_string()))?;
        let finished = match (st.state.as_str(), st.passed) {
            ("running", _) => false,
            ("finished", Some(true)) => true,
            ("finished", _) => {
                let stats = self.src.dev.vgpu_stats(self.src.vgpu_id);
                if stats.is_ok_and(|s| s.hangs != self.hangs0) {
                    return Err(EpochError::Hung(format!(
                        "vGPU {} hung (its hang counter moved); the VM failed: {}",
                        self.src.vgpu_id,
                        st.result.unwrap_or_default()
                    )));
                }
                return Err(EpochError::Vm(format!(
                    "the VM finished with a failure: {}",
                    st.result.unwrap_or_default()
                )));
            }
            (other, _) => return Err(EpochError::Vm(format!("the VM is {other}"))),
        };
        let mut report = EpochReport {
            epoch: self.epoch + 1,
            iteration: st.iteration,
            ..EpochReport::default()
        };
        let result = self.capture_paused(finished, &mut report);
        // Whatever happened: the vGPU and the VM run on.
        let mut problems = Vec::new();
        if self.src.quiesced {
            if let Err(e) = self.src.dev.resume(self.src.vgpu_id) {
                problems.push(format!("cannot resume the vGPU: {e}"));
            }
            self.src.quiesced = false;
        }
        if self.src.paused {
            if let Err(e) = self.src.vm.resume() {
                problems.push(format!("cannot resume the VM: {e}"));
            }
            self.src.paused = false;
        }
        let resumed_at = Instant::now();
        report.pause_ms = t0.elapsed().as_secs_f64() * 1e3;
        if !problems.is_empty() {
            return Err(EpochError::Vm(problems.join("; ")));
        }
        let (pages, raw, context, vm_state) = result?;
        Ok(Captured {
            pages,
            raw,
            context,
            vm_state,
            finished,
            report,
            resumed_at,
        })
    }

    #[allow(clippy::type_complexity)]
    fn capture_paused(
        &mut self,
        finished: bool,
        report: &mut EpochReport,
    ) -> Result<(Vec<u64>, Vec<u8>, Vec<u8>, Vec<u8>), EpochError> {
        if !finished {
            report.iteration = self
                .src
                .vm
                .client()
                .pause()
                .map_err(|e| EpochError::Retry(format!("cannot pause the VM: {e}")))?;
            self.src.paused = true;
        }
        let tq = Instant::now();
        self.src
            .dev
            .quiesce(self.src.vgpu_id, self.opts.quiesce_timeout_ms)
            .map_err(|e| EpochError::Retry(format!("the vGPU did not quiesce: {e}")))?;
        self.src.quiesced = true;
        report.quiesce_ms = tq.elapsed().as_secs_f64() * 1e3;
        // The vGPU is idle: its context and GTT hold still. The baselines
        // need the GTT before they collect.
        let context = self.src.dev.save_context(self.src.vgpu_id)?;
        hag_abi::snapshot::Snapshot::parse(&context).map_err(MigrateError::BadContext)?;
        if matches!(self.opts.gpu_dirty, GpuDirty::Full | GpuDirty::Hash) {
            self.src.gtt = Some(gtt_guest_pages(&context).map_err(MigrateError::BadContext)?);
        }
        let d = self.src.collect()?;
        report.cpu_dirty = d.cpu;
        report.gpu_dirty = d.gpu;
        self.carry.extend(d.pages);
        if self.opts.gpu_dirty == GpuDirty::Full {
            let limit = self.src.ram.pages();
            let mapped = self.src.gtt.as_deref().unwrap_or_default();
            report.gpu_dirty = mapped.len() as u64;
            self.carry
                .extend(mapped.iter().copied().filter(|&p| p < limit));
        }
        let scan = std::mem::take(&mut self.src.scan);
        report.hashed_pages = scan.hashed;
        report.hash_ms = scan.ms;
        let stats = self
            .src
            .dev
            .vgpu_stats(self.src.vgpu_id)
            .map_err(|e| EpochError::Retry(e.to_string()))?;
        if stats.hangs != self.hangs0 {
            return Err(EpochError::Hung(format!(
                "vGPU {} hung (its hang counter went from {} to {})",
                self.src.vgpu_id, self.hangs0, stats.hangs
            )));
        }
        report.gpu_bytes_written = stats.bytes_written.wrapping_sub(self.written0);
        self.written0 = stats.bytes_written;
        let vm_state = self
            .src
            .vm
            .client()
            .get_state()
            .map_err(|e| EpochError::Retry(format!("cannot get the VM state: {e}")))?;
        let pages: Vec<u64> = self.carry.iter().copied().collect();
        let mut raw = vec![0u8; pages.len() * PAGE];
        for (i, p) in pages.iter().enumerate() {
            let page = &mut raw[i * PAGE..(i + 1) * PAGE];
            self.src.ram.read(p * PAGE_SIZE, page)?;
            if let Some(h) = &mut self.src.hashes {
                h.record(*p, page);
            }
        }
        // Console output so far belongs to this epoch.
        self.src
            .vm
            .client()
            .mark_epoch(self.epoch + 1)
            .map_err(|e| EpochError::Vm(e.to_string()))?;
        Ok((pages, raw, context, vm_state))
    }

    /// Streams a captured epoch and waits for its acknowledgement.
    fn send(&mut self, cap: &mut Captured) -> Result<(), EpochError> {
        let round = self.round;
        let epoch = self.epoch + 1;
        let mut bytes = 0u64;
        for (chunk_pages, chunk_raw) in cap
            .pages
            .chunks(PAGES_PER_FRAME)
            .zip(cap.raw.chunks(PAGES_PER_FRAME * PAGE))
        {
            let list = chunk_pages
                .iter()
                .zip(chunk_raw.chunks(PAGE))
                .map(|(&p, b)| (p, PageData::encode_with(b, self.opts.compress)))
                .collect();
            bytes += self.src.send(&Msg::Pages { round, pages: list }, "epoch")?;
        }
        bytes += self.src.send(
            &Msg::RoundEnd {
                round,
                pages: cap.pages.len() as u64,
            },
            "epoch",
        )?;
        bytes += self
            .src
            .send(&Msg::Context(std::mem::take(&mut cap.context)), "epoch")?;
        bytes += self
            .src
            .send(&Msg::VmState(std::mem::take(&mut cap.vm_state)), "epoch")?;
        bytes += self.src.send(
            &Msg::EpochEnd {
                epoch,
                generation: self.opts.generation,
            },
            "epoch",
        )?;
        self.round += 1;
        self.src.expect_ok(&format!("epoch {epoch}"), round)?;
        let (reply, _) = read_msg(&mut self.src.stream)
            .map_err(|e| EpochError::Link(format!("waiting for EPOCH_ACK {epoch}: {e}")))?;
        match reply {
            Msg::EpochAck { generation, .. } if generation > self.opts.generation => {
                Err(EpochError::Newer(generation))
            }
            Msg::EpochAck { epoch: e, .. } if e == epoch => {
                cap.report.pages = cap.pages.len() as u64;
                cap.report.raw_bytes = cap.report.pages * PAGE as u64;
                cap.report.bytes = bytes;
                cap.report.ack_ms = cap.resumed_at.elapsed().as_secs_f64() * 1e3;
                Ok(())
            }
            Msg::Error { message } => Err(EpochError::Link(format!(
                "the backup refused epoch {epoch}: {message}"
            ))),
            other => Err(EpochError::Link(format!(
                "epoch {epoch}: the backup answered {}, expected EPOCH_ACK",
                other.ty().name()
            ))),
        }
    }

    /// One epoch: capture, stream, ack, release output. Returns whether
    /// the VM had finished (its result line is now released).
    fn epoch_once(&mut self) -> Result<(), EpochError> {
        let mut cap = self.capture()?;
        if let Some(h) = self.link.hung() {
            return Err(EpochError::Hung(h));
        }
        self.send(&mut cap)?;
        self.epoch += 1;
        self.carry.clear();
        self.link.lock().acked = self.epoch;
        cap.report.released = self
            .src
            .vm
            .client()
            .release_output(self.epoch)
            .map_err(|e| EpochError::Vm(e.to_string()))?;
        let r = &cap.report;
        eprintln!(
            "epoch {}: pause {:.1} ms (quiesce {:.1}), {} pages (cpu {}, gpu {}), {:.2} MiB, acked in {:.1} ms{}",
            r.epoch,
            r.pause_ms,
            r.quiesce_ms,
            r.pages,
            r.cpu_dirty,
            r.gpu_dirty,
            r.bytes as f64 / f64::from(1 << 20),
            r.ack_ms,
            if cap.finished { " (VM finished)" } else { "" }
        );
        self.status.last_epoch = self.epoch;
        self.status.last_ack_unix_ms = unix_ms();
        self.status.last_pause_ms = r.pause_ms;
        self.status.last_bytes = r.bytes;
        self.status.last_ack_ms = r.ack_ms;
        self.report.per_epoch.push(cap.report);
        self.save_status("protected", "");
        if cap.finished {
            return Err(EpochError::Vm("finished".into()));
        }
        Ok(())
    }

    fn unprotected(&mut self, why: &str) {
        Link::cut(&mut self.link.lock());
        if self.status.state != "unprotected" {
            eprintln!(
                "hagctl: unprotected: backup {} unreachable ({why}); the VM keeps running, retrying every {:.1} s",
                self.opts.backup,
                self.opts.interval.as_secs_f64()
            );
        }
        // A backup still heard on another path holds an older checkpoint and
        // would take over from it if this host died before the resync:
        // output released now could be contradicted, so it stays held until
        // an epoch is acknowledged again. With the backup gone on every
        // path, nobody can contradict it: let it out.
        let backup_alive = self.link.lock().heard_any.elapsed() <= self.link.timeout;
        if !backup_alive {
            let _ = self.src.vm.client().hold_output(false);
        }
        self.save_status("unprotected", why);
    }

    fn end(&mut self, outcome: &str, detail: String) -> CheckpointReport {
        self.report.outcome = outcome.to_owned();
        self.report.detail = detail.clone();
        self.report.finish();
        self.save_status(outcome, &detail);
        std::mem::take(&mut self.report)
    }

    /// Ends without a takeover: the status file goes, and the backup
    /// (also if only heard on another path) learns that protection ends.
    fn close(&mut self, outcome: &str, detail: String) -> CheckpointReport {
        let abort = Msg::Abort {
            reason: format!("protection ends: {outcome}"),
        };
        for s in self.link.lock().paths.values_mut() {
            let _ = write_msg(s, &abort);
        }
        let r = self.end(outcome, detail);
        let _ = std::fs::remove_file(status_path(&self.opts.status_dir, self.src.vgpu_id));
        r
    }

    /// After a hang: the backup confirms with a newer generation.
    fn hand_over(&mut self, why: String) -> CheckpointReport {
        self.link.hang(why.clone());
        let deadline = Instant::now() + self.opts.failover_timeout + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(g) = self.link.newer() {
                self.report.generation = g;
                return self.end(
                    "handed-over",
                    format!(
                        "{why}; the backup took over from epoch {} at generation {g}",
                        self.epoch
                    ),
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.end(
            "handed-over",
            format!("{why}; the VM is stopped, but the backup did not confirm a takeover"),
        )
    }

    fn run(&mut self) -> anyhow::Result<CheckpointReport> {
        let mut first = true;
        let mut next = Instant::now();
        loop {
            let result = if self.link.lock().connected {
                self.epoch_once()
            } else if first || Instant::now() >= next {
                let r = self.sync();
                if first {
                    if let Err(EpochError::Link(why)) = &r {
                        let _ = self.src.vm.client().hold_output(false);
                        anyhow::bail!("cannot protect the VM: backup {}: {why}", self.opts.backup);
                    }
                }
                first = false;
                r
            } else {
                Ok(())
            };
            match result {
                Ok(()) => {}
                Err(EpochError::Link(why)) => {
                    let why = self.link.lock().lost.take().unwrap_or(why);
                    if let Some(h) = self.link.hung() {
                        return Ok(self.hand_over(h));
                    }
                    if let Some(g) = self.link.newer() {
                        return self.fenced(g);
                    }
                    self.unprotected(&why);
                }
                Err(EpochError::Retry(why)) => eprintln!("hagctl: epoch skipped: {why}"),
                Err(EpochError::Hung(why)) => return Ok(self.hand_over(why)),
                Err(EpochError::Newer(g)) => return self.fenced(g),
                Err(EpochError::Vm(why)) => {
                    if let Some(h) = self.link.hung() {
                        return Ok(self.hand_over(h));
                    }
                    if let Some(g) = self.link.newer() {
                        return self.fenced(g);
                    }
                    let _ = write_msg(
                        &mut self.src.stream,
                        &Msg::Abort {
                            reason: format!("protection ends: {why}"),
                        },
                    );
                    Link::cut(&mut self.link.lock());
                    let _ = self.src.vm.client().hold_output(false);
                    if why == "finished" {
                        return Ok(self.close(
                            "finished",
                            "the VM finished; its last epoch was acknowledged and its output released".into(),
                        ));
                    }
                    return Ok(self.close("vm-stopped", why));
                }
            }
            // Wait for the next epoch, watching for a hang or a takeover.
            next = Instant::now() + self.opts.interval;
            while Instant::now() < next {
                if let Some(h) = self.link.hung() {
                    return Ok(self.hand_over(h));
                }
                if let Some(g) = self.link.newer() {
                    return self.fenced(g);
                }
                let lost = self.link.lock().lost.take();
                if let Some(why) = lost {
                    self.unprotected(&why);
                }
                if !self.link.lock().connected && self.status.state == "unprotected" {
                    // Unprotected: a finished VM just ends.
                    if let Ok(st) = self.src.vm.client().status() {
                        if st.state == "finished" || st.state == "stopped" {
                            return Ok(self.close(
                                "vm-stopped",
                                format!("the VM is {} (unprotected)", st.state),
                            ));
                        }
                    } else {
                        return Ok(self.close("vm-stopped", "the VM is gone (unprotected)".into()));
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    fn fenced(&mut self, generation: u64) -> anyhow::Result<CheckpointReport> {
        self.link.stop_vm(&format!(
            "the backup took over at generation {generation} (this primary: {})",
            self.opts.generation
        ));
        self.report.generation = generation;
        let r = self.end(
            "fenced",
            format!(
                "the backup runs the VM at generation {generation}, newer than this primary's {}: this VM was stopped so it never runs twice",
                self.opts.generation
            ),
        );
        Ok(r)
    }
}

/// `hagctl checkpoint`.
pub fn checkpoint(opts: &CheckpointOptions) -> anyhow::Result<CheckpointReport> {
    let (vm, ram, dev, vgpu_id) = open_running(&opts.vm)?;
    let stats0 = dev.vgpu_stats(vgpu_id)?;
    // Until the backup is reached, nothing holds the VM's output.
    let link = Arc::new(Link {
        shared: Mutex::new(Shared {
            hung: None,
            vm_stopped: false,
            newer: None,
            heard: Instant::now(),
            heard_any: Instant::now(),
            connected: false,
            lost: None,
            control: None,
            data: None,
            acked: 0,
            paths: BTreeMap::new(),
        }),
        vm_path: opts.vm.clone(),
        generation: opts.generation,
        timeout: opts.failover_timeout,
    });
    {
        let link = link.clone();
        std::thread::spawn(move || events_thread(link, vgpu_id));
    }
    {
        let link = link.clone();
        std::thread::spawn(move || heartbeat_thread(link));
    }
    for addr in &opts.heartbeat_addrs {
        let (link, addr) = (link.clone(), addr.clone());
        std::thread::spawn(move || heartbeat_path(link, addr));
    }
    let mopts = MigrateOptions {
        vm: opts.vm.clone(),
        to: opts.backup.clone(),
        max_rounds: opts.max_rounds,
        threshold_pages: opts.threshold_pages,
        quiesce_timeout_ms: opts.quiesce_timeout_ms,
        gpu_dirty: opts.gpu_dirty,
        compress: opts.compress,
        connect_timeout: opts.connect_timeout,
        inject_fault: None,
    };
    // The first connection may take a while (the backup starting).
    let mut src = Source::connect(vm, ram, dev, vgpu_id, mopts)?;
    if opts.gpu_dirty == GpuDirty::Audit {
        src.start_gpu_log()?;
    }
    let first = src.stream.try_clone()?;
    let mut p = Primary {
        src,
        link,
        opts: opts.clone(),
        hangs0: stats0.hangs,
        written0: stats0.bytes_written,
        carry: BTreeSet::new(),
        round: 0,
        epoch: 0,
        first: Some(first),
        status: StatusFile {
            pid: std::process::id(),
            vgpu_id,
            backup: opts.backup.clone(),
            generation: opts.generation,
            ..StatusFile::default()
        },
        report: CheckpointReport {
            backup: opts.backup.clone(),
            generation: opts.generation,
            gpu_dirty_mode: opts.gpu_dirty,
            compress: opts.compress,
            ..CheckpointReport::default()
        },
    };
    let result = p.run();
    let _ = p.src.dev.dirty_stop(vgpu_id);
    if p.src.quiesced {
        let _ = p.src.dev.resume(vgpu_id);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_files_read_back_as_lines() {
        let dir = std::env::temp_dir().join(format!("hag-status-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut st = StatusFile {
            pid: std::process::id(),
            vgpu_id: 3,
            backup: "192.0.2.11:7200".into(),
            state: "protected".into(),
            last_epoch: 412,
            last_ack_unix_ms: unix_ms(),
            ..StatusFile::default()
        };
        write_status(&dir, &st);
        let lines = protection_lines(&dir);
        assert_eq!(lines.len(), 1);
        assert!(
            lines[0].1.starts_with(
                "vGPU 3 protected, last epoch 412 acked 0.0 s ago, backup 192.0.2.11:7200"
            ),
            "{}",
            lines[0].1
        );
        st.state = "unprotected".into();
        st.reason = "no heartbeat from the backup for 3.2 s".into();
        st.pid = u32::MAX;
        write_status(&dir, &st);
        let line = &protection_lines(&dir)[0].1;
        assert!(
            line.contains("unprotected: backup 192.0.2.11:7200 unreachable since"),
            "{line}"
        );
        assert!(line.ends_with("is gone]"), "{line}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn report_sums_epochs() {
        let mut r = CheckpointReport::default();
        for (i, pause) in [10.0, 30.0].into_iter().enumerate() {
            r.per_epoch.push(EpochReport {
                epoch: i as u64 + 1,
                pause_ms: pause,
                ack_ms: 4.0,
                bytes: 1000,
                ..EpochReport::default()
            });
        }
        r.finish();
        assert_eq!((r.epochs, r.pause_ms_mean, r.pause_ms_max), (2, 20.0, 30.0));
        assert_eq!((r.ack_ms_mean, r.epoch_bytes), (4.0, 2000));
        assert!(r
            .text()
            .contains("2 epochs, pause mean 20.0 ms max 30.0 ms"));
    }
}
