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

use crate::log::{info, progress, warning};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{Shutdown, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use guest_ram::{GuestRam, PAGE_SIZE};
use hag_abi::abi;
use hag_dev::Device;
use vmm_control::VmClient;

use crate::backup::HEARTBEAT;
use crate::console::ConsoleGate;
use crate::migrate::{
    connect, gtt_guest_pages, open_running, secure_connect, tune, GpuDirty, MigrateError,
    MigrateOptions, MigrationReport, Source,
};
use crate::page_cache::PageCache;
use crate::pagehash::PageHashes;
use crate::primary::{Action, Event, Policy, State};
use crate::schedule::Schedule;
use crate::secure::{self, Key, Outbox};
use crate::stall::StallGuard;
use crate::state_delta;
use crate::term::{Instance, Term};
use crate::vm_dirs::VmName;
use crate::vm_shape::VmShape;
use crate::vmm::copy::{CopyVm, OutputGate, VmStatus};
use crate::vmm::qemu::Qemu;
use crate::vmm::qemu_copy::{PlugGate, QemuVm};
use crate::vmm::qemu_disks::DeltaStats;
use crate::vmm::{Vmm, VmmError};
use crate::wire::{
    self, read_msg, session_name, write_msg, Msg, PageScratch, VmmKind, DISKS_SINCE, ENDED_PHASE,
    PAGE, PAGES_PER_FRAME, PAGE_DELTA_SINCE, RAM_SUMS_SINCE, STATE_DELTA_SINCE,
};
use crate::witness::{Asked, Asker, Request, Side, Verdict};

/// Options of `hagctl checkpoint`.
#[derive(Clone, Debug)]
pub struct CheckpointOptions {
    /// The VM.
    pub vm: VmAt,
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
    /// The VM's name (`--name`): the backup refuses a primary of another.
    pub vm_name: Option<VmName>,
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
    /// Bytes of the pages the backup holds, kept to send epochs' pages as
    /// deltas against (0: every page whole).
    pub page_cache: u64,
    /// How long to try reaching the backup at start.
    pub connect_timeout: Duration,
    /// Where the status file goes.
    pub status_dir: PathBuf,
    /// The pair's pre-shared key file.
    pub key: PathBuf,
    /// The witness (`--witness`), and its key file if not the pair's.
    pub witness: Option<(String, Option<PathBuf>)>,
    /// For benchmarks: take an epoch's cost apart (test builds only).
    pub ablation: Option<Ablation>,
}

/// Half an epoch, for the checkpoint benchmark's ablations (`--test-ablation`,
/// test builds only): from epoch 3 on, once the first synchronisation and
/// one epoch are acknowledged, each period does only one of the two costs
/// an epoch has for the VM. The VM is not protected meanwhile: pause-only
/// sends nothing (the backup keeps epoch 2) and releases each epoch's output
/// unacknowledged; send-only's epochs are applied and acknowledged, but
/// their memory was copied from the running VM and their device state is
/// epoch 2's, so a takeover from one would resume a torn image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Ablation {
    /// The pause (stop, dirty logs, device state, page copy, cont), then
    /// nothing sent.
    PauseOnly,
    /// No pause: the dirty logs read and the pages copied while the VM
    /// runs, sent with the last device state, applied and acknowledged.
    SendOnly,
}

/// The VM `hagctl checkpoint` protects.
#[derive(Clone, Debug)]
pub enum VmAt {
    /// A `hag-vmm serve` VM: its control socket.
    HagVmm(PathBuf),
    /// A QEMU VM (see [`crate::vmm::qemu_copy`]).
    Qemu {
        /// QEMU's QMP socket (hagctl's own: QEMU serves one client per
        /// socket).
        qmp: PathBuf,
        /// The network interface the VM's packets leave this host by
        /// (its egress gets `sch_plug`, held per epoch); none: the VM's
        /// network output is not held.
        plug: Option<String>,
        /// The VM's console socket (a QEMU socket chardev) and the log its
        /// released output is appended to; none: the console is not held.
        console: Option<(PathBuf, PathBuf)>,
        /// For tests: withhold the CPU dirty log (a takeover must fail).
        withhold_cpu_dirty: bool,
        /// For tests: withhold every epoch's disk delta.
        withhold_disk_delta: bool,
        /// Where disk deltas wait to be sent.
        delta_dir: PathBuf,
    },
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
    /// Of which: pausing the VM (QEMU: QMP `stop`, the vGPU to VFIO STOP).
    pub stop_ms: f64,
    /// Of which: collecting the dirty logs (QEMU: soft-dirty bits read and
    /// cleared, hag's GPU log).
    pub dirty_ms: f64,
    /// Of which: saving the VM's device state (QEMU: its x-ignore-shared
    /// stream).
    pub state_ms: f64,
    /// Of which: copying the dirty pages out of guest RAM.
    pub copy_ms: f64,
    /// Of which: resuming the vGPU and the VM (QEMU: `cont`).
    pub resume_ms: f64,
    /// Pages sent.
    pub pages: u64,
    /// Of them, sent as deltas against the backup's copy (the page
    /// cache's).
    pub delta_pages: u64,
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
    /// Since the previous epoch started, milliseconds: the actual period
    /// (0 for an epoch after a synchronisation).
    pub period_ms: f64,
    /// How late this epoch started, milliseconds: the previous one was
    /// still unacknowledged when this one was due (0: on time).
    pub late_ms: f64,
    /// Bytes of the VM's state sent: whole, or a patch against the last
    /// acknowledged epoch's.
    pub state_bytes: u64,
    /// The state went as a patch.
    pub state_patched: bool,
    /// Of the pause: re-activating the disks after the save and starting
    /// their capture, milliseconds.
    pub disk_capture_ms: f64,
    /// Disk delta: bytes of data (zeroed ranges not counted).
    pub disk_bytes: u64,
    /// Disk delta: milliseconds QEMU's backup jobs ran after the resume
    /// before the delta could be read.
    pub disk_job_ms: u64,
    /// The sender's part: VM resumed to EPOCH_END written (pages encoded,
    /// compressed, encrypted and written; the disks' delta read and sent).
    pub send_ms: f64,
    /// Of the sender's part: the pages' frames built (zero pages found,
    /// pages compressed, checksummed), milliseconds.
    pub encode_ms: f64,
    /// Of the sender's part: everything the epoch sent encrypted,
    /// milliseconds (the rest is the disks' delta and the socket's).
    pub seal_ms: f64,
    /// The backup's part: EPOCH_END written to EPOCH_ACK read (the rest of
    /// the epoch received and applied, made durable, acknowledged).
    pub wait_ms: f64,
    /// `--test-ablation`: which half of an epoch this one was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ablation: Option<Ablation>,
}

impl EpochReport {
    /// The epoch's line on stderr (`finished`: the VM's last).
    fn line(&self, finished: bool) -> String {
        let r = self;
        let late = if r.late_ms > 0.0 {
            format!(
                " (started {:.0} ms late: the previous epoch overran)",
                r.late_ms
            )
        } else {
            String::new()
        };
        let disk = if r.disk_bytes > 0 || r.disk_job_ms > 0 {
            format!(
                ", disk {:.2} MiB (copied in {} ms)",
                r.disk_bytes as f64 / f64::from(1 << 20),
                r.disk_job_ms
            )
        } else {
            String::new()
        };
        let deltas = match r.delta_pages {
            0 => String::new(),
            n => format!("; {n} as deltas"),
        };
        let sent = if r.ablation == Some(Ablation::PauseOnly) {
            "not sent (ablation: pause only)".to_owned()
        } else {
            format!(
                "{:.2} MiB (VM state {} B{}), acked in {:.1} ms",
                r.bytes as f64 / f64::from(1 << 20),
                r.state_bytes,
                if r.state_patched { " as a patch" } else { "" },
                r.ack_ms,
            )
        };
        format!(
            "epoch {}: pause {:.1} ms (quiesce {:.1}), {} pages (cpu {}, gpu {}{deltas}){disk}, {sent}, period {:.0} ms{late}{}",
            r.epoch,
            r.pause_ms,
            r.quiesce_ms,
            r.pages,
            r.cpu_dirty,
            r.gpu_dirty,
            r.period_ms,
            if finished { " (VM finished)" } else { "" }
        )
    }
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
    /// Bytes of disk data the synchronisations sent (their full copies).
    pub sync_disk_bytes: u64,
    /// Mean / max pause per epoch, milliseconds.
    pub pause_ms_mean: f64,
    /// Max pause.
    pub pause_ms_max: f64,
    /// Mean ack latency, milliseconds.
    pub ack_ms_mean: f64,
    /// Mean actual period between epochs, milliseconds (`--interval`
    /// unless epochs overran).
    pub period_ms_mean: f64,
    /// Epochs that started late because the previous one overran.
    pub overruns: u64,
    /// Bytes of all epochs.
    pub epoch_bytes: u64,
    /// Where the GPU's dirty pages came from.
    pub gpu_dirty_mode: GpuDirty,
    /// Pages were LZ4-compressed.
    pub compress: bool,
    /// The last epochs, at most [`PER_EPOCH_KEPT`] (a protection runs for
    /// months; the totals above count every epoch).
    pub per_epoch: std::collections::VecDeque<EpochReport>,
    /// Older epochs no longer in `per_epoch`.
    pub per_epoch_dropped: u64,
    /// Running sums behind the means, over every epoch.
    #[serde(skip)]
    totals: EpochTotals,
}

/// How many epochs' reports a checkpoint keeps: about half an hour at 2 s,
/// a few hundred KiB.
pub const PER_EPOCH_KEPT: usize = 1000;

/// Sums over every epoch, so that the report's means do not need them all.
#[derive(Clone, Debug, Default)]
struct EpochTotals {
    epochs: u64,
    pause_ms: f64,
    pause_ms_max: f64,
    ack_ms: f64,
    period_ms: f64,
    periods: u64,
    overruns: u64,
    bytes: u64,
}

impl CheckpointReport {
    /// The text form.
    pub fn text(&self) -> String {
        format!(
            "checkpoint to {}: {} ({}); generation {}, {} epochs, pause mean {:.1} ms max {:.1} ms, ack mean {:.1} ms, period mean {:.2} s ({} late), {:.1} MiB in epochs, {} sync(s) with {:.1} MiB of pre-copy\n",
            self.backup,
            self.outcome,
            self.detail,
            self.generation,
            self.epochs,
            self.pause_ms_mean,
            self.pause_ms_max,
            self.ack_ms_mean,
            self.period_ms_mean / 1e3,
            self.overruns,
            self.epoch_bytes as f64 / f64::from(1 << 20),
            self.syncs,
            self.sync_bytes as f64 / f64::from(1 << 20)
        )
    }

