//! `hagctl migrate` and `hagctl receive`: live migration of a `hag-vmm
//! serve` VM with a vGPU, over the stream in [`crate::wire`].
//!
//! The source copies guest RAM while the VM runs (pre-copy rounds: round 0
//! every non-zero page, then the pages the CPU dirtied, from the VMM's
//! log, or the GPU dirtied, from hag's dirty log through `/dev/hag`), then
//! pauses the VM, quiesces the vGPU and sends the last dirty pages, the
//! vGPU context and the VM state. The target writes pages into its VM's
//! RAM, restores the context into its own vGPU and resumes. Until the
//! target's OK to COMMIT, any failure leaves the source VM running and the
//! target VM discarded.
//!
//! hag's dirty log marks a submission's pages before the engine writes
//! them, so a page read and cleared while that submission still runs may be
//! copied before its write lands. The source therefore sends each round's
//! GPU-dirty pages again in the next round (and after the quiesce, when the
//! engine is idle, in the final one).
//!
//! Where the GPU's dirty pages come from is one choice, [`GpuDirty`]: hag's
//! audited log, or one of the baselines it is measured against (a full copy
//! of every page the vGPU's GTT maps, or page hashing, [`crate::pagehash`]).

use crate::log::{info, progress, warning};
use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use guest_ram::{GuestRam, PAGE_SIZE};
use hag_dev::{bitmap_pages, bitmap_words, Device};
use vmm_control::VmClient;

use crate::pagehash::{PageHashes, Scan};
use crate::secure::{self, Key};
use crate::term::Term;
use crate::vm_shape::VmShape;
use crate::vmm::copy::CopyVm;
use crate::vmm::hagvmm::HagVmm;
use crate::vmm::{RunKind, Vmm, VmmError};
use crate::wire::{
    self, read_msg, write_msg, Msg, ReceiveError, Received, Receiver, Target, COMMIT_PHASE, PAGE,
    PAGES_PER_FRAME, VERSION_MAX, VERSION_MIN,
};

/// Options of `hagctl migrate`.
#[derive(Clone, Debug)]
pub struct MigrateOptions {
    /// The source VM's control socket.
    pub vm: PathBuf,
    /// Target `HOST:PORT`.
    pub to: String,
    /// Pre-copy rounds at most (round 0 included).
    pub max_rounds: u32,
    /// Stop and copy once a round would send at most this many pages.
    pub threshold_pages: u64,
    /// vGPU quiesce timeout.
    pub quiesce_timeout_ms: u32,
    /// Where the GPU's dirty pages come from.
    pub gpu_dirty: GpuDirty,
    /// LZ4-compress pages (off: every page goes raw, zero pages too).
    pub compress: bool,
    /// How long to keep trying to connect.
    pub connect_timeout: Duration,
    /// Damage the stream on purpose (tests).
    pub inject_fault: Option<Fault>,
    /// The pre-shared key file both hosts hold.
    pub key: PathBuf,
    /// Stop and copy once the rest would take at most this to send
    /// (zero: only the page threshold and the round limit decide).
    pub max_downtime: Duration,
    /// Bytes per second at most (None: as fast as the link goes).
    pub bandwidth: Option<u64>,
    /// Raised by SIGINT/SIGTERM: abort while the source can still resume.
    pub stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// The GPU pages the source must still send (issue 12, item 6). hag's
/// log marks a submission's pages before the engine writes them, and a
/// long submission may write a page well after the round that sent it:
/// so each round's GPU pages go again in the next round, and every page
/// marked since the vGPU was last idle goes again once it is quiesced
/// (then the engine is idle and every marked write has landed). A log
/// that repeats a page for only one extra read (GVT-g's) is covered the
/// same way.
#[derive(Clone, Debug, Default)]
pub(crate) struct GpuPending {
    /// The last read's pages.
    prev: BTreeSet<u64>,
    /// Every page marked since the last quiesce.
    unsettled: BTreeSet<u64>,
}

impl GpuPending {
    /// A read of the log gave `pages`: returns the previous read's, to
    /// send again now.
    pub(crate) fn note(&mut self, pages: BTreeSet<u64>) -> BTreeSet<u64> {
        self.unsettled.extend(pages.iter().copied());
        std::mem::replace(&mut self.prev, pages)
    }

    /// The vGPU is quiesced: every page marked since the last quiesce
    /// (sent once more now, with its final bytes).
    pub(crate) fn settle(&mut self) -> BTreeSet<u64> {
        std::mem::take(&mut self.unsettled)
    }

    /// Forget everything (a new full copy starts).
    pub(crate) fn clear(&mut self) {
        *self = GpuPending::default();
    }
}

/// When pre-copy stops and the VM is paused: once the remaining pages fit
/// in `max_downtime` at `bytes_per_s` (QEMU's rule: expected downtime =
/// remaining bytes / bandwidth), or at most `threshold_pages` are left, or
/// the next round is the last allowed.
pub(crate) fn converged(
    pending_pages: u64,
    bytes_per_s: f64,
    opts: (u64, Duration, u32),
    next_round: u32,
) -> bool {
    let (threshold_pages, max_downtime, max_rounds) = opts;
    if pending_pages <= threshold_pages || next_round + 1 >= max_rounds {
        return true;
    }
    if max_downtime.is_zero() || bytes_per_s <= 0.0 {
        return false;
    }
    let expected = (pending_pages * PAGE_SIZE) as f64 / bytes_per_s;
    expected <= max_downtime.as_secs_f64()
}

/// What the source knows of the target after a failed stop-and-copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CommitOutcome {
    /// COMMIT was never sent: the target cannot have resumed.
    NotSent,
    /// The target answered COMMIT with ERROR: it did not resume.
    Refused,
    /// The link failed or the deadline passed after COMMIT went out: the
    /// target may be running the VM.
    Unknown,
}

/// What the source does with its paused VM (issue 12, item 4): resume it
/// only when the target certainly did not; in doubt, stay paused, so two
/// copies never run.
pub(crate) fn source_after(o: CommitOutcome) -> &'static str {
    match o {
        CommitOutcome::NotSent | CommitOutcome::Refused => "resume",
        CommitOutcome::Unknown => "stay-paused",
    }
}

