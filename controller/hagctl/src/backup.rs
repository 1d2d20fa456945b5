//! `hagctl backup`: the standby side of continuous checkpointing.
//!
//! It accepts a primary's `hagctl checkpoint` (two TCP connections: the
//! checkpoint stream of [`crate::wire`] and a control connection with
//! heartbeats), keeps a standby image (guest RAM in a memfd of its own, the
//! last acknowledged vGPU context and VM state) and acknowledges each epoch
//! only once it is applied. It does not run the VM. It takes over when the
//! primary hands its VM over (HANG: its vGPU hung, or its VM crashed) or
//! goes silent past `--failover-timeout`: it starts the standby VMM
//! (`hag-vmm serve --incoming` on its own vGPU, or QEMU), fills its RAM
//! from the image, restores the context and VM state, resumes it and
//! reports the takeover time. Each takeover raises the
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

use crate::log::{debug, info, warning};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use guest_ram::{GuestRam, PAGE_SIZE};
use vmm_control::VmClient;

use crate::admission::{self, Admission};
use crate::fence::{FenceFacts, FencePeer};
use crate::migrate::{tune, IncomingVm};
use crate::replica::{replica_path, shared_refusal, standby_refusal, Replicas};
use crate::secure::{self, Key, Outbox, Reader};
use crate::stall::StallGuard;
use crate::state_delta;
use crate::term::{self, Instance, Record, Term, Verdict};
use crate::vm_dirs::VmName;
use crate::vm_shape::{self, VmShape};
use crate::vmm::qemu_copy::EpochState;
use crate::vmm::qemu_standby;
use crate::wire::MAX_PAYLOAD;
use crate::wire::{
    check_context, check_hello, read_msg, session_name, DiskInfo, Msg, PageData, PageSink, Round,
    Sides, VmmKind, ENDED_PHASE, PAGE, VERSION_MAX,
};
use crate::witness::{self, WitnessAt};

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
    /// Reads page `index` (for the undo record of an epoch being applied).
    fn read_page(&self, index: u64, out: &mut [u8; PAGE]) -> Result<(), String>;
}

/// The standby image's guest RAM: a memfd of the backup's own, mapped
/// here and written and read through the mapping (a page applied is a
/// copy, not a system call). Its memory is reserved when it is made
/// (fallocate), so that a pairing the backup cannot hold is refused at
/// HELLO, not discovered part-way through an epoch.
pub struct StandbyRam {
    ram: GuestRam,
    /// Pages ever written (the rest are zero): what a takeover copies.
    written: Vec<u64>,
}

impl StandbyRam {
    /// `size` bytes of zeroes, reserved.
    pub fn new(size: u64) -> std::io::Result<Self> {
        use nix::fcntl::{fallocate, FallocateFlags};
        use nix::sys::memfd::{memfd_create, MFdFlags};
        let fd = memfd_create(c"hag-standby-ram", MFdFlags::MFD_CLOEXEC)?;
        let len = i64::try_from(size).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        fallocate(&fd, FallocateFlags::empty(), 0, len)?;
        let ram = GuestRam::map_fd(fd, size).map_err(std::io::Error::other)?;
        Ok(StandbyRam {
            ram,
            written: vec![0; hag_dev::bitmap_words(size)],
        })
    }

    /// Bytes.
    pub fn size(&self) -> u64 {
        self.ram.size()
    }

    /// The pages ever written, ascending.
    pub fn written(&self) -> impl Iterator<Item = u64> + '_ {
        hag_dev::bitmap_pages(&self.written)
    }

    /// The memfd (a standby QEMU maps it as its guest RAM).
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.ram
            .fd()
            .unwrap_or_else(|| unreachable!("mapped from a memfd in new"))
    }

    /// Reads bytes at `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.ram.read(offset, buf).map_err(std::io::Error::other)
    }
}

impl Image for StandbyRam {
    fn ram_size(&self) -> u64 {
        self.size()
    }
    fn write_page(&mut self, index: u64, bytes: &[u8; PAGE]) -> Result<(), String> {
        self.ram
            .write(index * PAGE_SIZE, bytes)
            .map_err(|e| format!("standby image: {e}"))?;
        if let Some(w) = self.written.get_mut((index / 64) as usize) {
            *w |= 1 << (index % 64);
        }
        Ok(())
    }
    fn read_page(&self, index: u64, out: &mut [u8; PAGE]) -> Result<(), String> {
        self.read_at(index * PAGE_SIZE, out)
            .map_err(|e| format!("standby image: {e}"))
    }
}

/// A checkpoint the backup acknowledged: with the standby image's pages,
/// what a takeover resumes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    /// The session (pairing) it came from.
    pub session: u128,
    /// Epoch number.
    pub epoch: u64,
    /// Generation it was taken in.
    pub generation: u64,
    /// The VM instance it is a copy of (if its primary named it): the one
    /// a takeover from it supersedes.
    pub instance: Option<Instance>,
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
    /// Another pairing holds this backup.
    #[error("this backup protects session {ours} (epoch {epoch}); session {theirs} must wait until that primary ends protection")]
    Busy {
        /// The pairing asking.
        theirs: String,
        /// The pairing the checkpoint belongs to.
        ours: String,
        /// Its epoch.
        epoch: u64,
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
    /// Page records that came as deltas against the image's bytes.
    pub delta_pages: u64,
    /// The last applied epoch's pages, and how many of them changed the
    /// image (the rest were sent but held the same bytes).
    pub last_epoch_pages: u64,
    /// Changed pages of the last applied epoch.
    pub last_epoch_changed: u64,
    /// Disk bytes the last applied epoch wrote into the replicas (data,
    /// zeroes).
    pub last_epoch_disk: (u64, u64),
}

/// What the backup accepts from any primary (issue 12, item 8): checked
/// before anything is allocated for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest guest RAM a primary may ask the backup to hold, bytes. A
    /// resynchronisation holds a second image until its first epoch ends,
    /// so the backup may need twice this.
    pub max_ram: u64,
    /// The failover timeout, told to the primary in HELLO_OK.
    pub timeout_ms: u32,
    /// The VMM this backup stands by with: a primary under another is
    /// refused at HELLO.
    pub vmm: VmmKind,
    /// The witness whose grant a takeover needs (its id, told in
    /// HELLO_OK: a primary claims from its witness only if it is this
    /// one).
    pub witness: Option<u64>,
}

/// The backup's side of the checkpoint stream.
///
/// Every session (a HELLO) writes its first checkpoint into a fresh image
/// of its own (`next`), never into one an earlier, unfinished session
/// wrote: the image becomes the standby image only when that session's
/// first EPOCH_END arrives, replacing the old one whole. A resynchronising
/// primary (the same pairing, after its link failed) thus leaves the last
/// acknowledged checkpoint valid until the new one is complete, and
/// nothing of an aborted sync survives into a checkpoint. Later epochs are
/// staged in memory (at most one copy of each page) and applied at their
/// EPOCH_END with an undo record: a write that fails part-way is rolled
/// back, so the image always holds exactly the last acknowledged
/// checkpoint.
///
/// The image type is generic so that the policy is tested on plain
/// memory; the backup uses [`StandbyRam`].
#[derive(Debug)]
pub struct Standby<I> {
    phase: Phase,
    staged: BTreeMap<u64, Box<[u8; PAGE]>>,
    /// The session of the stream in progress (after its HELLO).
    session: Option<u128>,
    last_epoch_in_session: u64,
    /// The image of [`Self::committed`].
    current: Option<I>,
    /// The image the session in progress fills, until its first epoch.
    next: Option<I>,
    limits: Limits,
    /// The last acknowledged checkpoint.
    pub committed: Option<Checkpoint>,
    /// This backup's generation (raised by each takeover).
    pub generation: u64,
    /// Counters.
    pub stats: StandbyStats,
    /// The connection feeding the stream (a number the I/O gives it).
    pub owner: u64,
    /// Where disk replicas go, and the standby QEMU's command line that
    /// must open them; `None`: this backup replicates no disks.
    disk_policy: Option<(PathBuf, Vec<String>)>,
    /// The replicas of the checkpoint's disks (and of the session's).
    replicas: Option<Replicas>,
    /// The session in progress named its disks.
    session_disks: bool,
    /// The term the session's primary presented in its HELLO.
    term: Option<Term>,
    /// The session's image has received no page yet (RAM_SUMS may seed it).
    fresh: bool,
    /// A file of guest RAM to seed a session's image from when this
    /// backup holds no checkpoint (the old primary's RAM file).
    ram_seed: Option<PathBuf>,
}

/// Makes a fresh zero image of the size a HELLO asks for, for a VM of the
/// shape the primary sent (if it did), once the limits allow it.
pub type CreateImage<'a, I> = dyn FnMut(u64, Option<&VmShape>) -> Result<I, String> + 'a;

impl<I: Image> Standby<I> {
    /// Refuses a HELLO of another pairing than the checkpoint's, before
    /// anything of the stream in progress is touched; but not one of the
    /// same VM instance (`instance`, from its term): a hagctl restarted on
    /// the VM it protected, which must pair again (the checkpoint stays
    /// until the new session's first epoch replaces it, as at a resync).
    /// Refused, it could only leave that VM running unprotected while this
    /// backup takes over from its checkpoint: two copies.
    pub fn busy(&self, session: u128, instance: Option<Instance>) -> Option<StandbyError> {
        let cp = self.committed.as_ref()?;
        let same_vm = instance.is_some() && cp.instance == instance;
        (cp.session != session && !same_vm).then(|| StandbyError::Busy {
            theirs: session_name(session),
            ours: session_name(cp.session),
            epoch: cp.epoch,
        })
    }

    /// A standby at `generation` with no checkpoint.
    pub fn new(generation: u64, limits: Limits) -> Self {
        Standby {
            phase: Phase::AwaitHello,
            staged: BTreeMap::new(),
            session: None,
            last_epoch_in_session: 0,
            current: None,
            next: None,
            limits,
            committed: None,
            generation,
            stats: StandbyStats::default(),
            owner: 0,
            disk_policy: None,
            replicas: None,
            session_disks: false,
            term: None,
            fresh: false,
            ram_seed: None,
        }
    }

    /// Seeds a session's image from `file` (guest RAM of this VM from
    /// before: the old primary's RAM file) when no checkpoint is held.
    pub fn seed_ram_from(&mut self, file: PathBuf) {
        self.ram_seed = Some(file);
    }

    /// RAM_SUMS: fills the session's fresh image with what this backup
    /// holds of the VM (the checkpoint's image, else the seed file, if of
    /// the same size) and returns a hash of each of its pages; nothing
    /// held: none (the primary sends every page).
    fn ram_sums(&mut self) -> Result<Vec<u64>, StandbyError> {
        let Some(next) = self.next.as_mut() else {
            return Err(StandbyError::Invalid("RAM_SUMS before HELLO".into()));
        };
        let size = next.ram_size();
        let pages = size / PAGE as u64;
        let seed_file = match (&self.current, &self.ram_seed) {
            (Some(_), _) => None,
            (None, Some(path)) => match std::fs::File::open(path) {
                Ok(f) if f.metadata().is_ok_and(|m| m.len() == size) => Some(f),
                Ok(_) => {
                    info!(
                        "{} is not {} MiB of guest RAM: not used as the session's seed",
                        path.display(),
                        size >> 20
                    );
                    return Ok(Vec::new());
                }
                Err(e) => {
                    info!(
                        "{}: {e}: the session starts from an empty image",
                        path.display()
                    );
                    return Ok(Vec::new());
                }
            },
            (None, None) => return Ok(Vec::new()),
        };
        let mut sums = Vec::with_capacity(pages as usize);
        let mut buf = [0u8; PAGE];
        for index in 0..pages {
            match (&self.current, &seed_file) {
                (Some(cur), _) => cur
                    .read_page(index, &mut buf)
                    .map_err(StandbyError::Invalid)?,
                (None, Some(f)) => {
                    std::os::unix::fs::FileExt::read_exact_at(f, &mut buf, index * PAGE as u64)
                        .map_err(|e| StandbyError::Invalid(format!("reading the RAM seed: {e}")))?
                }
                (None, None) => unreachable!("returned above"),
            }
            if buf.iter().any(|&b| b != 0) {
                next.write_page(index, &buf)
                    .map_err(StandbyError::Invalid)?;
            }
            sums.push(crate::pagehash::page_hash(&buf));
        }
        Ok(sums)
    }

    /// Replicates a QEMU VM's disks into `dir`, for a standby QEMU started
    /// with `command`, which must open each replica (checked when a
    /// primary names its disks).
    pub fn replicate_disks(&mut self, dir: PathBuf, command: Vec<String>) {
        self.disk_policy = Some((dir, command));
    }

    /// A new connection from a primary: back to HELLO; an unfinished
    /// epoch or sync is dropped (the checkpoint stays).
    pub fn new_session(&mut self) {
        self.phase = Phase::AwaitHello;
        self.staged.clear();
        self.next = None;
        self.session = None;
        self.last_epoch_in_session = 0;
        self.session_disks = false;
        self.term = None;
        self.fresh = false;
        if let Some(r) = &mut self.replicas {
            r.drop_staged();
        }
    }

    /// Drops the checkpoint (protection ended).
    pub fn discard(&mut self) {
        self.committed = None;
        self.current = None;
        self.replicas = None;
        self.new_session();
    }

    /// Hands over the checkpoint and its image (at takeover).
    pub fn take(&mut self) -> Option<(Checkpoint, I)> {
        let cp = self.committed.take()?;
        let img = self.current.take()?;
        self.new_session();
        Some((cp, img))
    }

    /// Takes back what [`Standby::take`] handed over, after a takeover
    /// that did not happen.
    pub fn put_back(&mut self, cp: Checkpoint, image: I) {
        self.committed = Some(cp);
        self.current = Some(image);
    }

    /// Applies one message of the checkpoint stream; returns the reply.
    /// `create` makes a fresh zero image of the size a HELLO asks for,
    /// once the limits allow it.
    pub fn on(
        &mut self,
        msg: Msg,
        create: &mut CreateImage<'_, I>,
    ) -> Result<Option<Msg>, StandbyError> {
        let phase = std::mem::replace(&mut self.phase, Phase::AwaitHello);
        let (next, reply) = self.step(phase, msg, create)?;
        self.phase = next;
        Ok(reply)
    }

    fn hello(
        &mut self,
        (min, max, ram_size, session): (u16, u16, u64, u128),
        term: Option<Term>,
        shape: Option<&VmShape>,
        create: &mut CreateImage<'_, I>,
    ) -> Result<Msg, StandbyError> {
        let bad = |s: String| Err(StandbyError::Invalid(s));
        if ram_size == 0 || ram_size % PAGE as u64 != 0 {
            return bad(format!("guest RAM of {ram_size} bytes is not whole pages"));
        }
        if ram_size > self.limits.max_ram {
            return bad(format!(
                "the primary's VM has {} MiB of guest RAM, this backup takes at most {} MiB (--max-ram)",
                ram_size >> 20,
                self.limits.max_ram >> 20
            ));
        }
        if let Some(busy) = self.busy(session, term.as_ref().map(|t| t.instance)) {
            return Err(busy);
        }
        let have = self.current.as_ref().map_or(ram_size, Image::ram_size);
        let version =
            check_hello(CHECKPOINT, (min, max, ram_size), have).map_err(StandbyError::Invalid)?;
        let img = create(ram_size, shape).map_err(|e| {
            StandbyError::Invalid(format!(
                "cannot stand by for a VM of {} MiB here: {e}",
                ram_size >> 20
            ))
        })?;
        self.next = Some(img);
        self.fresh = true;
        self.session = Some(session);
        // A superseded primary was answered before its HELLO got here
        // (data_session): this one is current.
        let superseded = term.as_ref().map(|_| false);
        self.term = term;
        Ok(Msg::HelloOk {
            version,
            generation: self.generation,
            timeout_ms: self.limits.timeout_ms,
            superseded,
            witness: self.limits.witness,
        })
    }

