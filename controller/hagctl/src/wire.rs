//! The migration stream between `hagctl migrate` (source) and `hagctl
//! receive` (target), over TCP.
//!
//! Every message is one frame:
//!
//! ```text
//! type u32 | length u32 | crc32 u32 | payload (length bytes)     all little-endian
//! ```
//!
//! `crc32` (IEEE) covers the type and length fields and the payload, so a
//! damaged header is caught as surely as a damaged payload. Type 0 is
//! invalid; unknown types, payloads over [`MAX_PAYLOAD`] and a stream that
//! ends inside a frame are errors. The receiver is a state machine
//! ([`Receiver`]) that accepts only the messages its state expects and
//! names both when it gets another.
//!
//! ```text
//! source (hagctl migrate)                       target (hagctl receive)
//!   HELLO magic, versions min..max, RAM size, VMM ─▶
//!                                             ◀─ HELLO_OK version | ERROR
//!   ┌ pre-copy round r (r = 0: every non-zero page;
//!   │ then pages the CPU or the GPU dirtied)
//!   │ PAGES r … PAGES r, ROUND_END r ─────────▶  pages written to guest RAM
//!   └                                         ◀─ OK round r | ERROR
//!   pause VM, quiesce vGPU, last dirty pages
//!   PAGES f …, ROUND_END f,
//!   CONTEXT (vGPU snapshot), VM_STATE, COMMIT ─▶ restore vGPU context,
//!                                                set VM state, resume
//!                                                vGPU and VM
//!                                             ◀─ OK commit | ERROR
//!   quit the source VM
//!
//!   on any failure before the commit's OK: ABORT reason ─▶ target discards
//!   (the source resumes its vGPU and VM)
//! ```
//!
//! Continuous checkpointing (`hagctl checkpoint` → `hagctl backup`) runs
//! the same stream without the COMMIT: the first checkpoint is pre-copy
//! rounds then one stop-and-copy round, and every later epoch is one more
//! stop-and-copy round, each closed by EPOCH_END instead of COMMIT. The
//! backup applies an epoch to its standby image only when EPOCH_END
//! arrives (pages of an unfinished epoch are staged, so the last
//! acknowledged checkpoint is never half overwritten) and answers
//! EPOCH_ACK. A second connection carries HEARTBEATs both ways (and HANG,
//! primary → backup: take over now):
//!
//! ```text
//! primary (hagctl checkpoint)                   backup (hagctl backup)
//!   HELLO …, pre-copy rounds as above ────────▶ pages into the standby image
//!   epoch e (VM paused only to capture it):
//!   PAGES r …, ROUND_END r ───────────────────▶ pages staged
//!                                             ◀─ OK round r
//!   CONTEXT, VM_STATE (or VM_STATE_DELTA) ────▶ (a delta: rebuilt from
//!                                                the committed state)
//!   EPOCH_END e, gen g ───────────────────────▶ staged pages applied,
//!                                                checkpoint e stored
//!                                             ◀─ EPOCH_ACK e, gen | ERROR
//!   ABORT reason (protection ends) ───────────▶ standby discarded
//! control connection, every 200 ms both ways:
//!   HEARTBEAT gen, epoch ◀───────────────────▶ HEARTBEAT gen, epoch
//!   HANG reason ──────────────────────────────▶ take over from the last
//!                                                acknowledged epoch
//! ```
//!
//! The generation counts takeovers: a backup that took over answers with a
//! higher one, and a primary that sees it stops its VM.
//!
//! HELLO payload: `magic | min u16 | max u16 | RAM bytes u64 | page size
//! u32 | session u128 | VMM u8` ([`VmmKind`]; version 3 added it).
//! HEARTBEAT payload: `generation u64 | epoch u64`; HANG: the reason
//! (UTF-8); EPOCH_END and EPOCH_ACK: `epoch u64 | generation u64`.
//! VM_STATE_DELTA (version 4): `base epoch u64 | patch`, the state as a
//! [`crate::state_delta`] patch against the one the backup committed at
//! the base epoch (the primary's last acknowledged); refused unless the
//! backup holds exactly that epoch of the session.
//!
//! CONTEXT payload: `snapshot length u32 | LZ4 block` (at most
//! `CONTEXT_MAX_BYTES` once decompressed). PAGES payload: `round u32 |
//! count u32`, then `count` records of
//! `page index u64 | kind u8 | length u32 | bytes`: kind 0 a zero page
//! (length 0), 1 raw (length 4096), 2 LZ4 block (length < 4096,
//! decompressing to exactly 4096 bytes); from version 7, in an epoch,
//! deltas against the bytes the backup's committed image holds for the
//! page: 3 the same bytes (length 0), 4 an LZ4 block (length < 4096) of
//! the page XOR them ([`crate::page_cache`]).

use crate::page_cache::PageCache;
use crate::term::{Instance, Term};
use crate::vm_dirs::VmName;
use crate::vm_shape::{VmShape, MAX_ENCODED as MAX_SHAPE};
use std::io::{self, Read, Write};

/// Which VMM runs the VM a stream carries, named in HELLO: it says what
/// CONTEXT and VM_STATE hold, and a backup stands by with one kind only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum VmmKind {
    /// `hag-vmm serve`: CONTEXT is the vGPU's snapshot, VM_STATE
    /// hag-vmm's state bytes, and every page of guest RAM is in the stream.
    HagVmm = 0,
    /// QEMU: CONTEXT is empty and VM_STATE is QEMU's own migration stream
    /// without its shared RAM (`x-ignore-shared`), the vGPU's VFIO
    /// migration data inside it; the pages come from the shared backend.
    Qemu = 1,
}

impl VmmKind {
    /// The kind of byte `b`.
    pub fn from_u8(b: u8) -> Option<VmmKind> {
        match b {
            0 => Some(VmmKind::HagVmm),
            1 => Some(VmmKind::Qemu),
            _ => None,
        }
    }

    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            VmmKind::HagVmm => "hag-vmm",
            VmmKind::Qemu => "QEMU",
        }
    }
}

/// Handshake magic.
pub const MAGIC: [u8; 8] = *b"HAGMIG\r\n";
/// Oldest stream version this build speaks.
pub const VERSION_MIN: u16 = 3;
/// Newest stream version this build speaks.
pub const VERSION_MAX: u16 = 7;

/// The first stream version with VM_STATE_DELTA.
pub const STATE_DELTA_SINCE: u16 = 4;
/// The first stream version with DISKS and DISK_DATA: a primary whose VM
/// has writable disks needs a backup that speaks it.
pub const DISKS_SINCE: u16 = 5;
/// The first stream version with RAM_SUMS: a backup says what guest RAM
/// it already holds, so that a new session sends only pages that differ.
pub const RAM_SUMS_SINCE: u16 = 6;
/// The first stream version with delta pages (kinds 3 and 4) in epochs.
pub const PAGE_DELTA_SINCE: u16 = 7;
/// The most writable disks a VM may have under protection.
pub const MAX_DISKS: usize = 16;
/// The most data bytes one DISK_DATA carries.
pub const DISK_DATA_MAX: usize = 1 << 20;
/// Bytes of a frame header.
pub const HEADER_BYTES: usize = 12;
/// Largest payload accepted (a compressed vGPU context must fit: a GVT-g
/// one is ~10 MiB raw, mostly zeros; a PAGES frame is sized to stay well
/// under this).
pub const MAX_PAYLOAD: u32 = 8 << 20;
/// Page size of the stream.
pub const PAGE: usize = 4096;
/// Pages per PAGES frame the source sends.
pub const PAGES_PER_FRAME: usize = 256;

/// Message types. 0 is invalid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum MsgType {
    /// Source → target: magic, version range, RAM size.
    Hello = 1,
    /// Target → source: the version chosen.
    HelloOk = 2,
    /// Target → source: a phase is done.
    Ok = 3,
    /// Either way: what failed; the session ends.
    Error = 4,
    /// Source → target: guest pages.
    Pages = 5,
    /// Source → target: a round is complete.
    RoundEnd = 6,
    /// Source → target: the vGPU context snapshot.
    Context = 7,
    /// Source → target: the VM's state.
    VmState = 8,
    /// Source → target: restore and resume.
    Commit = 9,
    /// Source → target: give up, discard.
    Abort = 10,
    /// Either way, on the checkpoint control connection: alive.
    Heartbeat = 11,
    /// Primary → backup: the primary's vGPU hung; take over.
    Hang = 12,
    /// Primary → backup: the epoch is complete; apply it.
    EpochEnd = 13,
    /// Backup → primary: the epoch is applied.
    EpochAck = 14,
    /// Primary → backup: the first message of a control (heartbeat)
    /// connection, naming the session it belongs to.
    Join = 15,
    /// Primary → backup (version 4): the VM's state as a patch against
    /// the one the backup committed at an epoch ([`crate::state_delta`]).
    VmStateDelta = 16,
    /// Primary → backup (version 5): the VM's writable disks, once per
    /// session before any DISK_DATA.
    Disks = 17,
    /// Primary → backup (version 5): bytes (or zeroes) of one disk at an
    /// offset, part of the round or epoch in progress.
    DiskData = 18,
    /// Backup → primary (version 5), the answer to DISKS: what each
    /// replica already holds, as a sum per chunk.
    DiskSums = 19,
    /// Primary → backup (version 6), empty, once per session after HELLO:
    /// what guest RAM do you hold? Backup → primary: a hash of each page
    /// of the image the session fills ([`crate::pagehash::page_hash`]),
    /// or none (it holds nothing: send every page).
    RamSums = 20,
}

impl MsgType {
    /// The type of number `n`, if it is one.
    pub fn from_u32(n: u32) -> Option<Self> {
        use MsgType::*;
        Some(match n {
            1 => Hello,
            2 => HelloOk,
            3 => Ok,
            4 => Error,
            5 => Pages,
            6 => RoundEnd,
            7 => Context,
            8 => VmState,
            9 => Commit,
            10 => Abort,
            11 => Heartbeat,
            12 => Hang,
            13 => EpochEnd,
            14 => EpochAck,
            15 => Join,
            16 => VmStateDelta,
            17 => Disks,
            18 => DiskData,
            19 => DiskSums,
            20 => RamSums,
            _ => return None,
        })
    }