/// How the source learns which guest pages the GPU wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuDirty {
    /// hag's audited GPU dirty log (command auditing).
    #[default]
    Audit,
    /// No tracking: every guest page the vGPU's GTT maps is copied while
    /// the VM is paused (at stop-and-copy, and at every epoch).
    Full,
    /// Page hashing: every round and epoch, hash every page the GPU could
    /// have written (the GTT-mapped ones; all of guest RAM while the VM
    /// runs) and send those that changed.
    Hash,
    /// Ignore the GPU entirely (tests: GPU-only writes are then missed).
    None,
}

/// A fault `hagctl migrate --inject-fault` puts into the stream, so tests
/// see the target refuse it and the source VM run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    /// Flip one byte of the last PAGES frame of round 0 after its CRC was
    /// computed.
    CorruptPage,
    /// During stop-and-copy, send only the first half of the CONTEXT frame,
    /// then close the sending side of the connection.
    TruncateContext,
}

/// The guest pages the GTT section of `context` maps (present entries),
/// sorted and without duplicates.
pub fn gtt_guest_pages(context: &[u8]) -> Result<Vec<u64>, hag_abi::snapshot::SnapshotError> {
    let snap = hag_abi::snapshot::Snapshot::parse(context)?;
    let mut pages = BTreeSet::new();
    for section in snap.sections() {
        let (tag, bytes) = section?;
        if tag != hag_abi::snapshot::TAG_GTT {
            continue;
        }
        for pte in bytes.chunks_exact(8) {
            let pte = u64::from_le_bytes(pte.try_into().unwrap_or([0; 8]));
            if pte & hag_abi::sim_regs::GTT_PRESENT != 0 {
                pages.insert((pte & hag_abi::sim_regs::GTT_ADDR_MASK) / PAGE_SIZE);
            }
        }
    }
    Ok(pages.into_iter().collect())
}