    fn step(
        &mut self,
        phase: Phase,
        msg: Msg,
        create: &mut CreateImage<'_, I>,
    ) -> Result<(Phase, Option<Msg>), StandbyError> {
        match (phase, msg) {
            (_, Msg::Abort { reason }) => Err(StandbyError::Ended(reason)),
            (_, Msg::Error { message }) => Err(StandbyError::PrimaryError(message)),
            (
                Phase::AwaitHello,
                Msg::Hello {
                    min,
                    max,
                    ram_size,
                    session,
                    vmm,
                    term,
                    shape,
                },
            ) => {
                if vmm != self.limits.vmm {
                    return Err(StandbyError::Invalid(format!(
                        "the primary's VM runs under {}, this backup stands by with {}",
                        vmm.name(),
                        self.limits.vmm.name()
                    )));
                }
                let reply =
                    self.hello((min, max, ram_size, session), term, shape.as_ref(), create)?;
                Ok((Phase::Rounds(Round::FIRST), Some(reply)))
            }
            (Phase::Rounds(at), Msg::RamSums(ask)) if ask.is_empty() && self.fresh => {
                let sums = self.ram_sums()?;
                Ok((Phase::Rounds(at), Some(Msg::RamSums(sums))))
            }
            (Phase::Rounds(at), Msg::Pages { round, pages }) => {
                self.fresh = false;
                let Standby {
                    next,
                    current,
                    staged,
                    stats,
                    ..
                } = self;
                let ram_size = next.as_ref().or(current.as_ref()).map_or(0, I::ram_size);
                let mut sink = Incoming {
                    next,
                    current,
                    staged,
                    stats,
                };
                let at = at
                    .on_pages(round, &pages, ram_size, &mut sink)
                    .map_err(StandbyError::Invalid)?;
                Ok((Phase::Rounds(at), None))
            }
            (Phase::Rounds(at), Msg::Disks(disks)) => {
                let sums = self.open_disks(&disks)?;
                Ok((Phase::Rounds(at), Some(Msg::DiskSums(sums))))
            }
            (
                Phase::Rounds(at),
                Msg::DiskData {
                    disk,
                    offset,
                    extent,
                },
            ) => {
                let direct = self.committed.is_none();
                let r = self
                    .replicas
                    .as_mut()
                    .filter(|_| self.session_disks)
                    .ok_or_else(|| StandbyError::Invalid("DISK_DATA before DISKS".into()))?;
                let written = if direct {
                    r.write_direct(disk, offset, &extent)
                } else {
                    r.stage(disk, offset, extent)
                };
                written.map_err(StandbyError::Invalid)?;
                Ok((Phase::Rounds(at), None))
            }
            (Phase::Rounds(at), Msg::RoundEnd { round, pages }) => {
                let next = at.on_end(round, pages).map_err(StandbyError::Invalid)?;
                Ok((Phase::Rounds(next), Some(Msg::Ok { phase: at.round })))
            }
            (Phase::Rounds(Round { round, pages: 0 }), Msg::Context(context)) => {
                match self.limits.vmm {
                    VmmKind::HagVmm => check_context(&context).map_err(StandbyError::Invalid)?,
                    // The vGPU's state is in QEMU's stream (VM_STATE).
                    VmmKind::Qemu if !context.is_empty() => {
                        return Err(StandbyError::Invalid(format!(
                            "a QEMU epoch carries its vGPU state in VM_STATE, but CONTEXT has {} bytes",
                            context.len()
                        )))
                    }
                    VmmKind::Qemu => {}
                }
                Ok((Phase::GotContext { round, context }, None))
            }
            (Phase::GotContext { round, context }, Msg::VmStateDelta { base_epoch, patch }) => {
                // Against the checkpoint this backup holds for the
                // session: the primary patches the state of its last
                // acknowledged epoch, which is this backup's committed one.
                let base = self
                    .committed
                    .as_ref()
                    .filter(|c| Some(c.session) == self.session && c.epoch == base_epoch)
                    .ok_or_else(|| {
                        StandbyError::Invalid(format!(
                            "a device-state patch against epoch {base_epoch}, but this backup holds {}",
                            self.committed.as_ref().map_or("no checkpoint".into(), |c| format!("epoch {}", c.epoch))
                        ))
                    })?;
                let vm_state = state_delta::apply(&base.vm_state, &patch, MAX_PAYLOAD as usize)
                    .map_err(StandbyError::Invalid)?;
                self.got_state(round, context, vm_state)
            }
            (Phase::GotContext { round, context }, Msg::VmState(vm_state)) => {
                self.got_state(round, context, vm_state)
            }
            (
                Phase::GotState {
                    round,
                    context,
                    vm_state,
                },
                Msg::EpochEnd { epoch, generation },
            ) => {
                self.epoch_end(epoch, generation, context, vm_state)?;
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

    /// A session names its VM's disks: their replicas are opened (made,
    /// for a first checkpoint). The checkpoint's replicas must be of the
    /// same disks; the standby QEMU must open every one. Returns what the
    /// replicas hold, for the primary's first copy to skip.
    fn open_disks(&mut self, disks: &[DiskInfo]) -> Result<Vec<Vec<[u8; 32]>>, StandbyError> {
        let bad = |s: String| Err(StandbyError::Invalid(s));
        if self.session_disks {
            return bad("DISKS twice in one session".into());
        }
        let Some((dir, command)) = &self.disk_policy else {
            return bad(format!(
                "the primary's VM has {} writable disk(s) ({}), and this backup does not replicate disks (a hag-vmm standby)",
                disks.len(),
                disks.iter().map(|d| d.id.as_str()).collect::<Vec<_>>().join(", ")
            ));
        };
        for d in disks {
            let path = replica_path(dir, &d.id);
            if let Some(why) =
                standby_refusal(command, &d.id, &path).or_else(|| shared_refusal(&d.id, &path))
            {
                return bad(why);
            }
        }
        let fresh = self.committed.is_none();
        match &self.replicas {
            Some(r) if r.matches(disks) => {}
            Some(_) if !fresh => {
                return bad(format!(
                    "the primary names disks {} but the checkpoint holds others",
                    disks
                        .iter()
                        .map(|d| d.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            }
            _ => {
                self.replicas =
                    Some(Replicas::open(dir, disks, fresh).map_err(StandbyError::Invalid)?);
            }
        }
        self.session_disks = true;
        let r = self
            .replicas
            .as_mut()
            .ok_or_else(|| StandbyError::Invalid("no replicas".into()))?;
        let t0 = Instant::now();
        let sums = r.sums().map_err(StandbyError::Invalid)?;
        info!(
            "disk replicas summed for the primary's comparison in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        Ok(sums)
    }

    /// An epoch's VM state arrived (whole, or rebuilt from a patch).
    fn got_state(
        &self,
        round: u32,
        context: Vec<u8>,
        vm_state: Vec<u8>,
    ) -> Result<(Phase, Option<Msg>), StandbyError> {
        if self.limits.vmm == VmmKind::Qemu {
            EpochState::decode(&vm_state).map_err(StandbyError::Invalid)?;
        }
        Ok((
            Phase::GotState {
                round,
                context,
                vm_state,
            },
            None,
        ))
    }

    fn epoch_end(
        &mut self,
        epoch: u64,
        generation: u64,
        context: Vec<u8>,
        vm_state: Vec<u8>,
    ) -> Result<(), StandbyError> {
        if generation < self.generation {
            return Err(StandbyError::Stale {
                theirs: generation,
                ours: self.generation,
            });
        }
        let Some(session) = self.session else {
            return Err(StandbyError::Invalid("EPOCH_END before HELLO".into()));
        };
        let after = self
            .committed
            .as_ref()
            .filter(|c| c.session == session)
            .map_or(0, |c| c.epoch)
            .max(self.last_epoch_in_session);
        if epoch <= after {
            return Err(StandbyError::Invalid(format!(
                "epoch {epoch} after epoch {after}"
            )));
        }
        if self.replicas.is_some() && !self.session_disks && self.committed.is_some() {
            return Err(StandbyError::Invalid(
                "the checkpoint has disks, but this session named none".into(),
            ));
        }
        let staged = std::mem::take(&mut self.staged);
        self.stats.last_epoch_pages = staged.len() as u64;
        self.stats.last_epoch_changed = 0;
        if let Some(img) = self.next.take() {
            // The session's first checkpoint: its image replaces the old
            // one whole (nothing was staged: its pages went into it).
            self.current = Some(img);
        } else {
            let img = self
                .current
                .as_mut()
                .ok_or_else(|| StandbyError::Invalid("no standby image".into()))?;
            match apply(img, &staged) {
                Ok(changed) => self.stats.last_epoch_changed = changed,
                Err((e, intact)) => {
                    if !intact {
                        // Neither the new epoch nor the old checkpoint:
                        // nothing left to take over from.
                        self.committed = None;
                        self.current = None;
                        return Err(StandbyError::Invalid(format!(
                            "epoch {epoch} failed part-way ({e}) and could not be undone: the checkpoint is lost"
                        )));
                    }
                    return Err(StandbyError::Invalid(format!(
                        "epoch {epoch} refused: {e}; the image was rolled back to the last acknowledged checkpoint"
                    )));
                }
            }
            self.stats.staged_applied += staged.len() as u64;
        }
        // The memory is in; the disks follow, synced before the
        // acknowledgement. A replica left half-written cannot be taken
        // over onto: the checkpoint goes with it.
        if let Some(r) = self.replicas.as_mut().filter(|_| self.session_disks) {
            match r.commit() {
                Ok(c) => self.stats.last_epoch_disk = (c.data, c.zero),
                Err(e) => {
                    self.committed = None;
                    self.current = None;
                    self.replicas = None;
                    return Err(StandbyError::Invalid(format!(
                        "epoch {epoch}: the disk replicas could not be written ({e}): the checkpoint is lost"
                    )));
                }
            }
        }
        self.generation = generation;
        self.last_epoch_in_session = epoch;
        self.committed = Some(Checkpoint {
            session,
            epoch,
            generation,
            instance: self.term.as_ref().map(|t| t.instance),
            context,
            vm_state,
        });
        self.stats.epochs += 1;
        Ok(())
    }
}

/// Where a PAGES message's pages go on the backup: a session's first
/// checkpoint fills its own image; later epochs are staged. A delta page
/// applies to the page as the epoch so far leaves it: staged, or else
/// the image's.
struct Incoming<'a, I> {
    next: &'a mut Option<I>,
    current: &'a Option<I>,
    staged: &'a mut BTreeMap<u64, Box<[u8; PAGE]>>,
    stats: &'a mut StandbyStats,
}

impl<I: Image> PageSink for Incoming<'_, I> {
    fn current(&mut self, index: u64, out: &mut [u8; PAGE]) -> Result<(), String> {
        if let Some(page) = self.staged.get(&index) {
            out.copy_from_slice(&page[..]);
            return Ok(());
        }
        match self.next.as_ref().or(self.current.as_ref()) {
            Some(img) => img.read_page(index, out),
            None => Err(format!("page {index} came as a delta before any image")),
        }
    }

    fn write(&mut self, index: u64, data: &PageData, bytes: &[u8; PAGE]) -> Result<(), String> {
        match self.next {
            Some(img) => img.write_page(index, bytes)?,
            None => {
                self.staged.insert(index, Box::new(*bytes));
            }
        }
        self.stats.pages += 1;
        self.stats.delta_pages += u64::from(data.is_delta());
        Ok(())
    }
}

/// Writes an epoch's staged pages into `img` with an undo record; returns
/// how many changed. On a failed write every page already written is put
/// back; the error says whether that worked (`true`: the image is as it
/// was).
fn apply<I: Image>(
    img: &mut I,
    staged: &BTreeMap<u64, Box<[u8; PAGE]>>,
) -> Result<u64, (String, bool)> {
    let mut undo: Vec<(u64, Box<[u8; PAGE]>)> = Vec::with_capacity(staged.len());
    let mut changed = 0;
    for (&index, page) in staged {
        let mut old = Box::new([0u8; PAGE]);
        let step = img
            .read_page(index, &mut old)
            .and_then(|()| img.write_page(index, page));
        if let Err(e) = step {
            let intact = undo
                .iter()
                .rev()
                .all(|(i, old)| img.write_page(*i, old).is_ok());
            return Err((e, intact));
        }
        if *old != **page {
            changed += 1;
        }
        undo.push((index, old));
    }
    Ok(changed)
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
        (Some(h), _, _) => format!("the primary handed its VM over: {h}"),
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

/// What `--on-silence` and a requested takeover (`hagctl takeover`,
/// `requested`) make of [`decide`]'s `decision` (`hang`: it was on a
/// forwarded hang). A request takes over whenever there is a checkpoint:
/// the requester (an operator, a cluster manager) has fenced the primary;
/// the takeover's recheck still gives it up if the primary is heard after
/// it. Under `hold`, silence alone never takes over.
pub fn under_policy(
    decision: Decision,
    hang: bool,
    on_silence: OnSilence,
    requested: bool,
    has_checkpoint: bool,
) -> Decision {
    match decision {
        Decision::Takeover(why) if hang => Decision::Takeover(why),
        _ if requested && has_checkpoint => {
            Decision::Takeover("a takeover was requested (hagctl takeover)".into())
        }
        Decision::Takeover(why) if on_silence == OnSilence::Hold => Decision::Hold(format!(
            "{why}: holding (--on-silence hold); a takeover waits for hagctl takeover"
        )),
        d => d,
    }
}

/// Where a pairing stands on this backup. Ending protection (the
/// primary's ABORT) and taking over exclude each other: whichever comes
/// first wins, decided under one lock, so a backup that is starting the
/// VM never confirms an end (the primary would release output the
/// takeover then contradicts, and run on beside the taken-over copy), and
/// a backup that confirmed an end never takes over.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Role {
    /// Standing by: an ABORT ends protection, silence or a hang takes
    /// over.
    #[default]
    Standby,
    /// The primary ended protection; no takeover follows.
    Ended(String),
    /// A takeover is under way or done; no end is confirmed.
    TakingOver,
}

/// How to answer an ABORT.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AbortAnswer {
    /// Discard the checkpoint (if any), then confirm (OK ENDED).
    End,
    /// Already ended: confirm again.
    Confirm,
    /// A takeover is under way: no confirmation. The primary, unconfirmed,
    /// stops its VM and keeps its output held; the fence follows.
    Refuse,
}

impl Role {
    /// An ABORT arrived: protection ends (with or without a checkpoint:
    /// the backup is done either way), unless a takeover started.
    pub fn abort(&mut self, reason: String) -> AbortAnswer {
        match self {
            Role::Standby => {
                *self = Role::Ended(reason);
                AbortAnswer::End
            }
            Role::Ended(_) => AbortAnswer::Confirm,
            Role::TakingOver => AbortAnswer::Refuse,
        }
    }

    /// A takeover was decided: whether it may start (only while standing
    /// by).
    pub fn take_over(&mut self) -> bool {
        let start = *self == Role::Standby;
        if start {
            *self = Role::TakingOver;
        }
        start
    }

    /// Whether a takeover started.
    pub fn taking_over(&self) -> bool {
        *self == Role::TakingOver
    }

    /// The takeover failed with the checkpoint kept: standing by again
    /// (a later decision tries again; an ABORT may end protection).
    pub fn takeover_failed(&mut self) {
        if self.taking_over() {
            *self = Role::Standby;
        }
    }
}

/// Options of `hagctl backup`.
#[derive(Clone, Debug)]
pub struct BackupOptions {
    /// `ADDR:PORT` to listen on.
    pub listen: String,
    /// More `ADDR:PORT`s to listen on for heartbeats (other paths).
    pub heartbeat_listen: Vec<String>,
    /// The backup's own hag-sim mdev (hag-vmm standbys).
    pub mdev: String,
    /// The command line of the QEMU that takes a QEMU VM over (program
    /// first; see [`crate::vmm::qemu_standby`]); empty: hag-vmm standbys.
    pub qemu: Vec<String>,
    /// Control socket of the VM started at takeover.
    pub control: PathBuf,
    /// The hag-vmm binary.
    pub vmm: PathBuf,
    /// Extra arguments for `hag-vmm serve`.
    pub vmm_args: Vec<String>,
    /// Silence before takeover.
    pub failover_timeout: Duration,
    /// Generation to start at (the stored one wins if newer).
    pub generation: u64,
    /// Runtime files: takeover requests, the standby's QMP socket and log.
    pub status_dir: PathBuf,
    /// Where the state that must survive a reboot goes (backup.json, with
    /// the generation).
    pub state_dir: PathBuf,
    /// The VM's name (`--name`): a primary of another is refused.
    pub vm_name: Option<VmName>,
    /// Where a QEMU VM's disk replicas go.
    pub replica_dir: PathBuf,
    /// JSON takeover report.
    pub json: bool,
    /// The pair's pre-shared key file.
    pub key: PathBuf,
    /// Largest guest RAM accepted.
    pub max_ram: u64,
    /// Authenticated connections open at once, at most (more are closed
    /// at once; handshakes have their own pool, [`crate::admission`]).
    pub max_connections: usize,
    /// For tests: a file naming a fault to play (mute, drop-acks).
    pub test_fault_file: Option<PathBuf>,
    /// The operator's fencing, run before every takeover.
    pub fence_peer: Option<FencePeer>,
    /// Whether the primary's silence alone makes a takeover.
    pub on_silence: OnSilence,
    /// The witness (`--witness`), and its key file if not the pair's.
    pub witness: Option<(String, Option<PathBuf>)>,
    /// After a takeover: the next backup (HOST:PORT) and more `hagctl
    /// checkpoint` arguments ([`crate::reprotect`]).
    pub reprotect: Option<(String, Vec<String>)>,
    /// Guest RAM of this VM from before (the old primary's RAM file): a
    /// session's image starts as it when no checkpoint is held, and the
    /// primary sends only pages that differ (RAM_SUMS).
    pub ram_seed: Option<PathBuf>,
    /// A takeover is a libvirt restore of this domain
    /// ([`crate::libvirt_restore`]), not a QEMU of this backup's own.
    pub libvirt_owned: Option<crate::libvirt_restore::Owned>,
}

/// What the primary's silence past the failover timeout does
/// (`--on-silence`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnSilence {
    /// Take over (after `--fence-peer`, if given).
    #[default]
    Takeover,
    /// Hold: a cluster manager decides, and asks for the takeover
    /// (`hagctl takeover`) once it has fenced the primary. A forwarded
    /// hang still takes over at once.
    Hold,
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

/// The steps of a takeover, in the order [`take_over`] runs them.
pub trait TakeoverSteps {
    /// Everything that can fail before the VM runs: start the VMM, fill
    /// its RAM, restore the vGPU context and the VM state (not resumed).
    fn prepare(&mut self) -> Result<(), String>;
    /// Whether the decision still stands, asked just before the new
    /// generation is stored: a takeover decided on the primary's silence
    /// is given up if it was heard since (a backup that had stalled
    /// decided before its readers drained the heartbeats that arrived
    /// meanwhile; or the primary came back while the VM was prepared).
    /// `Err` says what was heard.
    fn recheck(&mut self) -> Result<(), String>;
    /// The witness's grant of the VM instance the checkpoint is of, at the
    /// checkpoint's generation (no witness: `Ok`; a retried takeover claims
    /// at the same generation, though the fence raised the backup's).
    /// [`TakeoverError::NotGranted`] if it did not decide;
    /// [`TakeoverError::Void`] if it gave the VM to the primary, which ran
    /// on past the checkpoint.
    fn claim(&mut self) -> Result<(), TakeoverError>;
    /// The operator's fencing of the primary (`--fence-peer`), for the
    /// takeover to `generation`: `Err` if it did not succeed (nothing to
    /// run: `Ok`).
    fn fence_peer(&mut self, generation: u64) -> Result<(), String>;
    /// Stores the new generation durably (written, synced, read back).
    fn persist(&mut self, generation: u64) -> Result<(), String>;
    /// Tells every connection of the session the new generation.
    fn fence(&mut self, generation: u64);
    /// Resumes the prepared VM.
    fn resume(&mut self) -> Result<(), String>;
    /// Ends a prepared VM that will not run.
    fn abandon(&mut self);
}

/// Why a takeover did not happen.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TakeoverError {
    /// Preparing failed: the primary was not fenced, the checkpoint kept.
    #[error("the takeover cannot work here ({0}); the primary was not fenced")]
    Infeasible(String),
    /// The generation could not be stored: not fenced either.
    #[error("the new generation could not be stored ({0}); the primary was not fenced")]
    NotDurable(String),
    /// The primary was heard after a decision on its silence: not fenced.
    #[error("{0}; the primary was not fenced")]
    PrimaryAlive(String),
    /// The witness did not answer: no takeover (tried again).
    #[error("the witness did not answer ({0}); the primary was not fenced, no takeover")]
    NotGranted(String),
    /// The witness gave the VM to the primary: this checkpoint can never
    /// be resumed.
    #[error("the witness refused the takeover: {0}")]
    Void(String),
    /// The operator's fence command did not succeed: no takeover.
    #[error("{0}; the primary was not fenced, no takeover")]
    PeerNotFenced(String),
    /// The generation is at its end.
    #[error("generation {0} cannot be raised")]
    Exhausted(u64),
    /// Resuming failed after the fence.
    #[error("the primary was fenced but the VM did not resume here: {0}")]
    Resume(String),
}

/// A takeover from generation `generation`: the primary is fenced only
/// once this host is known able to run the VM, the witness (if any)
/// granted it, the operator's fence command (if any) succeeded, and the
/// new generation is durable (issue 12, items 3 and 9; issue 21, items 1
/// and 2). Returns the new generation.
pub fn take_over(steps: &mut impl TakeoverSteps, generation: u64) -> Result<u64, TakeoverError> {
    let next = generation
        .checked_add(1)
        .ok_or(TakeoverError::Exhausted(generation))?;
    if let Err(e) = steps.prepare() {
        steps.abandon();
        return Err(TakeoverError::Infeasible(e));
    }
    if let Err(e) = steps.recheck() {
        steps.abandon();
        return Err(TakeoverError::PrimaryAlive(e));
    }
    if let Err(e) = steps.claim() {
        steps.abandon();
        return Err(e);
    }
    if let Err(e) = steps.fence_peer(next) {
        steps.abandon();
        return Err(TakeoverError::PeerNotFenced(e));
    }
    if let Err(e) = steps.persist(next) {
        steps.abandon();
        return Err(TakeoverError::NotDurable(e));
    }
    steps.fence(next);
    if let Err(e) = steps.resume() {
        // Fenced, but not running here: the checkpoint is the VM's only
        // copy now, so the caller tries again from it with a fresh VMM.
        steps.abandon();
        return Err(TakeoverError::Resume(e));
    }
    Ok(next)
}

/// [`TakeoverSteps::recheck`] for a takeover decided at `decided` on the
/// primary's silence (`None`: on its hang, which stands whatever is heard
/// after it).
fn still_silent(b: &Backup, decided: Option<Instant>) -> Result<(), String> {
    let l = b.live();
    // A HANG after the decision: that primary stopped its VM for us.
    let committed = l.end_refused || l.hang.is_some();
    heard_after(decided, committed, &l.heard)
}

/// Whether the primary was heard on some path (`heard`: when, per path)
/// after a decision on its silence at `decided`, which then no longer
/// stands; unless the primary is `committed` to the takeover meanwhile
/// (its ABORT was refused, or it sent HANG: either way it stops its VM,
/// counting on the takeover).
fn heard_after(
    decided: Option<Instant>,
    committed: bool,
    heard: &BTreeMap<String, Instant>,
) -> Result<(), String> {
    let Some(decided) = decided else {
        return Ok(());
    };
    if committed {
        return Ok(());
    }
    match heard.iter().find(|(_, &t)| t > decided) {
        Some((path, t)) => Err(format!(
            "the primary was heard on {path} {:.1} s after this backup decided it was silent: it is alive",
            t.duration_since(decided).as_secs_f64()
        )),
        None => Ok(()),
    }
}

/// How long a finishing backup waits for each connection to write what
/// it holds (the OK ENDED a primary waits for).
const FLUSH_AT_EXIT: Duration = Duration::from_secs(2);

/// How long a backup whose takeover failed waits before trying again
/// (a VMM that did not start, a restore that failed: often transient).
const TAKEOVER_RETRY: Duration = Duration::from_secs(5);

/// A fault the backup plays for tests (`--test-fault-file`): 0 none, 1
/// "mute" (nothing reaches the primary: the backup-to-primary direction
/// is cut), 2 "drop-acks" (epochs are applied but never acknowledged), 3
/// "hold-takeover" (a takeover waits, its VM prepared, before it stores
/// the generation and fences: the window in which an ABORT may arrive).
static TEST_FAULT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether the test fault in force swallows `msg` on its way out.
fn swallowed(msg: &Msg) -> bool {
    match TEST_FAULT.load(std::sync::atomic::Ordering::Relaxed) {
        1 => true,
        2 => matches!(msg, Msg::EpochAck { .. }),
        _ => false,
    }
}

fn read_test_fault(path: &std::path::Path) {
    let mode = match std::fs::read_to_string(path).as_deref().map(str::trim) {
        Ok("mute") => 1,
        Ok("drop-acks") => 2,
        Ok("hold-takeover") => 3,
        _ => 0,
    };
    let old = TEST_FAULT.swap(mode, std::sync::atomic::Ordering::Relaxed);
    if old != mode {
        info!("test fault now {mode} (0 none, 1 mute, 2 drop-acks, 3 hold-takeover)");
    }
}

/// While the test fault says hold-takeover (at most 5 minutes): the
/// takeover's VM is prepared, nothing stored or fenced yet.
fn test_hold_takeover(file: Option<&std::path::Path>) {
    let Some(file) = file else { return };
    let until = Instant::now() + Duration::from_secs(300);
    let mut said = false;
    while Instant::now() < until {
        read_test_fault(file);
        if TEST_FAULT.load(std::sync::atomic::Ordering::Relaxed) != 3 {
            return;
        }
        if !std::mem::replace(&mut said, true) {
            info!("TEST: the takeover holds before the fence");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One connection of the session, for fences and heartbeats.
struct Member {
    out: Outbox,
}

/// Liveness and the session's connections: short critical sections only
/// (applying an epoch happens under [`Backup::standby`], never here).
struct Live {
    /// The pairing served (from its HELLO, or a JOIN while none is).
    session: Option<u128>,
    /// When the primary was last heard from, per path (listen address).
    heard: BTreeMap<String, Instant>,
    hang: Option<String>,
    /// Every connection of the session, by connection number.
    members: BTreeMap<u64, Member>,
    /// The data connection's number.
    data: Option<u64>,
    next_conn: u64,
    role: Role,
    /// The end of protection was confirmed to every connection (queued).
    end_confirmed: bool,
    /// An end of protection was refused during a takeover: the primary,
    /// unconfirmed, stops its VM, so the takeover must go on even if the
    /// primary is heard before it fences.
    end_refused: bool,
    /// The backup's generation (mirrors the standby's).
    generation: u64,
    /// The VM instances it took over from (stored with the generation).
    superseded: Vec<Instance>,
    epoch: u64,
    /// The VM instance of the checkpoint (mirrors the standby's).
    instance: Option<Instance>,
    /// The address the session's data connection came from (what
    /// `--fence-peer` is told to fence).
    primary: Option<String>,
}

impl Live {
    /// No pairing yet, at `generation`, having taken over from the
    /// instances `superseded`.
    fn new(generation: u64, superseded: Vec<Instance>) -> Live {
        Live {
            session: None,
            heard: BTreeMap::new(),
            hang: None,
            members: BTreeMap::new(),
            data: None,
            next_conn: 0,
            role: Role::Standby,
            end_confirmed: false,
            end_refused: false,
            generation,
            superseded,
            epoch: 0,
            instance: None,
            primary: None,
        }
    }

    fn heard(&mut self, path: &str) {
        self.heard.insert(path.to_owned(), Instant::now());
    }

    /// Switches to pairing `session`: connections of any other are closed.
    fn adopt(&mut self, session: u128) {
        if self.session == Some(session) {
            return;
        }
        if let Some(old) = self.session {
            info!(
                "session {} replaces session {}",
                session_name(session),
                session_name(old)
            );
        }
        self.session = Some(session);
        for (_, m) in std::mem::take(&mut self.members) {
            m.out.close();
        }
        self.data = None;
        self.heard.clear();
        self.hang = None;
    }

    /// Whether a JOIN of `session` from the VM instance `instance` joins:
    /// the session in progress; or, while this backup holds no checkpoint
    /// (no pairing yet, or one that never completed, e.g. refused at its
    /// HELLO), a new one, which replaces it, as a new pairing's HELLO does;
    /// or a new one of the checkpoint's own VM instance (a restarted
    /// hagctl: [`Standby::busy`]). Never another session while taking
    /// over.
    fn admits(&self, session: u128, instance: Option<Instance>) -> bool {
        if self.role.taking_over() {
            return self.session == Some(session);
        }
        self.session.is_none_or(|s| s == session)
            || self.epoch == 0
            || (instance.is_some() && instance == self.instance)
    }

    fn member_of(&self, conn: u64) -> bool {
        self.members.contains_key(&conn)
    }

    /// Posts `msg` to every connection of the session (never blocking).
    fn broadcast(&mut self, msg: &Msg) {
        if swallowed(msg) {
            return;
        }
        self.members.retain(|_, m| m.out.post(msg));
    }
}

struct Backup {
    opts: Arc<BackupOptions>,
    live: Mutex<Live>,
    standby: Mutex<Standby<StandbyRam>>,
    key: Key,
    admission: Arc<Admission>,
    timeout: Duration,
    /// The witness whose grant a takeover needs, if there is one.
    witness: Option<WitnessAt>,
}

impl Backup {
    fn live(&self) -> MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn standby(&self) -> MutexGuard<'_, Standby<StandbyRam>> {
        self.standby.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The primary ended protection (ABORT on any connection of the
    /// session): unless a takeover is under way, the checkpoint goes, so
    /// no takeover can contradict what the primary releases next, and
    /// every connection is told (OK ENDED). During a takeover nothing is
    /// confirmed ([`Role::abort`]).
    fn abort(&self, reason: String) {
        let mut l = self.live();
        let answer = l.role.abort(reason.clone());
        l.end_refused |= answer == AbortAnswer::Refuse;
        drop(l);
        if answer == AbortAnswer::Refuse {
            info!(
                "the primary ended protection ({reason}) while this backup takes over: not confirmed"
            );
            return;
        }
        // Confirmed at once: the role has ended, which already rules out a
        // takeover. Freeing the image comes after, as it may take longer
        // (a large guest's RAM, on a loaded host) than the primary waits
        // for the confirmation before it stops its VM.
        let mut l = self.live();
        l.broadcast(&Msg::Ok { phase: ENDED_PHASE });
        if answer == AbortAnswer::End {
            l.heard.clear();
            l.hang = None;
            drop(l);
            self.standby().discard();
            info!("the primary ended protection: {reason}; standby image discarded");
            // Only now may the backup finish: the confirmation is queued
            // and the image gone.
            self.live().end_confirmed = true;
        }
    }
}

/// The largest wait for one whole checkpoint-stream message (a trickling
/// peer is cut off at this, whatever its pace). It includes the wait for
/// the message to begin: in a first synchronisation the primary reads its
/// whole disks to compare their chunks' sums with the backup's before it
/// sends the next message, which took over 120 s for the Debian guest's
/// 2 GiB disk under emulation (qemu_failover_database was cut off there
/// and began again), and takes minutes for a large disk on a real host.
const DATA_MESSAGE_DEADLINE: Duration = Duration::from_secs(600);

fn data_session(
    b: &Backup,
    mut r: Reader,
    out: Outbox,
    conn: u64,
    first: Msg,
    from: &str,
    path: &str,
) {
    info!("checkpoint stream from {from}");
    let (session, term) = match &first {
        Msg::Hello { session, term, .. } => (*session, term.clone()),
        _ => return,
    };
    // Before terms a primary's generation came only with its epochs: the
    // standby refuses a stale one there.
    if let Some(refusal) = refuse_term(
        b,
        &b.live(),
        term.as_ref(),
        &format!("checkpoint stream from {from}"),
    ) {
        out.send(&refusal);
        return;
    }
    let mut msg = first;
    let mut joined = false;
    loop {
        if b.live().role.taking_over() {
            // An end of protection on the data link is answered as on a
            // control connection: refused, and said so.
            if let Msg::Abort { reason } = &msg {
                b.abort(reason.clone());
            }
            let why = format!(
                "this backup took over (generation {}); the primary's VM must stop",
                b.live().generation
            );
            out.send(&Msg::Error { message: why });
            return;
        }
        let is_hello = matches!(msg, Msg::Hello { .. });
        let result = {
            let mut st = b.standby();
            let r = if let Some(busy) = st.busy(session, term.as_ref().map(|t| t.instance)) {
                Err(busy)
            } else if !is_hello && st.owner != conn {
                // A newer connection of the session took the stream over.
                return;
            } else {
                if is_hello {
                    st.new_session();
                    st.owner = conn;
                }
                st.on(msg, &mut |size, shape| {
                    feasible_for(b.opts.as_ref(), size, shape)?;
                    StandbyRam::new(size).map_err(|e| e.to_string())
                })
            };
            if let Ok(Some(Msg::EpochAck { epoch, .. })) = &r {
                // Read by qemu-tests/eval: what each epoch really changed.
                info!(
                    "epoch {epoch} applied: {} pages, {} changed",
                    st.stats.last_epoch_pages, st.stats.last_epoch_changed
                );
            }
            (
                r,
                st.generation,
                st.committed.as_ref().map_or(0, |c| c.epoch),
                st.committed.as_ref().and_then(|c| c.instance),
            )
        };
        let (result, generation, epoch, instance) = result;
        {
            let mut l = b.live();
            l.generation = generation;
            l.epoch = epoch;
            l.instance = instance;
            if is_hello && result.is_ok() && !joined {
                // The pairing is this session now; the data connection
                // is one of its members.
                l.adopt(session);
                l.primary = Some(
                    from.parse::<std::net::SocketAddr>()
                        .map_or_else(|_| from.to_owned(), |a| a.ip().to_string()),
                );
                if let Some(old) = l.data.replace(conn) {
                    if let Some(m) = l.members.remove(&old) {
                        m.out.close();
                    }
                }
                l.members.insert(conn, Member { out: out.clone() });
                joined = true;
            }
            if joined && !l.member_of(conn) {
                // Another pairing took over this backup's session.
                return;
            }
            l.heard(path);
        }
        let reply = match result {
            Ok(reply) => reply,
            Err(StandbyError::Ended(reason)) => {
                b.abort(reason);
                return;
            }
            Err(e) => {
                info!("checkpoint stream from {from}: {e}");
                out.send(&Msg::Error {
                    message: e.to_string(),
                });
                b.standby().new_session();
                return;
            }
        };
        if let Some(reply) = reply.filter(|r| !swallowed(r)) {
            if !out.send(&reply) {
                return;
            }
        }
        r.set_deadline(Some(Instant::now() + DATA_MESSAGE_DEADLINE));
        msg = match read_msg(&mut r) {
            Ok((m, _)) => m,
            Err(e) => {
                if b.live().member_of(conn) {
                    info!("checkpoint stream from {from} ended: {e}");
                }
                return;
            }
        };
    }
}

/// The answer to a HELLO or JOIN (on `conn`, for the log) whose primary
/// must not pair, if it must not: an ERROR for a primary of another VM, a
/// HELLO_OK saying `superseded` (with the generation that replaced it: it
/// stops its VM) for an instance this backup took over from.
fn refuse_term(b: &Backup, l: &Live, term: Option<&Term>, conn: &str) -> Option<Msg> {
    if let Some(why) = term::wrong_vm(b.opts.vm_name.as_ref(), term) {
        info!("refused a {conn}: {why}");
        return Some(Msg::Error { message: why });
    }
    let t = term?;
    if term::judge(l.generation, &l.superseded, Some(t), t.generation) != Verdict::Superseded {
        return None;
    }
    info!(
        "{conn}: {} was taken over from (generation {}): told to stop",
        t.instance, l.generation
    );
    Some(Msg::HelloOk {
        version: VERSION_MAX,
        generation: l.generation,
        timeout_ms: b.timeout.as_millis().min(u32::MAX as u128) as u32,
        superseded: Some(true),
        witness: b.witness.as_ref().map(WitnessAt::id),
    })
}

fn control_session(
    b: &Backup,
    mut r: Reader,
    out: Outbox,
    conn: u64,
    (session, term): (u128, Option<Term>),
    from: &str,
    path: &str,
) {
    {
        let mut l = b.live();
        // Whatever session it names: the copy this backup took over from
        // must stop. Before terms a primary learnt the generation from the
        // answer and judged itself (primary::Policy).
        if let Some(refusal) = refuse_term(
            b,
            &l,
            term.as_ref(),
            &format!("control connection from {from}"),
        ) {
            out.send(&refusal);
            return;
        }
        if !l.admits(session, term.as_ref().map(|t| t.instance)) {
            let why = format!(
                "refused a control connection from {from}: session {} is not this backup's ({})",
                session_name(session),
                l.session.map_or("none".into(), session_name)
            );
            info!("{why}");
            out.send(&Msg::Error { message: why });
            return;
        }
        l.adopt(session);
        let ok = Msg::HelloOk {
            version: VERSION_MAX,
            generation: l.generation,
            timeout_ms: b.timeout.as_millis().min(u32::MAX as u128) as u32,
            superseded: term.as_ref().map(|_| false),
            witness: b.witness.as_ref().map(WitnessAt::id),
        };
        if !swallowed(&ok) {
            out.post(&ok);
        }
        l.members.insert(conn, Member { out });
        l.heard(path);
    }
    debug!(
        "control connection from {from} (path {path}, session {})",
        session_name(session)
    );
    loop {
        r.set_deadline(Some(Instant::now() + b.timeout.max(HEARTBEAT * 5) * 2));
        let msg = match read_msg(&mut r) {
            Ok((m, _)) => m,
            Err(_) => break,
        };
        let mut l = b.live();
        if !l.member_of(conn) {
            info!(
                "{} from {from} refused: its session {} is no longer this backup's",
                msg.ty().name(),
                session_name(session)
            );
            break;
        }
        match msg {
            Msg::Heartbeat { generation, .. } => {
                if generation < l.generation {
                    // A stale primary: it is not the one protected; it
                    // hears the fence in every heartbeat it gets.
                    info!(
                        "heartbeat from {from} at generation {generation}, this backup is at {}: not counted",
                        l.generation
                    );
                } else {
                    l.heard(path);
                }
            }
            Msg::Hang { reason } => {
                l.heard(path);
                l.hang = Some(reason);
            }
            Msg::Abort { reason } => {
                drop(l);
                b.abort(reason);
                break;
            }
            other => {
                info!(
                    "control connection from {from}: unexpected {}",
                    other.ty().name()
                );
                break;
            }
        }
    }
    if let Some(m) = b.live().members.remove(&conn) {
        m.out.close();
    }
}

/// Serves one listener; `path` (its address) names the heartbeat path.
/// Every connection authenticates first, in the handshake pool
/// ([`crate::admission`]); only then does it hold a session slot, and only
/// then is anything read.
fn accept_loop(b: Arc<Backup>, listener: TcpListener, path: String) {
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        let Ok(peer) = stream.peer_addr() else {
            continue;
        };
        let from = peer.to_string();
        let handshake = match b.admission.handshake(peer.ip()) {
            Ok(h) => h,
            Err(e) => {
                info!("refused a connection from {from}: {e}");
                continue;
            }
        };
        let b = b.clone();
        let path = path.clone();
        std::thread::spawn(move || {
            tune(&stream);
            let (mut r, w) = match secure::handshake_within(
                stream,
                &b.key,
                false,
                admission::ACCEPT_HANDSHAKE,
            ) {
                Ok(rw) => rw,
                Err(e) => {
                    info!("refused a connection from {from}: {e}");
                    return;
                }
            };
            let _slot = match handshake.authenticated() {
                Ok(slot) => slot,
                Err(e) => {
                    info!("refused a connection from {from}: {e}");
                    return;
                }
            };
            let Ok(out) = Outbox::spawn(w) else { return };
            let conn = {
                let mut l = b.live();
                l.next_conn += 1;
                l.next_conn
            };
            r.set_deadline(Some(Instant::now() + secure::HANDSHAKE_TIMEOUT));
            match read_msg(&mut r) {
                Ok((m @ Msg::Hello { .. }, _)) => data_session(&b, r, out, conn, m, &from, &path),
                Ok((Msg::Join { session, term }, _)) => {
                    control_session(&b, r, out, conn, (session, term), &from, &path)
                }
                Ok((m, _)) => {
                    info!(
                        "refused a connection from {from}: it opened with {}",
                        m.ty().name()
                    );
                    out.send(&Msg::Error {
                        message: format!("unexpected {} to open a connection", m.ty().name()),
                    });
                }
                Err(e) => info!("connection from {from}: {e}"),
            }
        });
    }
}

/// Heartbeats to every connection of the session, posted, never blocking.
fn heartbeat_loop(b: Arc<Backup>) {
    loop {
        std::thread::sleep(HEARTBEAT);
        let mut l = b.live();
        let msg = Msg::Heartbeat {
            generation: l.generation,
            epoch: l.epoch,
        };
        let data = l.data;
        if swallowed(&msg) {
            continue;
        }
        l.members
            .retain(|&c, m| Some(c) == data || m.out.post(&msg));
    }
}

/// The backup's runtime status, in its status directory: pid, state,
/// listen address, generation, last applied epoch; rewritten at every
/// epoch (what `hagctl takeover` and `hagctl job` read).
fn status_path(dir: &std::path::Path) -> PathBuf {
    dir.join("backup.json")
}

/// Writes the status of a backup standing by at `generation` with
/// `epoch` its last applied one (0: none yet), and the instances it took
/// over from (kept in the durable record too).
fn publish_standby(opts: &BackupOptions, generation: u64, epoch: u64, superseded: &[Instance]) {
    let record = Record {
        generation,
        superseded: superseded.to_vec(),
    };
    let state = serde_json::json!({
        "pid": std::process::id(),
        "state": "standby",
        "listen": opts.listen,
        "generation": generation,
        "epoch": epoch,
        "superseded": record.superseded_json(),
    });
    if let Err(e) = crate::vm_dirs::write_json(&status_path(&opts.status_dir), &state, false) {
        warning!("{e}");
    }
}

/// The backup's durable generation, in its state directory: written with
/// `fsync` (and read back) at each takeover, before the fence; read at
/// start. Apart from the status so that the per-epoch rewrite never waits
/// for a disk.
fn generation_path(dir: &std::path::Path) -> PathBuf {
    dir.join("generation.json")
}

/// `hagctl takeover`'s request, in the backup's status directory.
fn request_path(dir: &std::path::Path) -> PathBuf {
    dir.join("takeover.request")
}

/// Why a requested takeover did not happen, written by the backup.
fn refusal_path(dir: &std::path::Path) -> PathBuf {
    dir.join("takeover.refused")
}

/// Whether `hagctl takeover` asked for a takeover (the request is taken:
/// it is acted on once).
fn take_request(dir: &std::path::Path) -> bool {
    std::fs::remove_file(request_path(dir)).is_ok()
}

/// Says why a requested takeover did not happen, for `hagctl takeover`.
fn refuse_request(dir: &std::path::Path, why: &str) {
    info!("the requested takeover did not happen: {why}");
    if let Err(e) = std::fs::write(refusal_path(dir), format!("{why}\n")) {
        warning!("{}: {e}", refusal_path(dir).display());
    }
}

/// `hagctl takeover`: asks the `hagctl backup` whose files are in `dirs`
/// to take over now (its primary fenced by the caller), and waits up to
/// `timeout` for the outcome. Returns the new generation.
pub fn request_takeover(dirs: &crate::vm_dirs::VmDirs, timeout: Duration) -> anyhow::Result<u64> {
    let dir = dirs.run.as_path();
    let state: serde_json::Value = std::fs::read_to_string(status_path(dir))
        .map_err(|e| anyhow::anyhow!("no hagctl backup status in {}: {e}", dir.display()))
        .and_then(|s| Ok(serde_json::from_str(&s)?))?;
    let pid = state.get("pid").and_then(|p| p.as_u64()).unwrap_or(0);
    let alive = u32::try_from(pid).is_ok_and(crate::jobs::is_hagctl);
    if !alive {
        anyhow::bail!(
            "the hagctl backup of {} (pid {pid}) is not running",
            status_path(dir).display()
        );
    }
    if state.get("state").and_then(|s| s.as_str()) == Some("took-over") {
        anyhow::bail!(
            "the backup of {} took over already (generation {})",
            dir.display(),
            state
                .get("generation")
                .and_then(|g| g.as_u64())
                .unwrap_or(0)
        );
    }
    let _ = std::fs::remove_file(refusal_path(dir));
    std::fs::write(request_path(dir), format!("{}\n", std::process::id()))
        .map_err(|e| anyhow::anyhow!("{}: {e}", request_path(dir).display()))?;
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(why) = std::fs::read_to_string(refusal_path(dir)) {
            let _ = std::fs::remove_file(refusal_path(dir));
            return Err(crate::exit::with_status(
                crate::exit::Status::Refused,
                format!("the backup did not take over: {}", why.trim()),
            ));
        }
        let now: Option<serde_json::Value> = std::fs::read_to_string(status_path(dir))
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok());
        if let Some(now) = now {
            if now.get("state").and_then(|s| s.as_str()) == Some("took-over") {
                return Ok(now.get("generation").and_then(|g| g.as_u64()).unwrap_or(0));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_file(request_path(dir));
    anyhow::bail!(
        "no takeover within {:.0} s (the request was withdrawn)",
        timeout.as_secs_f64()
    )
}

/// The fencing record in a backup file (status or durable) at `path`:
/// `None` if there is no file, an error if there is one that does not say
/// its generation or lists an instance it cannot read (a backup must not
/// start below a takeover it cannot read, nor forget whom it took over
/// from).
fn record_in(path: &std::path::Path) -> Result<Option<Record>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let v: Option<serde_json::Value> = serde_json::from_str(&text).ok();
    let generation = v
        .as_ref()
        .and_then(|v| v.get("generation")?.as_u64())
        .ok_or_else(|| format!("{} holds no generation: '{}'", path.display(), text.trim()))?;
    let superseded = v
        .as_ref()
        .map_or(Ok(Vec::new()), Record::superseded_from_json)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Some(Record {
        generation,
        superseded,
    }))
}

/// What this backup stored: the highest generation and every instance
/// taken over from, in the durable record in `state_dir` and the status
/// in `status_dir` (a restart without a reboot keeps it; before the state
/// directory existed, the generation was kept only there).
pub fn stored_record(
    state_dir: &std::path::Path,
    status_dir: &std::path::Path,
) -> Result<Record, String> {
    let mut record = Record::default();
    for r in [
        record_in(&generation_path(state_dir))?,
        record_in(&status_path(status_dir))?,
    ]
    .into_iter()
    .flatten()
    {
        for i in r.superseded {
            record.take_over(record.generation, Some(i));
        }
        record.generation = record.generation.max(r.generation);
    }
    Ok(record)
}

/// Stores a generation durably in `state_dir` and reads it back.
fn store_generation(state_dir: &std::path::Path, value: &serde_json::Value) -> Result<(), String> {
    let path = generation_path(state_dir);
    crate::vm_dirs::write_json(&path, value, true)?;
    let want = value.get("generation").and_then(|g| g.as_u64());
    let got = record_in(&path)?.map(|r| r.generation);
    if got != want {
        return Err(format!(
            "{} reads back generation {got:?}, not {want:?}",
            path.display()
        ));
    }
    Ok(())
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
    // The VM a takeover started ends with this backup: a VM left running by
    // a dead controller is an unmanaged second copy.
    qemu_standby::dies_with_this_process(&mut cmd);
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
                let _ = child.kill();
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

impl BackupOptions {
    /// The VMM this backup stands by with.
    pub fn vmm_kind(&self) -> VmmKind {
        if self.qemu.is_empty() {
            VmmKind::HagVmm
        } else {
            VmmKind::Qemu
        }
    }
}

/// Whether a takeover of a VM with `ram_size` bytes of RAM could run
/// here, checked when a primary pairs: for QEMU, the standby started as a
/// dry run ([`qemu_standby::dry_run`]), which must be the primary's VM
/// (its `shape`, where the primary sent one) as its guest sees it.
fn feasible_for(
    opts: &BackupOptions,
    ram_size: u64,
    shape: Option<&VmShape>,
) -> Result<(), String> {
    feasible(opts)?;
    if opts.vmm_kind() == VmmKind::Qemu {
        crate::replica::create_named(&opts.qemu, &opts.replica_dir)?;
        let standby = qemu_standby::dry_run(&opts.qemu, ram_size, &opts.status_dir)
            .map_err(|e| format!("the QEMU that would take over does not start here: {e}"))?;
        if let Some(primary) = shape {
            let differences = vm_shape::differences(primary, &standby);
            if !differences.is_empty() {
                return Err(format!(
                    "the QEMU that would take over is not the primary's VM as its guest sees it \
                     (hagctl backup's QEMU command line must describe the same machine, CPU and devices): {}",
                    differences.join("; ")
                ));
            }
        }
    }
    Ok(())
}

/// Whether a takeover could run here: the vGPU exists and the VMM is
/// there (checked at start, when a primary pairs, and again at takeover).
fn feasible(opts: &BackupOptions) -> Result<(), String> {
    if let Some(program) = opts.qemu.first() {
        return if program_found(std::path::Path::new(program)) {
            Ok(())
        } else {
            Err(format!("no QEMU {program} here"))
        };
    }
    let mdev = std::path::Path::new("/sys/bus/mdev/devices").join(&opts.mdev);
    if !mdev.exists() {
        return Err(format!("this host has no mdev {}", opts.mdev));
    }
    if !program_found(&opts.vmm) {
        return Err(format!("no VMM {} here", opts.vmm.display()));
    }
    Ok(())
}

/// `program` exists (a path), or is on PATH.
fn program_found(program: &std::path::Path) -> bool {
    if program.components().count() > 1 {
        program.exists()
    } else {
        std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).exists()))
    }
}

/// Stores a takeover's generation durably (before the fence), with the
/// instance it supersedes: the checkpoint's.
fn persist_takeover(
    opts: &BackupOptions,
    b: &Backup,
    cp: &Checkpoint,
    reason: &str,
    generation: u64,
) -> Result<(), String> {
    let mut record = Record {
        generation,
        superseded: b.live().superseded.clone(),
    };
    record.take_over(generation, cp.instance);
    let state = serde_json::json!({
        "pid": std::process::id(),
        "state": "took-over",
        "listen": opts.listen,
        "generation": generation,
        "epoch": cp.epoch,
        "reason": reason,
        "superseded": record.superseded_json(),
    });
    store_generation(&opts.state_dir, &state)?;
    b.live().superseded = record.superseded;
    crate::vm_dirs::write_json(&status_path(&opts.status_dir), &state, false)
}

/// `--fence-peer`, if given, for a takeover to `generation` from `cp`.
fn fence_primary(
    opts: &BackupOptions,
    b: &Backup,
    cp: &Checkpoint,
    reason: &str,
    generation: u64,
) -> Result<(), String> {
    let Some(fence) = &opts.fence_peer else {
        return Ok(());
    };
    let facts = FenceFacts {
        peer: b.live().primary.clone().unwrap_or_default(),
        listen: opts.listen.clone(),
        generation,
        epoch: cp.epoch,
        reason: reason.to_owned(),
    };
    info!(
        "takeover: fencing the primary {} with --fence-peer",
        if facts.peer.is_empty() {
            "(never heard)"
        } else {
            &facts.peer
        }
    );
    fence.run(&facts)
}

/// The witness's grant of the instance `cp` was taken from, at its
/// generation ([`TakeoverSteps::claim`]).
fn claim_from_witness(b: &Backup, cp: &Checkpoint) -> Result<(), TakeoverError> {
    let generation = cp.generation;
    let Some(witness) = &b.witness else {
        return Ok(());
    };
    let instance = cp.instance.ok_or_else(|| {
        TakeoverError::NotGranted("the checkpoint names no VM instance to claim".into())
    })?;
    info!(
        "takeover: claiming {instance} at generation {generation} from the witness {}",
        witness.addr
    );
    let answer = witness
        .ask(&witness::Request::Claim {
            side: witness::Side::Backup,
            instance: instance.into(),
            generation,
            vm: b.opts.vm_name.as_ref().map(|n| n.to_string()),
        })
        .map_err(TakeoverError::NotGranted)?;
    match answer.verdict {
        witness::Verdict::Granted => {}
        witness::Verdict::Undecided => return Err(TakeoverError::NotGranted(answer.why)),
        witness::Verdict::Refused => return Err(TakeoverError::Void(answer.why)),
    }
    info!("the witness: {}", answer.why);
    Ok(())
}

/// Tells every connection of the session, the data link's too, the new
/// generation.
fn fence(b: &Backup, generation: u64, epoch: u64) {
    let mut l = b.live();
    l.generation = generation;
    l.broadcast(&Msg::Heartbeat { generation, epoch });
}

/// What every real takeover shares: the decision it carries out.
struct Decided<'a> {
    opts: &'a BackupOptions,
    b: &'a Backup,
    cp: &'a Checkpoint,
    detected: Instant,
    /// The decision was on silence, at this instant.
    silent_since: Option<Instant>,
}

/// A real takeover's own part: the VM it prepares, resumes or abandons.
/// The steps between (re-check, claim, fence agent, durable generation,
/// fence) are every takeover's ([`TakeoverSteps`] for any `VmSteps`).
trait VmSteps {
    /// The decision, and its reason.
    fn decided(&self) -> (&Decided<'_>, &str);
    fn prepare_vm(&mut self) -> Result<(), String>;
    fn resume_vm(&mut self) -> Result<(), String>;
    fn abandon_vm(&mut self);
}

impl<T: VmSteps> TakeoverSteps for T {
    fn prepare(&mut self) -> Result<(), String> {
        self.prepare_vm()
    }
    fn recheck(&mut self) -> Result<(), String> {
        let (d, _) = self.decided();
        still_silent(d.b, d.silent_since)
    }
    fn claim(&mut self) -> Result<(), TakeoverError> {
        let (d, _) = self.decided();
        claim_from_witness(d.b, d.cp)
    }
    fn fence_peer(&mut self, generation: u64) -> Result<(), String> {
        let (d, reason) = self.decided();
        fence_primary(d.opts, d.b, d.cp, reason, generation)
    }
    fn persist(&mut self, generation: u64) -> Result<(), String> {
        let (d, reason) = self.decided();
        persist_takeover(d.opts, d.b, d.cp, reason, generation)
    }
    fn fence(&mut self, generation: u64) {
        let (d, _) = self.decided();
        fence(d.b, generation, d.cp.epoch);
    }
    fn resume(&mut self) -> Result<(), String> {
        self.resume_vm()
    }
    fn abandon(&mut self) {
        self.abandon_vm()
    }
}

/// A QEMU takeover: the standby QEMU started on the image itself (its
/// memfd is the VM's RAM), the epoch's device state loaded.
struct QemuTakeover<'a> {
    d: Decided<'a>,
    image: &'a StandbyRam,
    report: TakeoverReport,
    standby: Option<qemu_standby::Standby>,
}

impl VmSteps for QemuTakeover<'_> {
    fn decided(&self) -> (&Decided<'_>, &str) {
        (&self.d, &self.report.reason)
    }
    fn prepare_vm(&mut self) -> Result<(), String> {
        feasible(self.d.opts)?;
        let state = EpochState::decode(&self.d.cp.vm_state)?;
        let path = qemu_standby::proc_fd_path(self.image.fd());
        let standby = qemu_standby::start(
            &self.d.opts.qemu,
            state.ram_id,
            &path,
            self.image.size(),
            &self.d.opts.status_dir,
            "takeover",
        )?;
        let standby = self.standby.insert(standby);
        self.report.start_vm_ms = self.d.detected.elapsed().as_secs_f64() * 1e3;
        info!(
            "takeover: QEMU (pid {}) waits for epoch {} ({:.0} ms)",
            standby.child.id(),
            self.d.cp.epoch,
            self.report.start_vm_ms
        );
        let t = Instant::now();
        standby
            .load(state.stream)
            .map_err(|e| format!("restoring epoch {}: {e}", self.d.cp.epoch))?;
        self.report.restore_ms = t.elapsed().as_secs_f64() * 1e3;
        info!(
            "takeover: epoch {} loaded ({} bytes of device state, {:.0} ms), the VM paused",
            self.d.cp.epoch,
            state.stream.len(),
            self.report.restore_ms
        );
        test_hold_takeover(self.d.opts.test_fault_file.as_deref());
        Ok(())
    }
    fn resume_vm(&mut self) -> Result<(), String> {
        let t = Instant::now();
        self.standby
            .as_mut()
            .ok_or_else(|| "nothing prepared".to_owned())?
            .run()?;
        self.report.restore_ms += t.elapsed().as_secs_f64() * 1e3;
        self.report.takeover_ms = self.d.detected.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }
    fn abandon_vm(&mut self) {
        if let Some(s) = &mut self.standby {
            s.kill();
        }
    }
}

/// A takeover libvirt owns: the epoch written as a save image of the
/// protected domain and restored paused by libvirtd, guest RAM the standby
/// image (the hook links it where libvirt puts the domain's RAM file);
/// resumed with `virsh resume` ([`crate::libvirt_restore`]).
struct LibvirtTakeover<'a> {
    d: Decided<'a>,
    owned: &'a crate::libvirt_restore::Owned,
    image: &'a StandbyRam,
    report: TakeoverReport,
    /// The domain's name, once restored.
    restored: Option<String>,
}

