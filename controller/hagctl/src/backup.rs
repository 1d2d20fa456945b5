//! `hagctl backup`: the standby side of continuous checkpointing.
//!
//! It accepts a primary's `hagctl checkpoint` (two TCP connections: the
//! checkpoint stream of [`crate::wire`] and a control connection with
//! heartbeats), keeps a standby image (guest RAM in a memfd of its own, the
//! last acknowledged vGPU context and VM state) and acknowledges each epoch
//! only once it is applied. It does not run the VM. It takes over when the
//! primary forwards a vGPU hang (HANG) or goes silent past
//! `--failover-timeout`: it starts `hag-vmm serve --incoming` on its own
//! vGPU, fills its RAM from the image, restores the context and VM state,
//! resumes it and reports the takeover time. Each takeover raises the
//! generation; the primary, told the new one, stops its VM.
//!
//! Heartbeats may come over several paths (`--heartbeat-listen`: more
//! listeners, on other networks): the backup takes over on silence only when
//! every path is silent. A primary still heard on another path while its
//! checkpoint stream (the data link) is down is alive and unprotected: the
//! backup waits for it to reconnect and resynchronise.
//!
//! [`Standby`] (the stream's state machine) and [`decide`] (when to take
//! over) are pure and unit-tested; [`backup`] wires them to sockets, a
//! clock and the VMM.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hag_vmm::control::VmClient;
use hag_vmm::ram::PAGE_SIZE;

use crate::migrate::{tune, IncomingVm};
#[cfg(test)]
use crate::wire::PageData;
use crate::wire::{
    check_context, check_hello, read_msg, write_msg, Msg, Round, Sides, Target, PAGE,
};

/// `hagctl checkpoint` → `hagctl backup`.
const CHECKPOINT: Sides = Sides {
    peer: "primary",
    us: "backup",
    ram: "the standby image",
};

/// Heartbeat period, both ways.
pub const HEARTBEAT: Duration = Duration::from_millis(200);

/// Where the standby writes pages.
pub trait Image {
    /// Guest RAM bytes.
    fn ram_size(&self) -> u64;
    /// Writes page `index`.
    fn write_page(&mut self, index: u64, bytes: &[u8; PAGE]) -> Result<(), String>;
    /// Whether page `index` now holds other bytes than `bytes` (for the
    /// count of pages an epoch really changed; unknown counts as changed).
    fn differs(&self, _index: u64, _bytes: &[u8; PAGE]) -> bool {
        true
    }
}

/// The standby image's guest RAM: a memfd of the backup's own, written
/// and read by offset.
pub struct StandbyRam {
    file: std::fs::File,
    size: u64,
    /// Pages ever written (the rest are zero): what a takeover copies.
    written: Vec<u64>,
}

impl StandbyRam {
    /// `size` bytes of zeroes.
    pub fn new(size: u64) -> std::io::Result<Self> {
        use nix::sys::memfd::{memfd_create, MFdFlags};
        let fd = memfd_create(c"hag-standby-ram", MFdFlags::MFD_CLOEXEC)?;
        let file = std::fs::File::from(fd);
        file.set_len(size)?;
        Ok(StandbyRam {
            file,
            size,
            written: vec![0; hag_dev::bitmap_words(size)],
        })
    }

    /// Bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The pages ever written, ascending.
    pub fn written(&self) -> impl Iterator<Item = u64> + '_ {
        hag_dev::bitmap_pages(&self.written)
    }

    /// Reads bytes at `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.file, buf, offset)
    }
}

impl Image for StandbyRam {
    fn ram_size(&self) -> u64 {
        self.size
    }
    fn write_page(&mut self, index: u64, bytes: &[u8; PAGE]) -> Result<(), String> {
        std::os::unix::fs::FileExt::write_all_at(&self.file, bytes, index * PAGE_SIZE)
            .map_err(|e| format!("standby image: {e}"))?;
        if let Some(w) = self.written.get_mut((index / 64) as usize) {
            *w |= 1 << (index % 64);
        }
        Ok(())
    }
    fn differs(&self, index: u64, bytes: &[u8; PAGE]) -> bool {
        let mut old = [0u8; PAGE];
        self.read_at(index * PAGE_SIZE, &mut old).is_err() || old != *bytes
    }
}

/// A checkpoint the backup acknowledged: with the standby image's pages,
/// what a takeover resumes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    /// Epoch number.
    pub epoch: u64,
    /// Generation it was taken in.
    pub generation: u64,
    /// vGPU context snapshot.
    pub context: Vec<u8>,
    /// VM state.
    pub vm_state: Vec<u8>,
}

/// Why a checkpoint session ended.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StandbyError {
    /// A message out of turn.
    #[error("unexpected {got} while {state}")]
    Unexpected {
        /// Its type.
        got: &'static str,
        /// The state.
        state: &'static str,
    },
    /// Wrong contents.
    #[error("{0}")]
    Invalid(String),
    /// The primary is of an older generation: a takeover happened since.
    #[error("stale primary: generation {theirs}, but this backup is at generation {ours} (it took over); stop that VM")]
    Stale {
        /// The primary's.
        theirs: u64,
        /// Ours.
        ours: u64,
    },
    /// The primary ended protection (ABORT).
    #[error("the primary ended protection: {0}")]
    Ended(String),
    /// The primary reported an error.
    #[error("the primary failed: {0}")]
    PrimaryError(String),
}