/// Why `hagctl migrate` failed. The source VM runs on unless it says
/// otherwise.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// Reaching the VM.
    #[error(transparent)]
    Vm(#[from] vmm_control::ControlError),
    /// The VM's VMM.
    #[error(transparent)]
    Vmm(#[from] VmmError),
    /// `/dev/hag`.
    #[error(transparent)]
    Open(#[from] hag_dev::OpenError),
    /// `/dev/hag` version.
    #[error(transparent)]
    Version(#[from] hag_dev::VersionError),
    /// A vGPU ioctl.
    #[error(transparent)]
    Vgpu(#[from] hag_dev::DirtyError),
    /// Guest RAM access.
    #[error(transparent)]
    Ram(#[from] guest_ram::RamError),
    /// Connecting to the target.
    #[error("cannot connect to the target {to}: {why}")]
    Connect {
        /// Target.
        to: String,
        /// Why.
        why: String,
    },
    /// The stream.
    #[error("{step}")]
    Wire {
        /// What was being done.
        step: String,
        /// The error.
        #[source]
        source: wire::WireError,
    },
    /// The target said no.
    #[error("the target refused during {step}: {message}")]
    Refused {
        /// What was being done.
        step: String,
        /// The target's reason.
        message: String,
    },
    /// The target answered out of turn.
    #[error("{step}: the target answered {got}, expected {want}")]
    Unexpected {
        /// What was being done.
        step: String,
        /// What came.
        got: String,
        /// What was expected.
        want: &'static str,
    },
    /// The vGPU did not go idle in time; the VM was resumed.
    #[error("the vGPU did not quiesce within {ms} ms ({errno}); the source VM was resumed")]
    QuiesceTimeout {
        /// Timeout.
        ms: u32,
        /// What the module said.
        errno: nix::errno::Errno,
    },
    /// The context the module saved does not parse.
    #[error("the vGPU context saved on the source is invalid: {0}")]
    BadContext(hag_abi::snapshot::SnapshotError),
    /// The VM is not in a state to migrate.
    #[error("the VM is {0}, not running")]
    NotRunning(String),
    /// SIGINT or SIGTERM before the commit.
    #[error("cancelled on a signal")]
    Cancelled,
}

/// While the VM is paused, the target's replies must come within this.
const PAUSED_REPLY_DEADLINE: Duration = Duration::from_secs(10);

/// One round of the report.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RoundReport {
    /// Round number.
    pub round: u32,
    /// `precopy` or `stop-copy`.
    pub kind: &'static str,
    /// Pages sent.
    pub pages: u64,
    /// Of them, zero pages (sent as a flag).
    pub zero_pages: u64,
    /// Dirtied by the CPU (from the VMM).
    pub cpu_dirty: u64,
    /// Dirtied by the GPU (from hag's log, with the previous round's).
    pub gpu_dirty: u64,
    /// Page bytes before compression.
    pub raw_bytes: u64,
    /// Bytes on the wire (frames included).
    pub wire_bytes: u64,
    /// Milliseconds for the round.
    pub ms: f64,
    /// `--gpu-dirty hash`: pages hashed to find this round's GPU pages.
    pub hashed_pages: u64,
    /// `--gpu-dirty hash`: milliseconds spent hashing them.
    pub hash_ms: f64,
}

/// What `hagctl migrate` reports.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct MigrationReport {
    /// Target.
    pub to: String,
    /// Downtime as the source measures it: from just before it asks the
    /// VM to pause to the target's OK to COMMIT (sent after the target
    /// resumed its VM), milliseconds. It includes the pause request, the
    /// quiesce, the last round and the target's restore, plus the return
    /// of the OK (half a round trip more than the VM's real pause).
    pub downtime_ms: f64,
    /// Of which: waiting for the vGPU to go idle.
    pub quiesce_ms: f64,
    /// Rounds, the stop-and-copy one included.
    pub rounds: u32,
    /// Every round.
    pub per_round: Vec<RoundReport>,
    /// Pages sent in all.
    pub total_pages: u64,
    /// Bytes on the wire in all.
    pub total_bytes: u64,
    /// Bytes sent while the VM was paused.
    pub downtime_bytes: u64,
    /// vGPU context bytes.
    pub context_bytes: u64,
    /// VM state bytes.
    pub vm_state_bytes: u64,
    /// The workload's iteration when it was paused.
    pub paused_at_iteration: u32,
    /// hag's GPU dirty log was used.
    pub gpu_dirty: bool,
    /// Where the GPU's dirty pages came from: audit, full, hash, none.
    pub gpu_dirty_mode: GpuDirty,
    /// Pages were LZ4-compressed.
    pub compress: bool,
    /// GPU pages were sent as a full copy of what the GTT maps at stop time.
    pub gpu_full_copy: bool,
    /// With `gpu_full_copy` or hashing: guest pages the GTT mapped at stop
    /// time.
    pub gtt_pages: u64,
    /// Hashing: pages hashed in all rounds, and the milliseconds it took.
    pub hashed_pages: u64,
    /// Hashing: milliseconds.
    pub hash_ms: f64,
    /// Whole migration, milliseconds.
    pub total_ms: f64,
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

impl MigrationReport {
    /// The text form.
    pub fn text(&self) -> String {
        let mut s = format!(
            "migrated to {}: downtime {:.1} ms (quiesce {:.1} ms), {} rounds, {} pages, {} sent ({} during downtime), context {} bytes, VM state {} bytes{}\n",
            self.to,
            self.downtime_ms,
            self.quiesce_ms,
            self.rounds,
            self.total_pages,
            mib(self.total_bytes),
            mib(self.downtime_bytes),
            self.context_bytes,
            self.vm_state_bytes,
            match self.gpu_dirty_mode {
                GpuDirty::Audit => String::new(),
                GpuDirty::Full => format!(
                    " (GPU dirty log replaced by a full copy of {} GTT-mapped pages)",
                    self.gtt_pages
                ),
                GpuDirty::Hash => format!(
                    " (GPU dirty pages found by hashing {} pages in {:.1} ms)",
                    self.hashed_pages, self.hash_ms
                ),
                GpuDirty::None => " (GPU dirty log NOT used)".to_owned(),
            } + if self.compress { "" } else { ", uncompressed" }
        );
        for r in &self.per_round {
            s += &format!(
                "  round {} ({}): {} pages ({} zero; cpu {}, gpu {}), {} → {} on the wire, {:.1} ms\n",
                r.round,
                r.kind,
                r.pages,
                r.zero_pages,
                r.cpu_dirty,
                r.gpu_dirty,
                mib(r.raw_bytes),
                mib(r.wire_bytes),
                r.ms
            );
        }
        s
    }
}

/// Keepalive and a user timeout, so a dead peer is noticed.
pub(crate) fn tune(stream: &TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(60)));
    let _ = setsockopt(stream, sockopt::KeepAlive, &true);
    let _ = setsockopt(stream, sockopt::TcpKeepIdle, &5);
    let _ = setsockopt(stream, sockopt::TcpKeepInterval, &2);
    let _ = setsockopt(stream, sockopt::TcpKeepCount, &5);
    let _ = setsockopt(stream, sockopt::TcpUserTimeout, &30_000);
}

/// Connects to `to` and authenticates, retrying for `timeout` while the
/// peer cannot be reached or does not answer in time (a peer that
/// refuses the key is an answer: no retry).
pub(crate) fn secure_connect(
    to: &str,
    timeout: Duration,
    key: &Key,
) -> Result<secure::Conn, MigrateError> {
    let start = Instant::now();
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        let stream = connect(to, left)?;
        tune(&stream);
        match secure::handshake(stream, key, true) {
            Ok((r, w)) => return Ok(secure::Conn { r, w }),
            Err(e @ secure::HandshakeError::Refused(_)) => {
                return Err(MigrateError::Connect {
                    to: to.to_owned(),
                    why: e.to_string(),
                })
            }
            Err(e) if start.elapsed() >= timeout => {
                return Err(MigrateError::Connect {
                    to: to.to_owned(),
                    why: e.to_string(),
                })
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

pub(crate) fn connect(to: &str, timeout: Duration) -> Result<TcpStream, MigrateError> {
    let start = Instant::now();
    loop {
        let err = match to.to_socket_addrs() {
            Ok(addrs) => {
                let addrs: Vec<SocketAddr> = addrs.collect();
                let mut last = format!("{to} resolves to no address");
                for a in &addrs {
                    match TcpStream::connect_timeout(a, Duration::from_secs(5)) {
                        Ok(s) => return Ok(s),
                        Err(e) => last = e.to_string(),
                    }
                }
                last
            }
            Err(e) => e.to_string(),
        };
        if start.elapsed() >= timeout {
            return Err(MigrateError::Connect {
                to: to.to_owned(),
                why: format!("{err} (tried for {:.0} s)", timeout.as_secs_f64()),
            });
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The source side's live connections (also the primary's, for
/// `hagctl checkpoint`).
pub(crate) struct Source {
    pub(crate) vm: Box<dyn CopyVm>,
    pub(crate) ram: GuestRam,
    pub(crate) dev: Device,
    pub(crate) vgpu_id: u32,
    pub(crate) stream: secure::Conn,
    pub(crate) gpu_bitmap: Option<Vec<u64>>,
    pub(crate) gpu: GpuPending,
    /// COMMIT went out: from now on the target may run the VM.
    pub(crate) commit_sent: bool,
    /// `--gpu-dirty hash`: what the peer has.
    pub(crate) hashes: Option<PageHashes>,
    /// The guest pages the vGPU's GTT mapped at the last saved context
    /// (hashing looks only there once known).
    pub(crate) gtt: Option<Vec<u64>>,
    /// Hashing done since last taken.
    pub(crate) scan: Scan,
    pub(crate) paused: bool,
    pub(crate) quiesced: bool,
    pub(crate) opts: MigrateOptions,
    /// The session every connection of this pairing names.
    pub(crate) session: u128,
    /// What the peer said in its HELLO_OK.
    pub(crate) peer: Peer,
    /// A hash of each page the peer already holds (RAM_SUMS), for the
    /// first round only: it sends just the pages that differ.
    pub(crate) held: Option<Vec<u64>>,
}

/// What the receiving side said of itself in HELLO_OK.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Peer {
    /// Its generation (a backup's; 0 for a migration target).
    pub(crate) generation: u64,
    /// Its failover timeout (a backup's; zero for a migration target).
    pub(crate) timeout: Duration,
    /// The stream version it chose.
    pub(crate) version: u16,
    /// A backup's verdict on the primary's term (see `term`).
    pub(crate) superseded: Option<bool>,
    /// The witness a backup takes over with (its id), if any.
    pub(crate) witness: Option<u64>,
}

/// Dirty pages of one collection.
pub(crate) struct Dirty {
    pub(crate) pages: BTreeSet<u64>,
    pub(crate) cpu: u64,
    pub(crate) gpu: u64,
}

/// The running VM at `path`: its control connection, guest RAM, this
/// host's `/dev/hag` and the VM's vGPU id.
pub(crate) fn open_running(
    path: &std::path::Path,
) -> Result<(HagVmm, GuestRam, Device, u32), MigrateError> {
    let mut vm = HagVmm::connect(path)?;
    let state = vm.run_state()?;
    if !state.is_running() {
        return Err(MigrateError::NotRunning(state.name));
    }
    let ram = vm.guest_memory()?;
    let (_mdev, vgpu_id) = vm.client().vgpu()?;
    let dev = Device::open()?;
    dev.version()?;
    Ok((vm, ram, dev, vgpu_id))
}

impl Source {
    /// Connects to `opts.to` (retrying for `opts.connect_timeout`) to copy
    /// the VM out.
    pub(crate) fn connect(
        vm: Box<dyn CopyVm>,
        ram: GuestRam,
        dev: Device,
        vgpu_id: u32,
        opts: MigrateOptions,
        key: &Key,
    ) -> Result<Source, MigrateError> {
        let stream = secure_connect(&opts.to, opts.connect_timeout, key)?;
        let hashes = (opts.gpu_dirty == GpuDirty::Hash).then(|| PageHashes::new(ram.pages()));
        Ok(Source {
            vm,
            ram,
            dev,
            vgpu_id,
            stream,
            gpu_bitmap: None,
            gpu: GpuPending::default(),
            commit_sent: false,
            hashes,
            gtt: None,
            scan: Scan::default(),
            paused: false,
            quiesced: false,
            opts,
            session: wire::new_session(),
            peer: Peer::default(),
            held: None,
        })
    }

    pub(crate) fn send(&mut self, msg: &Msg, step: &str) -> Result<u64, MigrateError> {
        write_msg(&mut self.stream, msg)
            .map(|n| n as u64)
            .map_err(|e| MigrateError::Wire {
                step: format!("sending {} ({step})", msg.ty().name()),
                source: e.into(),
            })
    }

    pub(crate) fn send_raw(&mut self, frame: &[u8], step: &str) -> Result<u64, MigrateError> {
        use std::io::Write;
        self.stream
            .write_all(frame)
            .map(|()| frame.len() as u64)
            .map_err(|e| MigrateError::Wire {
                step: format!("sending ({step})"),
                source: e.into(),
            })
    }

    pub(crate) fn expect_ok(&mut self, step: &str, phase: u32) -> Result<(), MigrateError> {
        let (msg, _) = read_msg(&mut self.stream).map_err(|source| MigrateError::Wire {
            step: format!("waiting for the target's OK ({step})"),
            source,
        })?;
        match msg {
            Msg::Ok { phase: p } if p == phase => Ok(()),
            Msg::Error { message } => Err(MigrateError::Refused {
                step: step.to_owned(),
                message,
            }),
            other => Err(MigrateError::Unexpected {
                step: step.to_owned(),
                got: format!("{other:?}").chars().take(80).collect(),
                want: "OK",
            }),
        }
    }

    /// Reads and clears both dirty logs; adds the previous round's GPU
    /// pages (see the module docs).
    pub(crate) fn collect(&mut self) -> Result<Dirty, MigrateError> {
        let cpu_words = self.vm.cpu_dirty_log()?;
        let cpu: BTreeSet<u64> = bitmap_pages(&cpu_words).collect();
        let mut gpu = BTreeSet::new();
        let limit = self.ram.pages();
        if let Some(bitmap) = &mut self.gpu_bitmap {
            bitmap.fill(0);
            self.dev.dirty_read_clear(self.vgpu_id, bitmap)?;
            gpu = bitmap_pages(bitmap).collect();
        }
        if let Some(hashes) = &self.hashes {
            // Pages the CPU dirtied are sent anyway: hash only the rest.
            let candidates: Vec<u64> = match &self.gtt {
                Some(mapped) => mapped.iter().copied().filter(|&p| p < limit).collect(),
                None => (0..limit).collect(),
            };
            let candidates = candidates.into_iter().filter(|p| !cpu.contains(p));
            gpu = hashes
                .changed_in(&self.ram, candidates, &mut self.scan)?
                .into_iter()
                .collect();
        }
        let mut pages: BTreeSet<u64> = cpu.union(&gpu).copied().collect();
        let (cpu_n, gpu_n) = (cpu.len() as u64, gpu.len() as u64);
        // Only the audited log marks pages before they are written.
        if self.gpu_bitmap.is_some() {
            pages.extend(self.gpu.note(gpu));
        }
        pages.retain(|&p| p < limit);
        Ok(Dirty {
            pages,
            cpu: cpu_n,
            gpu: gpu_n,
        })
    }

    /// Sends `pages` as round `round` and its ROUND_END.
    fn send_round(
        &mut self,
        round: u32,
        pages: impl IntoIterator<Item = u64>,
        report: &mut RoundReport,
    ) -> Result<(), MigrateError> {
        let started = Instant::now();
        let mut batch = Vec::with_capacity(PAGES_PER_FRAME);
        let mut raw = vec![0u8; PAGES_PER_FRAME * PAGE];
        let (mut frame, mut scratch) = (Vec::new(), wire::PageScratch::default());
        let mut count = 0u64;
        let mut pages = pages.into_iter().peekable();
        while pages.peek().is_some() {
            batch.clear();
            // The buffer first: a full one takes no page from `pages`.
            for (buf, p) in raw.chunks_exact_mut(PAGE).zip(pages.by_ref()) {
                self.ram.read(p * PAGE_SIZE, buf)?;
                if let Some(h) = &mut self.hashes {
                    h.record(p, buf);
                }
                batch.push(p);
            }
            count += batch.len() as u64;
            let encoded = wire::encode_pages_frame(
                round,
                &batch,
                &raw[..batch.len() * PAGE],
                self.opts.compress,
                None,
                &mut frame,
                &mut scratch,
            );
            report.zero_pages += encoded.zero;
            if round == 0
                && pages.peek().is_none()
                && self.opts.inject_fault == Some(Fault::CorruptPage)
            {
                // The last byte is page data (or a page header): the
                // frame's CRC no longer matches.
                if let Some(b) = frame.last_mut() {
                    *b ^= 0x5a;
                }
                info!("injecting a fault: one byte of the last PAGES frame of round 0 flipped");
                report.wire_bytes += self.send_raw(&frame, "round 0 (corrupt-page)")?;
                continue;
            }
            report.wire_bytes += self.send_raw(&frame, &format!("round {round}"))?;
            if let Some(rate) = self.opts.bandwidth {
                // --bandwidth: never ahead of RATE bytes per second.
                let due = Duration::from_secs_f64(report.wire_bytes as f64 / rate.max(1) as f64);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
        }
        report.pages = count;
        report.raw_bytes = count * PAGE_SIZE;
        report.wire_bytes += self.send(
            &Msg::RoundEnd {
                round,
                pages: count,
            },
            &format!("round {round}"),
        )?;
        Ok(())
    }

    pub(crate) fn progress(r: &RoundReport) {
        progress!(
            "round {}: {} pages, {} → {} compressed",
            r.round,
            r.pages,
            mib(r.raw_bytes),
            mib(r.wire_bytes)
        );
    }

    fn run(&mut self, report: &mut MigrationReport) -> Result<(), MigrateError> {
        let start = Instant::now();
        self.handshake(None, None)?;
        if self.opts.gpu_dirty == GpuDirty::Audit {
            self.start_gpu_log()?;
        }
        let (round, pending, pending_counts) = self.precopy(report)?;
        self.stop_and_copy(round, pending, pending_counts, report, start)
    }

    /// Starts hag's GPU dirty log over all of guest RAM.
    pub(crate) fn start_gpu_log(&mut self) -> Result<(), MigrateError> {
        let ram_size = self.ram.size();
        self.dev.dirty_start(self.vgpu_id, 0, ram_size)?;
        self.gpu_bitmap = Some(vec![0; bitmap_words(ram_size)]);
        Ok(())
    }

    /// HELLO (with a protecting primary's `term` and its VM's `shape`),
    /// and the target's HELLO_OK.
    pub(crate) fn handshake(
        &mut self,
        term: Option<Term>,
        shape: Option<&VmShape>,
    ) -> Result<(), MigrateError> {
        let ram_size = self.ram.size();
        self.send(
            &Msg::Hello {
                min: VERSION_MIN,
                max: VERSION_MAX,
                ram_size,
                session: self.session,
                vmm: self.vm.kind(),
                term,
                shape: shape.cloned(),
            },
            "handshake",
        )?;
        let (msg, _) = read_msg(&mut self.stream).map_err(|source| MigrateError::Wire {
            step: "waiting for the target's HELLO_OK".into(),
            source,
        })?;
        match msg {
            Msg::HelloOk {
                version,
                generation,
                timeout_ms,
                superseded,
                witness,
            } if (VERSION_MIN..=VERSION_MAX).contains(&version) => {
                self.peer = Peer {
                    generation,
                    timeout: Duration::from_millis(u64::from(timeout_ms)),
                    version,
                    superseded,
                    witness,
                };
            }
            Msg::Error { message } => {
                return Err(MigrateError::Refused {
                    step: "the handshake".into(),
                    message,
                })
            }
            other => {
                return Err(MigrateError::Unexpected {
                    step: "handshake".into(),
                    got: format!("{other:?}"),
                    want: "HELLO_OK",
                })
            }
        }
        Ok(())
    }

    /// Pre-copy rounds while the VM runs, until a round would send at most
    /// `threshold_pages` or the next round is the last allowed. Returns the
    /// next round's number, its pages and their (CPU, GPU) counts: what
    /// the stop-and-copy round sends.
    #[allow(clippy::type_complexity)]
    pub(crate) fn precopy(
        &mut self,
        report: &mut MigrationReport,
    ) -> Result<(u32, BTreeSet<u64>, (u64, u64)), MigrateError> {
        // Round 0: clear the logs first, so every later write is seen.
        let _ = self.collect()?;
        self.gpu.clear();
        let mut round = 0u32;
        let mut pending: BTreeSet<u64> = BTreeSet::new();
        let mut pending_counts = (0, 0);
        let mut first = true;
        loop {
            let t = Instant::now();
            let mut r = RoundReport {
                round,
                kind: "precopy",
                ..RoundReport::default()
            };
            if first {
                let pages = match self.held.take() {
                    Some(held) => self.differing(&held)?,
                    None => {
                        let mut nonzero = Vec::new();
                        for p in 0..self.ram.pages() {
                            if !self.ram.page_is_zero(p)? {
                                nonzero.push(p);
                            }
                        }
                        nonzero
                    }
                };
                self.send_round(round, pages, &mut r)?;
                first = false;
            } else {
                (r.cpu_dirty, r.gpu_dirty) = pending_counts;
                let pages = std::mem::take(&mut pending);
                self.send_round(round, pages, &mut r)?;
            }
            self.expect_ok(&format!("round {round}"), round)?;
            r.ms = t.elapsed().as_secs_f64() * 1e3;
            Self::progress(&r);
            report.per_round.push(r);
            round += 1;
            let d = self.collect()?;
            if let Some(last) = report.per_round.last_mut() {
                // The scan that found the next round's pages: counted with
                // the round it fed, as the stop-and-copy's is.
                let scan = std::mem::take(&mut self.scan);
                last.hashed_pages += scan.hashed;
                last.hash_ms += scan.ms;
            }
            pending_counts = (d.cpu, d.gpu);
            pending = d.pages;
            if self.stopped() {
                return Err(MigrateError::Cancelled);
            }
            let rate = report.per_round.last().map_or(0.0, |r| {
                let measured = r.wire_bytes as f64 / (r.ms / 1e3).max(1e-3);
                let raw = r.raw_bytes.max(1) as f64 / r.wire_bytes.max(1) as f64;
                // Pages per second at the wire rate (compression counted),
                // capped by --bandwidth.
                let wire = self
                    .opts
                    .bandwidth
                    .map_or(measured, |b| measured.min(b as f64));
                wire * raw
            });
            // The stop-and-copy round counts toward --max-rounds.
            let limits = (
                self.opts.threshold_pages,
                self.opts.max_downtime,
                self.opts.max_rounds,
            );
            if converged(pending.len() as u64, rate, limits, round) {
                return Ok((round, pending, pending_counts));
            }
        }
    }

    /// The pages whose hash differs from `held`'s (the peer's), with how
    /// many it held already and what a full copy (every non-zero page)
    /// would have sent, said once.
    fn differing(&mut self, held: &[u64]) -> Result<Vec<u64>, MigrateError> {
        let t = Instant::now();
        let mut page = [0u8; PAGE];
        let mut differ = Vec::new();
        let mut nonzero = 0u64;
        for (p, h) in held.iter().enumerate() {
            self.ram.read(p as u64 * PAGE_SIZE, &mut page)?;
            nonzero += u64::from(page.iter().any(|&b| b != 0));
            if crate::pagehash::page_hash(&page) != *h {
                differ.push(p as u64);
            }
        }
        info!(
            "the peer holds {} of {} pages already (hashes compared in {:.0} ms): {} to send, where a full copy sends {nonzero}",
            held.len() - differ.len(),
            held.len(),
            t.elapsed().as_secs_f64() * 1e3,
            differ.len()
        );
        Ok(differ)
    }

    fn stop_and_copy(
        &mut self,
        round: u32,
        mut pages: BTreeSet<u64>,
        (mut cpu, mut gpu): (u64, u64),
        report: &mut MigrationReport,
        start: Instant,
    ) -> Result<(), MigrateError> {
        let paused_at = Instant::now();
        report.paused_at_iteration = self.vm.pause_at()?;
        self.paused = true;
        let tq = Instant::now();
        match self.dev.quiesce(self.vgpu_id, self.opts.quiesce_timeout_ms) {
            Ok(()) => self.quiesced = true,
            Err(e) if e.errno() == nix::errno::Errno::ETIMEDOUT => {
                return Err(MigrateError::QuiesceTimeout {
                    ms: self.opts.quiesce_timeout_ms,
                    errno: e.errno(),
                })
            }
            Err(e) => return Err(e.into()),
        }
        report.quiesce_ms = tq.elapsed().as_secs_f64() * 1e3;
        // The vGPU is idle: its context (and GTT) no longer changes.
        let context = self.dev.save_context(self.vgpu_id)?;
        hag_abi::snapshot::Snapshot::parse(&context).map_err(MigrateError::BadContext)?;
        if matches!(self.opts.gpu_dirty, GpuDirty::Full | GpuDirty::Hash) {
            let mapped = gtt_guest_pages(&context).map_err(MigrateError::BadContext)?;
            report.gtt_pages = mapped.len() as u64;
            self.gtt = Some(mapped);
        }
        let d = self.collect()?;
        pages.extend(d.pages);
        // The vGPU is idle: every page marked since pre-copy began holds
        // its final bytes now.
        pages.extend(
            self.gpu
                .settle()
                .into_iter()
                .filter(|&p| p < self.ram.pages()),
        );
        cpu += d.cpu;
        gpu += d.gpu;
        if self.opts.gpu_dirty == GpuDirty::Full {
            let limit = self.ram.pages();
            let mapped = self.gtt.as_deref().unwrap_or_default();
            gpu = mapped.len() as u64;
            pages.extend(mapped.iter().copied().filter(|&p| p < limit));
        }
        let scan = std::mem::take(&mut self.scan);
        let mut r = RoundReport {
            round,
            kind: "stop-copy",
            cpu_dirty: cpu,
            gpu_dirty: gpu,
            hashed_pages: scan.hashed,
            hash_ms: scan.ms,
            ..RoundReport::default()
        };
        self.send_round(round, pages, &mut r)?;
        let state = self.vm.vm_state()?;
        report.context_bytes = context.len() as u64;
        report.vm_state_bytes = state.len() as u64;
        if self.opts.inject_fault == Some(Fault::TruncateContext) {
            let frame = wire::encode_frame(&Msg::Context(context));
            let half = frame.len() / 2;
            info!(
                "injecting a fault: CONTEXT frame cut after {half} of {} bytes",
                frame.len()
            );
            self.send_raw(&frame[..half], "stop-and-copy (truncate-context)")?;
            self.stream.w.shutdown_write();
            // The round's OK, then the target must refuse: its ERROR (or
            // its closing the connection) ends this migration.
            self.expect_ok(&format!("round {round}"), round)?;
            self.expect_ok("stop-and-copy (truncated CONTEXT)", COMMIT_PHASE)?;
            return Err(MigrateError::Unexpected {
                step: "stop-and-copy (truncated CONTEXT)".into(),
                got: "OK to COMMIT".into(),
                want: "ERROR",
            });
        }
        r.wire_bytes += self.send(&Msg::Context(context), "stop-and-copy")?;
        r.wire_bytes += self.send(&Msg::VmState(state), "stop-and-copy")?;
        // While paused, a stalled target is given up on at once, not
        // after a per-read timeout.
        self.stream
            .r
            .set_deadline(Some(Instant::now() + PAUSED_REPLY_DEADLINE));
        self.expect_ok(&format!("round {round}"), round)?;
        // The last moment a Ctrl-C can leave the VM here.
        if self.stopped() {
            return Err(MigrateError::Cancelled);
        }
        self.commit_sent = true;
        r.wire_bytes += self.send(&Msg::Commit, "stop-and-copy")?;
        self.stream
            .r
            .set_deadline(Some(Instant::now() + PAUSED_REPLY_DEADLINE));
        self.expect_ok("commit (restore and resume on the target)", COMMIT_PHASE)?;
        self.stream.r.set_deadline(None);
        report.downtime_ms = paused_at.elapsed().as_secs_f64() * 1e3;
        r.ms = report.downtime_ms;
        Self::progress(&r);
        report.downtime_bytes = r.wire_bytes;
        report.per_round.push(r);
        report.rounds = round + 1;
        report.total_pages = report.per_round.iter().map(|r| r.pages).sum();
        report.total_bytes = report.per_round.iter().map(|r| r.wire_bytes).sum();
        report.hashed_pages = report.per_round.iter().map(|r| r.hashed_pages).sum();
        report.hash_ms = report.per_round.iter().map(|r| r.hash_ms).sum();
        report.total_ms = start.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    fn stopped(&self) -> bool {
        self.opts
            .stop
            .as_ref()
            .is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// After a failure: resume what was stopped, tell the target.
    fn roll_back(&mut self, why: &str) -> Vec<String> {
        let mut problems = Vec::new();
        let _ = write_msg(
            &mut self.stream,
            &Msg::Abort {
                reason: why.to_owned(),
            },
        );
        if self.quiesced {
            if let Err(e) = self.dev.resume(self.vgpu_id) {
                problems.push(format!("cannot resume the vGPU: {e}"));
            }
        }
        if self.paused {
            if let Err(e) = self.vm.resume() {
                problems.push(format!("cannot resume the VM: {e}"));
            }
        }
        problems
    }
}

/// `hagctl migrate`.
pub fn migrate(opts: &MigrateOptions) -> anyhow::Result<MigrationReport> {
    let key = Key::load(&opts.key)?;
    let (vm, ram, dev, vgpu_id) = open_running(&opts.vm)?;
    let mut src = Source::connect(Box::new(vm), ram, dev, vgpu_id, opts.clone(), &key)?;
    let mut report = MigrationReport {
        to: opts.to.clone(),
        gpu_dirty: opts.gpu_dirty == GpuDirty::Audit,
        gpu_dirty_mode: opts.gpu_dirty,
        compress: opts.compress,
        gpu_full_copy: opts.gpu_dirty == GpuDirty::Full,
        ..MigrationReport::default()
    };
    let result = src.run(&mut report);
    if src.gpu_bitmap.is_some() {
        let _ = src.dev.dirty_stop(vgpu_id);
    }
    match result {
        Ok(()) => {
            // The VM runs on the target now: stop this copy.
            src.vm.quit()?;
            Ok(report)
        }
        Err(e) => {
            let why = e.to_string();
            let outcome = if !src.commit_sent {
                CommitOutcome::NotSent
            } else if matches!(e, MigrateError::Refused { .. }) {
                CommitOutcome::Refused
            } else {
                CommitOutcome::Unknown
            };
            if source_after(outcome) == "stay-paused" {
                // The target may run the VM: never resume this copy.
                return Err(anyhow::Error::new(e).context(
                    "the commit's outcome is unknown: the source VM stays paused (it may be running on the target: check there, then quit or resume this one)",
                ));
            }
            let problems = src.roll_back(&why);
            let err = anyhow::Error::new(e).context(if problems.is_empty() {
                "migration failed; the source VM keeps running".to_owned()
            } else {
                format!("migration failed, and then: {}", problems.join("; "))
            });
            Err(err)
        }
    }
}

/// Options of `hagctl receive`.
#[derive(Clone, Debug)]
pub struct ReceiveOptions {
    /// `ADDR:PORT` to listen on.
    pub listen: String,
    /// The incoming VM's control socket.
    pub vm: PathBuf,
    /// The pre-shared key file both hosts hold.
    pub key: PathBuf,
}

/// What `hagctl receive` reports.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ReceiveReport {
    /// The source's address.
    pub from: String,
    /// Counters.
    #[serde(flatten)]
    pub received: Received,
    /// Bytes read.
    pub bytes: u64,
    /// Resumed here.
    pub resumed: bool,
}

impl ReceiveReport {
    /// The text form.
    pub fn text(&self) -> String {
        format!(
            "received from {}: {} rounds, {} pages ({} zero), {} read, context {} bytes, VM state {} bytes; VM resumed here\n",
            self.from,
            self.received.rounds,
            self.received.pages,
            self.received.zero_pages,
            mib(self.bytes),
            self.received.context_bytes,
            self.received.vm_state_bytes
        )
    }
}

/// An incoming VM being filled (also the backup's, at takeover).
pub(crate) struct IncomingVm {
    pub(crate) vm: VmClient,
    pub(crate) ram: GuestRam,
    pub(crate) dev: Device,
    pub(crate) vgpu_id: u32,
}

impl IncomingVm {
    /// Adds this host's `/dev/hag` and the VM's vGPU to the VM and its RAM.
    pub(crate) fn open(mut vm: VmClient, ram: GuestRam) -> anyhow::Result<IncomingVm> {
        let (_mdev, vgpu_id) = vm.vgpu()?;
        let dev = Device::open()?;
        dev.version()?;
        Ok(IncomingVm {
            vm,
            ram,
            dev,
            vgpu_id,
        })
    }
}

impl Target for IncomingVm {
    fn ram_size(&self) -> u64 {
        self.ram.size()
    }

    fn write_page(&mut self, index: u64, bytes: &[u8; PAGE]) -> Result<(), String> {
        self.ram
            .write(index * PAGE_SIZE, bytes)
            .map_err(|e| e.to_string())
    }

    fn commit(&mut self, context: &[u8], vm_state: &[u8]) -> Result<(), String> {
        self.prepare(context, vm_state)?;
        self.resume()
    }
}

impl IncomingVm {
    /// Restores the vGPU context and sets the VM state; nothing runs yet.
    pub(crate) fn prepare(&mut self, context: &[u8], vm_state: &[u8]) -> Result<(), String> {
        self.dev
            .restore_context(self.vgpu_id, context)
            .map_err(|e| format!("restoring the vGPU context: {e}"))?;
        self.vm.set_state(vm_state).map_err(|e| e.to_string())
    }

    /// Resumes the vGPU and the VM.
    pub(crate) fn resume(&mut self) -> Result<(), String> {
        self.dev
            .resume(self.vgpu_id)
            .map_err(|e| format!("resuming the vGPU: {e}"))?;
        self.vm.resume().map_err(|e| e.to_string())
    }
}

/// `hagctl receive`.
pub fn receive(opts: &ReceiveOptions) -> anyhow::Result<ReceiveReport> {
    let mut vm = HagVmm::connect(&opts.vm)?;
    let state = vm.run_state()?;
    if state.kind != RunKind::Incoming {
        anyhow::bail!(
            "the VM at {} is {}, not incoming (start it with hag-vmm serve --incoming)",
            opts.vm.display(),
            state
        );
    }
    let ram = vm.guest_memory()?;
    let mut target = IncomingVm::open(vm.into_client(), ram)?;
    let key = Key::load(&opts.key)?;
    let listener = TcpListener::bind(&opts.listen)
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", opts.listen))?;
    info!("waiting for a migration on {}", opts.listen);
    // The first peer that authenticates: a port scan or a peer without
    // the key is refused and logged, and the wait goes on.
    let (mut stream, from) = loop {
        let (tcp, from) = listener
            .accept()
            .map_err(|e| anyhow::anyhow!("accept on {}: {e}", opts.listen))?;
        tune(&tcp);
        match secure::handshake(tcp, &key, false) {
            Ok((r, w)) => break (secure::Conn { r, w }, from),
            Err(e) => info!("refused a connection from {from}: {e}"),
        }
    };
    // A whole message must arrive within this, however it trickles.
    stream.r.set_idle_timeout(Some(Duration::from_secs(60)));
    info!("migration from {from}");
    let mut report = ReceiveReport {
        from: from.to_string(),
        ..ReceiveReport::default()
    };
    let mut state = Receiver::AwaitHello;
    let result: Result<(), String> = loop {
        let msg = match read_msg(&mut stream) {
            Ok((msg, n)) => {
                report.bytes += n as u64;
                msg
            }
            Err(e) => {
                let why = format!("reading the stream: {e}");
                // Best effort: the source may have gone already.
                let _ = write_msg(
                    &mut stream,
                    &Msg::Error {
                        message: why.clone(),
                    },
                );
                break Err(why);
            }
        };
        match state.on(msg, &mut target, &mut report.received) {
            Ok((next, reply)) => {
                state = next;
                if let Some(reply) = reply {
                    if let Err(e) = write_msg(&mut stream, &reply) {
                        if matches!(state, Receiver::Done) {
                            // The VM runs here already; the source will
                            // not see the OK and resumes its own copy.
                            warning!("the commit's OK did not reach the source: {e}");
                        } else {
                            break Err(format!("sending {}: {e}", reply.ty().name()));
                        }
                    }
                }
                if matches!(state, Receiver::Done) {
                    break Ok(());
                }
            }
            Err(e) => {
                let tell = !matches!(e, ReceiveError::Aborted(_) | ReceiveError::SourceError(_));
                if tell {
                    let _ = write_msg(
                        &mut stream,
                        &Msg::Error {
                            message: e.to_string(),
                        },
                    );
                }
                break Err(e.to_string());
            }
        }
    };
    match result {
        Ok(()) => {
            report.resumed = true;
            Ok(report)
        }
        Err(why) => {
            let discarded = match target.vm.quit() {
                Ok(()) => "the incoming VM was discarded".to_owned(),
                Err(e) => format!("and discarding the incoming VM failed too: {e}"),
            };
            anyhow::bail!("migration from {from} failed: {why}; {discarded}")
        }
    }
}

#[cfg(test)]
mod policy_tests {
    use super::*;

    /// Issue 12, item 6: a page the GPU log marked once, long before the
    /// stop, is sent again once the vGPU is quiesced.
    #[test]
    fn a_page_marked_early_is_sent_again_after_the_quiesce() {
        let mut g = GpuPending::default();
        let set = |v: &[u64]| v.iter().copied().collect::<BTreeSet<u64>>();
        assert!(g.note(set(&[7])).is_empty());
        assert_eq!(g.note(set(&[9])), set(&[7]), "the next round resends it");
        assert_eq!(g.note(set(&[])), set(&[9]));
        // Rounds later the submission that marked page 7 wrote it; the log
        // says nothing more. The quiesce settles it.
        assert_eq!(g.settle(), set(&[7, 9]));
        assert!(g.settle().is_empty());
    }

    /// Issue 12, item 10: the convergence rule.
    #[test]
    fn convergence_follows_downtime_bandwidth_and_limits() {
        let ms = Duration::from_millis;
        // 1000 pages (4 MiB) at 40 MiB/s: 100 ms.
        let rate = 40.0 * f64::from(1 << 20);
        assert!(converged(1000, rate, (10, ms(300), 30), 1));
        assert!(!converged(1000, rate, (10, ms(50), 30), 1));
        // The threshold and the round limit decide on their own.
        assert!(converged(10, 0.0, (10, ms(0), 30), 1));
        assert!(converged(5000, 0.0, (10, ms(0), 3), 2));
        // No measurement yet: keep copying.
        assert!(!converged(5000, 0.0, (10, ms(300), 30), 1));
    }

    /// Issue 12, item 4: after COMMIT went out, the source resumes only on
    /// the target's refusal; in doubt it stays paused.
    #[test]
    fn the_source_never_resumes_in_doubt() {
        assert_eq!(source_after(CommitOutcome::NotSent), "resume");
        assert_eq!(source_after(CommitOutcome::Refused), "resume");
        assert_eq!(source_after(CommitOutcome::Unknown), "stay-paused");
    }
}

#[cfg(test)]
mod full_copy_tests {
    use super::*;
    use hag_abi::sim_regs::{GTT_ADDR_MASK, GTT_PRESENT};
    use hag_abi::snapshot::{Writer, TAG_CONFIG, TAG_GTT};

    #[test]
    fn gtt_guest_pages_lists_present_entries_once() {
        let ptes: [u64; 5] = [
            (7 * PAGE_SIZE) | GTT_PRESENT,
            (3 * PAGE_SIZE) | GTT_PRESENT,
            9 * PAGE_SIZE, // not present
            (7 * PAGE_SIZE) | GTT_PRESENT,
            (GTT_ADDR_MASK & (1 << 38)) | GTT_PRESENT,
        ];
        let mut buf = vec![0u8; 512];
        let mut w = Writer::new(&mut buf, 1, 64 << 20).unwrap();
        w.section(TAG_CONFIG, 16, |b| b.fill(1)).unwrap();
        w.section(TAG_GTT, ptes.len() * 8, |b| {
            for (i, p) in ptes.iter().enumerate() {
                b[i * 8..i * 8 + 8].copy_from_slice(&p.to_le_bytes());
            }
        })
        .unwrap();
        let n = w.finish();
        buf.truncate(n);
        assert_eq!(
            gtt_guest_pages(&buf).unwrap(),
            vec![3, 7, (1 << 38) / PAGE_SIZE]
        );
        buf[40] ^= 1;
        assert!(gtt_guest_pages(&buf).is_err());
    }
}