    /// Its name in messages.
    pub fn name(self) -> &'static str {
        use MsgType::*;
        match self {
            Hello => "HELLO",
            HelloOk => "HELLO_OK",
            Ok => "OK",
            Error => "ERROR",
            Pages => "PAGES",
            RoundEnd => "ROUND_END",
            Context => "CONTEXT",
            VmState => "VM_STATE",
            Commit => "COMMIT",
            Abort => "ABORT",
            Heartbeat => "HEARTBEAT",
            Hang => "HANG",
            EpochEnd => "EPOCH_END",
            EpochAck => "EPOCH_ACK",
            Join => "JOIN",
            VmStateDelta => "VM_STATE_DELTA",
            Disks => "DISKS",
            DiskData => "DISK_DATA",
            DiskSums => "DISK_SUMS",
            RamSums => "RAM_SUMS",
        }
    }
}

/// What went wrong reading or checking the stream.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The socket failed.
    #[error("connection failed")]
    Io(#[from] io::Error),
    /// The peer closed the connection between frames.
    #[error("the peer closed the connection")]
    Closed,
    /// The stream ended inside a frame.
    #[error("stream truncated inside a {what}: {have} of {need} bytes")]
    Truncated {
        /// Header or payload.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes read.
        have: usize,
    },
    /// The stream ended inside a frame's payload.
    #[error("stream truncated inside a {ty} frame: {have} of {need} payload bytes")]
    TruncatedPayload {
        /// Type name.
        ty: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes read.
        have: usize,
    },
    /// Type 0 or a number this version does not have.
    #[error("invalid message type {0}")]
    InvalidType(u32),
    /// A payload over the limit.
    #[error("{ty} frame of {len} bytes exceeds the {max}-byte limit")]
    Oversize {
        /// Type name.
        ty: &'static str,
        /// Claimed length.
        len: u32,
        /// Limit.
        max: u32,
    },
    /// Checksum mismatch.
    #[error("{ty} frame damaged: crc32 {computed:#010x}, header says {stored:#010x}")]
    BadCrc {
        /// Type name.
        ty: &'static str,
        /// In the header.
        stored: u32,
        /// Of the bytes.
        computed: u32,
    },
    /// A payload that does not parse.
    #[error("malformed {ty}: {what}")]
    Malformed {
        /// Type name.
        ty: &'static str,
        /// What is wrong.
        what: String,
    },
}

/// One page record of a PAGES message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PageData {
    /// All zero.
    Zero,
    /// 4096 bytes as they are.
    Raw(Vec<u8>),
    /// An LZ4 block of 4096 bytes.
    Lz4(Vec<u8>),
    /// The bytes the receiver already holds for the page (it was dirtied,
    /// not changed).
    Same,
    /// An LZ4 block of the page XOR the bytes the receiver holds for it
    /// (the sender's [`crate::page_cache::PageCache`]).
    Xor(Vec<u8>),
}

/// Buffers a page's encoding reuses from page to page.
#[derive(Default)]
pub struct PageScratch {
    /// The page's LZ4 block (or its delta's).
    lz4: Vec<u8>,
    /// The page XOR the receiver's copy.
    xor: Vec<u8>,
}

/// A delta whose LZ4 block is at most this long is taken without also
/// trying the page on its own (one compression instead of two).
const SMALL_DELTA: usize = PAGE / 8;

/// Whether a delta against `base` could pay: at most half the page's
/// 8-byte words changed. A page rewritten whole (a frame, fresh data) would
/// otherwise cost an LZ4 pass over its XOR before the one over itself,
/// for nothing (the checkpoint benchmark's frames: 147 ms of frame
/// building per epoch instead of 90).
fn worth_a_delta(page: &[u8], base: &[u8]) -> bool {
    let changed = page
        .chunks_exact(8)
        .zip(base.chunks_exact(8))
        .filter(|(a, b)| a != b)
        .count();
    changed <= page.len() / 16
}

/// How a page goes on the wire: its kind byte and, for the LZ4 kinds,
/// the block's length in `s.lz4`. `base`: the bytes the receiver holds
/// for the page, if the sender knows them.
fn page_kind(page: &[u8], compress: bool, base: Option<&[u8]>, s: &mut PageScratch) -> (u8, usize) {
    if !compress {
        return (1, page.len());
    }
    if page.iter().all(|&b| b == 0) {
        return (0, 0);
    }
    s.lz4
        .resize(lz4_flex::block::get_maximum_output_size(page.len()), 0);
    let mut delta = None;
    if let Some(base) = base.filter(|b| worth_a_delta(page, b)) {
        if base == page {
            return (3, 0);
        }
        s.xor.clear();
        s.xor.extend(page.iter().zip(base).map(|(a, b)| a ^ b));
        match lz4_flex::block::compress_into(&s.xor, &mut s.lz4) {
            Ok(n) if n <= SMALL_DELTA => return (4, n),
            Ok(n) if n < page.len() => delta = Some(n),
            _ => {}
        }
    }
    // The page on its own, into the block's space after the delta's.
    let at = delta.unwrap_or(0);
    let need = at + lz4_flex::block::get_maximum_output_size(page.len());
    s.lz4.resize(need, 0);
    match (
        lz4_flex::block::compress_into(page, &mut s.lz4[at..]),
        delta,
    ) {
        (Ok(n), Some(d)) if n < d => {
            s.lz4.copy_within(at..at + n, 0);
            (2, n)
        }
        (_, Some(d)) => (4, d),
        (Ok(n), None) if n < page.len() => (2, n),
        _ => (1, page.len()),
    }
}

impl PageData {
    /// Encodes a page: zero flag, LZ4 if it is smaller, raw otherwise.
    #[cfg(test)]
    pub fn encode(page: &[u8]) -> PageData {
        PageData::encode_with(page, true)
    }

    /// [`Self::encode`], or with `compress` off every page raw, zero
    /// pages too (the baseline without compression).
    #[cfg(test)]
    pub fn encode_with(page: &[u8], compress: bool) -> PageData {
        PageData::encode_against(page, compress, None)
    }

    /// [`Self::encode_with`], as a delta against `base` (the receiver's
    /// bytes for the page) where that is smaller.
    #[cfg(test)]
    pub fn encode_against(page: &[u8], compress: bool, base: Option<&[u8]>) -> PageData {
        let mut s = PageScratch::default();
        match page_kind(page, compress, base, &mut s) {
            (0, _) => PageData::Zero,
            (3, _) => PageData::Same,
            (2, n) => PageData::Lz4(s.lz4[..n].to_vec()),
            (4, n) => PageData::Xor(s.lz4[..n].to_vec()),
            _ => PageData::Raw(page.to_vec()),
        }
    }

    /// Whether the record is a delta: its decoding starts from the bytes
    /// the receiver holds for the page.
    pub fn is_delta(&self) -> bool {
        matches!(self, PageData::Same | PageData::Xor(_))
    }

    /// The page's 4096 bytes, into `out`; a delta ([`Self::is_delta`])
    /// applies to the receiver's bytes for the page, which `out` holds.
    pub fn decode(&self, out: &mut [u8; PAGE]) -> Result<(), String> {
        fn lz4(b: &[u8], out: &mut [u8; PAGE]) -> Result<(), String> {
            match lz4_flex::block::decompress_into(b, out) {
                Ok(PAGE) => Ok(()),
                Ok(n) => Err(format!("LZ4 page decompresses to {n} bytes, not {PAGE}")),
                Err(e) => Err(format!("LZ4 page does not decompress: {e}")),
            }
        }
        match self {
            PageData::Zero => out.fill(0),
            PageData::Raw(b) => out.copy_from_slice(b),
            PageData::Lz4(b) => lz4(b, out)?,
            PageData::Same => {}
            PageData::Xor(b) => {
                let mut xor = [0u8; PAGE];
                lz4(b, &mut xor).map_err(|e| format!("delta: {e}"))?;
                out.iter_mut().zip(xor).for_each(|(o, x)| *o ^= x);
            }
        }
        Ok(())
    }
}

/// Appends a fencing term, if any (the last field of HELLO and JOIN).
fn put_term(p: &mut Vec<u8>, term: &Option<Term>) {
    if let Some(t) = term {
        p.extend_from_slice(&t.generation.to_le_bytes());
        p.extend_from_slice(&t.instance.boot.to_le_bytes());
        p.extend_from_slice(&t.instance.pid.to_le_bytes());
        p.extend_from_slice(&t.instance.started.to_le_bytes());
        let vm = t.vm.as_ref().map_or("", |v| v.as_str()).as_bytes();
        p.push(vm.len() as u8);
        p.extend_from_slice(vm);
    }
}