    /// Counts epoch `r` and keeps its report, dropping the oldest past
    /// [`PER_EPOCH_KEPT`].
    fn record(&mut self, r: EpochReport) {
        let t = &mut self.totals;
        t.epochs += 1;
        t.pause_ms += r.pause_ms;
        t.pause_ms_max = t.pause_ms_max.max(r.pause_ms);
        t.ack_ms += r.ack_ms;
        if r.period_ms > 0.0 {
            t.period_ms += r.period_ms;
            t.periods += 1;
        }
        t.overruns += u64::from(r.late_ms > 0.0);
        t.bytes += r.bytes;
        if self.per_epoch.len() == PER_EPOCH_KEPT {
            self.per_epoch.pop_front();
            self.per_epoch_dropped += 1;
        }
        self.per_epoch.push_back(r);
    }

    fn finish(&mut self) {
        let t = &self.totals;
        let n = t.epochs.max(1) as f64;
        self.epochs = t.epochs;
        self.pause_ms_mean = t.pause_ms / n;
        self.pause_ms_max = t.pause_ms_max;
        self.ack_ms_mean = t.ack_ms / n;
        self.period_ms_mean = t.period_ms / t.periods.max(1) as f64;
        self.overruns = t.overruns;
        self.epoch_bytes = t.bytes;
    }
}