impl LibvirtTakeover<'_> {
    fn restore(&mut self) -> Result<String, String> {
        use crate::libvirt_restore::{ram_marker, Restore};
        let facts = self.owned.facts()?;
        let state = EpochState::decode(&self.d.cp.vm_state)?;
        let marker = ram_marker(&facts.name);
        if let Some(dir) = marker.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        std::fs::write(&marker, qemu_standby::proc_fd_path(self.image.fd()))
            .map_err(|e| format!("{}: {e}", marker.display()))?;
        let restored = Restore {
            owned: self.owned,
            facts: &facts,
            fifo: &self.d.opts.status_dir.join("takeover.save"),
        }
        .run(state.stream);
        let _ = std::fs::remove_file(&marker);
        // Restored or not, the domain may exist now: abandon destroys it.
        self.restored = Some(facts.name.clone());
        restored?;
        Ok(facts.name)
    }
}

impl VmSteps for LibvirtTakeover<'_> {
    fn decided(&self) -> (&Decided<'_>, &str) {
        (&self.d, &self.report.reason)
    }
    fn prepare_vm(&mut self) -> Result<(), String> {
        let t = Instant::now();
        let name = self.restore()?;
        self.report.start_vm_ms = self.d.detected.elapsed().as_secs_f64() * 1e3;
        self.report.restore_ms = t.elapsed().as_secs_f64() * 1e3;
        info!(
            "takeover: libvirt restored domain {name} from epoch {} ({:.0} ms), paused",
            self.d.cp.epoch, self.report.restore_ms
        );
        test_hold_takeover(self.d.opts.test_fault_file.as_deref());
        Ok(())
    }
    fn resume_vm(&mut self) -> Result<(), String> {
        let name = self.restored.clone().ok_or("nothing restored")?;
        let t = Instant::now();
        self.owned.virsh(&["resume", &name])?;
        self.report.restore_ms += t.elapsed().as_secs_f64() * 1e3;
        self.report.takeover_ms = self.d.detected.elapsed().as_secs_f64() * 1e3;
        if !self.owned.replicas.is_empty() {
            let file = self.d.opts.status_dir.join("takeover-define.xml");
            let disks: Vec<String> = self
                .owned
                .replicas
                .iter()
                .map(|r| format!("{} on {}", r.id, r.replica.display()))
                .collect();
            match self.owned.define_on_replicas(&name, &file) {
                Ok(true) => info!(
                    "domain {name} runs on its disks' replicas ({}); its definition names them now",
                    disks.join(", ")
                ),
                Ok(false) => info!(
                    "domain {name} runs on its disks' replicas ({}); it is transient: no definition to change",
                    disks.join(", ")
                ),
                Err(e) => warning!(
                    "domain {name} runs on its disks' replicas ({}), but its definition still names its own images, which its next start would boot from: {e}",
                    disks.join(", ")
                ),
            }
        }
        Ok(())
    }
    fn abandon_vm(&mut self) {
        if let Some(name) = self.restored.take() {
            if let Err(e) = self.owned.virsh(&["destroy", &name]) {
                warning!("the restored domain {name} could not be destroyed: {e}");
            }
        }
    }
}