#[derive(Debug)]
enum Phase {
    AwaitHello,
    Rounds(Round),
    GotContext {
        round: u32,
        context: Vec<u8>,
    },
    GotState {
        round: u32,
        context: Vec<u8>,
        vm_state: Vec<u8>,
    },
}

impl Phase {
    fn name(&self) -> &'static str {
        match self {
            Phase::AwaitHello => "waiting for HELLO",
            Phase::Rounds(_) => "receiving pages",
            Phase::GotContext { .. } => "waiting for VM_STATE after CONTEXT",
            Phase::GotState { .. } => "waiting for EPOCH_END",
        }
    }
}

/// Counters of the standby.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StandbyStats {
    /// Epochs applied.
    pub epochs: u64,
    /// Page records received.
    pub pages: u64,
    /// Pages staged and applied at an EPOCH_END.
    pub staged_applied: u64,
    /// The last applied epoch's pages, and how many of them changed the
    /// image (the rest were sent but held the same bytes).
    pub last_epoch_pages: u64,
    /// Changed pages of the last applied epoch.
    pub last_epoch_changed: u64,
}

/// The backup's side of the checkpoint stream.
///
/// Until the first epoch is applied, pages go straight into the image (there
/// is no checkpoint to protect yet). From then on, pages are staged and
/// written only when their epoch's EPOCH_END arrives, so the image always
/// holds exactly the last acknowledged checkpoint — also across a new
/// session (a primary that reconnects resends everything while the old
/// checkpoint stays valid).
#[derive(Debug)]
pub struct Standby {
    phase: Phase,
    staged: BTreeMap<u64, Box<[u8; PAGE]>>,
    last_epoch_in_session: u64,
    /// A new session over an existing checkpoint: its first epoch replaces
    /// the whole image (pages it does not send are zero).
    resync: bool,
    /// The last acknowledged checkpoint.
    pub committed: Option<Checkpoint>,
    /// This backup's generation (raised by each takeover).
    pub generation: u64,
    /// Counters.
    pub stats: StandbyStats,
}

impl Standby {
    /// A standby at `generation` with no checkpoint.
    pub fn new(generation: u64) -> Self {
        Standby {
            phase: Phase::AwaitHello,
            staged: BTreeMap::new(),
            last_epoch_in_session: 0,
            resync: false,
            committed: None,
            generation,
            stats: StandbyStats::default(),
        }
    }

    /// A new connection from a primary: back to HELLO; an unfinished
    /// epoch is dropped (the checkpoint stays).
    pub fn new_session(&mut self) {
        self.phase = Phase::AwaitHello;
        self.staged.clear();
        self.last_epoch_in_session = 0;
        self.resync = self.committed.is_some();
    }

    /// Drops the checkpoint (protection ended).
    pub fn discard(&mut self) {
        self.committed = None;
        self.new_session();
    }

    /// Applies one message of the checkpoint stream; returns the reply.
    pub fn on(&mut self, msg: Msg, image: &mut impl Image) -> Result<Option<Msg>, StandbyError> {
        let phase = std::mem::replace(&mut self.phase, Phase::AwaitHello);
        let (next, reply) = self.step(phase, msg, image)?;
        self.phase = next;
        Ok(reply)
    }