/// A message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Handshake.
    Hello {
        /// Oldest version the source speaks.
        min: u16,
        /// Newest.
        max: u16,
        /// Guest RAM bytes.
        ram_size: u64,
        /// The session (a pairing of a primary with a backup, or one
        /// migration) this connection belongs to: random, chosen by the
        /// sender once per pairing.
        session: u128,
        /// The VMM the VM runs under: what CONTEXT and VM_STATE hold.
        vmm: VmmKind,
        /// A protecting primary's fencing term (none for a migration, or
        /// from a hagctl before terms).
        term: Option<Term>,
        /// A protecting QEMU primary's VM shape, which the backup's
        /// standby must match (none for hag-vmm, a migration, or from a
        /// hagctl before shapes; only with a term).
        shape: Option<VmShape>,
    },
    /// Handshake accepted (the answer to HELLO and to JOIN).
    HelloOk {
        /// Chosen version.
        version: u16,
        /// The receiver's generation (0 for a migration target).
        generation: u64,
        /// The receiver's failover timeout, ms (0 for a migration
        /// target): the primary adopts it, so both sides judge silence
        /// alike.
        timeout_ms: u32,
        /// A backup's verdict on the term the primary presented: whether
        /// it took over from that VM instance (none if no term was
        /// presented, or from a hagctl before terms).
        superseded: Option<bool>,
        /// The witness a backup takes over with ([`crate::witness::WitnessAt::id`];
        /// only after `superseded`; none: it takes over on silence alone).
        /// A primary claims from its own witness only when this is its id.
        witness: Option<u64>,
    },
    /// A control connection joins `session`.
    Join {
        /// The session.
        session: u128,
        /// The primary's fencing term (none from a hagctl before terms).
        term: Option<Term>,
    },
    /// A phase is done: round number, or [`COMMIT_PHASE`].
    Ok {
        /// What is acknowledged.
        phase: u32,
    },
    /// Failure.
    Error {
        /// Why.
        message: String,
    },
    /// Pages.
    Pages {
        /// Round.
        round: u32,
        /// (page index, data).
        pages: Vec<(u64, PageData)>,
    },
    /// End of a round.
    RoundEnd {
        /// Round.
        round: u32,
        /// Pages sent in it.
        pages: u64,
    },
    /// vGPU snapshot.
    Context(Vec<u8>),
    /// VM state.
    VmState(Vec<u8>),
    /// VM state as a patch against the state committed at `base_epoch`.
    VmStateDelta {
        /// The epoch whose committed state it patches.
        base_epoch: u64,
        /// The patch.
        patch: Vec<u8>,
    },
    /// The VM's writable disks.
    Disks(Vec<DiskInfo>),
    /// Part of a disk's delta.
    DiskData {
        /// Index into the session's DISKS.
        disk: u32,
        /// Byte offset in the disk.
        offset: u64,
        /// What is there.
        extent: DiskExtent,
    },
    /// For each disk of DISKS, in order, the sum of each
    /// [`DISK_DATA_MAX`]-byte chunk its replica holds
    /// ([`disk_chunk_sum`]); an empty list: nothing known, send it all.
    DiskSums(Vec<Vec<[u8; 32]>>),
    /// The primary's question (empty), or the backup's page hashes.
    RamSums(Vec<u64>),
    /// Restore and resume.
    Commit,
    /// Give up.
    Abort {
        /// Why.
        reason: String,
    },
    /// Alive (checkpoint control connection).
    Heartbeat {
        /// The sender's generation.
        generation: u64,
        /// The last epoch acknowledged.
        epoch: u64,
    },
    /// The primary's vGPU hung: take over.
    Hang {
        /// What happened.
        reason: String,
    },
    /// End of a checkpoint epoch.
    EpochEnd {
        /// Epoch number (1 = the first checkpoint).
        epoch: u64,
        /// The primary's generation.
        generation: u64,
    },
    /// A checkpoint epoch is applied.
    EpochAck {
        /// Epoch number.
        epoch: u64,
        /// The backup's generation.
        generation: u64,
    },
}

/// A writable disk of a protected VM, as DISKS names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskInfo {
    /// Its device's id (what names its replica on the backup).
    pub id: String,
    /// Its size, bytes.
    pub size: u64,
}

/// The longest device id a disk may have.
pub const DISK_ID_MAX: usize = 64;

/// Whether `id` can name a disk (and its replica's file): QEMU's id
/// characters, at most [`DISK_ID_MAX`] bytes, not starting with a dot.
pub fn is_disk_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= DISK_ID_MAX
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// The sum of one chunk of a disk (at most [`DISK_DATA_MAX`] bytes, the
/// chunk at its offset): BLAKE2b-256, which both sides compute alike.
pub fn disk_chunk_sum(chunk: &[u8]) -> [u8; 32] {
    use blake2::{digest::consts::U32, Blake2b, Digest};
    Blake2b::<U32>::digest(chunk).into()
}

/// [`disk_chunk_sum`] of a whole chunk of zeroes ([`DISK_DATA_MAX`]
/// bytes), computed once: most of a disk reads as zeroes, which a map or a
/// hole says without reading, and neither side hashes them.
pub fn zero_chunk_sum() -> [u8; 32] {
    static SUM: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();
    *SUM.get_or_init(|| disk_chunk_sum(&vec![0; DISK_DATA_MAX]))
}

/// What a DISK_DATA says is at its offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiskExtent {
    /// These bytes (at most [`DISK_DATA_MAX`]).
    Data(Vec<u8>),
    /// This many bytes of zeroes.
    Zero(u64),
}

impl DiskExtent {
    /// Bytes of the disk it covers.
    pub fn bytes(&self) -> u64 {
        match self {
            DiskExtent::Data(b) => b.len() as u64,
            DiskExtent::Zero(n) => *n,
        }
    }
}

/// The `phase` of the OK that acknowledges COMMIT.
pub const COMMIT_PHASE: u32 = u32::MAX;
/// The `phase` of the OK that acknowledges an ABORT ending protection:
/// the backup has discarded its checkpoint and will not take over.
pub const ENDED_PHASE: u32 = u32::MAX - 1;

struct Cursor<'a> {
    b: &'a [u8],
    ty: &'static str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(WireError::Malformed {
                ty: self.ty,
                what: format!("{what}: {n} bytes needed, {} left", self.b.len()),
            });
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self, what: &str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, WireError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32, WireError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, WireError> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    }
    fn u128(&mut self, what: &str) -> Result<u128, WireError> {
        let b = self.take(16, what)?;
        Ok(u128::from_le_bytes(b.try_into().unwrap_or([0; 16])))
    }
    /// A count of disks, at most [`MAX_DISKS`].
    fn disk_count(&mut self) -> Result<usize, WireError> {
        let count = self.u32("disk count")? as usize;
        if count > MAX_DISKS {
            return Err(WireError::Malformed {
                ty: self.ty,
                what: format!("{count} disks, at most {MAX_DISKS}"),
            });
        }
        Ok(count)
    }
    /// An optional fencing term, last in its message: none if the
    /// message ends here (a hagctl before terms).
    fn term(&mut self) -> Result<Option<Term>, WireError> {
        if self.b.is_empty() {
            return Ok(None);
        }
        let generation = self.u64("term's generation")?;
        let instance = Instance {
            boot: self.u128("instance's boot")?,
            pid: self.u32("instance's pid")?,
            started: self.u64("instance's start")?,
        };
        let len = self.u8("VM name's length")?;
        let name = self.take(usize::from(len), "VM name")?;
        let vm = match len {
            0 => None,
            _ => Some(
                std::str::from_utf8(name)
                    .map_err(|_| "not UTF-8".to_owned())
                    .and_then(str::parse::<VmName>)
                    .map_err(|e| WireError::Malformed {
                        ty: self.ty,
                        what: format!("VM name: {e}"),
                    })?,
            ),
        };
        Ok(Some(Term {
            generation,
            instance,
            vm,
        }))
    }
    /// An optional VM shape, after a HELLO's term: none if the message
    /// ends there.
    fn shape(&mut self) -> Result<Option<VmShape>, WireError> {
        if self.b.is_empty() {
            return Ok(None);
        }
        let len = self.u32("VM shape's length")? as usize;
        if len > MAX_SHAPE {
            return Err(WireError::Malformed {
                ty: self.ty,
                what: format!("a VM shape of {len} bytes, at most {MAX_SHAPE}"),
            });
        }
        let bytes = self.take(len, "VM shape")?;
        VmShape::decode(bytes)
            .map(Some)
            .map_err(|what| WireError::Malformed { ty: self.ty, what })
    }
    fn end(&self) -> Result<(), WireError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(WireError::Malformed {
                ty: self.ty,
                what: format!("{} bytes after the end", self.b.len()),
            })
        }
    }
}

impl Msg {
    /// Its type.
    pub fn ty(&self) -> MsgType {
        match self {
            Msg::Hello { .. } => MsgType::Hello,
            Msg::HelloOk { .. } => MsgType::HelloOk,
            Msg::Join { .. } => MsgType::Join,
            Msg::Ok { .. } => MsgType::Ok,
            Msg::Error { .. } => MsgType::Error,
            Msg::Pages { .. } => MsgType::Pages,
            Msg::RoundEnd { .. } => MsgType::RoundEnd,
            Msg::Context(_) => MsgType::Context,
            Msg::VmState(_) => MsgType::VmState,
            Msg::VmStateDelta { .. } => MsgType::VmStateDelta,
            Msg::Disks(_) => MsgType::Disks,
            Msg::DiskData { .. } => MsgType::DiskData,
            Msg::DiskSums(_) => MsgType::DiskSums,
            Msg::RamSums(_) => MsgType::RamSums,
            Msg::Commit => MsgType::Commit,
            Msg::Abort { .. } => MsgType::Abort,
            Msg::Heartbeat { .. } => MsgType::Heartbeat,
            Msg::Hang { .. } => MsgType::Hang,
            Msg::EpochEnd { .. } => MsgType::EpochEnd,
            Msg::EpochAck { .. } => MsgType::EpochAck,
        }
    }