/// Has the hook's configuration protect the domain a libvirt takeover
/// restored at `generation` again, then returns once it is no longer
/// running or paused (shut off, or gone).
fn wait_for_domain_end(owned: &crate::libvirt_restore::Owned, generation: u64) {
    let Ok(facts) = owned.facts() else { return };
    info!(
        "the VM taken over is libvirt's domain {} now; standing by until it ends, to fence the old primary",
        facts.name
    );
    match owned.virsh(&["dumpxml", &facts.name]) {
        Ok(xml) => crate::libvirt_hook::protect_restored(&facts.name, &xml, generation),
        Err(e) => warning!("domain {} is not protected again: {e}", facts.name),
    }
    loop {
        std::thread::sleep(Duration::from_secs(2));
        match owned.virsh(&["domstate", &facts.name]) {
            Ok(state)
                if matches!(
                    state.trim(),
                    "running" | "paused" | "in shutdown" | "pmsuspended"
                ) => {}
            Ok(state) => {
                info!("domain {} is {}: the backup ends", facts.name, state.trim());
                return;
            }
            Err(e) => {
                info!("domain {}: {e}: the backup ends", facts.name);
                return;
            }
        }
    }
}

/// The real takeover: hag-vmm started here, the image copied in.
struct Takeover<'a> {
    d: Decided<'a>,
    image: &'a StandbyRam,
    report: TakeoverReport,
    child: Option<Child>,
    incoming: Option<IncomingVm>,
}