/// What the threads share: the policy and the session's connections.
struct Shared {
    policy: Policy,
    /// Last heartbeat from the backup on the data link's control
    /// connection.
    heard: Instant,
    /// Last heartbeat from the backup on any connection of the session.
    heard_any: Instant,
    /// The data link is up (a sync succeeded and nothing cut it since).
    connected: bool,
    /// Why the link was cut by another thread.
    lost: Option<String>,
    /// The data connection's socket (to cut it from another thread).
    data: Option<TcpStream>,
    /// Every control connection of the session: the data link's
    /// (`"control"`) and each heartbeat path's (by address).
    outs: BTreeMap<String, Outbox>,
    /// The backup confirmed the end of protection.
    end_confirmed: bool,
    /// An outcome a thread reached (a fence, a failed stop).
    exit: Option<(&'static str, String)>,
}

/// How another thread than the copy loop's stops the VM (a fence, a hang):
/// on a connection of its own.
#[derive(Clone, Debug)]
enum Stopper {
    /// `quit` on hag-vmm's control socket.
    HagVmm(PathBuf),
    /// SIGKILL to QEMU (its one QMP connection is the copy loop's): a
    /// stopped VM must not run on, and nothing of it is needed here.
    Qemu(i32),
}

impl Stopper {
    fn stop(&self) -> Result<(), String> {
        match self {
            Stopper::HagVmm(path) => VmClient::connect(path)
                .and_then(|mut vm| vm.quit())
                .map_err(|e| e.to_string()),
            Stopper::Qemu(pid) => {
                use nix::sys::signal::{kill, Signal};
                let pid = nix::unistd::Pid::from_raw(*pid);
                match kill(pid, Signal::SIGKILL) {
                    Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                    Err(e) => return Err(format!("cannot kill QEMU (pid {pid}): {e}")),
                }
                // Gone once its pid is (or it is a zombie of another parent).
                let deadline = Instant::now() + Duration::from_secs(10);
                while Instant::now() < deadline {
                    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"));
                    match stat {
                        Err(_) => return Ok(()),
                        Ok(s)
                            if s.rsplit(')')
                                .next()
                                .is_some_and(|r| r.trim_start().starts_with('Z')) =>
                        {
                            return Ok(())
                        }
                        Ok(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
                Err(format!(
                    "QEMU (pid {pid}) did not exit within 10 s of SIGKILL"
                ))
            }
        }
    }
}

struct Link {
    shared: Mutex<Shared>,
    stopper: Stopper,
    /// The VM instance protected (its VMM process) and its name: with the
    /// policy's generation, the term every HELLO and JOIN presents.
    instance: Instance,
    vm_name: Option<VmName>,
    session: u128,
    key: Key,
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This primary's fencing term now.
    fn term(&self) -> Term {
        Term {
            generation: self.lock().policy.generation(),
            instance: self.instance,
            vm: self.vm_name.clone(),
        }
    }

    /// Feeds the policy from any thread and carries out what it says
    /// (releasing output is the main thread's: it alone gets acks).
    fn event(&self, ev: Event) -> Vec<Action> {
        let actions = self.lock().policy.on(ev);
        let mut rest = Vec::new();
        for a in actions {
            match a {
                Action::StopVm(why) => self.stop_vm(&why),
                Action::SendHang(reason) => {
                    let g = self.lock();
                    let sent = g
                        .outs
                        .values()
                        .filter(|o| {
                            o.post(&Msg::Hang {
                                reason: reason.clone(),
                            })
                        })
                        .count();
                    drop(g);
                    if sent > 0 {
                        info!("told the backup to take over (HANG, {sent} connection(s))");
                    } else {
                        info!("cannot reach the backup to report the hang; it takes over when the failover timeout passes");
                    }
                }
                Action::SendAbort(reason) => {
                    for o in self.lock().outs.values() {
                        o.post(&Msg::Abort {
                            reason: reason.clone(),
                        });
                    }
                    rest.push(Action::SendAbort(reason));
                }
                Action::Cut => Link::cut(&mut self.lock()),
                Action::Exit(outcome, detail) => {
                    let mut g = self.lock();
                    if g.exit.is_none() {
                        g.exit = Some((outcome, detail));
                    }
                }
                other => rest.push(other),
            }
        }
        rest
    }

    /// Stops the VM on its own connection; a failure goes back to the
    /// policy (which retries, output held).
    fn stop_vm(&self, why: &str) {
        info!("stopping the VM: {why}");
        match self.stopper.stop() {
            Ok(()) => {
                info!("the VM is stopped");
                self.lock().policy.on(Event::Stopped);
            }
            Err(e) => {
                info!("stopping the VM failed: {e}");
                std::thread::sleep(Duration::from_millis(200));
                self.event(Event::StopFailed(e.to_string()));
            }
        }
    }

    fn cut(g: &mut Shared) {
        if let Some(s) = g.data.take() {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(o) = g.outs.remove("control") {
            o.close();
        }
        g.connected = false;
    }

    fn hung(&self) -> bool {
        matches!(self.lock().policy.state, State::HandedOver(_))
    }

    fn exit(&self) -> Option<(&'static str, String)> {
        self.lock().exit.clone()
    }

    /// A hang of our vGPU.
    fn hang(&self, reason: String) {
        self.hand_over(Event::Hung(reason));
    }

    /// Our VM crashed (its VMM gone without shutting it down).
    fn crashed(&self, reason: String) {
        self.hand_over(Event::Crashed(reason));
    }

    /// A hang or a crash: the policy hands the VM over (HANG), once; no
    /// epoch is sent after it.
    fn hand_over(&self, ev: Event) {
        if self.hung() {
            return;
        }
        if let Event::Hung(why) | Event::Crashed(why) = &ev {
            info!("{why}");
        }
        self.event(ev);
        if let Some(d) = self.lock().data.take() {
            let _ = d.shutdown(Shutdown::Both);
        }
    }

    /// A control connection to `addr` for this session: authenticated,
    /// joined, its sending half behind an outbox and a reader thread
    /// feeding the policy.
    fn join(self: &Arc<Self>, addr: &str, name: &str, data_link: bool) -> Result<(), String> {
        let stream = connect(addr, Duration::ZERO).map_err(|e| e.to_string())?;
        tune(&stream);
        let (mut r, w) = secure::handshake(stream, &self.key, true).map_err(|e| e.to_string())?;
        let out = Outbox::spawn(w).map_err(|e| e.to_string())?;
        out.send(&Msg::Join {
            session: self.session,
            term: Some(self.term()),
        });
        r.set_deadline(Some(Instant::now() + secure::HANDSHAKE_TIMEOUT));
        match read_msg(&mut r) {
            Ok((
                Msg::HelloOk {
                    generation,
                    superseded,
                    ..
                },
                _,
            )) => {
                self.event(Event::Joined {
                    generation,
                    superseded,
                });
            }
            Ok((Msg::Error { message }, _)) => {
                return Err(format!("the backup refused: {message}"))
            }
            Ok((m, _)) => return Err(format!("the backup answered {}", m.ty().name())),
            Err(e) => return Err(e.to_string()),
        }
        r.set_deadline(None);
        {
            let mut g = self.lock();
            if data_link {
                g.heard = Instant::now();
            }
            g.heard_any = Instant::now();
            if let Some(old) = g.outs.insert(name.to_owned(), out) {
                old.close();
            }
        }
        let link = self.clone();
        let name = name.to_owned();
        std::thread::spawn(move || control_reader(link, r, name, data_link));
        Ok(())
    }
}

fn events_thread(link: Arc<Link>, vgpu_id: u32) {
    let mut socket = match crate::events::EventSocket::subscribe() {
        Ok(s) => s,
        Err(e) => {
            warning!("no hang events ({e}); hangs are seen at the next epoch");
            return;
        }
    };
    loop {
        let events = match socket.receive(Some(Duration::from_millis(500))) {
            Ok(Some(ev)) => ev,
            Ok(None) => continue,
            Err(e) => {
                warning!("hang events: {e}");
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

/// Heartbeats on every control connection of the session, and the data
/// link's silence check. Posting never blocks: a connection whose peer
/// does not take its heartbeats is closed.
fn heartbeat_thread(link: Arc<Link>) {
    let mut stalls = StallGuard::new(Instant::now());
    loop {
        std::thread::sleep(HEARTBEAT);
        let mut g = link.lock();
        // Stalled itself (or waiting for the lock), this primary holds its
        // verdict on the backup's silence until its readers drained the
        // heartbeats of that time.
        let may_judge = stalls.may_decide(Instant::now());
        let msg = Msg::Heartbeat {
            generation: g.policy.generation(),
            epoch: g.policy.acked(),
        };
        g.outs.retain(|_, o| o.post(&msg));
        if !g.connected || !may_judge {
            continue;
        }
        let silent = g.heard.elapsed();
        let timeout = g.policy.timeout();
        let why = if !g.outs.contains_key("control") {
            Some("the control connection failed".to_owned())
        } else if silent > timeout {
            Some(format!(
                "no heartbeat from the backup for {:.1} s",
                silent.as_secs_f64()
            ))
        } else {
            None
        };
        if let Some(why) = why {
            g.lost = Some(why);
            Link::cut(&mut g);
        }
    }
}

/// Reads the backup's messages on a control connection: heartbeats keep
/// the link alive (on the data link's) and carry the backup's generation
/// to the policy (a newer one stops the VM); an OK to ABORT confirms the
/// end of protection.
fn control_reader(link: Arc<Link>, mut r: secure::Reader, name: String, data_link: bool) {
    loop {
        // Heartbeats come every 200 ms: a connection silent for longer
        // than the timeout is dead whatever TCP says.
        let timeout = link.lock().policy.timeout();
        r.set_deadline(Some(Instant::now() + timeout.max(HEARTBEAT * 5)));
        match read_msg(&mut r) {
            Ok((Msg::Heartbeat { generation, .. }, _)) => {
                {
                    let mut g = link.lock();
                    if data_link {
                        g.heard = Instant::now();
                    }
                    g.heard_any = Instant::now();
                }
                link.event(Event::Heard { generation });
            }
            Ok((Msg::Ok { phase: ENDED_PHASE }, _)) => link.lock().end_confirmed = true,
            Ok((m, _)) => {
                info!(
                    "control connection {name}: unexpected {} from the backup: closed",
                    m.ty().name()
                );
                break;
            }
            Err(_) => break,
        }
    }
    let mut g = link.lock();
    if let Some(o) = g.outs.remove(&name) {
        o.close();
    }
}

/// An extra heartbeat path to the backup at `addr`: joined to the session
/// (and rejoined) for as long as the primary runs, whatever the data link
/// does.
fn heartbeat_path(link: Arc<Link>, addr: String) {
    let mut up = false;
    let mut last_refusal = String::new();
    loop {
        let present = link.lock().outs.contains_key(&addr);
        if !present {
            if up {
                info!("heartbeat path to {addr} down, reconnecting");
                up = false;
            }
            match link.join(&addr, &addr, false) {
                Ok(()) => {
                    info!("heartbeat path to {addr} up");
                    up = true;
                }
                Err(e) if e.contains("refused:") || e.contains("authenticated") => {
                    if e != last_refusal {
                        info!("heartbeat path to {addr}: {e}");
                        last_refusal = e;
                    }
                }
                Err(_) => {}
            }
        }
        std::thread::sleep(HEARTBEAT);
    }
}

/// The status file `hagctl status` reads.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct StatusFile {
    /// The checkpoint process.
    pub pid: u32,
    /// When it started (clock ticks after boot, /proc/PID/stat): `pid`
    /// names it only while this matches (a pid is reused).
    #[serde(default)]
    pub pid_start: u64,
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
    /// When the last acknowledged epoch was captured (Unix ms): its age
    /// is the recovery point, what a takeover now would lose.
    #[serde(default)]
    pub last_captured_unix_ms: u64,
    /// The last actual period between epochs, milliseconds.
    #[serde(default)]
    pub period_ms: f64,
    /// Epochs that started late (the previous one overran).
    #[serde(default)]
    pub overruns: u64,
    /// Epochs given up since the last acknowledged one (the VM resumed,
    /// its output held), and why the last was.
    #[serde(default)]
    pub skipped: u64,
    /// Why the last skipped epoch was given up.
    #[serde(default)]
    pub skipped_why: String,
    /// The VM instance protected ([`Instance::key`]): a run started again
    /// on it finds whether an earlier one was paired.
    #[serde(default)]
    pub vm_instance: String,
}

/// Whether an earlier run's status (`old`, this vGPU's) says a backup may
/// hold a checkpoint of the VM instance `instance`: that run had an epoch
/// acknowledged and did not end (killed, or crashed). A run started again
/// then never takes a failed first pairing for "nothing to protect": it
/// holds the output and retries as after a lost link, for that backup may
/// take the VM over from its checkpoint. (A run that never paired, such as
/// one refused at a domain's start, leaves nothing: the next one may give
/// up as it did.)
pub fn earlier_run_paired(old: Option<&StatusFile>, instance: &str) -> bool {
    old.is_some_and(|st| {
        st.vm_instance == instance
            && st.last_epoch > 0
            && matches!(st.state.as_str(), "syncing" | "protected" | "unprotected")
    })
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

/// `hagctl confirm-backup-down`'s request to the protection of vGPU
/// `vgpu_id`, and the protection's refusal beside it.
fn backup_down_paths(dir: &Path, vgpu_id: u32) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("checkpoint-vgpu{vgpu_id}.backup-down")),
        dir.join(format!("checkpoint-vgpu{vgpu_id}.backup-down.refused")),
    )
}

/// `hagctl confirm-backup-down`: tells the running `hagctl checkpoint`
/// that protects vGPU `vgpu` (the only one with a status file in `dir` if
/// `None`) that its backup is down for good (fenced, its host off), and
/// waits up to `timeout` for it to release the held output and end
/// protection. Returns what it said.
pub fn confirm_backup_down(
    dir: &Path,
    vgpu: Option<u32>,
    timeout: Duration,
) -> anyhow::Result<String> {
    let files = protection_lines(dir);
    let st = match vgpu {
        Some(id) => files
            .into_iter()
            .find(|(st, _)| st.vgpu_id == id)
            .map(|(st, _)| st),
        None if files.len() > 1 => anyhow::bail!(
            "{} protections have status files in {}: name one with --vgpu",
            files.len(),
            dir.display()
        ),
        None => files.into_iter().next().map(|(st, _)| st),
    }
    .ok_or_else(|| {
        anyhow::anyhow!(
            "no protection{} has a status file in {}",
            vgpu.map_or(String::new(), |v| format!(" of vGPU {v}")),
            dir.display()
        )
    })?;
    if !crate::jobs::is_hagctl(st.pid) {
        anyhow::bail!(
            "the hagctl checkpoint of vGPU {} (pid {}) is not running",
            st.vgpu_id,
            st.pid
        );
    }
    let (request, refused) = backup_down_paths(dir, st.vgpu_id);
    let _ = std::fs::remove_file(&refused);
    std::fs::write(&request, format!("{}\n", std::process::id()))
        .map_err(|e| anyhow::anyhow!("{}: {e}", request.display()))?;
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(why) = std::fs::read_to_string(&refused) {
            let _ = std::fs::remove_file(&refused);
            return Err(crate::exit::with_status(
                crate::exit::Status::Refused,
                format!("protection of vGPU {} goes on: {}", st.vgpu_id, why.trim()),
            ));
        }
        if !status_path(dir, st.vgpu_id).exists() {
            return Ok(format!(
                "protection of vGPU {} ended: its held output released, the VM runs on unprotected",
                st.vgpu_id
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_file(&request);
    anyhow::bail!(
        "no answer from the hagctl checkpoint of vGPU {} within {:.0} s (the request was withdrawn)",
        st.vgpu_id,
        timeout.as_secs_f64()
    )
}

fn write_status(dir: &Path, st: &StatusFile) {
    if let Ok(value) = serde_json::to_value(st) {
        let _ = crate::vm_dirs::write_json(&status_path(dir, st.vgpu_id), &value, false);
    }
}

/// A protection as `--json` shows it: its status file's fields and its
/// line of text.
pub fn protection_json(st: &StatusFile, line: &str) -> serde_json::Value {
    let mut o = serde_json::to_value(st).unwrap_or_default();
    o["text"] = line.into();
    o
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
                "vGPU {} protected, last epoch {} acked {:.1} s ago, backup {} (generation {}, pause {:.1} ms, {} bytes, ack {:.1} ms; period {:.2} s, {} late; recovery point {:.1} s)",
                st.vgpu_id,
                st.last_epoch,
                ago(st.last_ack_unix_ms),
                st.backup,
                st.generation,
                st.last_pause_ms,
                st.last_bytes,
                st.last_ack_ms,
                st.period_ms / 1e3,
                st.overruns,
                ago(st.last_captured_unix_ms),
            ) + &if st.skipped > 0 {
                format!(
                    "; {} epoch(s) skipped since, output held: {}",
                    st.skipped, st.skipped_why
                )
            } else {
                String::new()
            },
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
pub(crate) enum EpochError {
    /// The backup link failed: run unprotected.
    Link(String),
    /// The vGPU hung.
    Hung(String),
    /// The policy reached an outcome (a fence, a failed stop).
    Exit(&'static str, String),
    /// The VM finished and its last epoch was acknowledged.
    Finished,
    /// The VM finished with a failure, stopped, or its control failed.
    Vm(String),
    /// The VM crashed: hand it over, as after a hang.
    Crashed(String),
    /// The VM runs but can no longer be protected: end protection.
    Unprotectable(String),
    /// Someone else migrates the VM away (libvirt): end protection, and
    /// never resume it here.
    MigratingAway(String),
    /// Capturing failed (the VM was resumed); try again next interval.
    Retry(String),
}

impl From<hag_dev::DirtyError> for EpochError {
    fn from(e: hag_dev::DirtyError) -> Self {
        EpochError::Retry(e.to_string())
    }
}

impl From<guest_ram::RamError> for EpochError {
    fn from(e: guest_ram::RamError) -> Self {
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

/// The largest page buffer kept from one epoch for the next (the default
/// `--page-cache`'s size).
const SPARE_RAW_MAX: usize = 64 << 20;

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
    /// The first data connection, made at start, is not used yet.
    first: bool,
    /// The data connection now open has said HELLO: the backup reads an
    /// ABORT on it as the end of protection. One still opening (a
    /// resynchronisation that failed before its HELLO, say on a VM that
    /// exited meanwhile) would only be refused for opening with ABORT.
    hello_said: bool,
    /// What the VM's guest sees (QEMU), sent at every pairing: the
    /// backup's standby must match it.
    shape: Option<VmShape>,
    /// A backup accepted this pairing once (from then on it may hold a
    /// checkpoint of this VM).
    paired: bool,
    /// Lines the last release let out.
    released: u64,
    /// SIGINT or SIGTERM arrived.
    stop: Arc<AtomicBool>,
    status: StatusFile,
    report: CheckpointReport,
    /// When epochs start.
    schedule: Schedule,
    /// How late the next epoch starts (its predecessor overran).
    late: Option<Duration>,
    /// The last acknowledged epoch and its VM state: what the backup
    /// committed, which the next epoch's state is sent as a patch against.
    acked_state: Option<(u64, Vec<u8>)>,
    /// The PAGES frame being sent and its pages' compression scratch,
    /// reused from frame to frame and epoch to epoch.
    frame: Vec<u8>,
    scratch: PageScratch,
    /// The last epoch's page buffer, for the next capture: a fresh one
    /// would be faulted in page by page during the pause (each fault
    /// emulated in a test host).
    spare_raw: Vec<u8>,
    /// The pages the backup's committed image holds, as last sent: what
    /// epochs' pages go as deltas against (see `page_cache`).
    page_cache: PageCache,
    /// The witness, if there is one.
    witness: Option<Asker>,
    /// What the witness decided about this VM instance was read (before
    /// a pairing: [`Primary::witness_query`]).
    witness_read: bool,
    /// The witness granted the VM to this primary since it was last
    /// paired: nothing more to claim.
    granted: bool,
    /// The last failure to reach the witness, logged once until another.
    witness_error: Option<String>,
    /// The backup's witness the last pairing warned about (a mismatch is
    /// said once, not at every resynchronisation).
    backup_witness_warned: Option<Option<u64>>,
    /// Epochs of a `--test-ablation` taken so far (their numbers in the
    /// report, as none is acknowledged).
    ablated: u64,
}

impl Primary {
    fn save_status(&mut self, state: &str, reason: &str) {
        if self.status.state != state {
            self.status.since_unix_ms = unix_ms();
        }
        let changed = self.status.state != state || self.status.reason != reason;
        self.status.state = state.to_owned();
        self.status.reason = reason.to_owned();
        write_status(&self.opts.status_dir, &self.status);
        if changed {
            let what = if reason.is_empty() {
                state.to_owned()
            } else {
                format!("{state}: {reason}")
            };
            crate::service::notify(
                state == "protected",
                &format!("vGPU {}: {what}", self.status.vgpu_id),
            );
        }
    }

    /// Connects the data link (authenticated, HELLO naming the session),
    /// joins its control connection to the session and runs the first
    /// checkpoint: pre-copy rounds, then an epoch.
    fn sync(&mut self) -> Result<(), EpochError> {
        // A new session: whatever the backup holds now, it is not known
        // to be what the cache says.
        self.page_cache.clear();
        // The first data connection was made at start.
        if !std::mem::take(&mut self.first) {
            self.src.stream =
                secure_connect(&self.opts.backup, Duration::from_secs(1), &self.link.key)
                    .map_err(|e| EpochError::Link(e.to_string()))?;
            self.hello_said = false;
        }
        {
            let mut g = self.link.lock();
            g.lost = None;
            g.data = self.src.stream.r.socket().ok();
        }
        self.save_status("syncing", "");
        self.src.vm.hold_output(true).map_err(EpochError::Vm)?;
        // Held again: should this sync fail, the witness is claimed again.
        self.granted = false;
        info!(
            "synchronising with the backup {} (session {}, pre-copy while the VM runs)",
            self.opts.backup,
            session_name(self.link.session)
        );
        // The control connection first: a backup that took over answers
        // its JOIN with the newer generation (the fence), where the data
        // link's HELLO would only be refused.
        self.link
            .join(&self.opts.backup, "control", true)
            .map_err(|e| EpochError::Link(format!("control connection: {e}")))?;
        if let Some((outcome, detail)) = self.link.exit() {
            return Err(EpochError::Exit(outcome, detail));
        }
        let term = self.link.term();
        self.src.handshake(Some(term), self.shape.as_ref())?;
        self.hello_said = true;
        self.paired = true;
        let peer = self.src.peer;
        self.link.event(Event::Paired {
            generation: peer.generation,
            timeout: peer.timeout,
            superseded: peer.superseded,
        });
        if let Some((outcome, detail)) = self.link.exit() {
            return Err(EpochError::Exit(outcome, detail));
        }
        let generation = self.link.lock().policy.generation();
        if generation != self.status.generation {
            info!(
                "the backup is at generation {generation}, from a takeover of another instance of this VM: this one ({}) adopts it",
                self.link.instance
            );
            self.status.generation = generation;
            self.report.generation = generation;
        }
        {
            let mut g = self.link.lock();
            g.heard = Instant::now();
            g.connected = true;
        }
        self.witness_paired();
        if self.src.hashes.is_some() {
            // A new session replaces the backup's image: it starts from zero.
            self.src.hashes = Some(PageHashes::new(self.src.ram.pages()));
        }
        if self.src.peer.version >= RAM_SUMS_SINCE {
            self.src.held = self.ask_ram_sums()?;
        }
        let disks = self.src.vm.disks();
        if !disks.is_empty() {
            if self.src.peer.version < DISKS_SINCE {
                return Err(EpochError::Unprotectable(format!(
                    "the VM has writable disks ({}), and backup {} speaks stream version {}, which has no disk replication (version {DISKS_SINCE} has)",
                    disks.iter().map(|d| d.id.as_str()).collect::<Vec<_>>().join(", "),
                    self.opts.backup,
                    self.src.peer.version
                )));
            }
            let count = disks.len();
            self.src.send(&Msg::Disks(disks), "sync")?;
            let held = match read_msg(&mut self.src.stream) {
                Ok((Msg::DiskSums(held), _)) if held.len() == count => held,
                Ok((Msg::Error { message }, _)) => {
                    return Err(EpochError::Link(format!(
                        "the backup refused the disks: {message}"
                    )))
                }
                Ok((other, _)) => {
                    return Err(EpochError::Link(format!(
                        "the backup answered DISKS with {}, expected DISK_SUMS for {count} disk(s)",
                        other.ty().name()
                    )))
                }
                Err(e) => return Err(EpochError::Link(format!("waiting for DISK_SUMS: {e}"))),
            };
            // The session's full copy of the disks, taken now (the VM
            // runs): QEMU copies it while the RAM is pre-copied, and only
            // chunks the backup does not hold are sent.
            self.src.vm.restart_disks(held);
            self.src
                .vm
                .capture_disks()
                .map_err(|e| EpochError::Link(format!("copying the disks: {e}")))?;
        }
        let mut rep = MigrationReport::default();
        let (round, pending, _) = self.src.precopy(&mut rep)?;
        let sending = Instant::now();
        let (_, disk) = self.send_disks()?;
        if disk.data_bytes + disk.zero_bytes + disk.held_bytes > 0 {
            let mib = |b: u64| b as f64 / f64::from(1 << 20);
            info!(
                "disks copied: {:.1} MiB of data sent, {:.1} MiB of zeroes, {:.1} MiB already on the backup; \
                 after the RAM's pre-copy QEMU's copy took {:.1} s more, reading and comparing {:.1} s",
                mib(disk.data_bytes),
                mib(disk.zero_bytes),
                mib(disk.held_bytes),
                disk.job_ms as f64 / 1e3,
                sending.elapsed().saturating_sub(Duration::from_millis(disk.job_ms)).as_secs_f64()
            );
        }
        self.report.sync_disk_bytes += disk.data_bytes;
        self.report.syncs += 1;
        self.report.sync_bytes += rep.per_round.iter().map(|r| r.wire_bytes).sum::<u64>();
        self.round = round;
        self.carry = pending;
        // A new session: the backup holds nothing to patch against.
        self.acked_state = None;
        // Epochs are timed from the synchronisation's own (which has no
        // period: the pre-copy came before it).
        self.schedule = Schedule::new(self.opts.interval, Instant::now());
        self.late = None;
        self.epoch_once()
    }

    /// RAM_SUMS: what guest RAM the backup holds already (its checkpoint's
    /// image, or a seed file), a hash per page; none: it holds nothing.
    fn ask_ram_sums(&mut self) -> Result<Option<Vec<u64>>, EpochError> {
        self.src.send(&Msg::RamSums(Vec::new()), "sync")?;
        let pages = self.src.ram.pages();
        match read_msg(&mut self.src.stream) {
            Ok((Msg::RamSums(held), _)) if held.is_empty() => Ok(None),
            Ok((Msg::RamSums(held), _)) if held.len() as u64 == pages => Ok(Some(held)),
            Ok((Msg::RamSums(held), _)) => Err(EpochError::Link(format!(
                "the backup sent {} page hashes for guest RAM of {pages} pages",
                held.len()
            ))),
            Ok((Msg::Error { message }, _)) => Err(EpochError::Link(format!(
                "the backup refused RAM_SUMS: {message}"
            ))),
            Ok((other, _)) => Err(EpochError::Link(format!(
                "the backup answered RAM_SUMS with {}",
                other.ty().name()
            ))),
            Err(e) => Err(EpochError::Link(format!("waiting for RAM_SUMS: {e}"))),
        }
    }

    /// Reads the captured disk delta and streams it as DISK_DATA (nothing
    /// captured: nothing sent); returns the bytes on the wire and the
    /// delta's figures.
    fn send_disks(&mut self) -> Result<(u64, DeltaStats), EpochError> {
        let Source { vm, stream, .. } = &mut self.src;
        let mut wire = 0u64;
        let mut link_failed = false;
        let stats = vm.read_disks(&mut |disk, offset, extent| {
            let msg = Msg::DiskData {
                disk: disk as u32,
                offset,
                extent,
            };
            let n = write_msg(stream, &msg).map_err(|e| {
                link_failed = true;
                format!("sending DISK_DATA: {e}")
            })?;
            wire += n as u64;
            Ok(())
        });
        let why = match stats {
            Ok(s) => return Ok((wire, s)),
            Err(e) => format!("the disks' delta: {e}"),
        };
        // The delta read after the VM resumed: a VM gone meanwhile (shut
        // down, or crashed) ends protection as it would have at the next
        // pause, not as a lost backup.
        if !link_failed && !matches!(vm.status(), Ok(VmStatus::Running { .. })) {
            return Err(EpochError::Vm(why));
        }
        // Else the session's copy of the disks is now incomplete: the next
        // synchronisation starts them over.
        Err(EpochError::Link(why))
    }

    /// The `--test-ablation` in force for the next epoch: from epoch 3 on,
    /// once epoch 2 is acknowledged.
    fn ablation(&self) -> Option<Ablation> {
        self.opts
            .ablation
            .filter(|_| self.acked_state.as_ref().is_some_and(|(e, _)| *e >= 2))
    }

    /// Pause, capture, resume.
    fn capture(&mut self) -> Result<Captured, EpochError> {
        // The VM's state first: a VM that shut down must end protection,
        // not fail the disks' preparation at every interval.
        let st = self
            .src
            .vm
            .status()
            .map_err(|e| EpochError::Vm(e.to_string()))?;
        let (finished, iteration) = match st {
            VmStatus::Running { iteration } => (false, iteration),
            VmStatus::Finished { passed: true, .. } => (true, 0),
            VmStatus::Finished { result, .. } => {
                let stats = self.src.dev.vgpu_stats(self.src.vgpu_id);
                if stats.is_ok_and(|s| s.hangs != self.hangs0) {
                    return Err(EpochError::Hung(format!(
                        "vGPU {} hung (its hang counter moved); the VM failed: {result}",
                        self.src.vgpu_id,
                    )));
                }
                return Err(EpochError::Vm(format!(
                    "the VM finished with a failure: {result}"
                )));
            }
            VmStatus::Crashed(why) => return Err(EpochError::Crashed(why)),
            VmStatus::Unprotectable(why) => return Err(EpochError::Unprotectable(why)),
            VmStatus::MigratingAway(why) => return Err(EpochError::MigratingAway(why)),
            VmStatus::Other(other) => {
                // A guest that hung its vGPU may have shut down over it.
                let stats = self.src.dev.vgpu_stats(self.src.vgpu_id);
                if stats.is_ok_and(|s| s.hangs != self.hangs0) {
                    return Err(EpochError::Hung(format!(
                        "vGPU {} hung (its hang counter moved); the VM is {other}",
                        self.src.vgpu_id,
                    )));
                }
                return Err(EpochError::Vm(format!("the VM is {other}")));
            }
        };
        self.src
            .vm
            .prepare_disks()
            .map_err(|e| EpochError::Retry(format!("cannot prepare the disks' capture: {e}")))?;
        let t0 = Instant::now();
        let mut report = EpochReport {
            epoch: self.link.lock().policy.next_epoch(),
            iteration,
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
        let tr = Instant::now();
        // A save that failed because a migration hagctl did not start is
        // under way: that migration owns the VM now, and resuming it here
        // could run it on two hosts (paused, it converges at once).
        let away = if result.is_err() && self.src.paused {
            self.src.vm.migrating_away()
        } else {
            None
        };
        if let Some(why) = away {
            self.src.paused = false;
            return Err(EpochError::MigratingAway(format!(
                "{why}; the VM is left paused for that migration (libvirt resumes it where it lands, or here if it fails)"
            )));
        }
        if self.src.paused {
            if let Err(e) = self.src.vm.resume() {
                problems.push(format!("cannot resume the VM: {e}"));
            }
            self.src.paused = false;
        }
        let resumed_at = Instant::now();
        report.resume_ms = ms_since(tr);
        report.pause_ms = ms_since(t0);
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
        let send_only = self.ablation() == Some(Ablation::SendOnly);
        let ts = Instant::now();
        if !finished && !send_only {
            let at = self
                .src
                .vm
                .pause_at()
                .map_err(|e| EpochError::Retry(format!("cannot pause the VM: {e}")))?;
            if at != 0 {
                report.iteration = at;
            }
            self.src.paused = true;
        }
        report.stop_ms = ms_since(ts);
        let tq = Instant::now();
        if !self.src.vm.pause_stops_vgpu() && !send_only {
            self.src
                .dev
                .quiesce(self.src.vgpu_id, self.opts.quiesce_timeout_ms)
                .map_err(|e| EpochError::Retry(format!("the vGPU did not quiesce: {e}")))?;
            self.src.quiesced = true;
        }
        report.quiesce_ms = ms_since(tq);
        // The vGPU is idle: its context and GTT hold still. The baselines
        // need the GTT before they collect. A QEMU VM's vGPU state goes in
        // QEMU's own stream (VM_STATE), CONTEXT empty.
        let context = match self.src.vm.kind() {
            VmmKind::HagVmm => {
                let context = self.src.dev.save_context(self.src.vgpu_id)?;
                hag_abi::snapshot::Snapshot::parse(&context).map_err(MigrateError::BadContext)?;
                context
            }
            VmmKind::Qemu => Vec::new(),
        };
        if matches!(self.opts.gpu_dirty, GpuDirty::Full | GpuDirty::Hash) {
            self.src.gtt = Some(gtt_guest_pages(&context).map_err(MigrateError::BadContext)?);
        }
        let td = Instant::now();
        let d = self.src.collect()?;
        report.dirty_ms = ms_since(td);
        report.cpu_dirty = d.cpu;
        report.gpu_dirty = d.gpu;
        self.carry.extend(d.pages);
        // The vGPU is idle: every page its log marked since the last
        // quiesce holds its final bytes now (item 6).
        let limit = self.src.ram.pages();
        self.carry
            .extend(self.src.gpu.settle().into_iter().filter(|&p| p < limit));
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
        let tv = Instant::now();
        let vm_state = match self.acked_state.as_ref().filter(|_| send_only) {
            // Sent without a pause: the last state again (a save needs one).
            Some((_, state)) => state.clone(),
            None => self.src.vm.vm_state().map_err(|e| match e {
                VmmError::Unprotectable { .. } => EpochError::Unprotectable(e.to_string()),
                e => EpochError::Retry(format!("cannot get the VM state: {e}")),
            })?,
        };
        report.state_ms = ms_since(tv);
        // The disks' point in time, with the memory's: after the save,
        // which leaves them inactive (see vmm::qemu_disks).
        let tk = Instant::now();
        self.src
            .vm
            .capture_disks()
            .map_err(|e| EpochError::Retry(format!("cannot capture the disks: {e}")))?;
        report.disk_capture_ms = ms_since(tk);
        let tc = Instant::now();
        let pages: Vec<u64> = self.carry.iter().copied().collect();
        // Every byte is copied over below: only growth needs zeroing.
        let mut raw = std::mem::take(&mut self.spare_raw);
        raw.resize(pages.len() * PAGE, 0);
        for (i, p) in pages.iter().enumerate() {
            let page = &mut raw[i * PAGE..(i + 1) * PAGE];
            self.src.ram.read(p * PAGE_SIZE, page)?;
            if let Some(h) = &mut self.src.hashes {
                h.record(*p, page);
            }
        }
        report.copy_ms = ms_since(tc);
        // Console output so far belongs to this epoch.
        let next = self.link.lock().policy.next_epoch();
        self.src.vm.mark_epoch(next).map_err(EpochError::Vm)?;
        Ok((pages, raw, context, vm_state))
    }

    /// Streams a captured epoch and waits for its acknowledgement;
    /// returns the backup's generation in it.
    fn send(&mut self, cap: &mut Captured) -> Result<u64, EpochError> {
        let sent = self.send_epoch(cap);
        match sent {
            Ok(_) => {
                // The backup committed these bytes before its ack.
                for (&page, bytes) in cap.pages.iter().zip(cap.raw.chunks_exact(PAGE)) {
                    self.page_cache.put(page, bytes);
                }
            }
            // It may have committed the epoch with its ack lost, or not:
            // its image is no longer known page by page.
            Err(_) => self.page_cache.clear(),
        }
        sent
    }

    fn send_epoch(&mut self, cap: &mut Captured) -> Result<u64, EpochError> {
        let round = self.round;
        let epoch = self.link.lock().policy.next_epoch();
        let mut bytes = 0u64;
        let sealed0 = self.src.stream.w.seal_time();
        let mut encode = Duration::ZERO;
        let cache = Some(&self.page_cache).filter(|_| self.src.peer.version >= PAGE_DELTA_SINCE);
        for (chunk_pages, chunk_raw) in cap
            .pages
            .chunks(PAGES_PER_FRAME)
            .zip(cap.raw.chunks(PAGES_PER_FRAME * PAGE))
        {
            let t = Instant::now();
            let encoded = wire::encode_pages_frame(
                round,
                chunk_pages,
                chunk_raw,
                self.opts.compress,
                cache,
                &mut self.frame,
                &mut self.scratch,
            );
            cap.report.delta_pages += encoded.delta;
            encode += t.elapsed();
            bytes += self.src.send_raw(&self.frame, "epoch")?;
        }
        cap.report.encode_ms = encode.as_secs_f64() * 1e3;
        let (disk_wire, disk) = self.send_disks()?;
        bytes += disk_wire;
        cap.report.disk_bytes = disk.data_bytes;
        cap.report.disk_job_ms = disk.job_ms;
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
        let state = std::mem::take(&mut cap.vm_state);
        let patch = self
            .acked_state
            .as_ref()
            .filter(|_| self.src.peer.version >= STATE_DELTA_SINCE)
            .and_then(|(base_epoch, base)| Some((*base_epoch, state_delta::encode(base, &state)?)));
        let msg = match patch {
            Some((base_epoch, patch)) => Msg::VmStateDelta { base_epoch, patch },
            None => Msg::VmState(state.clone()),
        };
        let state_bytes = self.src.send(&msg, "epoch")?;
        bytes += state_bytes;
        cap.report.state_bytes = state_bytes;
        cap.report.state_patched = matches!(msg, Msg::VmStateDelta { .. });
        drop(msg);
        // The number is spent once EPOCH_END may have gone out, acked or
        // not: a backup that applied an epoch whose ack was lost has it,
        // and the next capture must not reuse it (it would be refused as
        // "epoch E after epoch E" for ever). Output tagged with an
        // unacknowledged epoch goes with the next acknowledged one.
        self.epoch = self.link.lock().policy.spend_epoch();
        debug_assert_eq!(self.epoch, epoch);
        bytes += self.src.send(
            &Msg::EpochEnd {
                epoch,
                generation: self.link.lock().policy.generation(),
            },
            "epoch",
        )?;
        let sent_at = Instant::now();
        cap.report.send_ms = ms_since(cap.resumed_at);
        cap.report.seal_ms = (self.src.stream.w.seal_time() - sealed0).as_secs_f64() * 1e3;
        self.round += 1;
        // A backup that applies but does not answer is given up on (and
        // resynchronised with) after this, output held meanwhile.
        let timeout = self.link.lock().policy.timeout();
        self.src.stream.r.set_deadline(Some(
            Instant::now() + (timeout * 3).max(Duration::from_secs(5)),
        ));
        self.src.expect_ok(&format!("epoch {epoch}"), round)?;
        let (reply, _) = read_msg(&mut self.src.stream)
            .map_err(|e| EpochError::Link(format!("waiting for EPOCH_ACK {epoch}: {e}")))?;
        match reply {
            Msg::EpochAck {
                epoch: e,
                generation,
            } if e == epoch => {
                self.src.stream.r.set_deadline(None);
                self.src.vm.disks_acknowledged();
                self.acked_state = Some((epoch, state));
                cap.report.pages = cap.pages.len() as u64;
                cap.report.raw_bytes = cap.report.pages * PAGE as u64;
                cap.report.bytes = bytes;
                cap.report.ack_ms = ms_since(cap.resumed_at);
                cap.report.wait_ms = ms_since(sent_at);
                Ok(generation)
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

    /// Carries out what the policy answered to an event of the main
    /// thread (the threads' own actions are done in [`Link::event`]).
    fn event(&mut self, ev: Event) -> Result<(), EpochError> {
        for a in self.link.event(ev) {
            match a {
                Action::Release(epoch) => {
                    self.released = self.src.vm.release_output(epoch).map_err(EpochError::Vm)?;
                }
                Action::ReleaseAll => {
                    let _ = self.src.vm.hold_output(false);
                }
                Action::SendAbort(reason) if self.hello_said => {
                    let _ = write_msg(&mut self.src.stream, &Msg::Abort { reason });
                }
                _ => {}
            }
        }
        match self.link.exit() {
            Some((outcome, detail)) => Err(EpochError::Exit(outcome, detail)),
            None => Ok(()),
        }
    }

    /// Keeps an epoch's page buffer for the next capture, unless a
    /// one-off (a catch-up after a resynchronisation) made it larger than
    /// [`SPARE_RAW_MAX`].
    fn recycle(&mut self, raw: Vec<u8>) {
        if raw.capacity() <= SPARE_RAW_MAX {
            self.spare_raw = raw;
        }
    }

    /// One epoch: capture, stream, ack, release output.
    fn epoch_once(&mut self) -> Result<(), EpochError> {
        let period = self.schedule.started(Instant::now());
        let captured_unix_ms = unix_ms();
        let ablation = self.ablation();
        let mut cap = self.capture()?;
        cap.report.period_ms = period.map_or(0.0, |p| p.as_secs_f64() * 1e3);
        cap.report.late_ms = self.late.take().map_or(0.0, |l| l.as_secs_f64() * 1e3);
        cap.report.ablation = ablation;
        if self.link.hung() {
            return Err(EpochError::Hung(String::new()));
        }
        if ablation == Some(Ablation::PauseOnly) {
            // Nothing goes to the backup; the output goes out as if it
            // had acknowledged (the benchmark's VM is not protected).
            cap.report.pages = cap.pages.len() as u64;
            self.recycle(std::mem::take(&mut cap.raw));
            self.carry.clear();
            let next = self.link.lock().policy.next_epoch();
            cap.report.released = self.src.vm.release_output(next).map_err(EpochError::Vm)?;
            self.ablated += 1;
            cap.report.epoch = self.epoch + self.ablated;
            progress!("{}", cap.report.line(false));
            self.report.record(cap.report);
            return Ok(());
        }
        let generation = self.send(&mut cap)?;
        self.recycle(std::mem::take(&mut cap.raw));
        self.carry.clear();
        self.released = 0;
        self.event(Event::Acked {
            epoch: self.epoch,
            generation,
        })?;
        cap.report.released = self.released;
        progress!("{}", cap.report.line(cap.finished));
        let r = &cap.report;
        self.status.last_epoch = self.epoch;
        self.status.last_ack_unix_ms = unix_ms();
        self.status.last_captured_unix_ms = captured_unix_ms;
        self.status.period_ms = r.period_ms;
        self.status.overruns += u64::from(r.late_ms > 0.0);
        self.status.skipped = 0;
        self.status.skipped_why.clear();
        self.status.last_pause_ms = r.pause_ms;
        self.status.last_bytes = r.bytes;
        self.status.last_ack_ms = r.ack_ms;
        self.report.record(cap.report);
        self.save_status("protected", "");
        if cap.finished {
            return Err(EpochError::Finished);
        }
        Ok(())
    }

    fn unprotected(&mut self, why: &str) -> Result<(), EpochError> {
        if self.status.state != "unprotected" {
            info!(
                "unprotected: backup {} unreachable ({why}); the VM keeps running, its output held since epoch {}, retrying every {:.1} s",
                self.opts.backup,
                self.link.lock().policy.acked(),
                self.opts.interval.as_secs_f64()
            );
        }
        self.save_status(
            "unprotected",
            &format!(
                "{why}; output held since epoch {}",
                self.link.lock().policy.acked()
            ),
        );
        // The backup may still hear us, or take over from its last
        // checkpoint: nothing after it goes out (docs/ha.md).
        self.event(Event::LinkLost(why.to_owned()))
    }

    fn end(&mut self, outcome: &str, detail: String) -> CheckpointReport {
        info!("{outcome}: {detail}");
        self.report.outcome = outcome.to_owned();
        self.report.detail = detail.clone();
        self.report.generation = {
            let g = self.link.lock();
            match g.policy.state {
                State::Fenced(fenced) => fenced,
                _ => g.policy.generation(),
            }
        };
        self.report.finish();
        if self.link.lock().policy.held_output_void() {
            if let Err(e) = self.src.vm.discard_output() {
                info!("dropping the stopped VM's held output: {e}");
            }
        }
        self.save_status(outcome, &detail);
        if matches!(
            outcome,
            "finished" | "finished-unconfirmed" | "ended" | "vm-stopped"
        ) {
            let _ = std::fs::remove_file(status_path(&self.opts.status_dir, self.src.vgpu_id));
        }
        std::mem::take(&mut self.report)
    }

    /// A signal: end protection, and wait for the backup to confirm that
    /// it discarded its checkpoint.
    fn end_protection(&mut self, why: &str) -> CheckpointReport {
        let _ = self.event(Event::Signal(why.to_owned()));
        self.await_end(("vm-stopped", format!("{why}: protection ended")))
    }

    /// The VM finished: end protection as at a signal, so that the
    /// backup does not take the closed connections for a lost host.
    fn end_finished(&mut self) -> CheckpointReport {
        let _ = self.event(Event::Finished);
        self.await_end(("finished", "the VM finished".into()))
    }

    /// ABORT is out: waits (up to the failover timeout) for the backup's
    /// confirmation and ends as the policy says, or with `otherwise` if
    /// the policy was past ending already.
    fn await_end(&mut self, otherwise: (&'static str, String)) -> CheckpointReport {
        let deadline = Instant::now() + self.link.lock().policy.timeout();
        let mut confirmed = self.link.lock().end_confirmed;
        if !confirmed && self.link.lock().connected {
            // The data link's own answer.
            self.src.stream.r.set_deadline(Some(deadline));
            while let Ok((m, _)) = read_msg(&mut self.src.stream) {
                if m == (Msg::Ok { phase: ENDED_PHASE }) {
                    confirmed = true;
                    break;
                }
            }
        }
        // A control connection's answer counts as much as the data
        // link's, also when waiting on the data link took all the time.
        confirmed |= self.link.lock().end_confirmed;
        while !confirmed && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            confirmed = self.link.lock().end_confirmed;
        }
        let ev = if confirmed {
            Event::EndConfirmed
        } else {
            Event::EndUnconfirmed
        };
        let (outcome, detail) = match self.event(ev) {
            Err(EpochError::Exit(o, d)) => (o, d),
            _ => otherwise,
        };
        self.end(outcome, detail)
    }

    /// After a hang: the VM is stopped and the backup told; it confirms
    /// with a newer generation.
    fn hand_over(&mut self) -> CheckpointReport {
        let why = match &self.link.lock().policy.state {
            State::HandedOver(why) => why.clone(),
            _ => "the vGPU hung".into(),
        };
        let deadline = Instant::now() + self.link.lock().policy.timeout() + HAND_OVER_CONFIRM;
        while Instant::now() < deadline {
            if let Some((outcome, detail)) = self.link.exit() {
                return self.end(outcome, format!("{why}; {detail}"));
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
            if self.stop.load(Ordering::SeqCst) {
                return Ok(self.end_protection("a signal"));
            }
            let result = if self.link.lock().connected {
                self.epoch_once()
            } else if first || Instant::now() >= next {
                let r = self.sync();
                if first && !self.paired {
                    if let Err(EpochError::Link(why)) = &r {
                        // Not paired, by this run or one before on this
                        // VM: no backup holds anything of it.
                        let _ = self.src.vm.hold_output(false);
                        anyhow::bail!("cannot protect the VM: backup {}: {why}", self.opts.backup);
                    }
                }
                first = false;
                r
            } else {
                Ok(())
            };
            if matches!(result, Err(EpochError::Retry(_))) {
                self.schedule.skipped(Instant::now());
            }
            if let Some(exit) = self.outcome(result) {
                return Ok(exit);
            }
            // Wait for the next epoch, watching for a hang, a fence, a
            // signal, a lost link. Protected, epochs keep their period
            // (an overrun starts the next at once, reported with it);
            // unprotected, a resynchronisation is tried every interval.
            next = if self.link.lock().connected {
                let start = self.schedule.next(Instant::now());
                self.late = start.late;
                start.at
            } else {
                Instant::now() + self.opts.interval
            };
            // Stopped while it waited (SIGSTOP, a frozen host), this
            // primary starts nothing until what queued meanwhile (a
            // signal, a fence, a hang) has been handled: an epoch started
            // at once on waking could lose the link to a backup that is
            // taking over, and with it the ABORT of a pending SIGTERM.
            let mut stalls = StallGuard::new(Instant::now());
            loop {
                let now = Instant::now();
                if stalls.may_decide(now) && now >= next {
                    break;
                }
                if self.stop.load(Ordering::SeqCst) {
                    return Ok(self.end_protection("a signal"));
                }
                if self.link.hung() {
                    return Ok(self.hand_over());
                }
                if let Some((outcome, detail)) = self.link.exit() {
                    return Ok(self.end(outcome, detail));
                }
                let lost = self.link.lock().lost.take();
                if let Some(why) = lost {
                    let r = self.unprotected(&why);
                    if let Some(exit) = self.outcome(r) {
                        return Ok(exit);
                    }
                }
                if let Some(exit) = self.backup_down_request() {
                    return Ok(exit);
                }
                if let Some(exit) = self.witness_turn() {
                    return Ok(exit);
                }
                if !self.link.lock().connected
                    && matches!(self.src.vm.status(), Err(_) | Ok(VmStatus::Crashed(_)))
                {
                    let _ = self.event(Event::VmGone("the VM is gone (unprotected)".into()));
                    let detail = if self.granted {
                        "the VM is gone (unprotected, granted to this primary by the witness: its output went out)"
                    } else {
                        "the VM is gone (unprotected); its output since the last acknowledged epoch was never released"
                    };
                    return Ok(self.end("vm-stopped", detail.into()));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    /// Paired: an answer under way is of a moment that passed, and the
    /// backup said whether it takes over with this primary's witness.
    fn witness_paired(&mut self) {
        let Some(asker) = self.witness.as_mut() else {
            return;
        };
        asker.forget();
        let ours = asker.id();
        let theirs = self.src.peer.witness;
        if theirs != Some(ours) && self.backup_witness_warned != Some(theirs) {
            warning!(
                "the backup {} takes over {}, not with this primary's witness {}: this primary will not claim from it (its output stays held while the backup is unheard, as without a witness); give both sides the same --witness and key",
                self.opts.backup,
                match theirs {
                    None => "on silence alone".to_owned(),
                    Some(id) => format!("with another witness (id {id:016x}, this one's {ours:016x})"),
                },
                self.opts.witness.as_ref().map_or("", |(addr, _)| addr.as_str())
            );
        }
        self.backup_witness_warned = Some(theirs);
    }

    /// A grant moved this primary a generation up: its status and report
    /// say so (and a pairing does not take it for the backup's).
    fn witness_moved_generation(&mut self) {
        let generation = self.link.lock().policy.generation();
        self.status.generation = generation;
        self.report.generation = generation;
    }

    /// With a witness, on threads of their own, and acting on the answers:
    ///
    /// - until it was read once, what the witness decided about this VM
    ///   instance: taken over by the backup, the VM stops; kept by this
    ///   primary at its generation or above, its pairings go a generation
    ///   up (nothing is released: that is a claim's);
    /// - once the backup has been unheard for the failover timeout, a
    ///   claim, if the backup said at pairing that it takes over with this
    ///   same witness (else it takes over on silence alone, and a grant
    ///   here would be no protection): granted, the held output goes out
    ///   and the VM runs on; refused, the backup takes over and the VM
    ///   stops; undecided or unanswered, output stays held and it is
    ///   claimed again.
    fn witness_turn(&mut self) -> Option<CheckpointReport> {
        let asker = self.witness.as_mut()?;
        let own_id = asker.id();
        if let Some((asked, answer)) = asker.answer() {
            let a = match answer {
                Err(e) => {
                    if self.witness_error.as_ref() != Some(&e) {
                        info!("{e}: asked again every second; output stays held");
                        self.witness_error = Some(e);
                    }
                    return None;
                }
                Ok(a) => a,
            };
            self.witness_error = None;
            if asked == Asked::Query {
                self.witness_read = true;
            }
            let generation = self.link.lock().policy.generation();
            let ev = match (asked, a.verdict, a.ballot) {
                (_, _, Some(b)) if b.winner == Side::Backup => {
                    Some(Event::WitnessDenied(b.generation, a.why.clone()))
                }
                (Asked::Query, _, Some(b)) if b.generation >= generation => {
                    Some(Event::WitnessRecord(b.generation))
                }
                (Asked::Claim, Verdict::Granted, Some(b)) => {
                    Some(Event::WitnessGranted(b.generation))
                }
                (Asked::Claim, Verdict::Refused, b) => Some(Event::WitnessDenied(
                    b.map_or(generation, |b| b.generation),
                    a.why.clone(),
                )),
                _ => None,
            };
            if asked == Asked::Claim || ev.is_some() {
                info!("the witness: {}", a.why);
            }
            if let Some(ev) = ev {
                let unprotected = matches!(self.link.lock().policy.state, State::Unprotected(_));
                let granted = matches!(ev, Event::WitnessGranted(_));
                if let Err(EpochError::Exit(outcome, detail)) = self.event(ev) {
                    return Some(self.end(outcome, detail));
                }
                self.witness_moved_generation();
                if granted && unprotected {
                    self.granted = true;
                    let why = match &self.link.lock().policy.state {
                        State::Unprotected(why) => why.clone(),
                        _ => String::new(),
                    };
                    info!("{why}");
                    self.save_status("unprotected", &why);
                }
            }
        }
        let (claim, generation) = {
            let g = self.link.lock();
            let unheard = matches!(g.policy.state, State::Unprotected(_))
                && !g.connected
                && g.heard_any.elapsed() >= g.policy.timeout();
            (unheard && !self.granted, g.policy.generation())
        };
        let asker = self.witness.as_mut()?;
        if !self.witness_read {
            asker.start(Request::Query {
                instance: self.link.instance.into(),
            });
        } else if claim && self.src.peer.witness == Some(own_id) {
            asker.start(Request::Claim {
                side: Side::Primary,
                instance: self.link.instance.into(),
                generation,
                vm: self.link.vm_name.as_ref().map(|n| n.to_string()),
            });
        }
        None
    }

    /// An operator's `hagctl confirm-backup-down`, if one came: `Some` if
    /// protection ends with it; refused (said beside the request) while
    /// the backup is heard.
    fn backup_down_request(&mut self) -> Option<CheckpointReport> {
        let (request, refused) = backup_down_paths(&self.opts.status_dir, self.src.vgpu_id);
        std::fs::remove_file(&request).ok()?;
        let who = "the operator confirmed the backup down (hagctl confirm-backup-down)";
        info!("{who}");
        if let Err(EpochError::Exit(outcome, detail)) = self.event(Event::BackupDown(who.into())) {
            return Some(self.end(outcome, detail));
        }
        let why = match self.link.lock().policy.state {
            State::Protected => "the backup acknowledges epochs: it is not down".to_owned(),
            ref s => format!("not while {s}"),
        };
        info!("not confirmed: {why}");
        if let Err(e) = std::fs::write(&refused, why + "\n") {
            warning!("{}: {e}", refused.display());
        }
        None
    }

    /// Why the VM crashed, if its VMM says it did.
    fn vm_crashed(&mut self) -> Option<String> {
        match self.src.vm.status() {
            Ok(VmStatus::Crashed(why)) => Some(why),
            _ => None,
        }
    }

    /// What an epoch's or a sync's result means: `Some` to end.
    fn outcome(&mut self, result: Result<(), EpochError>) -> Option<CheckpointReport> {
        let err = match result {
            Ok(()) => return None,
            // A QMP call that failed mid-epoch or mid-capture may be the
            // VMM dying: asked again, a crash says so (and a connection
            // broken by a timeout is replaced). Unasked, a skipped epoch
            // would be skipped again at every interval on a dead QEMU.
            Err(EpochError::Vm(why)) => self
                .vm_crashed()
                .map_or(EpochError::Vm(why), EpochError::Crashed),
            Err(EpochError::Retry(why)) => self
                .vm_crashed()
                .map_or(EpochError::Retry(why), EpochError::Crashed),
            Err(e) => e,
        };
        if self.link.hung() {
            return Some(self.hand_over());
        }
        if let Some((outcome, detail)) = self.link.exit() {
            return Some(self.end(outcome, detail));
        }
        match err {
            EpochError::Link(why) => {
                let why = self.link.lock().lost.take().unwrap_or(why);
                match self.unprotected(&why) {
                    Err(EpochError::Exit(o, d)) => Some(self.end(o, d)),
                    _ => None,
                }
            }
            EpochError::Retry(why) => {
                info!("epoch skipped: {why}");
                self.status.skipped += 1;
                self.status.skipped_why = why;
                let state = self.status.state.clone();
                let reason = self.status.reason.clone();
                self.save_status(&state, &reason);
                None
            }
            EpochError::Hung(why) => {
                self.link.hang(why);
                Some(self.hand_over())
            }
            EpochError::Crashed(why) => {
                self.link.crashed(why);
                Some(self.hand_over())
            }
            EpochError::Exit(outcome, detail) => Some(self.end(outcome, detail)),
            EpochError::Finished => Some(self.end_finished()),
            EpochError::Vm(why) => {
                // The VM failed or stopped by itself: protection ends as at
                // a signal. Its unacknowledged output (a FAIL line) goes
                // out only once the backup confirms it will not take over
                // from an older epoch; unconfirmed, it stays held.
                let mut r = self.end_protection(&why);
                if r.outcome == "ended" {
                    r.outcome = "vm-stopped".into();
                }
                Some(r)
            }
            EpochError::Unprotectable(why) => {
                // The VM runs on, unprotected, as after a SIGTERM: its
                // held output goes out once the backup confirms the end.
                Some(self.end_protection(&format!("the VM can no longer be protected: {why}")))
            }
            EpochError::MigratingAway(why) => {
                // As above: the VM runs on, now where it lands (where the
                // libvirt hook protects it again).
                let mut r = self.end_protection(&format!("the VM is migrating away: {why}"));
                if r.outcome == "ended" {
                    r.outcome = "migrated-away".into();
                }
                Some(r)
            }
        }
    }
}

/// The VM to protect, opened.
struct OpenedVm {
    vm: Box<dyn CopyVm>,
    ram: GuestRam,
    /// This host's `/dev/hag`.
    dev: Device,
    vgpu_id: u32,
    /// How another thread stops it.
    stopper: Stopper,
    /// Its VMM process, named across hosts and reboots.
    instance: Instance,
    /// What its guest sees (QEMU).
    shape: Option<VmShape>,
}

/// The VM at `at`, opened.
fn open_vm(at: &VmAt) -> anyhow::Result<OpenedVm> {
    match at {
        VmAt::HagVmm(path) => {
            let (mut vm, ram, dev, vgpu_id) = open_running(path)?;
            let instance = vm
                .client()
                .peer_pid()
                .map_err(|e| {
                    format!(
                        "cannot tell hag-vmm's pid (SO_PEERCRED on {}): {e}",
                        path.display()
                    )
                })
                .and_then(Instance::of_process)
                .map_err(anyhow::Error::msg)?;
            Ok(OpenedVm {
                vm: Box::new(vm),
                ram,
                dev,
                vgpu_id,
                stopper: Stopper::HagVmm(path.clone()),
                instance,
                shape: None,
            })
        }
        VmAt::Qemu {
            qmp,
            plug,
            console,
            withhold_cpu_dirty,
            withhold_disk_delta,
            delta_dir,
        } => {
            let mut qemu = Qemu::connect(qmp, QMP_TIMEOUT)?;
            let state = qemu.run_state()?;
            if !state.is_running() {
                anyhow::bail!("{}: the VM is {state}, not running", qemu.describe());
            }
            let mut gates: Vec<Box<dyn OutputGate>> = Vec::new();
            if let Some(ifname) = plug {
                let plug = crate::plug::Plug::attach(ifname)
                    .and_then(PlugGate::new)
                    .map_err(|e| anyhow::anyhow!("cannot hold the VM's output on {ifname}: {e}"))?;
                gates.push(Box::new(plug));
            }
            if let Some((socket, log)) = console {
                gates.push(Box::new(
                    ConsoleGate::connect(socket, log).map_err(anyhow::Error::msg)?,
                ));
            }
            let mut opened = QemuVm::open(qemu, gates, delta_dir)?;
            if *withhold_cpu_dirty {
                info!("TEST: the CPU dirty log is withheld");
                opened.vm.withhold_cpu_dirty();
            }
            if *withhold_disk_delta {
                info!("TEST: the epochs' disk deltas are withheld");
                opened.vm.withhold_disk_delta();
            }
            for d in opened.vm.disks() {
                info!(
                    "disk {}: {} MiB, replicated with the VM's memory",
                    d.id,
                    d.size >> 20
                );
            }
            let pid = opened.vm.mapping().pid;
            let dev = Device::open()?;
            dev.version()?;
            let vgpu_id = dev.find_vgpu(&opened.vgpu_uuid)?.id;
            info!(
                "QEMU VM: {} MiB of guest RAM in {} (pid {pid}), vGPU {vgpu_id} (mdev {})",
                opened.ram.size() >> 20,
                opened.vm.mapping().name,
                opened.vgpu_uuid
            );
            let instance = u32::try_from(pid)
                .map_err(|_| format!("QEMU's pid {pid} is not a pid"))
                .and_then(Instance::of_process)
                .map_err(anyhow::Error::msg)?;
            Ok(OpenedVm {
                vm: Box::new(opened.vm),
                ram: opened.ram,
                dev,
                vgpu_id,
                stopper: Stopper::Qemu(pid),
                instance,
                shape: Some(opened.shape),
            })
        }
    }
}

/// Milliseconds since `t`.
fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// How long a QMP command may take.
const QMP_TIMEOUT: Duration = Duration::from_secs(30);

/// After a hang, how long (beyond the failover timeout) the stopped
/// primary waits for the backup's new generation: the backup confirms
/// once its standby is prepared, which for QEMU means starting it and
/// loading the epoch (seconds, many more on a loaded host). Waiting costs
/// nothing, the VM is stopped; giving up early only loses the confirmation.
const HAND_OVER_CONFIRM: Duration = Duration::from_secs(60);

/// `hagctl checkpoint`.
pub fn checkpoint(
    opts: &CheckpointOptions,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<CheckpointReport> {
    let key = Key::load(&opts.key)?;
    let OpenedVm {
        vm,
        ram,
        dev,
        vgpu_id,
        stopper,
        instance,
        shape,
    } = open_vm(&opts.vm)?;
    if let Some(a) = opts.ablation {
        // An ablation's epochs leave the disks' captures unsent.
        anyhow::ensure!(
            vm.disks().is_empty(),
            "--test-ablation {a:?}: the VM has disks; the ablations measure a VM without"
        );
        info!("TEST: from epoch 3 on, {a:?} (the VM is not protected)");
    }
    let stats0 = dev.vgpu_stats(vgpu_id)?;
    let mopts = MigrateOptions {
        vm: match &opts.vm {
            VmAt::HagVmm(p) | VmAt::Qemu { qmp: p, .. } => p.clone(),
        },
        to: opts.backup.clone(),
        max_rounds: opts.max_rounds,
        threshold_pages: opts.threshold_pages,
        quiesce_timeout_ms: opts.quiesce_timeout_ms,
        gpu_dirty: opts.gpu_dirty,
        compress: opts.compress,
        connect_timeout: opts.connect_timeout,
        inject_fault: None,
        key: opts.key.clone(),
        max_downtime: Duration::ZERO,
        bandwidth: None,
        stop: None,
    };
    let witness = crate::witness::configured(&opts.witness, &key)?.map(Asker::new);
    // The first connection may take a while (the backup starting).
    let mut src = Source::connect(vm, ram, dev, vgpu_id, mopts, &key)?;
    // Until the backup is reached, nothing holds the VM's output.
    let link = Arc::new(Link {
        shared: Mutex::new(Shared {
            policy: Policy::new(opts.generation, opts.failover_timeout),
            heard: Instant::now(),
            heard_any: Instant::now(),
            connected: false,
            lost: None,
            data: None,
            outs: BTreeMap::new(),
            end_confirmed: false,
            exit: None,
        }),
        stopper,
        instance,
        vm_name: opts.vm_name.clone(),
        session: src.session,
        key,
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
    if opts.gpu_dirty == GpuDirty::Audit {
        src.start_gpu_log()?;
    }
    let vm_instance = instance.key();
    let earlier = std::fs::read_to_string(status_path(&opts.status_dir, vgpu_id))
        .ok()
        .and_then(|t| serde_json::from_str::<StatusFile>(&t).ok());
    let paired = earlier_run_paired(earlier.as_ref(), &vm_instance);
    if paired {
        info!(
            "an earlier run protected this VM and did not end (it was {}): its backup may hold a checkpoint of it, so output stays held until a backup pairs",
            earlier.as_ref().map_or("", |e| e.state.as_str())
        );
    }
    let ram_size = src.ram.size();
    let mut p = Primary {
        src,
        link,
        opts: opts.clone(),
        hangs0: stats0.hangs,
        written0: stats0.bytes_written,
        carry: BTreeSet::new(),
        round: 0,
        epoch: 0,
        first: true,
        hello_said: false,
        shape,
        paired,
        released: 0,
        stop,
        status: StatusFile {
            pid: std::process::id(),
            pid_start: crate::jobs::process_start(std::process::id()).unwrap_or(0),
            vgpu_id,
            backup: opts.backup.clone(),
            generation: opts.generation,
            vm_instance,
            // What the backup may hold, until this run's first epoch.
            last_epoch: earlier
                .as_ref()
                .filter(|_| paired)
                .map_or(0, |e| e.last_epoch),
            last_ack_unix_ms: earlier
                .as_ref()
                .filter(|_| paired)
                .map_or(0, |e| e.last_ack_unix_ms),
            ..StatusFile::default()
        },
        report: CheckpointReport {
            backup: opts.backup.clone(),
            generation: opts.generation,
            gpu_dirty_mode: opts.gpu_dirty,
            compress: opts.compress,
            ..CheckpointReport::default()
        },
        schedule: Schedule::new(opts.interval, Instant::now()),
        late: None,
        acked_state: None,
        frame: Vec::new(),
        scratch: PageScratch::default(),
        spare_raw: Vec::new(),
        // No bigger than the guest's RAM: more could never fill.
        page_cache: PageCache::new(opts.page_cache.min(ram_size)),
        witness,
        witness_read: false,
        granted: false,
        witness_error: None,
        backup_witness_warned: None,
        ablated: 0,
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
    fn a_run_started_again_knows_an_earlier_one_paired() {
        let st = |state: &str, vm: &str| StatusFile {
            state: state.into(),
            vm_instance: vm.into(),
            last_epoch: 3,
            ..StatusFile::default()
        };
        assert!(!earlier_run_paired(None, "a"));
        assert!(earlier_run_paired(Some(&st("protected", "a")), "a"));
        assert!(earlier_run_paired(Some(&st("unprotected", "a")), "a"));
        assert!(
            !earlier_run_paired(Some(&st("protected", "b")), "a"),
            "another VM instance"
        );
        assert!(
            !earlier_run_paired(Some(&st("ended", "a")), "a"),
            "it ended protection"
        );
        assert!(!earlier_run_paired(Some(&st("finished", "a")), "a"));
        let never = StatusFile {
            last_epoch: 0,
            ..st("syncing", "a")
        };
        assert!(!earlier_run_paired(Some(&never), "a"), "it never paired");
    }

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
            last_captured_unix_ms: unix_ms() - 2500,
            period_ms: 2000.0,
            overruns: 1,
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
        // The period and the recovery point: how old the state a takeover
        // would resume is.
        assert!(
            lines[0]
                .1
                .contains("period 2.00 s, 1 late; recovery point 2.5 s)"),
            "{}",
            lines[0].1
        );
        st.skipped = 2;
        st.skipped_why = "cannot get the VM state: saving the device state took over 30 s".into();
        write_status(&dir, &st);
        let line = &protection_lines(&dir)[0].1;
        assert!(
            line.ends_with("; 2 epoch(s) skipped since, output held: cannot get the VM state: saving the device state took over 30 s"),
            "{line}"
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
    fn an_epoch_line_says_what_was_sent_or_that_nothing_was() {
        let mut r = EpochReport {
            epoch: 7,
            pause_ms: 150.04,
            pages: 2300,
            delta_pages: 2100,
            cpu_dirty: 2300,
            gpu_dirty: 386,
            bytes: 7 << 20,
            state_bytes: 480,
            state_patched: true,
            ack_ms: 1400.0,
            period_ms: 2001.0,
            ..EpochReport::default()
        };
        assert_eq!(
            r.line(false),
            "epoch 7: pause 150.0 ms (quiesce 0.0), 2300 pages (cpu 2300, gpu 386; 2100 as deltas), 7.00 MiB (VM state 480 B as a patch), acked in 1400.0 ms, period 2001 ms"
        );
        r.ablation = Some(Ablation::PauseOnly);
        r.delta_pages = 0;
        r.late_ms = 30.0;
        assert_eq!(
            r.line(true),
            "epoch 7: pause 150.0 ms (quiesce 0.0), 2300 pages (cpu 2300, gpu 386), not sent (ablation: pause only), period 2001 ms (started 30 ms late: the previous epoch overran) (VM finished)"
        );
    }

    #[test]
    fn report_sums_epochs() {
        let mut r = CheckpointReport::default();
        for (i, pause) in [10.0, 30.0].into_iter().enumerate() {
            r.record(EpochReport {
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

    /// Issue 22, item 4: a long protection keeps the last epochs' reports
    /// only, and its totals still count every epoch.
    #[test]
    fn the_epoch_history_is_bounded_and_the_totals_are_not() {
        let mut r = CheckpointReport::default();
        let n = PER_EPOCH_KEPT as u64 * 3 + 7;
        for epoch in 1..=n {
            r.record(EpochReport {
                epoch,
                pause_ms: if epoch == 5 { 99.0 } else { 1.0 },
                bytes: 10,
                late_ms: if epoch % 2 == 0 { 1.0 } else { 0.0 },
                ..EpochReport::default()
            });
        }
        r.finish();
        assert_eq!(r.per_epoch.len(), PER_EPOCH_KEPT);
        assert_eq!(r.per_epoch_dropped, n - PER_EPOCH_KEPT as u64);
        assert_eq!(
            r.per_epoch.front().unwrap().epoch,
            n - PER_EPOCH_KEPT as u64 + 1
        );
        assert_eq!(r.per_epoch.back().unwrap().epoch, n);
        assert_eq!((r.epochs, r.epoch_bytes, r.overruns), (n, 10 * n, n / 2));
        assert_eq!(r.pause_ms_max, 99.0, "a dropped epoch's pause still counts");
    }
}