    fn step(
        &mut self,
        phase: Phase,
        msg: Msg,
        image: &mut impl Image,
    ) -> Result<(Phase, Option<Msg>), StandbyError> {
        match (phase, msg) {
            (_, Msg::Abort { reason }) => Err(StandbyError::Ended(reason)),
            (_, Msg::Error { message }) => Err(StandbyError::PrimaryError(message)),
            (Phase::AwaitHello, Msg::Hello { min, max, ram_size }) => {
                let version = check_hello(CHECKPOINT, (min, max, ram_size), image.ram_size())
                    .map_err(StandbyError::Invalid)?;
                Ok((Phase::Rounds(Round::FIRST), Some(Msg::HelloOk { version })))
            }
            (Phase::Rounds(at), Msg::Pages { round, pages }) => {
                // Until the first checkpoint, pages go straight into the image.
                let staging = self.committed.is_some();
                let ram_size = image.ram_size();
                let at = at
                    .on_pages(round, &pages, ram_size, |index, _, buf| {
                        if staging {
                            self.staged.insert(index, Box::new(*buf));
                        } else {
                            image.write_page(index, buf)?;
                        }
                        self.stats.pages += 1;
                        Ok(())
                    })
                    .map_err(StandbyError::Invalid)?;
                Ok((Phase::Rounds(at), None))
            }
            (Phase::Rounds(at), Msg::RoundEnd { round, pages }) => {
                let next = at.on_end(round, pages).map_err(StandbyError::Invalid)?;
                Ok((Phase::Rounds(next), Some(Msg::Ok { phase: at.round })))
            }
            (Phase::Rounds(Round { round, pages: 0 }), Msg::Context(context)) => {
                check_context(&context).map_err(StandbyError::Invalid)?;
                Ok((Phase::GotContext { round, context }, None))
            }
            (Phase::GotContext { round, context }, Msg::VmState(vm_state)) => Ok((
                Phase::GotState {
                    round,
                    context,
                    vm_state,
                },
                None,
            )),
            (
                Phase::GotState {
                    round,
                    context,
                    vm_state,
                },
                Msg::EpochEnd { epoch, generation },
            ) => {
                if generation < self.generation {
                    return Err(StandbyError::Stale {
                        theirs: generation,
                        ours: self.generation,
                    });
                }
                if epoch <= self.last_epoch_in_session {
                    return Err(StandbyError::Invalid(format!(
                        "epoch {epoch} after epoch {}",
                        self.last_epoch_in_session
                    )));
                }
                if std::mem::take(&mut self.resync) {
                    // The primary sent every non-zero page again.
                    let zero = [0u8; PAGE];
                    for index in 0..image.ram_size() / PAGE as u64 {
                        if !self.staged.contains_key(&index) {
                            image
                                .write_page(index, &zero)
                                .map_err(StandbyError::Invalid)?;
                        }
                    }
                }
                self.stats.last_epoch_pages = self.staged.len() as u64;
                self.stats.last_epoch_changed = 0;
                for (index, page) in std::mem::take(&mut self.staged) {
                    if image.differs(index, &page) {
                        self.stats.last_epoch_changed += 1;
                    }
                    image
                        .write_page(index, &page)
                        .map_err(StandbyError::Invalid)?;
                    self.stats.staged_applied += 1;
                }
                self.generation = generation;
                self.last_epoch_in_session = epoch;
                self.committed = Some(Checkpoint {
                    epoch,
                    generation,
                    context,
                    vm_state,
                });
                self.stats.epochs += 1;
                Ok((
                    Phase::Rounds(Round { round, pages: 0 }),
                    Some(Msg::EpochAck {
                        epoch,
                        generation: self.generation,
                    }),
                ))
            }
            (phase, msg) => Err(StandbyError::Unexpected {
                got: msg.ty().name(),
                state: phase.name(),
            }),
        }
    }
}

/// What the backup does now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Nothing.
    Wait,
    /// The data link is silent but the primary is alive on another path:
    /// wait for it to reconnect (this says so).
    Hold(String),
    /// Take over from the last acknowledged checkpoint, for this reason.
    Takeover(String),
    /// The primary is gone but there is no checkpoint: forget the session.
    Forget(String),
}

/// When to take over: a forwarded hang at once, or silence past `timeout`
/// on every heartbeat path. `paths` holds each path's address and how long
/// the primary has been silent on it (`None`: never heard from); the first
/// is the data link's. A primary heard on some other path while the data
/// link is silent is alive: [`Decision::Hold`]. Without an acknowledged
/// checkpoint there is nothing to take over.
pub fn decide(
    has_checkpoint: bool,
    hang: Option<&str>,
    paths: &[(&str, Option<Duration>)],
    timeout: Duration,
) -> Decision {
    let heard = paths.iter().filter_map(|&(a, s)| Some((a, s?)));
    let alive = heard.clone().find(|&(_, s)| s <= timeout);
    let why = match (hang, alive, heard.map(|(_, s)| s).min()) {
        (Some(h), _, _) => format!("the primary reported a vGPU hang: {h}"),
        (None, Some((addr, _)), _) => {
            return match paths.first() {
                Some(&(_, Some(data))) if data > timeout => Decision::Hold(format!(
                    "primary alive via {addr}, data link down: not taking over"
                )),
                _ => Decision::Wait,
            }
        }
        (None, None, Some(s)) => format!(
            "the primary was silent for {:.1} s{} (failover timeout {:.1} s)",
            s.as_secs_f64(),
            if paths.len() > 1 {
                format!(" on all {} heartbeat paths", paths.len())
            } else {
                String::new()
            },
            timeout.as_secs_f64()
        ),
        (None, None, None) => return Decision::Wait,
    };
    if has_checkpoint {
        Decision::Takeover(why)
    } else {
        Decision::Forget(format!(
            "{why}, before any checkpoint: nothing to take over"
        ))
    }
}

/// Options of `hagctl backup`.
#[derive(Clone, Debug)]
pub struct BackupOptions {
    /// `ADDR:PORT` to listen on.
    pub listen: String,
    /// More `ADDR:PORT`s to listen on for heartbeats (other paths).
    pub heartbeat_listen: Vec<String>,
    /// The backup's own hag-sim mdev.
    pub mdev: String,
    /// Control socket of the VM started at takeover.
    pub control: PathBuf,
    /// The hag-vmm binary.
    pub vmm: PathBuf,
    /// Extra arguments for `hag-vmm serve`.
    pub vmm_args: Vec<String>,
    /// Silence before takeover.
    pub failover_timeout: Duration,
    /// Generation to start at.
    pub generation: u64,
    /// Where the backup's state file goes.
    pub status_dir: PathBuf,
    /// JSON takeover report.
    pub json: bool,
}