    /// The payload bytes.
    pub fn payload(&self) -> Vec<u8> {
        let mut p = Vec::new();
        match self {
            Msg::Hello {
                min,
                max,
                ram_size,
                session,
                vmm,
                term,
                shape,
            } => {
                p.extend_from_slice(&MAGIC);
                p.extend_from_slice(&min.to_le_bytes());
                p.extend_from_slice(&max.to_le_bytes());
                p.extend_from_slice(&ram_size.to_le_bytes());
                p.extend_from_slice(&(PAGE as u32).to_le_bytes());
                p.extend_from_slice(&session.to_le_bytes());
                p.push(*vmm as u8);
                put_term(&mut p, term);
                if let (Some(_), Some(shape)) = (term, shape) {
                    let bytes = shape.encode();
                    p.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
                    p.extend_from_slice(&bytes);
                }
            }
            Msg::HelloOk {
                version,
                generation,
                timeout_ms,
                superseded,
                witness,
            } => {
                p.extend_from_slice(&version.to_le_bytes());
                p.extend_from_slice(&generation.to_le_bytes());
                p.extend_from_slice(&timeout_ms.to_le_bytes());
                if let Some(s) = superseded {
                    p.push(u8::from(*s));
                    if let Some(w) = witness {
                        p.extend_from_slice(&w.to_le_bytes());
                    }
                }
            }
            Msg::Join { session, term } => {
                p.extend_from_slice(&session.to_le_bytes());
                put_term(&mut p, term);
            }
            Msg::Ok { phase } => p.extend_from_slice(&phase.to_le_bytes()),
            Msg::Error { message } => p.extend_from_slice(message.as_bytes()),
            Msg::Abort { reason } => p.extend_from_slice(reason.as_bytes()),
            Msg::Hang { reason } => p.extend_from_slice(reason.as_bytes()),
            Msg::Heartbeat { generation, epoch } => {
                p.extend_from_slice(&generation.to_le_bytes());
                p.extend_from_slice(&epoch.to_le_bytes());
            }
            Msg::EpochEnd { epoch, generation } | Msg::EpochAck { epoch, generation } => {
                p.extend_from_slice(&epoch.to_le_bytes());
                p.extend_from_slice(&generation.to_le_bytes());
            }
            Msg::Pages { round, pages } => {
                p.extend_from_slice(&round.to_le_bytes());
                p.extend_from_slice(&(pages.len() as u32).to_le_bytes());
                for (index, data) in pages {
                    p.extend_from_slice(&index.to_le_bytes());
                    let (kind, body): (u8, &[u8]) = match data {
                        PageData::Zero => (0, &[]),
                        PageData::Raw(b) => (1, b),
                        PageData::Lz4(b) => (2, b),
                        PageData::Same => (3, &[]),
                        PageData::Xor(b) => (4, b),
                    };
                    p.push(kind);
                    p.extend_from_slice(&(body.len() as u32).to_le_bytes());
                    p.extend_from_slice(body);
                }
            }
            Msg::RoundEnd { round, pages } => {
                p.extend_from_slice(&round.to_le_bytes());
                p.extend_from_slice(&pages.to_le_bytes());
            }
            Msg::Context(b) => {
                p.extend_from_slice(&(b.len() as u32).to_le_bytes());
                p.extend_from_slice(&lz4_flex::block::compress(b));
            }
            Msg::VmState(b) => p.extend_from_slice(b),
            Msg::VmStateDelta { base_epoch, patch } => {
                p.extend_from_slice(&base_epoch.to_le_bytes());
                p.extend_from_slice(patch);
            }
            Msg::Disks(disks) => {
                p.extend_from_slice(&(disks.len() as u32).to_le_bytes());
                for d in disks {
                    p.push(d.id.len() as u8);
                    p.extend_from_slice(d.id.as_bytes());
                    p.extend_from_slice(&d.size.to_le_bytes());
                }
            }
            Msg::DiskData {
                disk,
                offset,
                extent,
            } => {
                p.extend_from_slice(&disk.to_le_bytes());
                p.extend_from_slice(&offset.to_le_bytes());
                match extent {
                    DiskExtent::Zero(n) => {
                        p.push(0);
                        p.extend_from_slice(&n.to_le_bytes());
                    }
                    DiskExtent::Data(b) => {
                        p.push(1);
                        p.extend_from_slice(b);
                    }
                }
            }
            Msg::DiskSums(disks) => {
                p.extend_from_slice(&(disks.len() as u32).to_le_bytes());
                for sums in disks {
                    p.extend_from_slice(&(sums.len() as u32).to_le_bytes());
                    sums.iter().for_each(|s| p.extend_from_slice(s));
                }
            }
            Msg::RamSums(sums) => {
                p.extend_from_slice(&(sums.len() as u32).to_le_bytes());
                sums.iter()
                    .for_each(|h| p.extend_from_slice(&h.to_le_bytes()));
            }
            Msg::Commit => {}
        }
        p
    }

    /// Parses a payload of type `ty` (already checked by [`read_frame`]).
    pub fn decode(ty: MsgType, payload: &[u8]) -> Result<Msg, WireError> {
        let mut c = Cursor {
            b: payload,
            ty: ty.name(),
        };
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let msg = match ty {
            MsgType::Hello => {
                let magic = c.take(8, "magic")?;
                if magic != MAGIC {
                    return Err(WireError::Malformed {
                        ty: ty.name(),
                        what: format!("bad magic {magic:02x?}: not a hag migration stream"),
                    });
                }
                let min = c.u16("min version")?;
                let max = c.u16("max version")?;
                let ram_size = c.u64("RAM size")?;
                let page = c.u32("page size")?;
                if page as usize != PAGE {
                    return Err(WireError::Malformed {
                        ty: ty.name(),
                        what: format!("page size {page}, this build uses {PAGE}"),
                    });
                }
                let session = c.u128("session")?;
                let vmm = c.u8("VMM")?;
                let vmm = VmmKind::from_u8(vmm).ok_or_else(|| WireError::Malformed {
                    ty: ty.name(),
                    what: format!("unknown VMM {vmm}"),
                })?;
                Msg::Hello {
                    min,
                    max,
                    ram_size,
                    session,
                    vmm,
                    term: c.term()?,
                    shape: c.shape()?,
                }
            }
            MsgType::HelloOk => Msg::HelloOk {
                version: c.u16("version")?,
                generation: c.u64("generation")?,
                timeout_ms: c.u32("failover timeout")?,
                superseded: if c.b.is_empty() {
                    None
                } else {
                    match c.u8("superseded")? {
                        0 => Some(false),
                        1 => Some(true),
                        v => {
                            return Err(WireError::Malformed {
                                ty: ty.name(),
                                what: format!("superseded is {v}, not 0 or 1"),
                            })
                        }
                    }
                },
                witness: if c.b.is_empty() {
                    None
                } else {
                    Some(c.u64("witness")?)
                },
            },
            MsgType::Join => Msg::Join {
                session: c.u128("session")?,
                term: c.term()?,
            },
            MsgType::Ok => Msg::Ok {
                phase: c.u32("phase")?,
            },
            MsgType::Error => {
                return Ok(Msg::Error {
                    message: text(payload),
                })
            }
            MsgType::Abort => {
                return Ok(Msg::Abort {
                    reason: text(payload),
                })
            }
            MsgType::Hang => {
                return Ok(Msg::Hang {
                    reason: text(payload),
                })
            }
            MsgType::Heartbeat => Msg::Heartbeat {
                generation: c.u64("generation")?,
                epoch: c.u64("epoch")?,
            },
            MsgType::EpochEnd => Msg::EpochEnd {
                epoch: c.u64("epoch")?,
                generation: c.u64("generation")?,
            },
            MsgType::EpochAck => Msg::EpochAck {
                epoch: c.u64("epoch")?,
                generation: c.u64("generation")?,
            },
            MsgType::Pages => {
                let round = c.u32("round")?;
                let count = c.u32("count")? as usize;
                // Each record is at least 13 bytes: refuse a count the
                // payload cannot hold before allocating for it.
                if count > c.b.len() / 13 {
                    return Err(WireError::Malformed {
                        ty: ty.name(),
                        what: format!("{count} pages in {} bytes", c.b.len()),
                    });
                }
                let mut pages = Vec::with_capacity(count);
                for i in 0..count {
                    let index = c.u64("page index")?;
                    let kind = c.u8("page kind")?;
                    let len = c.u32("page length")? as usize;
                    let bad = |what: String| WireError::Malformed {
                        ty: MsgType::Pages.name(),
                        what: format!("record {i} (page {index}): {what}"),
                    };
                    let data = match (kind, len) {
                        (0, 0) => PageData::Zero,
                        (1, PAGE) => PageData::Raw(c.take(len, "raw page")?.to_vec()),
                        (2, 1..PAGE) => PageData::Lz4(c.take(len, "LZ4 page")?.to_vec()),
                        (3, 0) => PageData::Same,
                        (4, 1..PAGE) => PageData::Xor(c.take(len, "page delta")?.to_vec()),
                        (0..=4, _) => return Err(bad(format!("kind {kind} with length {len}"))),
                        _ => return Err(bad(format!("unknown kind {kind}"))),
                    };
                    pages.push((index, data));
                }
                Msg::Pages { round, pages }
            }
            MsgType::RoundEnd => Msg::RoundEnd {
                round: c.u32("round")?,
                pages: c.u64("pages")?,
            },
            MsgType::Context => {
                let len = c.u32("snapshot length")?;
                if u64::from(len) > hag_abi::abi::CONTEXT_MAX_BYTES {
                    return Err(WireError::Malformed {
                        ty: ty.name(),
                        what: format!(
                            "snapshot of {len} bytes, at most {} allowed",
                            hag_abi::abi::CONTEXT_MAX_BYTES
                        ),
                    });
                }
                let snapshot = lz4_flex::block::decompress(c.b, len as usize).map_err(|e| {
                    WireError::Malformed {
                        ty: ty.name(),
                        what: format!("snapshot does not decompress: {e}"),
                    }
                })?;
                if snapshot.len() != len as usize {
                    return Err(WireError::Malformed {
                        ty: ty.name(),
                        what: format!(
                            "snapshot decompresses to {} bytes, not {len}",
                            snapshot.len()
                        ),
                    });
                }
                return Ok(Msg::Context(snapshot));
            }
            MsgType::VmState => return Ok(Msg::VmState(payload.to_vec())),
            MsgType::VmStateDelta => {
                let base_epoch = c.u64("base epoch")?;
                return Ok(Msg::VmStateDelta {
                    base_epoch,
                    patch: c.b.to_vec(),
                });
            }
            MsgType::Disks => {
                let count = c.disk_count()?;
                let mut disks = Vec::with_capacity(count);
                for i in 0..count {
                    let n = usize::from(c.u8("disk id length")?);
                    let id = std::str::from_utf8(c.take(n, "disk id")?)
                        .ok()
                        .filter(|id| is_disk_id(id))
                        .ok_or_else(|| WireError::Malformed {
                            ty: MsgType::Disks.name(),
                            what: format!("disk {i}: its id is not a device id"),
                        })?
                        .to_owned();
                    let size = c.u64("disk size")?;
                    disks.push(DiskInfo { id, size });
                }
                Msg::Disks(disks)
            }
            MsgType::DiskData => {
                let disk = c.u32("disk")?;
                let offset = c.u64("offset")?;
                let extent = match c.u8("extent kind")? {
                    0 => DiskExtent::Zero(c.u64("zero length")?),
                    1 if !c.b.is_empty() && c.b.len() <= DISK_DATA_MAX => {
                        let data = c.b.to_vec();
                        c.b = &[];
                        DiskExtent::Data(data)
                    }
                    1 => {
                        return Err(WireError::Malformed {
                            ty: ty.name(),
                            what: format!("{} data bytes, 1 to {DISK_DATA_MAX} allowed", c.b.len()),
                        })
                    }
                    k => {
                        return Err(WireError::Malformed {
                            ty: ty.name(),
                            what: format!("unknown extent kind {k}"),
                        })
                    }
                };
                Msg::DiskData {
                    disk,
                    offset,
                    extent,
                }
            }
            MsgType::DiskSums => {
                let count = c.disk_count()?;
                let mut disks = Vec::with_capacity(count);
                for _ in 0..count {
                    let n = c.u32("sum count")? as usize;
                    // Checked against what is left before it is allocated.
                    let bytes = c.take(n.saturating_mul(32), "sums")?;
                    disks.push(
                        bytes
                            .chunks_exact(32)
                            .map(|b| b.try_into().unwrap_or([0; 32]))
                            .collect(),
                    );
                }
                Msg::DiskSums(disks)
            }
            MsgType::RamSums => {
                let n = c.u32("page count")? as usize;
                // Checked against what is left before it is allocated.
                let bytes = c.take(n.saturating_mul(8), "page hashes")?;
                Msg::RamSums(
                    bytes
                        .chunks_exact(8)
                        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                        .collect(),
                )
            }
            MsgType::Commit => Msg::Commit,
        };
        c.end()?;
        Ok(msg)
    }
}