impl VmSteps for Takeover<'_> {
    fn decided(&self) -> (&Decided<'_>, &str) {
        (&self.d, &self.report.reason)
    }
    fn prepare_vm(&mut self) -> Result<(), String> {
        feasible(self.d.opts)?;
        let (child, mut vm) =
            start_vm(self.d.opts, self.image.size()).map_err(|e| e.to_string())?;
        self.child = Some(child);
        self.report.start_vm_ms = self.d.detected.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let ram = vm.ram().map_err(|e| e.to_string())?;
        if ram.size() != self.image.size() {
            return Err(format!(
                "the VM has {} bytes of RAM, the image {}",
                ram.size(),
                self.image.size()
            ));
        }
        // The incoming VM's RAM is zero: copy the pages the image ever had
        // written (and are not zero now).
        let mut page = [0u8; PAGE];
        for p in self.image.written() {
            self.image
                .read_at(p * PAGE_SIZE, &mut page)
                .map_err(|e| e.to_string())?;
            if page.iter().any(|&b| b != 0) {
                ram.write(p * PAGE_SIZE, &page).map_err(|e| e.to_string())?;
                self.report.pages += 1;
            }
        }
        self.report.fill_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let mut incoming = IncomingVm::open(vm, ram).map_err(|e| e.to_string())?;
        incoming
            .prepare(&self.d.cp.context, &self.d.cp.vm_state)
            .map_err(|e| format!("restoring epoch {}: {e}", self.d.cp.epoch))?;
        self.report.restore_ms = t.elapsed().as_secs_f64() * 1e3;
        self.incoming = Some(incoming);
        Ok(())
    }
    fn resume_vm(&mut self) -> Result<(), String> {
        let t = Instant::now();
        let incoming = self
            .incoming
            .as_mut()
            .ok_or_else(|| "nothing prepared".to_owned())?;
        incoming.resume()?;
        self.report.restore_ms += t.elapsed().as_secs_f64() * 1e3;
        self.report.takeover_ms = self.d.detected.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }
    fn abandon_vm(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `hagctl backup`: returns the VM's exit status once it ends after a
/// takeover, or `None` when the primary ended protection.
pub fn backup(opts: &BackupOptions) -> anyhow::Result<Option<ExitStatus>> {
    let key = Key::load(&opts.key)?;
    let witness = witness::configured(&opts.witness, &key)?;
    feasible(opts).map_err(|e| anyhow::anyhow!("cannot stand by: {e}"))?;
    // The takeover's VM puts its sockets there: a named VM's directory is
    // new on a fresh host.
    std::fs::create_dir_all(&opts.status_dir)
        .map_err(|e| anyhow::anyhow!("cannot stand by: {}: {e}", opts.status_dir.display()))?;
    // The generation survives a restart: never go back below a takeover.
    let stored = stored_record(&opts.state_dir, &opts.status_dir)
        .map_err(|e| anyhow::anyhow!("cannot stand by: the stored generation: {e}"))?;
    let generation = opts.generation.max(stored.generation);
    let mut listeners = Vec::new();
    for addr in std::iter::once(&opts.listen).chain(&opts.heartbeat_listen) {
        let l =
            TcpListener::bind(addr).map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
        listeners.push((l, addr.clone()));
    }
    let limits = Limits {
        max_ram: opts.max_ram,
        timeout_ms: opts.failover_timeout.as_millis().min(u32::MAX as u128) as u32,
        vmm: opts.vmm_kind(),
        witness: witness.as_ref().map(WitnessAt::id),
    };
    let b = Arc::new(Backup {
        opts: Arc::new(opts.clone()),
        live: Mutex::new(Live::new(generation, stored.superseded)),
        standby: Mutex::new({
            let mut s = Standby::new(generation, limits);
            if !opts.qemu.is_empty() {
                s.replicate_disks(opts.replica_dir.clone(), opts.qemu.clone());
            }
            if let Some(f) = &opts.ram_seed {
                s.seed_ram_from(f.clone());
            }
            s
        }),
        key,
        admission: Admission::new(
            admission::MAX_HANDSHAKES,
            admission::MAX_HANDSHAKES_PER_SOURCE,
            opts.max_connections,
        ),
        timeout: opts.failover_timeout,
        witness,
    });
    for (listener, path) in listeners {
        let b = b.clone();
        std::thread::spawn(move || accept_loop(b, listener, path));
    }
    {
        let b = b.clone();
        std::thread::spawn(move || heartbeat_loop(b));
    }
    info!(
        "backup listening on {}{} ({}, failover timeout {:.1} s, generation {})",
        opts.listen,
        opts.heartbeat_listen
            .iter()
            .map(|a| format!(", heartbeats also on {a}"))
            .collect::<String>(),
        match opts.qemu.first() {
            Some(q) => format!("QEMU standby: {q} …"),
            None => format!("hag-vmm standby with vGPU {}", opts.mdev),
        },
        opts.failover_timeout.as_secs_f64(),
        generation
    );
    crate::service::notify(
        true,
        &format!("standing by on {}, generation {generation}", opts.listen),
    );
    // Standing by with no epoch yet: what `hagctl job` shows, and a
    // cluster manager's resource agent waits for.
    publish_standby(opts, generation, 0, &b.live().superseded);
    let mut last_stored = 0u64;
    let mut holding = false;
    // After a failed takeover, when to try again.
    let mut retry_at: Option<Instant> = None;
    let mut stalls = StallGuard::new(Instant::now());
    loop {
        std::thread::sleep(Duration::from_millis(20));
        if let Some(f) = &opts.test_fault_file {
            read_test_fault(f);
        }
        let has_checkpoint = b.standby().committed.is_some();
        let mut l = b.live();
        if let Role::Ended(reason) = &l.role {
            // Once the checkpoint is discarded and the confirmation queued
            // (just after the role changed), the backup is done, after its
            // connections have written what they hold; until then nothing
            // is decided.
            if !has_checkpoint && l.end_confirmed {
                info!("backup done: {reason}");
                let outboxes: Vec<Outbox> = l.members.values().map(|m| m.out.clone()).collect();
                drop(l);
                for out in outboxes {
                    out.flush(FLUSH_AT_EXIT);
                }
                return Ok(None);
            }
            continue;
        }
        if has_checkpoint && l.epoch != last_stored {
            last_stored = l.epoch;
            publish_standby(opts, l.generation, l.epoch, &l.superseded);
        }
        let paths: Vec<(&str, Option<Duration>)> = std::iter::once(&opts.listen)
            .chain(&opts.heartbeat_listen)
            .map(|a| (a.as_str(), l.heard.get(a).map(Instant::elapsed)))
            .collect();
        let requested = take_request(&opts.status_dir);
        if requested && !has_checkpoint {
            refuse_request(
                &opts.status_dir,
                "no acknowledged checkpoint to take over from",
            );
        }
        // Sampled here, after the locks: a wait for them is a stall too.
        let decision = if stalls.may_decide(Instant::now()) || requested {
            under_policy(
                decide(
                    has_checkpoint,
                    l.hang.as_deref(),
                    &paths,
                    opts.failover_timeout,
                ),
                l.hang.is_some(),
                opts.on_silence,
                requested,
                has_checkpoint,
            )
        } else {
            Decision::Wait
        };
        match decision {
            Decision::Wait => holding = false,
            Decision::Hold(why) => {
                if !std::mem::replace(&mut holding, true) {
                    info!("{why}");
                }
            }
            Decision::Forget(why) => {
                info!("{why}");
                l.hang = None;
                l.heard.clear();
                drop(l);
                b.standby().discard();
                continue;
            }
            Decision::Takeover(reason) => {
                if retry_at.is_some_and(|t| Instant::now() < t) && !requested {
                    continue;
                }
                let detected = Instant::now();
                let silent_since = l.hang.is_none().then_some(detected);
                // From now on no epoch is applied or acknowledged, and
                // no end of protection is confirmed.
                if !l.role.take_over() {
                    if requested {
                        refuse_request(
                            &opts.status_dir,
                            "protection ended, or a takeover is under way",
                        );
                    }
                    continue;
                }
                drop(l);
                let Some((cp, image)) = b.standby().take() else {
                    b.live().role.takeover_failed();
                    if requested {
                        refuse_request(
                            &opts.status_dir,
                            "no acknowledged checkpoint to take over from",
                        );
                    }
                    continue;
                };
                info!(
                    "taking over from epoch {} (generation {} → {}): {reason}",
                    cp.epoch,
                    cp.generation,
                    cp.generation.max(generation) + 1
                );
                let report = TakeoverReport {
                    reason,
                    epoch: cp.epoch,
                    ..TakeoverReport::default()
                };
                let from = b.live().generation;
                let decided = || Decided {
                    opts,
                    b: &b,
                    cp: &cp,
                    detected,
                    silent_since,
                };
                let taken = if let Some(owned) = &opts.libvirt_owned {
                    let mut t = LibvirtTakeover {
                        d: decided(),
                        owned,
                        image: &image,
                        report,
                        restored: None,
                    };
                    take_over(&mut t, from).map(|g| {
                        t.report.generation = g;
                        (t.report, None)
                    })
                } else if opts.vmm_kind() == VmmKind::Qemu {
                    let mut t = QemuTakeover {
                        d: decided(),
                        image: &image,
                        report,
                        standby: None,
                    };
                    take_over(&mut t, from).and_then(|g| {
                        t.report.generation = g;
                        let standby = t.standby.take().ok_or_else(|| {
                            TakeoverError::Resume("the standby QEMU is gone".into())
                        })?;
                        Ok((t.report, Some(standby.child)))
                    })
                } else {
                    let mut t = Takeover {
                        d: decided(),
                        image: &image,
                        report,
                        child: None,
                        incoming: None,
                    };
                    take_over(&mut t, from).and_then(|g| {
                        t.report.generation = g;
                        let child = t
                            .child
                            .take()
                            .ok_or_else(|| TakeoverError::Resume("the VM is gone".into()))?;
                        Ok((t.report, Some(child)))
                    })
                };
                let (report, child) = match taken {
                    Ok(taken) => taken,
                    Err(TakeoverError::Void(why)) => {
                        // The primary ran on past this checkpoint and
                        // released its output: resumed, it would
                        // contradict it. Standing by for its next pairing.
                        info!(
                            "the witness gave the VM to the primary ({why}): the checkpoint of epoch {} can no longer be resumed and is discarded; standing by for the primary's next pairing",
                            cp.epoch
                        );
                        drop((cp, image));
                        let mut l = b.live();
                        l.role.takeover_failed();
                        l.hang = None;
                        l.heard.clear();
                        if requested {
                            refuse_request(
                                &opts.status_dir,
                                &format!("the witness refused: {why}"),
                            );
                        }
                        continue;
                    }
                    Err(e) => {
                        // The backup stands on with its checkpoint: a
                        // transient failure must not end protection.
                        info!(
                            "takeover failed: {e}; standing by with epoch {}, trying again in {} s",
                            cp.epoch,
                            TAKEOVER_RETRY.as_secs()
                        );
                        b.standby().put_back(cp, image);
                        b.live().role.takeover_failed();
                        retry_at = Some(Instant::now() + TAKEOVER_RETRY);
                        if requested {
                            // Asked once: the requester hears why, and
                            // decides again (a silence-based decision
                            // retries by itself).
                            refuse_request(&opts.status_dir, &e.to_string());
                        }
                        continue;
                    }
                };
                // The report on stdout, and as a log line; once only
                // where both are the journal (a unit's), as the log line.
                if opts.json || !crate::log::stdout_is_journal() {
                    let line = if opts.json {
                        serde_json::to_string(&report)? + "\n"
                    } else {
                        report.text()
                    };
                    let mut out = std::io::stdout().lock();
                    out.write_all(line.as_bytes())?;
                    out.flush()?;
                }
                info!("{}", report.text().trim_end());
                // `systemctl status` said "standing by" until now.
                crate::service::notify(
                    false,
                    &format!(
                        "took over: generation {}, the VM resumed here from epoch {}",
                        report.generation, report.epoch
                    ),
                );
                // QEMU opened the image itself: this descriptor is no
                // longer needed, and a checkpoint of the VM refuses RAM
                // another process holds.
                drop(image);
                let Some(mut child) = child else {
                    // libvirt's domain now. This backup stays while it
                    // runs, to answer the old primary's connections with
                    // the newer generation (the fence).
                    if let Some(owned) = &opts.libvirt_owned {
                        wait_for_domain_end(owned, report.generation);
                    }
                    return Ok(None);
                };
                let status = match &opts.reprotect {
                    Some((to, extra)) => crate::reprotect::run(
                        &crate::reprotect::Reprotect {
                            to: to.clone(),
                            qmp: opts.status_dir.join("takeover.qmp"),
                            generation: report.generation,
                            key: opts.key.clone(),
                            failover_timeout: opts.failover_timeout,
                            witness: opts.witness.clone(),
                            status_dir: opts.status_dir.join("reprotect"),
                            state_dir: opts.state_dir.join("reprotect"),
                            extra: extra.clone(),
                        },
                        &mut child,
                    )?,
                    None => child.wait()?,
                };
                return Ok(Some(status));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::tests::snapshot;
    use crate::wire::DiskExtent;

    /// Plain memory; after `fail_after` writes every write fails, and
    /// write number `fail_once` fails (a full disk, a failing device).
    struct Ram {
        pages: Vec<[u8; PAGE]>,
        fail_after: Option<usize>,
        fail_once: Option<usize>,
        writes: usize,
    }

    impl Image for Ram {
        fn ram_size(&self) -> u64 {
            (self.pages.len() * PAGE) as u64
        }
        fn write_page(&mut self, index: u64, bytes: &[u8; PAGE]) -> Result<(), String> {
            self.writes += 1;
            if self.fail_after.is_some_and(|n| self.writes > n)
                || self.fail_once == Some(self.writes)
            {
                return Err("injected write failure".into());
            }
            self.pages[index as usize] = *bytes;
            Ok(())
        }
        fn read_page(&self, index: u64, out: &mut [u8; PAGE]) -> Result<(), String> {
            *out = self.pages[index as usize];
            Ok(())
        }
    }

    const SESSION: u128 = 0x5e55;
    const LIMITS: Limits = Limits {
        max_ram: 1 << 20,
        timeout_ms: 3000,
        vmm: VmmKind::HagVmm,
        witness: None,
    };

    fn standby(generation: u64) -> Standby<Ram> {
        Standby::new(generation, LIMITS)
    }

    fn fresh(size: u64, _shape: Option<&VmShape>) -> Result<Ram, String> {
        Ok(Ram {
            pages: vec![[0; PAGE]; (size / PAGE as u64) as usize],
            fail_after: None,
            fail_once: None,
            writes: 0,
        })
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

    fn feed(s: &mut Standby<Ram>, msgs: Vec<Msg>) -> Result<Vec<Msg>, StandbyError> {
        let mut replies = Vec::new();
        for m in msgs {
            if let Some(r) = s.on(m, &mut fresh)? {
                replies.push(r);
            }
        }
        Ok(replies)
    }

    fn hello_of(session: u128) -> Msg {
        Msg::Hello {
            min: 3,
            max: 3,
            ram_size: 8 * PAGE as u64,
            session,
            vmm: VmmKind::HagVmm,
            term: None,
            shape: None,
        }
    }

    fn hello() -> Msg {
        hello_of(SESSION)
    }

    fn img(s: &Standby<Ram>) -> &Ram {
        s.current.as_ref().unwrap()
    }

    /// Issue 24, item 2: an epoch's VM state may come as a patch against
    /// the committed one; a patch against any other epoch is refused.
    #[test]
    fn a_state_patch_rebuilds_the_next_state_from_the_committed_one() {
        // States of a few hundred bytes that differ in one.
        let state = |epoch: u64| format!("state {epoch} {}", "x".repeat(300)).into_bytes();
        let mut s = standby(0);
        let mut msgs = vec![hello(), pages(0, &[(1, 1)])];
        msgs.push(Msg::RoundEnd { round: 0, pages: 1 });
        let mut first = epoch_msgs(1, 1);
        first[3] = Msg::VmState(state(1));
        msgs.extend(first);
        feed(&mut s, msgs).unwrap();
        let patched = |base_epoch, epoch: u64| {
            let mut m = epoch_msgs(epoch as u32, epoch);
            m[3] = Msg::VmStateDelta {
                base_epoch,
                patch: state_delta::encode(&state(1), &state(epoch)).unwrap(),
            };
            m
        };
        feed(&mut s, patched(1, 2)).unwrap();
        let cp = s.committed.clone().unwrap();
        assert_eq!((cp.epoch, cp.vm_state), (2, state(2)));
        // Epoch 2 is committed now: a patch against epoch 1 is stale.
        let err = feed(&mut s, patched(1, 3)).unwrap_err().to_string();
        assert!(
            err.contains("a device-state patch against epoch 1, but this backup holds epoch 2"),
            "{err}"
        );
        assert_eq!(s.committed.as_ref().unwrap().epoch, 2);
    }

    /// A standby replicating disks into a fresh directory, for a standby
    /// QEMU that opens `vda`'s replica.
    fn disk_standby(name: &str) -> (Standby<Ram>, PathBuf) {
        let dir = std::env::temp_dir().join(format!("hag-standby-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut s = standby(0);
        let file = format!("file={},format=raw", replica_path(&dir, "vda").display());
        s.replicate_disks(dir.clone(), vec!["qemu".into(), "-drive".into(), file]);
        (s, dir)
    }

    /// DISKS' list of one disk.
    fn disks(id: &str, size: u64) -> Vec<DiskInfo> {
        vec![DiskInfo {
            id: id.into(),
            size,
        }]
    }

    fn disk_data(offset: u64, fill: u8) -> Msg {
        Msg::DiskData {
            disk: 0,
            offset,
            extent: DiskExtent::Data(vec![fill; 512]),
        }
    }

    fn replica_byte(dir: &std::path::Path, offset: u64) -> u8 {
        use std::os::unix::fs::FileExt;
        let mut b = [0u8];
        std::fs::File::open(replica_path(dir, "vda"))
            .unwrap()
            .read_exact_at(&mut b, offset)
            .unwrap();
        b[0]
    }

    #[test]
    fn an_epochs_disk_data_reaches_the_replica_only_at_its_end() {
        let (mut s, dir) = disk_standby("epochs");
        let vda = disks("vda", 8192);
        // The first synchronisation writes the replica directly.
        let mut msgs = vec![
            hello(),
            Msg::Disks(vda.clone()),
            disk_data(0, 1),
            disk_data(512, 1),
        ];
        msgs.extend(epoch_msgs(0, 1));
        feed(&mut s, msgs).unwrap();
        assert_eq!(
            (replica_byte(&dir, 0), s.stats.last_epoch_disk),
            (1, (1024, 0))
        );
        // Later epochs stage until EPOCH_END.
        let mut e2 = epoch_msgs(1, 2);
        e2.insert(0, disk_data(0, 2));
        let end = e2.pop().unwrap();
        feed(&mut s, e2).unwrap();
        assert_eq!(replica_byte(&dir, 0), 1);
        feed(&mut s, vec![end]).unwrap();
        assert_eq!(
            (replica_byte(&dir, 0), s.stats.last_epoch_disk),
            (2, (512, 0))
        );
        // An epoch cut off part-way leaves the replica at the last one.
        feed(&mut s, vec![disk_data(0, 3), disk_data(512, 3)]).unwrap();
        s.new_session();
        assert_eq!((replica_byte(&dir, 0), replica_byte(&dir, 512)), (2, 1));
        // A resynchronisation stages too (the checkpoint stays valid), and
        // must name the same disks.
        let other = disks("vda", 4096);
        let err = feed(&mut s, vec![hello(), Msg::Disks(other)]).unwrap_err();
        assert!(err.to_string().contains("checkpoint holds others"), "{err}");
        s.new_session();
        let mut msgs = vec![hello(), Msg::Disks(vda), disk_data(512, 4)];
        msgs.extend(epoch_msgs(0, 3));
        let end = msgs.pop().unwrap();
        feed(&mut s, msgs).unwrap();
        assert_eq!(replica_byte(&dir, 512), 1);
        feed(&mut s, vec![end]).unwrap();
        assert_eq!(replica_byte(&dir, 512), 4);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn disks_are_refused_without_a_standby_that_opens_their_replicas() {
        let (mut s, dir) = disk_standby("refused");
        let vdb = disks("vdb", 8192);
        let err = feed(&mut s, vec![hello(), Msg::Disks(vdb)]).unwrap_err();
        assert!(
            err.to_string()
                .contains("would not open disk vdb's replica"),
            "{err}"
        );
        s.new_session();
        let err = feed(&mut s, vec![hello(), disk_data(0, 1)]).unwrap_err();
        assert!(err.to_string().contains("DISK_DATA before DISKS"), "{err}");
        let mut plain = standby(0);
        let vda = disks("vda", 8192);
        let err = feed(&mut plain, vec![hello(), Msg::Disks(vda)]).unwrap_err();
        assert!(
            err.to_string().contains("does not replicate disks"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_new_session_starts_from_what_the_backup_holds_and_says_so_by_hashes() {
        let hashes = |fills: &[u8]| -> Vec<u64> {
            fills
                .iter()
                .map(|&f| crate::pagehash::page_hash(&[f; PAGE]))
                .collect()
        };
        let mut s = standby(0);
        // Nothing held yet: no hashes, every page is sent.
        let replies = feed(&mut s, vec![hello(), Msg::RamSums(vec![])]).unwrap();
        assert_eq!(replies[1], Msg::RamSums(vec![]));
        let mut first = vec![pages(0, &[(1, 1)]), Msg::RoundEnd { round: 0, pages: 1 }];
        first.extend(epoch_msgs(1, 1));
        feed(&mut s, first).unwrap();
        // A resync: the checkpoint's image, page by page, seeds the new
        // session's (page 3 holds epoch 1's fill).
        s.new_session();
        let replies = feed(&mut s, vec![hello(), Msg::RamSums(vec![])]).unwrap();
        assert_eq!(replies[1], Msg::RamSums(hashes(&[0, 1, 0, 1, 0, 0, 0, 0])));
        assert_eq!(s.next.as_ref().unwrap().pages[3], [1; PAGE]);
        // Asked again once pages came: refused, it would undo them.
        feed(&mut s, vec![pages(0, &[(2, 9)])]).unwrap();
        assert!(feed(&mut s, vec![Msg::RamSums(vec![])]).is_err());
    }

    #[test]
    fn a_seed_file_of_the_vms_size_seeds_a_backup_with_no_checkpoint() {
        let dir = std::env::temp_dir().join(format!("hag-ram-seed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let seed = dir.join("vm.ram");
        let mut bytes = vec![0u8; 8 * PAGE];
        bytes[5 * PAGE..6 * PAGE].fill(7);
        std::fs::write(&seed, &bytes).unwrap();
        let mut s = standby(0);
        s.seed_ram_from(seed.clone());
        let replies = feed(&mut s, vec![hello(), Msg::RamSums(vec![])]).unwrap();
        let Msg::RamSums(sums) = &replies[1] else {
            panic!("{replies:?}")
        };
        assert_eq!(sums[5], crate::pagehash::page_hash(&[7; PAGE]));
        assert_eq!(sums[0], crate::pagehash::page_hash(&[0; PAGE]));
        assert_eq!(s.next.as_ref().unwrap().pages[5], [7; PAGE]);
        // One of another size is not used.
        std::fs::write(&seed, [1u8; PAGE]).unwrap();
        s.new_session();
        let replies = feed(&mut s, vec![hello(), Msg::RamSums(vec![])]).unwrap();
        assert_eq!(replies[1], Msg::RamSums(vec![]));
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn epoch_msgs(round: u32, epoch_no: u64) -> Vec<Msg> {
        epoch(round, &[(3, epoch_no as u8)], epoch_no, 0)
    }

    #[test]
    fn precopy_then_epochs_are_applied_and_acknowledged() {
        let mut s = standby(0);
        let mut msgs = vec![hello(), pages(0, &[(1, 1), (2, 2)])];
        msgs.push(Msg::RoundEnd { round: 0, pages: 2 });
        msgs.extend(epoch(1, &[(2, 3)], 1, 0));
        let r = feed(&mut s, msgs).unwrap();
        assert_eq!(
            r,
            vec![
                Msg::HelloOk {
                    version: 3,
                    generation: 0,
                    timeout_ms: 3000,
                    superseded: None,
                    witness: None,
                },
                Msg::Ok { phase: 0 },
                Msg::Ok { phase: 1 },
                Msg::EpochAck {
                    epoch: 1,
                    generation: 0
                }
            ]
        );
        assert_eq!(img(&s).pages[1][0], 1);
        assert_eq!(img(&s).pages[2][0], 3);
        let cp = s.committed.clone().unwrap();
        assert_eq!((cp.epoch, cp.vm_state.as_slice()), (1, &b"state 1"[..]));
        assert_eq!(cp.session, SESSION);
        // Epoch 2 in the next round.
        let r = feed(&mut s, epoch(2, &[(3, 9)], 2, 0)).unwrap();
        assert_eq!(
            r.last(),
            Some(&Msg::EpochAck {
                epoch: 2,
                generation: 0
            })
        );
        assert_eq!(img(&s).pages[3][0], 9);
        assert_eq!(s.stats.epochs, 2);
    }

    /// Issue 24: an epoch's page may come as a delta against the bytes
    /// the committed image holds for it (or, sent twice in one epoch,
    /// against its staged bytes); the image changes only at EPOCH_END.
    #[test]
    fn a_delta_page_applies_to_the_committed_page_at_its_epochs_end() {
        let mut s = standby(0);
        let mut msgs = vec![hello(), pages(0, &[(1, 1), (2, 2)])];
        msgs.push(Msg::RoundEnd { round: 0, pages: 2 });
        msgs.extend(epoch(1, &[(3, 3)], 1, 0));
        feed(&mut s, msgs).unwrap();
        let (mut one, mut two) = ([1u8; PAGE], [2u8; PAGE]);
        one[9] = 0x99;
        two[5] = 0x55;
        let delta = |page: &[u8], base: &[u8]| PageData::encode_against(page, true, Some(base));
        let mut two_again = two;
        two_again[6] = 0x66;
        let mut e2 = epoch(2, &[], 2, 0);
        e2[0] = Msg::Pages {
            round: 2,
            pages: vec![
                (1, delta(&one, &[1; PAGE])),
                (2, delta(&two, &[2; PAGE])),
                (3, PageData::Same),
                (2, delta(&two_again, &two)),
            ],
        };
        e2[1] = Msg::RoundEnd { round: 2, pages: 4 };
        let end = e2.pop().unwrap();
        feed(&mut s, e2).unwrap();
        assert_eq!(img(&s).pages[1], [1; PAGE], "staged, not applied");
        feed(&mut s, vec![end]).unwrap();
        assert_eq!(img(&s).pages[1], one);
        assert_eq!(img(&s).pages[2], two_again);
        assert_eq!(img(&s).pages[3], [3; PAGE]);
        assert_eq!(s.stats.delta_pages, 4);
    }

    #[test]
    fn an_unfinished_epoch_never_touches_the_checkpoint() {
        let mut s = standby(0);
        let mut msgs = vec![hello()];
        msgs.extend(epoch(0, &[(1, 1)], 1, 0));
        feed(&mut s, msgs).unwrap();
        // Epoch 2 breaks off after its pages and ROUND_END.
        let partial = epoch(1, &[(1, 7), (4, 7)], 2, 0);
        feed(&mut s, partial[..2].to_vec()).unwrap();
        assert_eq!(img(&s).pages[1][0], 1, "staged, not applied");
        assert_eq!(img(&s).pages[4][0], 0);
        assert_eq!(s.committed.as_ref().unwrap().epoch, 1);
        // The primary reconnects: a new session resends everything; the
        // old checkpoint stays valid until the new epoch ends.
        s.new_session();
        let mut msgs = vec![hello(), pages(0, &[(1, 5)])];
        msgs.push(Msg::RoundEnd { round: 0, pages: 1 });
        feed(&mut s, msgs).unwrap();
        assert_eq!(img(&s).pages[1][0], 1);
        s.current.as_mut().unwrap().pages[6] = [8; PAGE];
        feed(&mut s, epoch(1, &[(4, 6)], 3, 0)).unwrap();
        assert_eq!((img(&s).pages[1][0], img(&s).pages[4][0]), (5, 6));
        assert_eq!(img(&s).pages[6][0], 0, "a page not resent is zero now");
    }

    /// Issue 12, item 1: an aborted first sync leaves pages in an image;
    /// the next session's checkpoint must not contain them (round 0 skips
    /// zero pages, so they would never be overwritten).
    #[test]
    fn an_aborted_sync_leaves_nothing_in_the_next_checkpoint() {
        let mut s = standby(0);
        let msgs = vec![hello(), pages(0, &[(3, 0xaa)])];
        feed(&mut s, msgs).unwrap();
        // The link fails; the primary (page 3 now zero there) syncs again.
        s.new_session();
        let mut msgs = vec![hello(), pages(0, &[(1, 1)])];
        msgs.push(Msg::RoundEnd { round: 0, pages: 1 });
        msgs.extend(epoch(1, &[], 1, 0));
        feed(&mut s, msgs).unwrap();
        assert_eq!(img(&s).pages[3], [0; PAGE], "a page no checkpoint held");
        assert_eq!(img(&s).pages[1][0], 1);
    }

    /// Issue 12, item 7: a write failing part-way through an epoch leaves
    /// the image and the checkpoint as they were.
    #[test]
    fn a_failing_apply_rolls_back_to_the_last_checkpoint() {
        let mut s = standby(0);
        let mut msgs = vec![hello()];
        msgs.extend(epoch(0, &[(1, 1), (2, 2), (3, 3)], 1, 0));
        feed(&mut s, msgs).unwrap();
        let before = img(&s).pages.clone();
        // The second of three writes fails; the undo of the first works.
        let writes = img(&s).writes;
        s.current.as_mut().unwrap().fail_once = Some(writes + 2);
        let err = feed(&mut s, epoch(1, &[(1, 9), (2, 9), (3, 9)], 2, 0)).unwrap_err();
        assert!(err.to_string().contains("rolled back"), "{err}");
        assert_eq!(s.committed.as_ref().unwrap().epoch, 1);
        assert_eq!(img(&s).pages, before);
    }

    /// Item 7: an undo that fails too drops the checkpoint rather than
    /// keep a mixed image under it.
    #[test]
    fn a_failed_undo_drops_the_checkpoint() {
        let mut s = standby(0);
        let mut msgs = vec![hello()];
        msgs.extend(epoch(0, &[(1, 1), (2, 2)], 1, 0));
        feed(&mut s, msgs).unwrap();
        let writes = img(&s).writes;
        s.current.as_mut().unwrap().fail_after = Some(writes + 1);
        let err = feed(&mut s, epoch(1, &[(1, 9), (2, 9)], 2, 0)).unwrap_err();
        assert!(err.to_string().contains("checkpoint is lost"), "{err}");
        assert!(s.committed.is_none() && s.current.is_none());
    }

    /// Issue 12, item 8: a HELLO asking for more RAM than the limit (or
    /// not whole pages) is refused before anything is allocated.
    #[test]
    fn a_primary_under_another_vmm_is_refused_at_hello() {
        let mut s = standby(0);
        let qemu_hello = Msg::Hello {
            min: 3,
            max: 3,
            ram_size: 8 * PAGE as u64,
            session: SESSION,
            vmm: VmmKind::Qemu,
            term: None,
            shape: None,
        };
        let err = feed(&mut s, vec![qemu_hello.clone()]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the primary's VM runs under QEMU, this backup stands by with hag-vmm"
        );
        // A QEMU standby: CONTEXT is empty (the vGPU's state is in QEMU's
        // stream), and a non-empty one is refused.
        let mut s = Standby::new(
            0,
            Limits {
                vmm: VmmKind::Qemu,
                witness: None,
                ..LIMITS
            },
        );
        let mut msgs = vec![qemu_hello.clone(), pages(0, &[(1, 1)])];
        msgs.push(Msg::RoundEnd { round: 0, pages: 1 });
        msgs.extend([
            Msg::Context(Vec::new()),
            Msg::VmState(
                EpochState {
                    ram_id: "ram0",
                    stream: b"QEVM",
                }
                .encode(),
            ),
            Msg::EpochEnd {
                epoch: 1,
                generation: 0,
            },
        ]);
        feed(&mut s, msgs).unwrap();
        let cp = s.committed.as_ref().unwrap();
        assert_eq!(EpochState::decode(&cp.vm_state).unwrap().stream, b"QEVM");
        let mut s = Standby::new(
            0,
            Limits {
                vmm: VmmKind::Qemu,
                witness: None,
                ..LIMITS
            },
        );
        let err = feed(&mut s, vec![qemu_hello, Msg::Context(snapshot())]).unwrap_err();
        assert!(err.to_string().contains("CONTEXT has"), "{err}");
    }

    #[test]
    fn oversized_hellos_are_refused_before_allocation() {
        let mut s = standby(0);
        let mut made = 0;
        for ram_size in [1u64 << 62, (1 << 20) + PAGE as u64, 0, 100] {
            let err = s
                .on(
                    Msg::Hello {
                        min: 3,
                        max: 3,
                        ram_size,
                        session: 1,
                        vmm: VmmKind::HagVmm,
                        term: None,
                        shape: None,
                    },
                    &mut |n, shape| {
                        made += 1;
                        fresh(n, shape)
                    },
                )
                .unwrap_err();
            assert!(matches!(err, StandbyError::Invalid(_)), "{err}");
            s.new_session();
        }
        assert_eq!(made, 0);
        let err = s.on(hello(), &mut |_, _| Err("ENOMEM".into())).unwrap_err();
        assert!(
            err.to_string()
                .contains("cannot stand by for a VM of 0 MiB"),
            "{err}"
        );
    }

    /// Issue 12, items 2 and 9: a checkpoint belongs to its pairing; a
    /// HELLO of another session is refused without touching it; a resync
    /// (the same session) writes into an image of its own, never stages a
    /// second copy of RAM in memory.
    #[test]
    fn another_pairing_is_refused_and_a_resync_stages_nothing() {
        let mut s = standby(0);
        let mut msgs = vec![hello()];
        msgs.extend(epoch(0, &[(1, 1)], 1, 0));
        feed(&mut s, msgs).unwrap();
        assert!(matches!(
            s.busy(99, None),
            Some(StandbyError::Busy { epoch: 1, .. })
        ));
        s.new_session();
        let err = feed(&mut s, vec![hello_of(99)]).unwrap_err();
        assert!(err.to_string().contains("must wait"), "{err}");
        assert_eq!(s.committed.as_ref().unwrap().epoch, 1);
        // The resync: every page of round 0 goes to the new image.
        s.new_session();
        feed(&mut s, vec![hello(), pages(0, &[(1, 2), (2, 2), (3, 2)])]).unwrap();
        assert!(s.staged.is_empty());
        assert_eq!(s.next.as_ref().unwrap().pages[2][0], 2);
        assert_eq!(
            img(&s).pages[2][0],
            0,
            "the checkpoint's image is untouched"
        );
    }

    /// A hagctl restarted on the VM it protected (a new session, the same
    /// VM instance) pairs again; the old checkpoint stays until the new
    /// session's first epoch replaces it. Another instance waits.
    #[test]
    fn a_restarted_primary_of_the_same_vm_pairs_again() {
        let vm = Instance {
            boot: 1,
            pid: 7,
            started: 9,
        };
        let hello_from = |session, instance| match hello_of(session) {
            Msg::Hello {
                min,
                max,
                ram_size,
                session,
                vmm,
                shape,
                ..
            } => Msg::Hello {
                min,
                max,
                ram_size,
                session,
                vmm,
                term: Some(Term {
                    generation: 0,
                    instance,
                    vm: None,
                }),
                shape,
            },
            _ => unreachable!(),
        };
        let mut s = standby(0);
        let mut msgs = vec![hello_from(SESSION, vm)];
        msgs.extend(epoch(0, &[(1, 1)], 1, 0));
        feed(&mut s, msgs).unwrap();
        assert_eq!(s.committed.as_ref().unwrap().instance, Some(vm));
        assert!(s.busy(99, Some(Instance { pid: 8, ..vm })).is_some());
        assert!(s.busy(99, None).is_some());
        assert!(s.busy(99, Some(vm)).is_none());
        s.new_session();
        let mut msgs = vec![hello_from(99, vm)];
        msgs.extend(epoch(0, &[(2, 5)], 1, 0));
        feed(&mut s, msgs).unwrap();
        let cp = s.committed.as_ref().unwrap();
        assert_eq!(
            (cp.session, cp.epoch),
            (99, 1),
            "the new session's checkpoint"
        );
    }

    #[test]
    fn stale_generations_and_bad_streams_are_refused() {
        let mut s = standby(2);
        let mut msgs = vec![hello()];
        msgs.extend(epoch(0, &[(1, 1)], 1, 1));
        let err = feed(&mut s, msgs).unwrap_err();
        assert_eq!(err, StandbyError::Stale { theirs: 1, ours: 2 });
        assert!(s.committed.is_none());
        // A newer generation is adopted.
        s.new_session();
        let mut msgs = vec![hello()];
        msgs.extend(epoch(0, &[(1, 1)], 1, 3));
        let r = feed(&mut s, msgs).unwrap();
        assert_eq!(
            r.last(),
            Some(&Msg::EpochAck {
                epoch: 1,
                generation: 3
            })
        );
        assert_eq!(s.generation, 3);
        // Out of turn, epochs going backwards, RAM size mismatch, ABORT.
        let err = s.on(Msg::Commit, &mut fresh).unwrap_err();
        assert!(err.to_string().starts_with("unexpected COMMIT"), "{err}");
        s.new_session();
        let mut msgs = vec![hello()];
        msgs.extend(epoch(0, &[], 5, 3));
        msgs.extend(epoch(1, &[], 5, 3));
        let err = feed(&mut s, msgs).unwrap_err();
        assert!(err.to_string().contains("epoch 5 after epoch 5"), "{err}");
        s.new_session();
        let err = s
            .on(
                Msg::Hello {
                    min: 3,
                    max: 3,
                    ram_size: 4 * PAGE as u64,
                    session: SESSION,
                    vmm: VmmKind::HagVmm,
                    term: None,
                    shape: None,
                },
                &mut fresh,
            )
            .unwrap_err();
        assert!(err.to_string().contains("guest RAM"), "{err}");
        s.new_session();
        let err = s
            .on(
                Msg::Abort {
                    reason: "the VM finished".into(),
                },
                &mut fresh,
            )
            .unwrap_err();
        assert_eq!(err, StandbyError::Ended("the VM finished".into()));
    }

    #[test]
    fn an_end_and_a_takeover_exclude_each_other() {
        // ABORT during a takeover (issue 20, item 2): never confirmed.
        let mut r = Role::Standby;
        assert!(r.take_over());
        assert_eq!(r.abort("SIGTERM".into()), AbortAnswer::Refuse);
        assert!(!r.take_over(), "a second takeover started");
        assert!(r.taking_over());
        // An end first: no takeover after it, and a repeated ABORT is
        // confirmed again.
        let mut r = Role::Standby;
        assert_eq!(r.abort("the VM finished".into()), AbortAnswer::End);
        assert!(!r.take_over(), "a takeover after the end was confirmed");
        assert_eq!(r.abort("again".into()), AbortAnswer::Confirm);
        assert_eq!(r, Role::Ended("the VM finished".into()));
        // A takeover that failed stands by again: an ABORT then ends
        // protection, and a later decision may try again.
        let mut r = Role::Standby;
        assert!(r.take_over());
        r.takeover_failed();
        assert!(r.take_over(), "no second try after a failed takeover");
        r.takeover_failed();
        assert_eq!(r.abort("SIGTERM".into()), AbortAnswer::End);
        r.takeover_failed();
        assert!(!r.take_over(), "a failed takeover's cleanup undid an end");
    }

    /// The order of a takeover, recorded.
    #[derive(Default)]
    struct Steps {
        log: Vec<String>,
        fail: Option<&'static str>,
    }

    impl TakeoverSteps for Steps {
        fn prepare(&mut self) -> Result<(), String> {
            self.log.push("prepare".into());
            if self.fail == Some("prepare") {
                return Err("no vGPU".into());
            }
            Ok(())
        }
        fn recheck(&mut self) -> Result<(), String> {
            self.log.push("recheck".into());
            if self.fail == Some("recheck") {
                return Err("heard on eth1".into());
            }
            Ok(())
        }
        fn claim(&mut self) -> Result<(), TakeoverError> {
            self.log.push("claim".into());
            match self.fail {
                Some("claim") => Err(TakeoverError::NotGranted("connection refused".into())),
                Some("claim-void") => Err(TakeoverError::Void("the primary kept it".into())),
                _ => Ok(()),
            }
        }
        fn fence_peer(&mut self, g: u64) -> Result<(), String> {
            self.log.push(format!("fence-peer {g}"));
            if self.fail == Some("fence-peer") {
                return Err("--fence-peer failed (exit status: 1)".into());
            }
            Ok(())
        }
        fn persist(&mut self, g: u64) -> Result<(), String> {
            self.log.push(format!("persist {g}"));
            if self.fail == Some("persist") {
                return Err("read back 0".into());
            }
            Ok(())
        }
        fn fence(&mut self, g: u64) {
            self.log.push(format!("fence {g}"));
        }
        fn resume(&mut self) -> Result<(), String> {
            self.log.push("resume".into());
            if self.fail == Some("resume") {
                return Err("QEMU exited".into());
            }
            Ok(())
        }
        fn abandon(&mut self) {
            self.log.push("abandon".into());
        }
    }

    /// Issue 21, item 2: under `--on-silence hold` silence never takes
    /// over, a hang still does; a request (`hagctl takeover`) takes over
    /// whenever there is a checkpoint, whatever the policy and liveness
    /// say (the takeover's recheck then decides), and never without one.
    #[test]
    fn silence_hold_and_requested_takeovers() {
        let silent = || Decision::Takeover("the primary was silent for 3.1 s".into());
        let hang = || Decision::Takeover("the primary handed its VM over: hang".into());
        let take = |d: &Decision| matches!(d, Decision::Takeover(_));
        // Today's behaviour is the default.
        assert_eq!(
            under_policy(silent(), false, OnSilence::Takeover, false, true),
            silent()
        );
        let held = under_policy(silent(), false, OnSilence::Hold, false, true);
        assert!(
            matches!(&held, Decision::Hold(w) if w.contains("--on-silence hold")),
            "{held:?}"
        );
        assert_eq!(
            under_policy(hang(), true, OnSilence::Hold, false, true),
            hang()
        );
        assert_eq!(
            under_policy(hang(), true, OnSilence::Hold, true, true),
            hang()
        );
        for (d, policy) in [
            (Decision::Wait, OnSilence::Hold),
            (Decision::Wait, OnSilence::Takeover),
            (Decision::Hold("alive via eth1".into()), OnSilence::Hold),
            (silent(), OnSilence::Hold),
        ] {
            let got = under_policy(d, false, policy, true, true);
            assert!(
                matches!(&got, Decision::Takeover(w) if w.contains("requested")),
                "{got:?}"
            );
        }
        let got = under_policy(
            Decision::Forget("nothing".into()),
            false,
            OnSilence::Hold,
            true,
            false,
        );
        assert!(!take(&got), "{got:?}");
        assert_eq!(
            under_policy(Decision::Wait, false, OnSilence::Takeover, true, false),
            Decision::Wait
        );
    }

    /// `hagctl takeover` asks only a running backup, and its request is
    /// taken once; the backup's refusal is what it reports.
    #[test]
    fn a_takeover_request_reaches_a_running_backup_once() {
        let dir = std::env::temp_dir().join(format!("hag-request-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let dirs = crate::vm_dirs::VmDirs {
            run: dir.clone(),
            state: dir.clone(),
        };
        let e = request_takeover(&dirs, Duration::from_millis(100)).unwrap_err();
        assert!(e.to_string().contains("no hagctl backup status"), "{e}");
        std::fs::create_dir_all(&dir).unwrap();
        // pid 1 is not a hagctl.
        std::fs::write(
            status_path(&dir),
            r#"{"pid":1,"state":"standby","generation":0}"#,
        )
        .unwrap();
        let e = request_takeover(&dirs, Duration::from_millis(100)).unwrap_err();
        assert!(e.to_string().contains("is not running"), "{e}");
        assert!(!take_request(&dir));
        std::fs::write(request_path(&dir), "1\n").unwrap();
        assert!(take_request(&dir));
        assert!(!take_request(&dir), "a request acted on twice");
        refuse_request(&dir, "the primary was heard on 192.0.2.10:7200");
        assert!(std::fs::read_to_string(refusal_path(&dir))
            .unwrap()
            .contains("heard"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Issue 20, item 5: a decision on silence is given up if the primary
    /// is heard after it, unless an end was refused meanwhile; a decision
    /// on a hang stands.
    #[test]
    fn a_primary_heard_after_the_decision_is_not_fenced() {
        let t0 = Instant::now();
        let decided = t0 + Duration::from_secs(3);
        let mut heard = BTreeMap::new();
        heard.insert("10.0.0.2:7200".to_owned(), t0);
        assert_eq!(heard_after(Some(decided), false, &heard), Ok(()));
        heard.insert(
            "10.1.0.2:7201".to_owned(),
            decided + Duration::from_millis(300),
        );
        let e = heard_after(Some(decided), false, &heard).unwrap_err();
        assert!(e.contains("heard on 10.1.0.2:7201 0.3 s after"), "{e}");
        assert_eq!(heard_after(Some(decided), true, &heard), Ok(()));
        assert_eq!(heard_after(None, false, &heard), Ok(()));
    }

    /// Issue 12, items 3 and 9: the primary is fenced only once the VM is
    /// ready here and the new generation is durable; a generation never
    /// wraps.
    #[test]
    fn takeover_fences_only_after_it_is_known_to_work() {
        let mut ok = Steps::default();
        assert_eq!(take_over(&mut ok, 4), Ok(5));
        assert_eq!(
            ok.log,
            [
                "prepare",
                "recheck",
                "claim",
                "fence-peer 5",
                "persist 5",
                "fence 5",
                "resume"
            ]
        );
        for fail in [
            "prepare",
            "recheck",
            "claim",
            "claim-void",
            "fence-peer",
            "persist",
        ] {
            let mut s = Steps {
                fail: Some(fail),
                ..Steps::default()
            };
            assert!(take_over(&mut s, 4).is_err());
            assert!(
                !s.log.iter().any(|l| l.starts_with("fence ")),
                "{:?}",
                s.log
            );
            assert_eq!(s.log.last().map(String::as_str), Some("abandon"));
            // The operator's fencing only for a takeover that can work,
            // that the primary's liveness did not call off and that the
            // witness granted.
            if fail == "prepare" || fail == "recheck" || fail.starts_with("claim") {
                assert!(
                    !s.log.iter().any(|l| l.starts_with("fence-peer")),
                    "{:?}",
                    s.log
                );
            }
        }
        let mut s = Steps {
            fail: Some("fence-peer"),
            ..Steps::default()
        };
        assert!(matches!(
            take_over(&mut s, 4),
            Err(TakeoverError::PeerNotFenced(_))
        ));
        assert!(
            !s.log.iter().any(|l| l.starts_with("persist")),
            "{:?}",
            s.log
        );
        // Fenced but not resumed: the VM prepared here is ended, so that
        // a second try starts afresh.
        let mut s = Steps {
            fail: Some("resume"),
            ..Steps::default()
        };
        assert!(matches!(
            take_over(&mut s, 4),
            Err(TakeoverError::Resume(_))
        ));
        assert_eq!(
            s.log,
            [
                "prepare",
                "recheck",
                "claim",
                "fence-peer 5",
                "persist 5",
                "fence 5",
                "resume",
                "abandon"
            ]
        );
        let mut s = Steps::default();
        assert_eq!(
            take_over(&mut s, u64::MAX),
            Err(TakeoverError::Exhausted(u64::MAX))
        );
        assert!(s.log.is_empty());
    }

    /// An authenticated connection over loopback: the backup's outbox
    /// and the primary's reading half.
    fn member() -> (Outbox, Reader) {
        let key = Key::from_hex(&"ab".repeat(32)).unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let k = key.clone();
        let t = std::thread::spawn(move || {
            let s = std::net::TcpStream::connect(addr).unwrap();
            secure::handshake(s, &k, true).unwrap().0
        });
        let (s, _) = l.accept().unwrap();
        let (_r, w) = secure::handshake(s, &key, false).unwrap();
        (Outbox::spawn(w).unwrap(), t.join().unwrap())
    }

    /// A finishing backup flushes its connections before it exits: the
    /// OK ENDED it queued reaches the primary (issue 20, item 11).
    #[test]
    fn an_outbox_flushes_what_it_holds() {
        let (out, mut r) = member();
        let ended = Msg::Ok { phase: ENDED_PHASE };
        for _ in 0..5 {
            assert!(out.post(&ended));
        }
        assert!(out.flush(Duration::from_secs(10)));
        for _ in 0..5 {
            assert_eq!(read_msg(&mut r).unwrap().0, ended);
        }
    }

    /// Issue 12, item 2: the fence goes to every connection of the
    /// session (not to the last one); a new pairing closes the old
    /// pairing's connections, so nothing from them counts any more.
    #[test]
    fn the_fence_reaches_every_connection_of_the_session() {
        let mut l = Live::new(0, Vec::new());
        l.adopt(SESSION);
        let mut readers = Vec::new();
        for conn in 1..=3 {
            let (out, r) = member();
            l.members.insert(conn, Member { out });
            readers.push(r);
        }
        let fence = Msg::Heartbeat {
            generation: 1,
            epoch: 7,
        };
        l.broadcast(&fence);
        for r in &mut readers {
            assert_eq!(read_msg(r).unwrap().0, fence);
        }
        assert!(l.member_of(2));
        l.adopt(99);
        assert!(l.members.is_empty() && !l.member_of(2));
        for r in &mut readers {
            assert!(
                read_msg(r).is_err(),
                "an old pairing's connection stays open"
            );
        }
    }

    /// A pairing refused at its HELLO (its JOIN had made its session the
    /// backup's) does not keep the next primary out while the backup holds
    /// no checkpoint; one that holds a checkpoint admits only its own
    /// session, or a new one of the checkpoint's VM instance (a restarted
    /// hagctl); one that takes over, only its own.
    #[test]
    fn only_a_checkpoint_or_a_takeover_keeps_a_session() {
        let ours = Instance {
            boot: 1,
            pid: 7,
            started: 9,
        };
        let (vm, other) = (Some(ours), Some(Instance { pid: 8, ..ours }));
        let mut l = Live::new(0, Vec::new());
        assert!(l.admits(SESSION, vm));
        l.adopt(SESSION);
        assert!(
            l.admits(SESSION, vm) && l.admits(99, other),
            "no checkpoint yet"
        );
        l.epoch = 4;
        l.instance = vm;
        assert!(
            l.admits(SESSION, vm) && !l.admits(99, other) && !l.admits(99, None),
            "a checkpoint of SESSION"
        );
        assert!(
            l.admits(99, vm),
            "a restarted hagctl of the checkpoint's VM"
        );
        l.epoch = 0;
        assert!(l.role.take_over());
        assert!(l.admits(SESSION, vm) && !l.admits(99, vm), "taking over");
    }

    /// Issue 12, item 9, and issue 20, item 3: the generation is stored
    /// durably in the state directory and read back; a status left in the
    /// runtime directory counts too (the higher wins), and a file that
    /// holds no generation stops the backup instead of starting it at 0.
    #[test]
    fn the_generation_is_read_back() {
        let base = std::env::temp_dir().join(format!("hag-backup-{}", std::process::id()));
        let (state, run) = (base.join("state"), base.join("run"));
        let _ = std::fs::remove_dir_all(&base);
        let stored = |state, run| stored_record(state, run).map(|r| r.generation);
        assert_eq!(stored(&state, &run), Ok(0));
        let old = Instance {
            boot: 1,
            pid: 100,
            started: 5,
        };
        store_generation(
            &state,
            &serde_json::json!({"generation": 7, "state": "took-over", "superseded": [old.to_json()]}),
        )
        .unwrap();
        assert_eq!(stored(&state, &run), Ok(7));
        crate::vm_dirs::write_json(
            &status_path(&run),
            &serde_json::json!({"generation": 9}),
            false,
        )
        .unwrap();
        assert_eq!(stored(&state, &run), Ok(9));
        // The instance taken over from is remembered across the restart.
        assert_eq!(stored_record(&state, &run).unwrap().superseded, vec![old]);
        std::fs::write(
            generation_path(&state),
            r#"{"generation": 7, "superseded": [{"pid": 1}]}"#,
        )
        .unwrap();
        let e = stored_record(&state, &run).unwrap_err();
        assert!(e.contains("not an instance"), "{e}");
        std::fs::write(generation_path(&state), "{\"gen").unwrap();
        let e = stored(&state, &run).unwrap_err();
        assert!(e.contains("generation.json holds no generation"), "{e}");
        let _ = std::fs::remove_dir_all(&base);
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
            decide(true, Some("vGPU hang: vgpu-hung vgpu=1"), &one(s(0)), t),
            Decision::Takeover(why) if why == "the primary handed its VM over: vGPU hang: vgpu-hung vgpu=1"
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
            Decision::Takeover(why) if why.contains("handed its VM over")
        ));
        assert!(matches!(
            decide(false, None, &two(s(8000), s(9000)), t),
            Decision::Forget(_)
        ));
    }
}