/// What a takeover reports.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct TakeoverReport {
    /// Why.
    pub reason: String,
    /// The new generation.
    pub generation: u64,
    /// The epoch resumed from.
    pub epoch: u64,
    /// Detection → VM resumed, milliseconds.
    pub takeover_ms: f64,
    /// Of which: starting the VMM until its control socket answers.
    pub start_vm_ms: f64,
    /// Copying the standby image into the VM's RAM.
    pub fill_ms: f64,
    /// Restoring the vGPU context and VM state and resuming.
    pub restore_ms: f64,
    /// Non-zero pages copied.
    pub pages: u64,
}

impl TakeoverReport {
    /// The text form.
    pub fn text(&self) -> String {
        format!(
            "takeover: generation {}, resumed from epoch {} in {:.1} ms (start VM {:.1} ms, fill RAM {:.1} ms / {} pages, restore {:.1} ms): {}\n",
            self.generation,
            self.epoch,
            self.takeover_ms,
            self.start_vm_ms,
            self.fill_ms,
            self.pages,
            self.restore_ms,
            self.reason
        )
    }
}

struct Inner {
    standby: Standby,
    image: Option<StandbyRam>,
    /// When the primary was last heard from, per path (listen address).
    heard: BTreeMap<String, Instant>,
    hang: Option<String>,
    /// The primary's control (heartbeat) connection, per path.
    controls: BTreeMap<String, TcpStream>,
    data: Option<TcpStream>,
    session: u64,
    taken_over: bool,
    ended: Option<String>,
}

struct Backup {
    inner: Mutex<Inner>,
}

impl Backup {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Inner {
    fn heard(&mut self, path: &str) {
        self.heard.insert(path.to_owned(), Instant::now());
    }

    /// The primary ended protection (ABORT on any connection).
    fn ended(&mut self, reason: String) {
        eprintln!("hagctl: the primary ended protection: {reason}; standby image discarded");
        self.standby.discard();
        self.image = None;
        self.heard.clear();
        self.ended = Some(reason);
    }
}

fn data_session(b: &Backup, mut stream: TcpStream, first: Msg, from: &str, path: &str) {
    let session = {
        let mut g = b.lock();
        if let Some(old) = g.data.take() {
            let _ = old.shutdown(Shutdown::Both);
        }
        g.session += 1;
        g.standby.new_session();
        g.data = stream.try_clone().ok();
        g.heard(path);
        g.session
    };
    eprintln!("hagctl: checkpoint stream from {from}");
    let mut msg = first;
    loop {
        let reply = {
            let mut g = b.lock();
            if g.session != session {
                return;
            }
            g.heard(path);
            if g.taken_over {
                let why = format!(
                    "this backup took over (generation {}); the primary's VM must stop",
                    g.standby.generation
                );
                let _ = write_msg(&mut stream, &Msg::Error { message: why });
                return;
            }
            if let Msg::Hello { ram_size, .. } = &msg {
                let fits = g.image.as_ref().is_some_and(|i| i.size() == *ram_size);
                if !fits && g.standby.committed.is_none() {
                    match StandbyRam::new(*ram_size) {
                        Ok(img) => g.image = Some(img),
                        Err(e) => {
                            let _ = write_msg(
                                &mut stream,
                                &Msg::Error {
                                    message: format!("cannot create the standby image: {e}"),
                                },
                            );
                            return;
                        }
                    }
                }
            }
            let Inner { standby, image, .. } = &mut *g;
            let result = match image {
                Some(img) => standby.on(msg, img),
                None => Err(StandbyError::Unexpected {
                    got: msg.ty().name(),
                    state: "waiting for HELLO",
                }),
            };
            match result {
                Ok(r) => {
                    if let Some(Msg::EpochAck { epoch, .. }) = &r {
                        // Read by qemu-tests/eval: what each epoch really changed.
                        let st = &g.standby.stats;
                        eprintln!(
                            "hagctl: epoch {epoch} applied: {} pages, {} changed",
                            st.last_epoch_pages, st.last_epoch_changed
                        );
                    }
                    r
                }
                Err(StandbyError::Ended(reason)) => {
                    g.ended(reason);
                    return;
                }
                Err(e) => {
                    eprintln!("hagctl: checkpoint stream from {from}: {e}");
                    let _ = write_msg(
                        &mut stream,
                        &Msg::Error {
                            message: e.to_string(),
                        },
                    );
                    g.standby.new_session();
                    return;
                }
            }
        };
        if let Some(reply) = reply {
            if write_msg(&mut stream, &reply).is_err() {
                return;
            }
        }
        msg = match read_msg(&mut stream) {
            Ok((m, _)) => m,
            Err(e) => {
                if b.lock().session == session {
                    eprintln!("hagctl: checkpoint stream from {from} ended: {e}");
                }
                return;
            }
        };
    }
}

fn control_session(b: &Backup, mut stream: TcpStream, from: &str, path: &str) {
    {
        let mut g = b.lock();
        if let Ok(c) = stream.try_clone() {
            g.controls.insert(path.to_owned(), c);
        }
        g.heard(path);
    }
    eprintln!("hagctl: control connection from {from} (path {path})");
    loop {
        match read_msg(&mut stream) {
            Ok((Msg::Heartbeat { .. }, _)) => b.lock().heard(path),
            Ok((Msg::Hang { reason }, _)) => {
                let mut g = b.lock();
                g.heard(path);
                g.hang = Some(reason);
            }
            Ok((Msg::Abort { reason }, _)) => {
                let mut g = b.lock();
                // Unless the checkpoint stream said so first.
                if g.ended.is_none() && g.standby.committed.is_some() {
                    g.ended(reason);
                }
                return;
            }
            Ok((other, _)) => {
                eprintln!(
                    "hagctl: control connection from {from}: unexpected {}",
                    other.ty().name()
                );
                return;
            }
            Err(_) => return,
        }
    }
}

/// Serves one listener; `path` (its address) names the heartbeat path.
fn accept_loop(b: Arc<Backup>, listener: TcpListener, path: String) {
    for conn in listener.incoming() {
        let Ok(mut stream) = conn else { continue };
        let b = b.clone();
        let path = path.clone();
        std::thread::spawn(move || {
            tune(&stream);
            let from = stream
                .peer_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|_| "?".into());
            match read_msg(&mut stream) {
                Ok((m @ Msg::Hello { .. }, _)) => data_session(&b, stream, m, &from, &path),
                Ok((Msg::Heartbeat { .. }, _)) => control_session(&b, stream, &from, &path),
                Ok((m, _)) => {
                    let _ = write_msg(
                        &mut stream,
                        &Msg::Error {
                            message: format!("unexpected {} to open a connection", m.ty().name()),
                        },
                    );
                }
                Err(e) => eprintln!("hagctl: connection from {from}: {e}"),
            }
        });
    }
}