fn frame_crc(header: &[u8], payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&header[..8]);
    h.update(payload);
    h.finalize()
}

/// The bytes of `msg` as one frame.
pub fn encode_frame(msg: &Msg) -> Vec<u8> {
    let payload = msg.payload();
    let mut f = Vec::with_capacity(HEADER_BYTES + payload.len());
    f.extend_from_slice(&(msg.ty() as u32).to_le_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    let crc = frame_crc(&f, &payload);
    f.extend_from_slice(&crc.to_le_bytes());
    f.extend_from_slice(&payload);
    f
}

/// The PAGES frame of `pages` (page indices) whose bytes are `raw`, one
/// page after another, encoded as [`PageData::encode_with`] would into
/// `out` (cleared first): the same bytes as
/// `encode_frame(&Msg::Pages { .. })`, without a buffer per page, so that
/// an epoch's sender reuses one buffer for all its frames. A page in
/// `cache` (the bytes the receiver holds for it) goes as a delta against
/// them where that is smaller. Returns how many pages went as zero pages
/// and how many as deltas.
pub fn encode_pages_frame(
    round: u32,
    pages: &[u64],
    raw: &[u8],
    compress: bool,
    cache: Option<&PageCache>,
    out: &mut Vec<u8>,
    scratch: &mut PageScratch,
) -> PagesEncoded {
    debug_assert_eq!(raw.len(), pages.len() * PAGE);
    out.clear();
    out.extend_from_slice(&(MsgType::Pages as u32).to_le_bytes());
    out.extend_from_slice(&[0; 8]); // length and crc32, once known
    out.extend_from_slice(&round.to_le_bytes());
    out.extend_from_slice(&(pages.len() as u32).to_le_bytes());
    let mut counts = PagesEncoded::default();
    for (&index, page) in pages.iter().zip(raw.chunks_exact(PAGE)) {
        out.extend_from_slice(&index.to_le_bytes());
        let base = cache.and_then(|c| c.get(index));
        let (kind, len) = page_kind(page, compress, base, scratch);
        counts.zero += u64::from(kind == 0);
        counts.delta += u64::from(kind == 3 || kind == 4);
        out.push(kind);
        out.extend_from_slice(&(len as u32).to_le_bytes());
        match kind {
            0 | 3 => {}
            2 | 4 => out.extend_from_slice(&scratch.lz4[..len]),
            _ => out.extend_from_slice(page),
        }
    }
    let len = (out.len() - HEADER_BYTES) as u32;
    out[4..8].copy_from_slice(&len.to_le_bytes());
    let crc = frame_crc(&out[..HEADER_BYTES], &out[HEADER_BYTES..]);
    out[8..12].copy_from_slice(&crc.to_le_bytes());
    counts
}

/// How a PAGES frame's pages went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PagesEncoded {
    /// As zero pages.
    pub zero: u64,
    /// As deltas against the receiver's bytes.
    pub delta: u64,
}

/// Writes `msg` as one frame; returns the bytes written.
pub fn write_msg(w: &mut impl Write, msg: &Msg) -> io::Result<usize> {
    let f = encode_frame(msg);
    w.write_all(&f)?;
    Ok(f.len())
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut have = 0;
    while have < buf.len() {
        match r.read(&mut buf[have..]) {
            Ok(0) => break,
            Ok(n) => have += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(have)
}

/// Reads one frame and checks it in a fixed order: complete header, known
/// type, length limit, complete payload, checksum; then parses it.
/// Returns the message and the frame's size on the wire.
pub fn read_msg(r: &mut impl Read) -> Result<(Msg, usize), WireError> {
    let mut h = [0u8; HEADER_BYTES];
    match read_full(r, &mut h)? {
        0 => return Err(WireError::Closed),
        HEADER_BYTES => {}
        have => {
            return Err(WireError::Truncated {
                what: "frame header",
                need: HEADER_BYTES,
                have,
            })
        }
    }
    let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let (ty, len, stored) = (word(0), word(4), word(8));
    let ty = MsgType::from_u32(ty).ok_or(WireError::InvalidType(ty))?;
    if len > MAX_PAYLOAD {
        return Err(WireError::Oversize {
            ty: ty.name(),
            len,
            max: MAX_PAYLOAD,
        });
    }
    let mut payload = vec![0u8; len as usize];
    let have = read_full(r, &mut payload)?;
    if have < payload.len() {
        return Err(WireError::TruncatedPayload {
            ty: ty.name(),
            need: payload.len(),
            have,
        });
    }
    let computed = frame_crc(&h, &payload);
    if computed != stored {
        return Err(WireError::BadCrc {
            ty: ty.name(),
            stored,
            computed,
        });
    }
    Ok((Msg::decode(ty, &payload)?, HEADER_BYTES + payload.len()))
}

/// A fresh random session id (128 bits from the kernel's CSPRNG).
pub fn new_session() -> u128 {
    let mut b = [0u8; 16];
    // getrandom(2) blocks only before the pool is seeded, never fails for
    // 16 bytes once it is.
    let _ = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    u128::from_le_bytes(b)
}

/// A session id as people read it (its first 8 hex digits).
pub fn session_name(session: u128) -> String {
    format!("{:08x}", (session >> 96) as u32)
}

/// What the receiving side applies messages to.
pub trait Target {
    /// Guest RAM bytes.
    fn ram_size(&self) -> u64;
    /// Writes page `index` of guest RAM.
    fn write_page(&mut self, index: u64, bytes: &[u8; PAGE]) -> Result<(), String>;
    /// Restores the vGPU context and VM state and resumes the VM.
    fn commit(&mut self, context: &[u8], vm_state: &[u8]) -> Result<(), String>;
}

/// Who speaks to whom, for the messages of [`check_hello`].
#[derive(Clone, Copy, Debug)]
pub struct Sides {
    /// The sending side ("source").
    pub peer: &'static str,
    /// This side ("target").
    pub us: &'static str,
    /// The guest RAM written here ("the target VM").
    pub ram: &'static str,
}

/// `hagctl migrate` → `hagctl receive`.
pub const MIGRATION: Sides = Sides {
    peer: "source",
    us: "target",
    ram: "the target VM",
};

/// Checks a HELLO against the versions this build speaks and the guest RAM
/// written here; returns the version chosen.
pub fn check_hello(
    sides: Sides,
    (min, max, ram_size): (u16, u16, u64),
    local_ram: u64,
) -> Result<u16, String> {
    let hi = max.min(VERSION_MAX);
    if min.max(VERSION_MIN) > hi {
        return Err(format!(
            "{} speaks versions {min}..={max}, this {} {VERSION_MIN}..={VERSION_MAX}",
            sides.peer, sides.us
        ));
    }
    if ram_size != local_ram {
        return Err(format!(
            "{} VM has {} MiB of guest RAM, {} {} MiB",
            sides.peer,
            ram_size >> 20,
            sides.ram,
            local_ram >> 20
        ));
    }
    Ok(hi)
}

/// Where a round's pages go on the receiving side.
pub trait PageSink {
    /// Puts the bytes held for page `index` (what a delta applies to)
    /// into `out`.
    fn current(&mut self, index: u64, out: &mut [u8; PAGE]) -> Result<(), String>;
    /// Takes page `index`, decoded from `data`.
    fn write(&mut self, index: u64, data: &PageData, bytes: &[u8; PAGE]) -> Result<(), String>;
}

/// The round of pages in progress on the receiving side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Round {
    /// Its number.
    pub round: u32,
    /// Pages received in it so far.
    pub pages: u64,
}

impl Round {
    /// Round 0, nothing received yet.
    pub const FIRST: Round = Round { round: 0, pages: 0 };

    /// Checks a PAGES message of round `r` and hands each page, decoded
    /// (a delta against what `sink` holds for it), to `sink`; returns the
    /// round with them counted.
    pub fn on_pages(
        self,
        r: u32,
        list: &[(u64, PageData)],
        ram_size: u64,
        sink: &mut impl PageSink,
    ) -> Result<Round, String> {
        let round = self.round;
        if r != round {
            return Err(format!("PAGES of round {r} during round {round}"));
        }
        let limit = ram_size / PAGE as u64;
        let mut buf = [0u8; PAGE];
        for (index, data) in list {
            if *index >= limit {
                return Err(format!("page {index} is outside guest RAM ({limit} pages)"));
            }
            if data.is_delta() {
                sink.current(*index, &mut buf)?;
            }
            data.decode(&mut buf)
                .map_err(|e| format!("page {index}: {e}"))?;
            sink.write(*index, data, &buf)?;
        }
        Ok(Round {
            round,
            pages: self.pages + list.len() as u64,
        })
    }

    /// Checks ROUND_END `r` with `n` pages against this round; returns the
    /// next one.
    pub fn on_end(self, r: u32, n: u64) -> Result<Round, String> {
        let Round { round, pages } = self;
        if r != round || n != pages {
            return Err(format!(
                "ROUND_END of round {r} with {n} pages, but round {round} carried {pages}"
            ));
        }
        Ok(Round {
            round: round + 1,
            pages: 0,
        })
    }
}

/// Checks a CONTEXT's vGPU snapshot before it is kept.
pub fn check_context(context: &[u8]) -> Result<(), String> {
    hag_abi::snapshot::Snapshot::parse(context)
        .map(drop)
        .map_err(|e| format!("vGPU context refused: {e}"))
}

/// Why the receiver ended the session.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReceiveError {
    /// A message its state does not accept.
    #[error("unexpected {got} while {state}")]
    Unexpected {
        /// The message's type.
        got: &'static str,
        /// The state.
        state: &'static str,
    },
    /// The handshake failed.
    #[error("handshake refused: {0}")]
    Handshake(String),
    /// A message's contents are wrong.
    #[error("{0}")]
    Invalid(String),
    /// The source gave up.
    #[error("the source aborted the migration: {0}")]
    Aborted(String),
    /// The source reported an error.
    #[error("the source failed: {0}")]
    SourceError(String),
    /// Restoring failed.
    #[error("cannot resume the VM here: {0}")]
    Commit(String),
}