fn heartbeat_loop(b: Arc<Backup>) {
    loop {
        std::thread::sleep(HEARTBEAT);
        let mut g = b.lock();
        let msg = Msg::Heartbeat {
            generation: g.standby.generation,
            epoch: g.standby.committed.as_ref().map_or(0, |c| c.epoch),
        };
        g.controls.retain(|_, c| write_msg(c, &msg).is_ok());
    }
}

fn state_path(dir: &std::path::Path) -> PathBuf {
    dir.join("backup.json")
}

/// Stores the generation and epoch with the checkpoint (best effort).
fn store_state(dir: &std::path::Path, value: &serde_json::Value) {
    let _ = std::fs::create_dir_all(dir);
    let tmp = dir.join(".backup.json.tmp");
    if std::fs::write(&tmp, value.to_string() + "\n").is_ok() {
        let _ = std::fs::rename(&tmp, state_path(dir));
    }
}

fn start_vm(opts: &BackupOptions, ram_size: u64) -> anyhow::Result<(Child, VmClient)> {
    let _ = std::fs::remove_file(&opts.control);
    let mut cmd = Command::new(&opts.vmm);
    cmd.arg("serve")
        .arg("--incoming")
        .arg("--mdev")
        .arg(&opts.mdev)
        .arg("--control")
        .arg(&opts.control)
        .arg("--ram-mib")
        .arg((ram_size >> 20).to_string())
        .args(&opts.vmm_args);
    let mut child = cmd
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot start {}: {e}", opts.vmm.display()))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut vm) = VmClient::connect(&opts.control) {
            if let Ok(s) = vm.status() {
                if s.state == "incoming" {
                    return Ok((child, vm));
                }
                anyhow::bail!(
                    "the VM started for the takeover is {}, not incoming",
                    s.state
                );
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            anyhow::bail!("{} exited ({status}) before serving", opts.vmm.display());
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            anyhow::bail!("the VM started for the takeover did not answer in 30 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn takeover(
    opts: &BackupOptions,
    detected: Instant,
    reason: String,
    cp: &Checkpoint,
    image: &StandbyRam,
) -> anyhow::Result<(TakeoverReport, Child)> {
    let mut report = TakeoverReport {
        reason,
        generation: cp.generation,
        epoch: cp.epoch,
        ..TakeoverReport::default()
    };
    let (child, mut vm) = start_vm(opts, image.size())?;
    report.start_vm_ms = detected.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let ram = vm.ram()?;
    anyhow::ensure!(
        ram.size() == image.size(),
        "the VM has {} bytes of RAM, the image {}",
        ram.size(),
        image.size()
    );
    // The incoming VM's RAM is zero: copy the pages the image ever had
    // written (and are not zero now).
    let mut page = [0u8; PAGE];
    for p in image.written() {
        image.read_at(p * PAGE_SIZE, &mut page)?;
        if page.iter().any(|&b| b != 0) {
            ram.write(p * PAGE_SIZE, &page)?;
            report.pages += 1;
        }
    }
    report.fill_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let mut incoming = IncomingVm::open(vm, ram)?;
    incoming
        .commit(&cp.context, &cp.vm_state)
        .map_err(|e| anyhow::anyhow!("resuming the VM from epoch {}: {e}", cp.epoch))?;
    report.restore_ms = t.elapsed().as_secs_f64() * 1e3;
    report.takeover_ms = detected.elapsed().as_secs_f64() * 1e3;
    Ok((report, child))
}

/// `hagctl backup`: returns the VM's exit status once it ends after a
/// takeover, or `None` when the primary ended protection.
pub fn backup(opts: &BackupOptions) -> anyhow::Result<Option<ExitStatus>> {
    let mut listeners = Vec::new();
    for addr in std::iter::once(&opts.listen).chain(&opts.heartbeat_listen) {
        let l =
            TcpListener::bind(addr).map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
        listeners.push((l, addr.clone()));
    }
    let b = Arc::new(Backup {
        inner: Mutex::new(Inner {
            standby: Standby::new(opts.generation),
            image: None,
            heard: BTreeMap::new(),
            hang: None,
            controls: BTreeMap::new(),
            data: None,
            session: 0,
            taken_over: false,
            ended: None,
        }),
    });
    for (listener, path) in listeners {
        let b = b.clone();
        std::thread::spawn(move || accept_loop(b, listener, path));
    }
    {
        let b = b.clone();
        std::thread::spawn(move || heartbeat_loop(b));
    }
    eprintln!(
        "hagctl: backup listening on {}{} (vGPU {}, failover timeout {:.1} s, generation {})",
        opts.listen,
        opts.heartbeat_listen
            .iter()
            .map(|a| format!(", heartbeats also on {a}"))
            .collect::<String>(),
        opts.mdev,
        opts.failover_timeout.as_secs_f64(),
        opts.generation
    );
    let mut last_stored = 0u64;
    let mut holding = false;
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let mut g = b.lock();
        if let Some(reason) = g.ended.take() {
            if g.standby.committed.is_none() && g.hang.is_none() {
                eprintln!("hagctl: backup done: {reason}");
                return Ok(None);
            }
        }
        if let Some(c) = &g.standby.committed {
            if c.epoch != last_stored {
                last_stored = c.epoch;
                store_state(
                    &opts.status_dir,
                    &serde_json::json!({
                        "pid": std::process::id(),
                        "state": "standby",
                        "listen": opts.listen,
                        "generation": g.standby.generation,
                        "epoch": c.epoch,
                    }),
                );
            }
        }
        let paths: Vec<(&str, Option<Duration>)> = std::iter::once(&opts.listen)
            .chain(&opts.heartbeat_listen)
            .map(|a| (a.as_str(), g.heard.get(a).map(Instant::elapsed)))
            .collect();
        let decision = decide(
            g.standby.committed.is_some(),
            g.hang.as_deref(),
            &paths,
            opts.failover_timeout,
        );
        match decision {
            Decision::Wait => holding = false,
            Decision::Hold(why) => {
                if !std::mem::replace(&mut holding, true) {
                    eprintln!("hagctl: {why}");
                }
            }
            Decision::Forget(why) => {
                eprintln!("hagctl: {why}");
                g.hang = None;
                g.heard.clear();
                g.standby.discard();
                if let Some(d) = g.data.take() {
                    let _ = d.shutdown(Shutdown::Both);
                }
                continue;
            }
            Decision::Takeover(reason) => {
                let detected = Instant::now();
                g.taken_over = true;
                g.standby.generation += 1;
                let generation = g.standby.generation;
                if let Some(d) = g.data.take() {
                    let _ = d.shutdown(Shutdown::Both);
                }
                let mut cp = g
                    .standby
                    .committed
                    .clone()
                    .ok_or_else(|| anyhow::anyhow!("no checkpoint"))?;
                cp.generation = generation;
                // Tell the primary at once (if it still listens): it must
                // stop its VM.
                for c in g.controls.values_mut() {
                    let _ = write_msg(
                        c,
                        &Msg::Heartbeat {
                            generation,
                            epoch: cp.epoch,
                        },
                    );
                }
                let image = g
                    .image
                    .take()
                    .ok_or_else(|| anyhow::anyhow!("no standby image"))?;
                drop(g);
                store_state(
                    &opts.status_dir,
                    &serde_json::json!({
                        "pid": std::process::id(),
                        "state": "took-over",
                        "listen": opts.listen,
                        "generation": generation,
                        "epoch": cp.epoch,
                        "reason": reason,
                    }),
                );
                eprintln!(
                    "hagctl: taking over from epoch {} (generation {generation}): {reason}",
                    cp.epoch
                );
                let (report, mut child) = takeover(opts, detected, reason, &cp, &image)?;
                let line = if opts.json {
                    serde_json::to_string(&report)? + "\n"
                } else {
                    report.text()
                };
                let mut out = std::io::stdout().lock();
                out.write_all(line.as_bytes())?;
                out.flush()?;
                drop(out);
                eprint!("hagctl: {}", report.text());
                let status = child.wait()?;
                return Ok(Some(status));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::tests::snapshot;

    struct Ram(Vec<[u8; PAGE]>);

    impl Image for Ram {
        fn ram_size(&self) -> u64 {
            (self.0.len() * PAGE) as u64
        }
        fn write_page(&mut self, index: u64, bytes: &[u8; PAGE]) -> Result<(), String> {
            self.0[index as usize] = *bytes;
            Ok(())
        }
    }

    fn pages(round: u32, list: &[(u64, u8)]) -> Msg {
        Msg::Pages {
            round,
            pages: list
                .iter()
                .map(|&(i, fill)| (i, PageData::encode(&[fill; PAGE])))
                .collect(),
        }
    }

    fn epoch(round: u32, list: &[(u64, u8)], epoch: u64, generation: u64) -> Vec<Msg> {
        vec![
            pages(round, list),
            Msg::RoundEnd {
                round,
                pages: list.len() as u64,
            },
            Msg::Context(snapshot()),
            Msg::VmState(format!("state {epoch}").into_bytes()),
            Msg::EpochEnd { epoch, generation },
        ]
    }

    fn feed(s: &mut Standby, img: &mut Ram, msgs: Vec<Msg>) -> Result<Vec<Msg>, StandbyError> {
        let mut replies = Vec::new();
        for m in msgs {
            if let Some(r) = s.on(m, img)? {
                replies.push(r);
            }
        }
        Ok(replies)
    }

    fn hello() -> Msg {
        Msg::Hello {
            min: 1,
            max: 1,
            ram_size: 8 * PAGE as u64,
        }
    }

    #[test]
    fn precopy_then_epochs_are_applied_and_acknowledged() {
        let mut s = Standby::new(0);
        let mut img = Ram(vec![[0; PAGE]; 8]);
        let mut msgs = vec![hello(), pages(0, &[(1, 1), (2, 2)])];
        msgs.push(Msg::RoundEnd { round: 0, pages: 2 });
        msgs.extend(epoch(1, &[(2, 3)], 1, 0));
        let r = feed(&mut s, &mut img, msgs).unwrap();
        assert_eq!(
            r,
            vec![
                Msg::HelloOk { version: 1 },
                Msg::Ok { phase: 0 },
                Msg::Ok { phase: 1 },
                Msg::EpochAck {
                    epoch: 1,
                    generation: 0
                }
            ]
        );
        assert_eq!(img.0[1][0], 1);
        assert_eq!(img.0[2][0], 3);
        let cp = s.committed.clone().unwrap();
        assert_eq!((cp.epoch, cp.vm_state.as_slice()), (1, &b"state 1"[..]));
        // Epoch 2 in the next round.
        let r = feed(&mut s, &mut img, epoch(2, &[(3, 9)], 2, 0)).unwrap();
        assert_eq!(
            r.last(),
            Some(&Msg::EpochAck {
                epoch: 2,
                generation: 0
            })
        );
        assert_eq!(img.0[3][0], 9);
        assert_eq!(s.stats.epochs, 2);
    }

    #[test]
    fn an_unfinished_epoch_never_touches_the_checkpoint() {
        let mut s = Standby::new(0);
        let mut img = Ram(vec![[0; PAGE]; 8]);
        let mut msgs = vec![hello()];
        msgs.extend(epoch(0, &[(1, 1)], 1, 0));
        feed(&mut s, &mut img, msgs).unwrap();
        // Epoch 2 breaks off after its pages and ROUND_END.
        let partial = epoch(1, &[(1, 7), (4, 7)], 2, 0);
        feed(&mut s, &mut img, partial[..2].to_vec()).unwrap();
        assert_eq!(img.0[1][0], 1, "staged, not applied");
        assert_eq!(img.0[4][0], 0);
        assert_eq!(s.committed.as_ref().unwrap().epoch, 1);
        // The primary reconnects: a new session resends everything; the
        // old checkpoint stays valid until the new epoch ends.
        s.new_session();
        let mut msgs = vec![hello(), pages(0, &[(1, 5)])];
        msgs.push(Msg::RoundEnd { round: 0, pages: 1 });
        feed(&mut s, &mut img, msgs).unwrap();
        assert_eq!(img.0[1][0], 1);
        img.0[6] = [8; PAGE];
        feed(&mut s, &mut img, epoch(1, &[(4, 6)], 1, 0)).unwrap();
        assert_eq!((img.0[1][0], img.0[4][0]), (5, 6));
        assert_eq!(img.0[6][0], 0, "a page not resent is zero now");
    }

    #[test]
    fn stale_generations_and_bad_streams_are_refused() {
        let mut s = Standby::new(2);
        let mut img = Ram(vec![[0; PAGE]; 8]);
        let mut msgs = vec![hello()];
        msgs.extend(epoch(0, &[(1, 1)], 1, 1));
        let err = feed(&mut s, &mut img, msgs).unwrap_err();
        assert_eq!(err, StandbyError::Stale { theirs: 1, ours: 2 });
        assert!(s.committed.is_none());
        // A newer generation is adopted.
        s.new_session();
        let mut msgs = vec![hello()];
        msgs.extend(epoch(0, &[(1, 1)], 1, 3));
        let r = feed(&mut s, &mut img, msgs).unwrap();
        assert_eq!(
            r.last(),
            Some(&Msg::EpochAck {
                epoch: 1,
                generation: 3
            })
        );
        assert_eq!(s.generation, 3);
        // Out of turn, epochs going backwards, RAM size mismatch, ABORT.
        let err = s.on(Msg::Commit, &mut img).unwrap_err();
        assert!(err.to_string().starts_with("unexpected COMMIT"), "{err}");
        s.new_session();
        let mut msgs = vec![hello()];
        msgs.extend(epoch(0, &[], 5, 3));
        msgs.extend(epoch(1, &[], 5, 3));
        let err = feed(&mut s, &mut img, msgs).unwrap_err();
        assert!(err.to_string().contains("epoch 5 after epoch 5"), "{err}");
        s.new_session();
        let err = s
            .on(
                Msg::Hello {
                    min: 1,
                    max: 1,
                    ram_size: 4 * PAGE as u64,
                },
                &mut img,
            )
            .unwrap_err();
        assert!(err.to_string().contains("guest RAM"), "{err}");
        s.new_session();
        let err = s
            .on(
                Msg::Abort {
                    reason: "the VM finished".into(),
                },
                &mut img,
            )
            .unwrap_err();
        assert_eq!(err, StandbyError::Ended("the VM finished".into()));
    }

    #[test]
    fn standby_ram_keeps_pages_and_knows_which_were_written() {
        let mut r = StandbyRam::new(8 * PAGE as u64).unwrap();
        r.write_page(3, &[5; PAGE]).unwrap();
        r.write_page(6, &[0; PAGE]).unwrap();
        assert_eq!(r.written().collect::<Vec<_>>(), vec![3, 6]);
        let mut b = [1u8; PAGE];
        r.read_at(3 * PAGE as u64, &mut b).unwrap();
        assert_eq!(b, [5; PAGE]);
        r.read_at(0, &mut b).unwrap();
        assert_eq!(b, [0; PAGE]);
        assert_eq!(r.size(), 8 * PAGE as u64);
    }

    #[test]
    fn takeover_decisions() {
        let t = Duration::from_secs(3);
        let s = |ms| Some(Duration::from_millis(ms));
        let one = |silent| [("192.0.2.11:7200", silent)];
        assert_eq!(decide(true, None, &one(None), t), Decision::Wait);
        assert_eq!(decide(true, None, &one(s(1000)), t), Decision::Wait);
        assert!(matches!(
            decide(true, None, &one(s(3100)), t),
            Decision::Takeover(why) if why == "the primary was silent for 3.1 s (failover timeout 3.0 s)"
        ));
        assert!(matches!(
            decide(true, Some("vgpu-hung vgpu=1"), &one(s(0)), t),
            Decision::Takeover(why) if why.contains("vGPU hang")
        ));
        assert!(matches!(
            decide(false, Some("hung"), &one(None), t),
            Decision::Forget(why) if why.contains("nothing to take over")
        ));
        assert!(matches!(
            decide(false, None, &one(s(9000)), t),
            Decision::Forget(_)
        ));
    }

    #[test]
    fn takeover_needs_silence_on_every_path() {
        let t = Duration::from_secs(3);
        let s = |ms| Some(Duration::from_millis(ms));
        let two = |data, hb| [("192.0.2.11:7200", data), ("198.51.100.11:7201", hb)];
        // Both paths alive, or only the data link heard so far.
        assert_eq!(decide(true, None, &two(s(100), s(100)), t), Decision::Wait);
        assert_eq!(decide(true, None, &two(s(100), None), t), Decision::Wait);
        // The heartbeat path is down, the data link alive: nothing to do.
        assert_eq!(decide(true, None, &two(s(100), s(9000)), t), Decision::Wait);
        // The data link is down but the primary is heard on the other path:
        // a partition, not a loss.
        assert_eq!(
            decide(true, None, &two(s(8000), s(150)), t),
            Decision::Hold(
                "primary alive via 198.51.100.11:7201, data link down: not taking over".into()
            )
        );
        assert_eq!(
            decide(false, None, &two(s(8000), s(150)), t),
            Decision::Hold(
                "primary alive via 198.51.100.11:7201, data link down: not taking over".into()
            )
        );
        // Silent everywhere (the host is lost): take over; the silence is
        // the shortest one.
        assert!(matches!(
            decide(true, None, &two(s(3400), s(3200)), t),
            Decision::Takeover(why) if why == "the primary was silent for 3.2 s on all 2 heartbeat paths (failover timeout 3.0 s)"
        ));
        assert!(matches!(
            decide(true, None, &two(None, s(3200)), t),
            Decision::Takeover(_)
        ));
        // A hang forwarded on any path wins.
        assert!(matches!(
            decide(true, Some("hung"), &two(s(8000), s(100)), t),
            Decision::Takeover(why) if why.contains("vGPU hang")
        ));
        assert!(matches!(
            decide(false, None, &two(s(8000), s(9000)), t),
            Decision::Forget(_)
        ));
    }
}