/// Counters of a receiving session.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Received {
    /// Rounds completed (pre-copy and the final one).
    pub rounds: u32,
    /// Page records applied.
    pub pages: u64,
    /// Of them, zero pages.
    pub zero_pages: u64,
    /// Context snapshot bytes.
    pub context_bytes: u64,
    /// VM state bytes.
    pub vm_state_bytes: u64,
}

/// A migration's pages, into its target. A migration sends each page
/// whole: its target holds no copy the source knows of.
struct Migrated<'a, T> {
    target: &'a mut T,
    stats: &'a mut Received,
}

impl<T: Target> PageSink for Migrated<'_, T> {
    fn current(&mut self, index: u64, _: &mut [u8; PAGE]) -> Result<(), String> {
        Err(format!(
            "page {index} came as a delta, which a migration never sends"
        ))
    }

    fn write(&mut self, index: u64, data: &PageData, bytes: &[u8; PAGE]) -> Result<(), String> {
        self.target.write_page(index, bytes)?;
        self.stats.pages += 1;
        self.stats.zero_pages += u64::from(*data == PageData::Zero);
        Ok(())
    }
}

/// The receiver's state; each message consumes it and yields the next.
#[derive(Debug)]
pub enum Receiver {
    /// Waiting for HELLO.
    AwaitHello,
    /// Receiving pages of the round in progress.
    Rounds(Round),
    /// Got the context, waiting for VM_STATE.
    GotContext(Vec<u8>),
    /// Got context and state, waiting for COMMIT.
    GotState(Vec<u8>, Vec<u8>),
    /// Committed: the VM runs here.
    Done,
}

impl Receiver {
    fn name(&self) -> &'static str {
        match self {
            Receiver::AwaitHello => "waiting for HELLO",
            Receiver::Rounds(_) => "receiving pages",
            Receiver::GotContext(_) => "waiting for VM_STATE after CONTEXT",
            Receiver::GotState(..) => "waiting for COMMIT",
            Receiver::Done => "done",
        }
    }

    /// Applies `msg`; returns the next state and the reply to send, if any.
    pub fn on(
        self,
        msg: Msg,
        target: &mut impl Target,
        stats: &mut Received,
    ) -> Result<(Receiver, Option<Msg>), ReceiveError> {
        match (self, msg) {
            (_, Msg::Abort { reason }) => Err(ReceiveError::Aborted(reason)),
            (_, Msg::Error { message }) => Err(ReceiveError::SourceError(message)),
            (
                Receiver::AwaitHello,
                Msg::Hello {
                    min,
                    max,
                    ram_size,
                    vmm,
                    ..
                },
            ) => {
                if vmm != VmmKind::HagVmm {
                    return Err(ReceiveError::Handshake(format!(
                        "the source's VM runs under {}: this stream carries hag-vmm VMs only (QEMU migrates its VMs itself: hagctl receive --qmp)",
                        vmm.name()
                    )));
                }
                let version = check_hello(MIGRATION, (min, max, ram_size), target.ram_size())
                    .map_err(ReceiveError::Handshake)?;
                Ok((
                    Receiver::Rounds(Round::FIRST),
                    Some(Msg::HelloOk {
                        version,
                        generation: 0,
                        timeout_ms: 0,
                        superseded: None,
                        witness: None,
                    }),
                ))
            }
            (Receiver::Rounds(at), Msg::Pages { round, pages }) => {
                let ram_size = target.ram_size();
                let at = at
                    .on_pages(round, &pages, ram_size, &mut Migrated { target, stats })
                    .map_err(ReceiveError::Invalid)?;
                Ok((Receiver::Rounds(at), None))
            }
            (Receiver::Rounds(at), Msg::RoundEnd { round, pages }) => {
                let next = at.on_end(round, pages).map_err(ReceiveError::Invalid)?;
                stats.rounds = next.round;
                Ok((Receiver::Rounds(next), Some(Msg::Ok { phase: at.round })))
            }
            (Receiver::Rounds(Round { pages: 0, .. }), Msg::Context(ctx)) => {
                check_context(&ctx).map_err(ReceiveError::Invalid)?;
                stats.context_bytes = ctx.len() as u64;
                Ok((Receiver::GotContext(ctx), None))
            }
            (Receiver::GotContext(ctx), Msg::VmState(state)) => {
                stats.vm_state_bytes = state.len() as u64;
                Ok((Receiver::GotState(ctx, state), None))
            }
            (Receiver::GotState(ctx, state), Msg::Commit) => {
                target.commit(&ctx, &state).map_err(ReceiveError::Commit)?;
                Ok((
                    Receiver::Done,
                    Some(Msg::Ok {
                        phase: COMMIT_PHASE,
                    }),
                ))
            }
            (state, msg) => Err(ReceiveError::Unexpected {
                got: msg.ty().name(),
                state: state.name(),
            }),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    struct Ram {
        pages: Vec<[u8; PAGE]>,
        committed: Option<(Vec<u8>, Vec<u8>)>,
    }

    impl Target for Ram {
        fn ram_size(&self) -> u64 {
            (self.pages.len() * PAGE) as u64
        }
        fn write_page(&mut self, index: u64, bytes: &[u8; PAGE]) -> Result<(), String> {
            self.pages[index as usize] = *bytes;
            Ok(())
        }
        fn commit(&mut self, c: &[u8], s: &[u8]) -> Result<(), String> {
            self.committed = Some((c.to_vec(), s.to_vec()));
            Ok(())
        }
    }

    fn ram() -> Ram {
        Ram {
            pages: vec![[0; PAGE]; 16],
            committed: None,
        }
    }

    /// A small valid vGPU context snapshot.
    pub(crate) fn snapshot() -> Vec<u8> {
        let mut buf = vec![0u8; 256];
        let mut w = hag_abi::snapshot::Writer::new(&mut buf, 1, 64 << 20).unwrap();
        w.section(hag_abi::snapshot::TAG_CONFIG, 16, |b| b.fill(7))
            .unwrap();
        let n = w.finish();
        buf.truncate(n);
        buf
    }

    fn page(fill: u8) -> Vec<u8> {
        let mut p = vec![fill; PAGE];
        p[100] = 1;
        p
    }

    fn session() -> Vec<Msg> {
        let mut noisy = vec![0u8; PAGE];
        for (i, b) in noisy.iter_mut().enumerate() {
            *b = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3];
        }
        vec![
            Msg::Hello {
                min: 3,
                max: 3,
                ram_size: 16 * PAGE as u64,
                session: 7,
                vmm: VmmKind::HagVmm,
                term: None,
                shape: None,
            },
            Msg::Pages {
                round: 0,
                pages: vec![
                    (1, PageData::encode(&page(3))),
                    (2, PageData::encode(&noisy)),
                ],
            },
            Msg::RoundEnd { round: 0, pages: 2 },
            Msg::Pages {
                round: 1,
                pages: vec![(1, PageData::encode(&[0; PAGE]))],
            },
            Msg::RoundEnd { round: 1, pages: 1 },
            Msg::Context(snapshot()),
            Msg::VmState(b"state".to_vec()),
            Msg::Commit,
        ]
    }

    fn run(msgs: Vec<Msg>, t: &mut Ram) -> Result<Vec<Msg>, ReceiveError> {
        let mut st = Receiver::AwaitHello;
        let mut stats = Received::default();
        let mut replies = Vec::new();
        for m in msgs {
            let (next, reply) = st.on(m, t, &mut stats)?;
            st = next;
            replies.extend(reply);
        }
        Ok(replies)
    }

    #[test]
    fn frames_round_trip_through_bytes() {
        for m in session() {
            let bytes = encode_frame(&m);
            let (back, n) = read_msg(&mut &bytes[..]).unwrap();
            assert_eq!(back, m);
            assert_eq!(n, bytes.len());
        }
    }

    #[test]
    fn a_pages_frame_encoded_in_place_is_the_message_s_frame() {
        let mut raw = vec![0u8; 4 * PAGE];
        raw[PAGE..2 * PAGE].fill(7); // compresses
        for (i, b) in raw[2 * PAGE..3 * PAGE].iter_mut().enumerate() {
            *b = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1]; // does not
        }
        raw[3 * PAGE] = 1;
        let pages = [9, 3, 70_000, 1 << 40];
        // The receiver's copies: page 3's one byte off, page 70 000's the
        // same (1 << 40 shares its slot, and is not there).
        let mut cache = PageCache::new(8 * PAGE as u64);
        let mut near = raw[PAGE..2 * PAGE].to_vec();
        near[100] = 8;
        cache.put(3, &near);
        cache.put(70_000, &raw[2 * PAGE..3 * PAGE]);
        for (compress, cache) in [
            (true, None),
            (false, None),
            (true, Some(&cache)),
            (false, Some(&cache)),
        ] {
            let msg = Msg::Pages {
                round: 5,
                pages: pages
                    .iter()
                    .zip(raw.chunks(PAGE))
                    .map(|(&p, b)| {
                        (
                            p,
                            PageData::encode_against(b, compress, cache.and_then(|c| c.get(p))),
                        )
                    })
                    .collect(),
            };
            let what = format!("compress {compress}, cache {}", cache.is_some());
            let (mut out, mut scratch) = (vec![1, 2, 3], PageScratch::default());
            let n = encode_pages_frame(5, &pages, &raw, compress, cache, &mut out, &mut scratch);
            assert_eq!(out, encode_frame(&msg), "{what}");
            assert_eq!(n.zero, u64::from(compress), "{what}");
            assert_eq!(
                n.delta,
                if compress && cache.is_some() { 2 } else { 0 },
                "{what}"
            );
            assert_eq!(read_msg(&mut &out[..]).unwrap().0, msg);
        }
    }

    /// A sink over plain pages, for the receiving side's tests.
    struct Pages(std::collections::BTreeMap<u64, [u8; PAGE]>);

    impl PageSink for Pages {
        fn current(&mut self, index: u64, out: &mut [u8; PAGE]) -> Result<(), String> {
            *out = *self.0.get(&index).ok_or(format!("no page {index}"))?;
            Ok(())
        }

        fn write(&mut self, index: u64, _: &PageData, bytes: &[u8; PAGE]) -> Result<(), String> {
            self.0.insert(index, *bytes);
            Ok(())
        }
    }

    #[test]
    fn a_delta_rebuilds_the_page_from_the_receivers_copy() {
        let mut old = vec![0u8; PAGE];
        let mut x = 7u32;
        for b in old.iter_mut() {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *b = x as u8;
        }
        let mut new = old.clone();
        new[17..40].fill(0xee);
        let delta = PageData::encode_against(&new, true, Some(&old));
        assert!(
            matches!(delta, PageData::Xor(ref b) if b.len() < 64),
            "{delta:?}"
        );
        assert_eq!(
            PageData::encode_against(&old, true, Some(&old)),
            PageData::Same
        );
        // Nothing like the old page: the page on its own is smaller.
        assert!(matches!(
            PageData::encode_against(&page(3), true, Some(&old)),
            PageData::Lz4(_)
        ));
        // Most words changed, yet the XOR compresses: sent whole all the
        // same (a delta is tried only where at most half the page changed).
        let mut most = old.clone();
        most[..3000].iter_mut().for_each(|b| *b ^= 0x5a);
        assert!(matches!(
            PageData::encode_against(&most, true, Some(&old)),
            PageData::Raw(_)
        ));
        assert!(!worth_a_delta(&most, &old) && worth_a_delta(&new, &old));
        // A zero page is a zero page, whatever the receiver holds.
        assert_eq!(
            PageData::encode_against(&[0; PAGE], true, Some(&old)),
            PageData::Zero
        );
        let mut sink = Pages(std::collections::BTreeMap::from([
            (4, old.clone().try_into().unwrap()),
            (5, [1; PAGE]),
        ]));
        let list = vec![(4, delta.clone()), (5, PageData::Same)];
        let at = Round::FIRST
            .on_pages(0, &list, 64 * PAGE as u64, &mut sink)
            .unwrap();
        assert_eq!(at.pages, 2);
        assert_eq!(&sink.0[&4][..], &new[..]);
        assert_eq!(sink.0[&5], [1; PAGE]);
        // A delta for a page the sink holds nothing for, or whose block
        // decompresses short, is refused naming the page.
        let e = Round::FIRST
            .on_pages(0, &[(6, delta)], 64 * PAGE as u64, &mut sink)
            .unwrap_err();
        assert!(e.contains("no page 6"), "{e}");
        let short = PageData::Xor(lz4_flex::block::compress(&[1u8; 100]));
        let e = Round::FIRST
            .on_pages(0, &[(5, short)], 64 * PAGE as u64, &mut sink)
            .unwrap_err();
        assert!(
            e.contains("page 5: delta: LZ4 page decompresses to 100 bytes"),
            "{e}"
        );
    }

    #[test]
    fn pages_are_compressed_zero_flagged_or_raw() {
        assert_eq!(PageData::encode(&[0; PAGE]), PageData::Zero);
        let p = page(9);
        let enc = PageData::encode(&p);
        assert!(
            matches!(enc, PageData::Lz4(ref b) if b.len() < 100),
            "{enc:?}"
        );
        let mut out = [0u8; PAGE];
        enc.decode(&mut out).unwrap();
        assert_eq!(&out[..], &p[..]);
        let mut noisy = [0u8; PAGE];
        let mut x = 1u32;
        for b in noisy.iter_mut() {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *b = x as u8;
        }
        assert!(matches!(PageData::encode(&noisy), PageData::Raw(_)));
        // An LZ4 block that decompresses short is refused.
        let short = PageData::Lz4(lz4_flex::block::compress(&[1u8; 100]));
        assert!(short.decode(&mut out).is_err());
    }

    #[test]
    fn a_whole_session_applies_pages_and_commits() {
        let mut t = ram();
        let replies = run(session(), &mut t).unwrap();
        assert_eq!(
            replies,
            vec![
                Msg::HelloOk {
                    version: 3,
                    generation: 0,
                    timeout_ms: 0,
                    superseded: None,
                    witness: None,
                },
                Msg::Ok { phase: 0 },
                Msg::Ok { phase: 1 },
                Msg::Ok {
                    phase: COMMIT_PHASE
                }
            ]
        );
        assert_eq!(t.pages[1], [0; PAGE]);
        assert_eq!(t.pages[2][0], 0);
        assert_eq!(t.committed.unwrap().1, b"state");
    }

    #[test]
    fn every_truncation_is_refused() {
        let bytes = encode_frame(&session()[1]);
        assert!(matches!(read_msg(&mut &[][..]), Err(WireError::Closed)));
        for cut in 1..bytes.len() {
            let err = read_msg(&mut &bytes[..cut]).unwrap_err();
            assert!(
                matches!(
                    err,
                    WireError::Truncated { .. } | WireError::TruncatedPayload { .. }
                ),
                "cut {cut}: {err}"
            );
        }
    }

    #[test]
    fn every_flipped_bit_is_refused() {
        let bytes = encode_frame(&Msg::RoundEnd { round: 3, pages: 9 });
        for bit in 0..bytes.len() * 8 {
            let mut b = bytes.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(read_msg(&mut &b[..]).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn type_zero_unknown_types_and_oversize_lengths_are_refused() {
        let mut b = encode_frame(&Msg::Commit);
        b[0] = 0;
        assert!(matches!(
            read_msg(&mut &b[..]),
            Err(WireError::InvalidType(0))
        ));
        // (11..=15 are the checkpoint messages.)
        b[0] = 99;
        assert!(matches!(
            read_msg(&mut &b[..]),
            Err(WireError::InvalidType(99))
        ));
        let mut b = encode_frame(&Msg::Commit);
        b[4..8].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
        let err = read_msg(&mut &b[..]).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "COMMIT frame of {} bytes exceeds the {MAX_PAYLOAD}-byte limit",
                MAX_PAYLOAD + 1
            )
        );
    }

    #[test]
    fn malformed_payloads_are_refused() {
        let frame = |ty: MsgType, p: &[u8]| {
            let mut f = (ty as u32).to_le_bytes().to_vec();
            f.extend_from_slice(&(p.len() as u32).to_le_bytes());
            let crc = frame_crc(&f, p);
            f.extend_from_slice(&crc.to_le_bytes());
            f.extend_from_slice(p);
            f
        };
        // A page count the payload cannot hold.
        let mut p = 0u32.to_le_bytes().to_vec();
        p.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(read_msg(&mut &frame(MsgType::Pages, &p)[..]).is_err());
        // A raw page of the wrong length, an unknown kind.
        for (kind, len) in [
            (1u8, 100u32),
            (2, 0),
            (2, 4096),
            (0, 1),
            (3, 1),
            (4, 0),
            (4, 4096),
            (7, 0),
        ] {
            let mut p = 0u32.to_le_bytes().to_vec();
            p.extend_from_slice(&1u32.to_le_bytes());
            p.extend_from_slice(&0u64.to_le_bytes());
            p.push(kind);
            p.extend_from_slice(&len.to_le_bytes());
            p.extend(std::iter::repeat_n(0u8, len as usize));
            let err = read_msg(&mut &frame(MsgType::Pages, &p)[..]).unwrap_err();
            assert!(
                matches!(err, WireError::Malformed { .. }),
                "{kind} {len}: {err}"
            );
        }
        // A context that claims more than it holds, or too much.
        let mut ctx = 100u32.to_le_bytes().to_vec();
        ctx.extend_from_slice(&lz4_flex::block::compress(&[5u8; 50]));
        assert!(read_msg(&mut &frame(MsgType::Context, &ctx)[..]).is_err());
        let ctx = (hag_abi::abi::CONTEXT_MAX_BYTES as u32 + 1).to_le_bytes();
        let err = read_msg(&mut &frame(MsgType::Context, &ctx)[..]).unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
        // Trailing bytes, bad magic.
        assert!(read_msg(&mut &frame(MsgType::Commit, &[0])[..]).is_err());
        let mut hello = Msg::Hello {
            min: 3,
            max: 3,
            ram_size: 1,
            session: 1,
            vmm: VmmKind::Qemu,
            term: None,
            shape: None,
        }
        .payload();
        hello[0] = b'X';
        assert!(read_msg(&mut &frame(MsgType::Hello, &hello)[..]).is_err());
        // A term's VM name that is not one, or runs past the payload.
        let term = |vm: Option<VmName>| Term {
            generation: 0,
            instance: Instance {
                boot: 1,
                pid: 2,
                started: 3,
            },
            vm,
        };
        let mut join = Msg::Join {
            session: 1,
            term: Some(term(Some("web1".parse().unwrap()))),
        }
        .payload();
        let name = join.len() - 4;
        join[name..].copy_from_slice(b"../x");
        let e = read_msg(&mut &frame(MsgType::Join, &join)[..]).unwrap_err();
        assert!(e.to_string().contains("VM name"), "{e}");
        join[name - 1] = 200;
        assert!(read_msg(&mut &frame(MsgType::Join, &join)[..]).is_err());
        // A VM shape over its cap (refused before it is read), or not one.
        let shaped = |len: u32, body: &[u8]| {
            let mut p = Msg::Hello {
                min: 3,
                max: 3,
                ram_size: 4096,
                session: 1,
                vmm: VmmKind::Qemu,
                term: Some(term(None)),
                shape: None,
            }
            .payload();
            p.extend_from_slice(&len.to_le_bytes());
            p.extend_from_slice(body);
            read_msg(&mut &frame(MsgType::Hello, &p)[..])
        };
        let e = shaped(MAX_SHAPE as u32 + 1, b"").unwrap_err();
        assert!(e.to_string().contains("at most 65536"), "{e}");
        let e = shaped(5, b"hello").unwrap_err();
        assert!(e.to_string().contains("not a VM shape"), "{e}");
        // Disks: too many, an id that is not one; disk data over the cap,
        // empty, of an unknown kind.
        let disks = |count: u32, id: &[u8]| {
            let mut p = count.to_le_bytes().to_vec();
            p.push(id.len() as u8);
            p.extend_from_slice(id);
            p.extend_from_slice(&1u64.to_le_bytes());
            frame(MsgType::Disks, &p)
        };
        assert!(read_msg(&mut &disks(1, b"vda")[..]).is_ok());
        for (count, id) in [(17, &b"vda"[..]), (1, b"../etc"), (1, b""), (2, b"vda")] {
            let err = read_msg(&mut &disks(count, id)[..]).unwrap_err();
            assert!(matches!(err, WireError::Malformed { .. }), "{err}");
        }
        let data = |kind: u8, body: &[u8]| {
            let mut p = 0u32.to_le_bytes().to_vec();
            p.extend_from_slice(&0u64.to_le_bytes());
            p.push(kind);
            p.extend_from_slice(body);
            frame(MsgType::DiskData, &p)
        };
        for (kind, len) in [(1u8, DISK_DATA_MAX + 1), (1, 0), (2, 8), (0, 7)] {
            let err = read_msg(&mut &data(kind, &vec![0; len])[..]).unwrap_err();
            assert!(
                matches!(err, WireError::Malformed { .. }),
                "{kind} {len}: {err}"
            );
        }
    }

    #[test]
    fn messages_out_of_order_are_refused_naming_both() {
        let s = session();
        // Pages before HELLO.
        let err = run(vec![s[1].clone()], &mut ram()).unwrap_err();
        assert_eq!(err.to_string(), "unexpected PAGES while waiting for HELLO");
        // COMMIT without context and state.
        let err = run(vec![s[0].clone(), Msg::Commit], &mut ram()).unwrap_err();
        assert_eq!(err.to_string(), "unexpected COMMIT while receiving pages");
        // CONTEXT in the middle of a round.
        let err = run(vec![s[0].clone(), s[1].clone(), s[5].clone()], &mut ram()).unwrap_err();
        assert_eq!(err.to_string(), "unexpected CONTEXT while receiving pages");
        // A second HELLO; pages after the context.
        let err = run(vec![s[0].clone(), s[0].clone()], &mut ram()).unwrap_err();
        assert!(err.to_string().starts_with("unexpected HELLO"));
        let err = run(vec![s[0].clone(), s[5].clone(), s[1].clone()], &mut ram()).unwrap_err();
        assert!(err
            .to_string()
            .starts_with("unexpected PAGES while waiting for VM_STATE"));
    }

    #[test]
    fn checkpoint_messages_round_trip() {
        for msg in [
            Msg::Heartbeat {
                generation: 3,
                epoch: 412,
            },
            Msg::Hang {
                reason: "vgpu-hung: injected".into(),
            },
            Msg::EpochEnd {
                epoch: 7,
                generation: 1,
            },
            Msg::EpochAck {
                epoch: 7,
                generation: 2,
            },
            Msg::Join {
                session: u128::MAX,
                term: None,
            },
            Msg::Join {
                session: 3,
                term: Some(Term {
                    generation: 2,
                    instance: Instance {
                        boot: u128::MAX - 1,
                        pid: 4_000_000,
                        started: u64::MAX,
                    },
                    vm: Some("web-1.example".parse().unwrap()),
                }),
            },
            Msg::Hello {
                min: 3,
                max: 6,
                ram_size: 1 << 30,
                session: 3,
                vmm: VmmKind::Qemu,
                term: Some(Term {
                    generation: 0,
                    instance: Instance {
                        boot: 7,
                        pid: 1,
                        started: 0,
                    },
                    vm: None,
                }),
                shape: Some(VmShape {
                    machine: "pc-q35-10.0-machine".into(),
                    cpus: 2,
                    ..VmShape::default()
                }),
            },
            Msg::HelloOk {
                version: 5,
                generation: 4,
                timeout_ms: 3000,
                superseded: Some(true),
                witness: None,
            },
            Msg::HelloOk {
                version: 5,
                generation: 4,
                timeout_ms: 3000,
                superseded: Some(false),
                witness: Some(0x0123_4567_89ab_cdef),
            },
            Msg::VmStateDelta {
                base_epoch: 6,
                patch: vec![1, 2, 3],
            },
            Msg::HelloOk {
                version: 2,
                generation: 9,
                timeout_ms: 3000,
                superseded: None,
                witness: None,
            },
            Msg::Disks(vec![
                DiskInfo {
                    id: "vda".into(),
                    size: 64 << 20,
                },
                DiskInfo {
                    id: "virtio-disk1".into(),
                    size: 1 << 40,
                },
            ]),
            Msg::DiskData {
                disk: 1,
                offset: 65536,
                extent: DiskExtent::Data(vec![7; 4096]),
            },
            Msg::DiskData {
                disk: 0,
                offset: 0,
                extent: DiskExtent::Zero(64 << 20),
            },
            Msg::DiskSums(vec![vec![[1; 32], [2; 32]], vec![]]),
            Msg::RamSums(vec![]),
            Msg::RamSums(vec![0, 7, u64::MAX]),
        ] {
            let frame = encode_frame(&msg);
            let (back, n) = read_msg(&mut &frame[..]).unwrap();
            assert_eq!(back, msg);
            assert_eq!(n, frame.len());
            // A short payload is refused, not misread.
            if matches!(msg, Msg::EpochEnd { .. }) {
                let mut bad = frame.clone();
                bad.truncate(bad.len() - 1);
                bad[4..8].copy_from_slice(&15u32.to_le_bytes());
                let crc = frame_crc(&bad, &bad[HEADER_BYTES..]);
                bad[8..12].copy_from_slice(&crc.to_le_bytes());
                let err = read_msg(&mut &bad[..]).unwrap_err();
                assert!(err.to_string().contains("malformed EPOCH_END"), "{err}");
            }
        }
        assert_eq!(MsgType::from_u32(14), Some(MsgType::EpochAck));
        assert_eq!(MsgType::from_u32(15), Some(MsgType::Join));
        assert_eq!(MsgType::from_u32(16), Some(MsgType::VmStateDelta));
        assert_eq!(MsgType::from_u32(19), Some(MsgType::DiskSums));
        assert_eq!(MsgType::from_u32(20), Some(MsgType::RamSums));
        assert_eq!(MsgType::from_u32(21), None);
    }

    #[test]
    fn bad_contents_are_refused() {
        let s = session();
        let hello = |ram_size, min, max| Msg::Hello {
            min,
            max,
            ram_size,
            session: 1,
            vmm: VmmKind::HagVmm,
            term: None,
            shape: None,
        };
        let err = run(vec![hello(32 * PAGE as u64, 3, 3)], &mut ram()).unwrap_err();
        assert!(matches!(err, ReceiveError::Handshake(_)), "{err}");
        let err = run(vec![hello(16 * PAGE as u64, 8, 9)], &mut ram()).unwrap_err();
        assert!(err.to_string().contains("versions 8..=9"), "{err}");
        // A page outside RAM; a round count that does not match.
        let out = Msg::Pages {
            round: 0,
            pages: vec![(16, PageData::Zero)],
        };
        let err = run(vec![s[0].clone(), out], &mut ram()).unwrap_err();
        assert!(err.to_string().contains("outside guest RAM"), "{err}");
        let err = run(
            vec![s[0].clone(), Msg::RoundEnd { round: 0, pages: 5 }],
            &mut ram(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("carried 0"), "{err}");
        // A damaged snapshot.
        let mut ctx = snapshot();
        ctx[40] ^= 1;
        let err = run(vec![s[0].clone(), Msg::Context(ctx)], &mut ram()).unwrap_err();
        assert!(err.to_string().contains("snapshot damaged"), "{err}");
        // Abort from the source.
        let err = run(
            vec![
                s[0].clone(),
                Msg::Abort {
                    reason: "quiesce timed out".into(),
                },
            ],
            &mut ram(),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the source aborted the migration: quiesce timed out"
        );
    }
}
