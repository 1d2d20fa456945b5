//! The command scanner: decode → validate → write set.
//!
//! [`audit`] walks one submission (a slice of a ring buffer) in execution
//! order, follows `MI_BATCH_BUFFER_START` into batch buffers read through
//! [`GfxMemory`], validates every command and hands each one, decoded, to an
//! [`AuditSink`] as a [`ValidatedCommand`]. Every address in a validated
//! command carries its [`AddressSpace`] and lies inside that space with its
//! full extent (`[0, gfx_mem_size)` for the GGTT, `[0, ppgtt_size)` for the
//! PPGTT), and [`Command::write_set`] says which graphics bytes, in which
//! space, the command may write.
//!
//! Address spaces follow the hardware (and GVT-g's scanner): a batch started
//! from the ring with the PPGTT address-space bit runs non-privileged, and
//! every memory operand inside it, and inside the batches it chains to or
//! starts, is a PPGTT address whatever the command's "use global GTT" bit
//! says. In the ring and in GGTT batches each command's GGTT bit selects the
//! space (GGTT if set, PPGTT if clear). The status page (`MI_STORE_DATA_INDEX`
//! and the index forms of `MI_FLUSH_DW` and `PIPE_CONTROL`) is always in the
//! GGTT; blits write the space of the batch they run in. With
//! [`AuditConfig::ppgtt_size`] 0 every PPGTT operand is refused.
//!
//! This file is included as a module by the kernel (`#[path]`), so it and its
//! submodules use only `core`, carry no crate attributes, never panic on any
//! input, never recurse, and bound every loop by the configured limits.

// Explicit paths: the kernel includes this file with `#[path]`, and a
// file loaded that way resolves plain `mod x;` next to itself (as if it were
// a `mod.rs`), not in `audit/`. These paths resolve the same in both builds.
#[path = "audit/decode.rs"]
mod decode;
#[path = "audit/encode.rs"]
pub mod encode;
#[path = "audit/flow.rs"]
pub mod flow;
#[path = "audit/opcodes.rs"]
pub mod opcodes;
#[path = "audit/scan.rs"]
mod scan;

use core::fmt;

pub use opcodes::{command_name, Op};
pub use scan::audit;

/// Size of a graphics page, the unit of dirty tracking.
pub const PAGE_SIZE: u64 = 4096;
/// Size of the hardware status page.
pub const HWSP_SIZE: u64 = 4096;
/// Largest graphics address space a Gen8/Gen9 command can address (48 bits).
pub const MAX_GFX_MEM_SIZE: u64 = 1 << 48;
/// Largest `max_batch_depth` a configuration may ask for (the size of the
/// auditor's fixed return stack).
pub const MAX_BATCH_DEPTH: u8 = 8;
/// Largest `max_batches` a configuration may ask for (the size of the
/// auditor's fixed visited set).
pub const MAX_BATCHES: usize = 64;

/// The graphics address space an address is translated through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AddressSpace {
    /// The global GTT (the vGPU's slice of it): ring, status page, GGTT
    /// batches.
    Ggtt,
    /// The per-process GTT of the workload's context: non-privileged
    /// batches and commands without the GGTT bit.
    Ppgtt,
}

impl AddressSpace {
    /// "GGTT" or "PPGTT".
    pub const fn name(self) -> &'static str {
        match self {
            AddressSpace::Ggtt => "GGTT",
            AddressSpace::Ppgtt => "PPGTT",
        }
    }
}

/// What the auditor may accept, set by the kernel per vGPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuditConfig<'a> {
    /// Size of the vGPU's graphics memory (its GGTT): every GGTT address a
    /// command uses must lie, with its whole extent, in `[0, gfx_mem_size)`.
    /// At most [`MAX_GFX_MEM_SIZE`].
    pub gfx_mem_size: u64,
    /// Size of the workload's PPGTT: every PPGTT address must lie, with its
    /// whole extent, in `[0, ppgtt_size)`. At most [`MAX_GFX_MEM_SIZE`].
    /// 0 refuses every PPGTT address and PPGTT batch (the simulated vGPU has
    /// no PPGTT).
    pub ppgtt_size: u64,
    /// Graphics address of the engine's hardware status page (4 KiB aligned,
    /// inside graphics memory): the base of `MI_STORE_DATA_INDEX` and of the
    /// "store data index" forms of `MI_FLUSH_DW` and `PIPE_CONTROL`.
    pub hwsp_gfx_addr: u64,
    /// Deepest batch nesting accepted: the ring is level 0, a batch started
    /// from the ring level 1, a second-level batch level 2. 1 to
    /// [`MAX_BATCH_DEPTH`].
    pub max_batch_depth: u8,
    /// Most commands scanned per submission (ring and batches together; an
    /// `MI_LOAD_REGISTER_IMM` counts once): bounds the auditor's work.
    pub max_commands: u32,
    /// Most [`ValidatedCommand`]s handed to the sink per submission (an
    /// `MI_LOAD_REGISTER_IMM` of n pairs hands over n): bounds the memory a
    /// sink that keeps them needs, `max_entries * size_of::<ValidatedCommand>()`
    /// bytes, which is what a kernel sets it from.
    pub max_entries: u32,
    /// Most distinct batch entries (address and level) followed per
    /// submission. At most [`MAX_BATCHES`].
    pub max_batches: usize,
    /// MMIO offsets that `MI_LOAD_REGISTER_IMM`, `MI_LOAD_REGISTER_MEM` and
    /// `MI_STORE_REGISTER_MEM` may name. Anything else is refused. The
    /// kernel must not list registers that redirect GPU writes (ring, HWSP
    /// or page-table registers), since the write set would not follow them.
    pub allowed_registers: &'a [u32],
}

impl<'a> AuditConfig<'a> {
    /// A configuration with the default limits (depth 3, 16384 commands,
    /// 32768 validated commands, 64 batches), no PPGTT and no allowed
    /// registers.
    pub const fn new(gfx_mem_size: u64, hwsp_gfx_addr: u64) -> Self {
        AuditConfig {
            gfx_mem_size,
            ppgtt_size: 0,
            hwsp_gfx_addr,
            max_batch_depth: 3,
            max_commands: 16384,
            max_entries: 32768,
            max_batches: MAX_BATCHES,
            allowed_registers: &[],
        }
    }

    /// The same configuration with another register allow list.
    pub const fn with_registers(self, allowed_registers: &'a [u32]) -> Self {
        AuditConfig {
            allowed_registers,
            ..self
        }
    }

    /// The same configuration with a PPGTT of `ppgtt_size` bytes (0: none).
    pub const fn with_ppgtt(self, ppgtt_size: u64) -> Self {
        AuditConfig { ppgtt_size, ..self }
    }

    /// Size of `space`: where its addresses must lie (0: refused).
    pub const fn space_size(&self, space: AddressSpace) -> u64 {
        match space {
            AddressSpace::Ggtt => self.gfx_mem_size,
            AddressSpace::Ppgtt => self.ppgtt_size,
        }
    }

    /// Checks the configuration itself; [`audit`] does this first.
    pub fn check(&self) -> Result<(), Reason> {
        let bad = |what| Err(Reason::BadConfig { what });
        if self.gfx_mem_size == 0 || self.gfx_mem_size > MAX_GFX_MEM_SIZE {
            return bad("gfx_mem_size must be 1 byte to 2^48 bytes");
        }
        if self.ppgtt_size > MAX_GFX_MEM_SIZE {
            return bad("ppgtt_size must be at most 2^48 bytes");
        }
        if !self.hwsp_gfx_addr.is_multiple_of(HWSP_SIZE) {
            return bad("hwsp_gfx_addr must be 4 KiB aligned");
        }
        match self.hwsp_gfx_addr.checked_add(HWSP_SIZE) {
            Some(end) if end <= self.gfx_mem_size => {}
            _ => return bad("the hardware status page must lie inside graphics memory"),
        }
        if self.max_batch_depth == 0 || self.max_batch_depth > MAX_BATCH_DEPTH {
            return bad("max_batch_depth must be 1 to MAX_BATCH_DEPTH");
        }
        if self.max_batches > MAX_BATCHES {
            return bad("max_batches must be at most MAX_BATCHES");
        }
        Ok(())
    }

    /// Whether `reg` is on the allow list.
    pub fn register_allowed(&self, reg: u32) -> bool {
        self.allowed_registers.contains(&reg)
    }
}

/// A read of graphics memory failed (page not mapped, not guest RAM…).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryFault {
    /// The graphics address that could not be read.
    pub gfx_addr: u64,
}

/// Where batch buffers are read from: the kernel implements it through the
/// vGPU's GTT (or the workload's PPGTT) and guest RAM; tests with an array
/// ([`SliceMemory`]).
pub trait GfxMemory {
    /// Reads `out.len()` little-endian dwords starting at `gfx_addr` in
    /// `space`. The auditor only asks for ranges inside that space's size
    /// ([`AuditConfig::space_size`]).
    fn read_dwords(
        &mut self,
        space: AddressSpace,
        gfx_addr: u64,
        out: &mut [u32],
    ) -> Result<(), MemoryFault>;
}

/// Graphics memory backed by a slice of dwords that starts at graphics
/// address `base` of `space`; anything outside it, or in the other space,
/// faults. For tests, fuzzing and the simulated vGPU's own checks.
#[derive(Clone, Copy, Debug)]
pub struct SliceMemory<'a> {
    /// The address space the slice is mapped in.
    pub space: AddressSpace,
    /// Graphics address of `dwords[0]`.
    pub base: u64,
    /// The memory contents.
    pub dwords: &'a [u32],
}

impl GfxMemory for SliceMemory<'_> {
    fn read_dwords(
        &mut self,
        space: AddressSpace,
        gfx_addr: u64,
        out: &mut [u32],
    ) -> Result<(), MemoryFault> {
        let fault = MemoryFault { gfx_addr };
        if space != self.space {
            return Err(fault);
        }
        let off = gfx_addr.checked_sub(self.base).ok_or(fault)?;
        if !off.is_multiple_of(4) {
            return Err(fault);
        }
        let start = usize::try_from(off / 4).map_err(|_| fault)?;
        let end = start.checked_add(out.len()).ok_or(fault)?;
        let src = self.dwords.get(start..end).ok_or(fault)?;
        for (o, s) in out.iter_mut().zip(src) {
            *o = *s;
        }
        Ok(())
    }
}

/// The sink refused another command (its buffer is full).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SinkFull;

/// Receives each validated command, in execution order.
///
/// **On error, discard everything received.** [`audit`] makes one pass:
/// when it rejects a submission the sink has already seen the commands
/// before the bad one, and the submission is rejected whole. A sink is
/// therefore a staging buffer that the caller commits only when `audit`
/// returns `Ok`. (A second, validation-only pass would not make this
/// stronger: the guest can rewrite its batch buffers between two passes, so
/// the emitting pass must be able to fail anyway. What runs is what the sink
/// received, never guest memory re-read afterwards.)
pub trait AuditSink {
    /// Takes one validated command.
    fn command(&mut self, cmd: &ValidatedCommand) -> Result<(), SinkFull>;
}

/// A sink that accepts and forgets everything: a validation-only pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoSink;

impl AuditSink for NoSink {
    fn command(&mut self, _cmd: &ValidatedCommand) -> Result<(), SinkFull> {
        Ok(())
    }
}

/// A command that passed the audit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValidatedCommand {
    /// Address space of `gfx_addr`: GGTT in the ring and in GGTT batches,
    /// PPGTT in PPGTT batches.
    pub space: AddressSpace,
    /// Graphics address of the command's header (for commands in the ring:
    /// `ring_gfx_addr` plus its offset in the submitted slice).
    pub gfx_addr: u64,
    /// Batch level it ran at: 0 for the ring, 1 for a batch started from the
    /// ring, 2 for a second-level batch…
    pub level: u8,
    /// The decoded command.
    pub kind: Command,
}

/// A post-sync write of `MI_FLUSH_DW` or `PIPE_CONTROL`. Every form writes a
/// qword (8 bytes) at its address; "store data index" forms already have the
/// status page base added (and are in the GGTT).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PostSync {
    /// No post-sync write.
    None,
    /// Write the immediate data (`data[0]` low dword, `data[1]` high).
    WriteImm {
        /// Address space of the destination.
        space: AddressSpace,
        /// Destination.
        addr: u64,
        /// Immediate data (high dword 0 for the 4-dword `MI_FLUSH_DW`).
        data: [u32; 2],
    },
    /// `PIPE_CONTROL` only: write the PS depth count.
    DepthCount {
        /// Address space of the destination.
        space: AddressSpace,
        /// Destination.
        addr: u64,
    },
    /// Write the timestamp.
    Timestamp {
        /// Address space of the destination.
        space: AddressSpace,
        /// Destination.
        addr: u64,
    },
}

impl PostSync {
    /// Bytes every post-sync write is audited as.
    pub const BYTES: u64 = 8;

    /// The destination, if there is a write.
    pub const fn addr(&self) -> Option<u64> {
        match self.dest() {
            Some((_, addr)) => Some(addr),
            None => None,
        }
    }

    /// The destination with its address space, if there is a write.
    pub const fn dest(&self) -> Option<(AddressSpace, u64)> {
        match *self {
            PostSync::None => None,
            PostSync::WriteImm { space, addr, .. }
            | PostSync::DepthCount { space, addr }
            | PostSync::Timestamp { space, addr } => Some((space, addr)),
        }
    }
}

/// Which 2D blit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlitKind {
    /// XY_COLOR_BLT: fill with a color.
    Color,
    /// XY_SRC_COPY_BLT: copy with a raster operation.
    SrcCopy,
    /// XY_FAST_COPY_BLT: plain copy.
    FastCopy,
}

/// One linear surface of a blit: pixel (`x`, `y`) is at
/// `base + y * pitch + x * bpp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Surface {
    /// Address space of the surface: the space of the batch the blit runs
    /// in (GGTT in the ring).
    pub space: AddressSpace,
    /// Graphics address of pixel (0, 0).
    pub base: u64,
    /// Bytes from one row to the next (below 32 KiB).
    pub pitch: u16,
    /// Left edge of the rectangle, in pixels.
    pub x: u16,
    /// Top edge of the rectangle, in rows.
    pub y: u16,
}

impl Surface {
    /// The bytes a `width` × `height` rectangle of `bpp`-byte pixels at
    /// (`x`, `y`) covers, or `None` on arithmetic overflow.
    pub fn rect(&self, bpp: u8, width: u16, height: u16) -> Option<Strided> {
        let bpp = u64::from(bpp);
        let row0 = u64::from(self.y).checked_mul(u64::from(self.pitch))?;
        let col0 = u64::from(self.x).checked_mul(bpp)?;
        Some(Strided {
            space: self.space,
            base: self.base.checked_add(row0)?.checked_add(col0)?,
            row_bytes: u64::from(width).checked_mul(bpp)?,
            pitch: u64::from(self.pitch),
            rows: u64::from(height),
        })
    }
}

/// A decoded 2D blit on linear surfaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blit {
    /// Which blit.
    pub kind: BlitKind,
    /// Bytes per pixel (1, 2, 4; fast copy also 8, 16).
    pub bpp: u8,
    /// Width of the rectangle in pixels (at least 1).
    pub width: u16,
    /// Height of the rectangle in rows (at least 1).
    pub height: u16,
    /// The destination.
    pub dst: Surface,
    /// The source (copies only).
    pub src: Option<Surface>,
    /// Raster operation (XY_COLOR_BLT, XY_SRC_COPY_BLT; 0 for fast copy).
    pub rop: u8,
    /// Fill color (XY_COLOR_BLT; 0 otherwise).
    pub color: u32,
}

impl Blit {
    /// Whether the blit writes a source (a copy), rather than a fill.
    pub fn copies(&self) -> bool {
        !matches!(self.kind, BlitKind::Color) && self.src.is_some()
    }

    /// Whether every row writes the same bytes to the same place, so that
    /// running one row leaves memory as running them all: the destination
    /// pitch is 0 and the blit is a fill, or copies a pitch-0 source row
    /// that does not overlap the destination row (an overlapping one could
    /// read what the previous row wrote).
    pub fn rows_repeat(&self) -> bool {
        let Some(dst) = self.dst.rect(self.bpp, self.width, self.height) else {
            return false;
        };
        if dst.pitch != 0 {
            return false;
        }
        if !self.copies() {
            return true;
        }
        match self
            .src
            .and_then(|s| s.rect(self.bpp, self.width, self.height))
        {
            Some(s) => {
                let apart = s.space != dst.space
                    || s.base.saturating_add(s.row_bytes) <= dst.base
                    || dst.base.saturating_add(dst.row_bytes) <= s.base;
                s.pitch == 0 && apart
            }
            None => false,
        }
    }
}

/// A decoded command with its fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// MI_NOOP.
    Noop,
    /// MI_USER_INTERRUPT.
    UserInterrupt,
    /// MI_ARB_CHECK: a preemption point (writes nothing).
    ArbCheck,
    /// MI_ARB_ON_OFF: turns preemption at arbitration points on or off
    /// (writes nothing).
    ArbOnOff {
        /// Arbitration enabled (bit 0).
        enable: bool,
    },
    /// MI_BATCH_BUFFER_START.
    BatchStart {
        /// Address space of the batch (and of every command in it).
        space: AddressSpace,
        /// Graphics address of the batch.
        addr: u64,
        /// A second-level batch (returns after its MI_BATCH_BUFFER_END);
        /// otherwise a jump (from a batch: a chain).
        second_level: bool,
        /// The level the batch runs at.
        level: u8,
        /// The batch was already audited at this level and in this address
        /// space in this submission
        /// and was not scanned again: the hardware will run commands listed
        /// earlier once more (or loop, until the watchdog stops it).
        already_audited: bool,
    },
    /// MI_BATCH_BUFFER_END.
    BatchEnd,
    /// MI_SEMAPHORE_WAIT (reads `addr`, writes nothing).
    SemaphoreWait {
        /// Address space of the semaphore.
        space: AddressSpace,
        /// The semaphore.
        addr: u64,
        /// Value compared with.
        data: u32,
        /// Compare operation (bits 14:12).
        compare: u8,
        /// Polling mode.
        poll: bool,
    },
    /// MI_STORE_DATA_IMM: writes 4 or 8 bytes.
    StoreDataImm {
        /// Address space of the destination.
        space: AddressSpace,
        /// Destination.
        addr: u64,
        /// Data (`data[1]` is 0 unless `qword`).
        data: [u32; 2],
        /// Stores a qword.
        qword: bool,
    },
    /// MI_STORE_DATA_INDEX: writes 4 or 8 bytes into the status page (GGTT).
    StoreDataIndex {
        /// Offset into the hardware status page.
        offset: u16,
        /// Destination: status page plus offset.
        addr: u64,
        /// Data (`data[1]` is 0 unless `qword`).
        data: [u32; 2],
        /// Stores a qword.
        qword: bool,
    },
    /// One register/value pair of MI_LOAD_REGISTER_IMM (a command with n
    /// pairs is delivered as n of these, each with the command's address).
    LoadRegisterImm {
        /// An allowed register.
        reg: u32,
        /// The value.
        value: u32,
        /// Byte write disables (bits 11:8 of the header).
        byte_disable: u8,
    },
    /// MI_STORE_REGISTER_MEM: writes 4 bytes.
    StoreRegisterMem {
        /// An allowed register.
        reg: u32,
        /// Address space of the destination.
        space: AddressSpace,
        /// Destination.
        addr: u64,
    },
    /// MI_LOAD_REGISTER_MEM: reads 4 bytes into a register.
    LoadRegisterMem {
        /// An allowed register.
        reg: u32,
        /// Address space of the source.
        space: AddressSpace,
        /// Source.
        addr: u64,
    },
    /// MI_COPY_MEM_MEM: copies 4 bytes.
    CopyMemMem {
        /// Address space of the destination.
        dst_space: AddressSpace,
        /// Destination.
        dst: u64,
        /// Address space of the source.
        src_space: AddressSpace,
        /// Source.
        src: u64,
    },
    /// MI_ATOMIC: read-modify-write of `len` bytes.
    Atomic {
        /// Address space of the destination.
        space: AddressSpace,
        /// Destination.
        addr: u64,
        /// Bytes written: 4, 8 or 16.
        len: u8,
        /// Atomic opcode (bits 15:8).
        opcode: u8,
        /// Data size field (bits 20:19).
        size: u8,
        /// Inline operands, if the command carries them.
        inline_data: Option<[u32; 8]>,
    },
    /// MI_FLUSH_DW.
    FlushDw {
        /// Its post-sync write.
        post_sync: PostSync,
        /// Raises an interrupt.
        notify: bool,
    },
    /// PIPE_CONTROL.
    PipeControl {
        /// DW1 flags as given.
        flags: u32,
        /// Its post-sync write.
        post_sync: PostSync,
    },
    /// A 2D blit.
    Blit(Blit),
}

impl Command {
    /// The graphics bytes this command may write, each range in its address
    /// space (a superset: it never misses a byte the hardware writes).
    pub fn write_set(&self) -> WriteSet {
        let range = |space, gfx_addr, len| {
            WriteSet::Range(WriteRange {
                space,
                gfx_addr,
                len,
            })
        };
        let qword = |q| if q { 8 } else { 4 };
        match *self {
            Command::StoreDataImm {
                space,
                addr,
                qword: q,
                ..
            } => range(space, addr, qword(q)),
            Command::StoreDataIndex { addr, qword: q, .. } => {
                range(AddressSpace::Ggtt, addr, qword(q))
            }
            Command::StoreRegisterMem { space, addr, .. } => range(space, addr, 4),
            Command::CopyMemMem { dst_space, dst, .. } => range(dst_space, dst, 4),
            Command::Atomic {
                space, addr, len, ..
            } => range(space, addr, u64::from(len)),
            Command::FlushDw { post_sync, .. } | Command::PipeControl { post_sync, .. } => {
                match post_sync.dest() {
                    Some((space, addr)) => range(space, addr, PostSync::BYTES),
                    None => WriteSet::None,
                }
            }
            Command::Blit(b) => match b.dst.rect(b.bpp, b.width, b.height) {
                Some(s) => WriteSet::Strided(s),
                // Unreachable for a validated command: the auditor checked
                // this arithmetic. Claim everything rather than nothing.
                None => range(b.dst.space, 0, u64::MAX),
            },
            Command::Noop
            | Command::UserInterrupt
            | Command::ArbCheck
            | Command::ArbOnOff { .. }
            | Command::BatchStart { .. }
            | Command::BatchEnd
            | Command::SemaphoreWait { .. }
            | Command::LoadRegisterImm { .. }
            | Command::LoadRegisterMem { .. } => WriteSet::None,
        }
    }
}

/// A contiguous range of graphics bytes in one address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRange {
    /// The address space `gfx_addr` is in.
    pub space: AddressSpace,
    /// First byte.
    pub gfx_addr: u64,
    /// Number of bytes.
    pub len: u64,
}

impl WriteRange {
    /// One past the last byte (saturating).
    pub const fn end(&self) -> u64 {
        self.gfx_addr.saturating_add(self.len)
    }

    /// The 4 KiB graphics pages the range touches (in its address space).
    pub fn pages(&self) -> Pages {
        pages_of(*self)
    }
}

/// `rows` ranges of `row_bytes` bytes, `pitch` bytes apart, in one address
/// space: the rows of a blit rectangle. Row `i` is
/// `[base + i * pitch, base + i * pitch + row_bytes)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    /// The address space of every row.
    pub space: AddressSpace,
    /// First byte of the first row.
    pub base: u64,
    /// Bytes per row.
    pub row_bytes: u64,
    /// Distance between rows.
    pub pitch: u64,
    /// Number of rows.
    pub rows: u64,
}

impl Strided {
    /// The smallest range holding every row, or `None` on overflow.
    pub fn extent(&self) -> Option<WriteRange> {
        if self.rows == 0 || self.row_bytes == 0 {
            return Some(WriteRange {
                space: self.space,
                gfx_addr: self.base,
                len: 0,
            });
        }
        let last = self.rows.checked_sub(1)?.checked_mul(self.pitch)?;
        let len = last.checked_add(self.row_bytes)?;
        self.base.checked_add(len)?;
        Some(WriteRange {
            space: self.space,
            gfx_addr: self.base,
            len,
        })
    }
}

/// What one command may write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteSet {
    /// Nothing.
    None,
    /// One range.
    Range(WriteRange),
    /// The rows of a rectangle.
    Strided(Strided),
}

impl WriteSet {
    /// Whether nothing is written.
    pub fn is_empty(&self) -> bool {
        match self {
            WriteSet::None => true,
            WriteSet::Range(r) => r.len == 0,
            WriteSet::Strided(s) => s.rows == 0 || s.row_bytes == 0,
        }
    }

    /// The written ranges, one per row for a rectangle, in ascending order.
    pub fn ranges(&self) -> Ranges {
        Ranges {
            set: *self,
            next_row: 0,
        }
    }

    /// The 4 KiB graphics pages written, ascending and without repeats (all
    /// in the set's one address space).
    pub fn pages(&self) -> WritePages {
        WritePages {
            ranges: self.ranges(),
            cur: Pages::EMPTY,
            last: None,
        }
    }
}

/// Iterator over the ranges of a [`WriteSet`].
#[derive(Clone, Debug)]
pub struct Ranges {
    set: WriteSet,
    next_row: u64,
}

impl Iterator for Ranges {
    type Item = WriteRange;

    fn next(&mut self) -> Option<WriteRange> {
        match self.set {
            WriteSet::None => None,
            WriteSet::Range(r) => {
                if self.next_row == 0 && r.len != 0 {
                    self.next_row = 1;
                    Some(r)
                } else {
                    None
                }
            }
            WriteSet::Strided(s) => {
                if self.next_row >= s.rows || s.row_bytes == 0 {
                    return None;
                }
                let off = self.next_row.checked_mul(s.pitch)?;
                let gfx_addr = s.base.checked_add(off)?;
                self.next_row = self.next_row.checked_add(1)?;
                Some(WriteRange {
                    space: s.space,
                    gfx_addr,
                    len: s.row_bytes,
                })
            }
        }
    }
}

/// Iterator over the 4 KiB page numbers (graphics address / 4096) of one
/// range; see [`pages_of`].
#[derive(Clone, Debug)]
pub struct Pages {
    next: u64,
    last: u64,
    done: bool,
}

impl Pages {
    const EMPTY: Pages = Pages {
        next: 0,
        last: 0,
        done: true,
    };
}

impl Iterator for Pages {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        if self.done || self.next > self.last {
            return None;
        }
        let page = self.next;
        match self.next.checked_add(1) {
            Some(n) => self.next = n,
            None => self.done = true,
        }
        Some(page)
    }
}

/// The 4 KiB graphics page numbers (address / 4096) that `range` touches, in
/// ascending order; none for an empty range.
pub fn pages_of(range: WriteRange) -> Pages {
    if range.len == 0 {
        return Pages::EMPTY;
    }
    let last_byte = range.gfx_addr.saturating_add(range.len.saturating_sub(1));
    Pages {
        next: range.gfx_addr / PAGE_SIZE,
        last: last_byte / PAGE_SIZE,
        done: false,
    }
}

/// Consecutive 4 KiB graphics pages `first..=last` (page numbers, address
/// / 4096) in one address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRun {
    /// The address space of the pages.
    pub space: AddressSpace,
    /// First page.
    pub first: u64,
    /// Last page (inclusive).
    pub last: u64,
}

impl WriteSet {
    /// The pages written, as ascending, disjoint runs of consecutive pages,
    /// in at most `max_steps` steps of work whatever the rows (at least
    /// one): a rectangle whose every page between its first and last is
    /// written (rows less than a page apart, or gaps between rows shorter
    /// than a page) is one run at once; otherwise rows are walked, merged
    /// where they touch, and once `max_steps` rows were walked the last run
    /// reaches to the rectangle's last page. So the runs are exactly
    /// [`Self::pages`] when that fits, and a superset (never missing a page)
    /// when it does not: a kernel can mark a huge blit's pages in bounded
    /// time under a lock.
    pub fn page_runs(&self, max_steps: u32) -> PageRuns {
        let mut runs = PageRuns {
            space: AddressSpace::Ggtt,
            rows: None,
            next_row: 0,
            pending: None,
            steps_left: max_steps.max(1),
            last_page: 0,
        };
        match *self {
            WriteSet::None => {}
            WriteSet::Range(r) => {
                runs.space = r.space;
                let mut pages = pages_of(r);
                if let Some(first) = pages.next() {
                    runs.pending = Some((first, pages.last));
                }
            }
            WriteSet::Strided(s) => {
                runs.space = s.space;
                if s.rows == 0 || s.row_bytes == 0 {
                    return runs;
                }
                let first = s.base / PAGE_SIZE;
                let end = match s.extent() {
                    Some(e) => e.end(),
                    // Unreachable for a validated blit: claim the rest of
                    // the space rather than miss a page.
                    None => u64::MAX,
                };
                let last = end.saturating_sub(1) / PAGE_SIZE;
                let gap = s.pitch.saturating_sub(s.row_bytes);
                if s.rows == 1 || s.pitch < PAGE_SIZE || gap < PAGE_SIZE {
                    // Every page from the first row's to the last row's is
                    // written: a row starts (or a row runs) in each.
                    runs.pending = Some((first, last));
                } else {
                    runs.rows = Some(s);
                    runs.last_page = last;
                }
            }
        }
        runs
    }
}

/// Iterator of [`WriteSet::page_runs`].
#[derive(Clone, Debug)]
pub struct PageRuns {
    space: AddressSpace,
    /// Rows still to walk (sparse rectangles only).
    rows: Option<Strided>,
    next_row: u64,
    /// The run being grown.
    pending: Option<(u64, u64)>,
    steps_left: u32,
    /// The rectangle's last page.
    last_page: u64,
}

impl Iterator for PageRuns {
    type Item = PageRun;

    fn next(&mut self) -> Option<PageRun> {
        let space = self.space;
        let run = |(first, last)| PageRun { space, first, last };
        // Each turn walks one row (and uses a step) or returns, so a call
        // ends after at most `steps_left` turns.
        loop {
            let Some(s) = self.rows else {
                return self.pending.take().map(run);
            };
            if self.next_row >= s.rows {
                self.rows = None;
                continue;
            }
            if self.steps_left == 0 {
                // Out of steps: everything from here to the end, at once.
                self.rows = None;
                let first = match self.pending {
                    Some((first, _)) => first,
                    None => self
                        .next_row
                        .checked_mul(s.pitch)
                        .and_then(|o| s.base.checked_add(o))
                        .map_or(self.last_page, |a| a / PAGE_SIZE),
                };
                self.pending = Some((first.min(self.last_page), self.last_page));
                continue;
            }
            self.steps_left -= 1;
            let row = self
                .next_row
                .checked_mul(s.pitch)
                .and_then(|o| s.base.checked_add(o))
                .and_then(|start| Some((start, start.checked_add(s.row_bytes - 1)?)));
            self.next_row += 1;
            let Some((start, end)) = row else {
                // Overflow (unreachable once validated): claim the rest.
                self.steps_left = 0;
                continue;
            };
            let (first, last) = (start / PAGE_SIZE, end / PAGE_SIZE);
            match self.pending {
                Some((pf, pl)) if first <= pl.saturating_add(1) => {
                    self.pending = Some((pf, pl.max(last)));
                }
                Some(done) => {
                    self.pending = Some((first, last));
                    return Some(run(done));
                }
                None => self.pending = Some((first, last)),
            }
        }
    }
}

/// Iterator over the pages of a [`WriteSet`], ascending, each once.
#[derive(Clone, Debug)]
pub struct WritePages {
    ranges: Ranges,
    cur: Pages,
    last: Option<u64>,
}

impl Iterator for WritePages {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        // Each turn either yields a page or moves to the next range, so this
        // ends after at most (pages + rows) turns.
        loop {
            if let Some(page) = self.cur.next() {
                self.last = Some(page);
                return Some(page);
            }
            let range = self.ranges.next()?;
            let mut pages = pages_of(range);
            // Rows ascend; skip pages an earlier row already yielded.
            if let Some(last) = self.last {
                pages.next = pages.next.max(last.saturating_add(1));
                if last == u64::MAX {
                    pages.done = true;
                }
            }
            self.cur = pages;
        }
    }
}

/// What one submission contained.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuditSummary {
    /// Commands scanned (an `MI_LOAD_REGISTER_IMM` counts once).
    pub commands: u32,
    /// Distinct batch entries scanned.
    pub batches: u32,
    /// Batch starts to a batch already audited (not scanned again).
    pub revisits: u32,
    /// Deepest batch level reached (0: the ring only).
    pub max_depth: u8,
}

/// Why a submission was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The header names no command this auditor supports.
    UnknownOpcode,
    /// The command runs past the end of the submitted ring slice.
    Truncated {
        /// Dwords the command needs.
        need: u32,
        /// Dwords left in the ring slice.
        have: u32,
    },
    /// The length field does not match the command's form.
    BadLength {
        /// Dwords the length field says.
        len: u32,
        /// Dwords this form has.
        expected: u32,
    },
    /// Bits that must be zero are set.
    ReservedBits {
        /// Which dword of the command (0 = header).
        dword: u8,
        /// The offending bits.
        bits: u32,
    },
    /// An address is not aligned as the command requires.
    Misaligned {
        /// The address.
        addr: u64,
        /// Required alignment in bytes.
        align: u64,
    },
    /// An access falls (partly) outside its address space.
    AddressOutOfRange {
        /// The address space.
        space: AddressSpace,
        /// First byte.
        addr: u64,
        /// Bytes.
        len: u64,
        /// Size of the address space (graphics memory for the GGTT).
        limit: u64,
    },
    /// A register not on the allow list.
    RegisterNotAllowed {
        /// Its MMIO offset (the whole dword as given).
        reg: u32,
    },
    /// A feature this auditor refuses rather than models.
    Unsupported {
        /// What it is.
        what: &'static str,
    },
    /// A field with a value the command does not allow.
    BadField {
        /// Which field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// A batch start would nest deeper than `max_batch_depth`.
    BatchTooDeep {
        /// Level it would start.
        depth: u8,
        /// The limit.
        limit: u8,
    },
    /// More than `max_commands` commands.
    TooManyCommands {
        /// The limit.
        limit: u32,
    },
    /// More than `max_batches` distinct batches.
    TooManyBatches {
        /// The limit.
        limit: usize,
    },
    /// More than `max_entries` validated commands (register loads count one
    /// per pair).
    TooManyEntries {
        /// The limit.
        limit: u32,
    },
    /// Reading graphics memory failed.
    MemoryFault {
        /// The address space read.
        space: AddressSpace,
        /// Where.
        addr: u64,
    },
    /// The sink refused a command.
    SinkFull,
    /// The configuration itself is invalid.
    BadConfig {
        /// What is wrong.
        what: &'static str,
    },
}

impl Reason {
    /// A stable number for the reason (the simulated vGPU's `ERROR_REASON`
    /// register reports it); 0 is never used.
    pub const fn code(&self) -> u32 {
        match self {
            Reason::UnknownOpcode => 1,
            Reason::Truncated { .. } => 2,
            Reason::BadLength { .. } => 3,
            Reason::ReservedBits { .. } => 4,
            Reason::Misaligned { .. } => 5,
            Reason::AddressOutOfRange { .. } => 6,
            Reason::RegisterNotAllowed { .. } => 7,
            Reason::Unsupported { .. } => 8,
            Reason::BadField { .. } => 9,
            Reason::BatchTooDeep { .. } => 10,
            Reason::TooManyCommands { .. } => 11,
            Reason::TooManyBatches { .. } => 12,
            Reason::MemoryFault { .. } => 13,
            Reason::SinkFull => 14,
            Reason::BadConfig { .. } => 15,
            Reason::TooManyEntries { .. } => 16,
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Reason::UnknownOpcode => f.write_str("unknown or unsupported opcode"),
            Reason::Truncated { need, have } => write!(
                f,
                "command needs {need} dwords but only {have} are left in the ring"
            ),
            Reason::BadLength { len, expected } => {
                write!(f, "length of {len} dwords, expected {expected}")
            }
            Reason::ReservedBits { dword, bits } => {
                write!(f, "reserved bits {bits:#x} set in dword {dword}")
            }
            Reason::Misaligned { addr, align } => {
                write!(f, "address {addr:#x} is not {align}-byte aligned")
            }
            Reason::AddressOutOfRange {
                space: AddressSpace::Ggtt,
                addr,
                len,
                limit,
            } => write!(
                f,
                "address {addr:#x}+{len} outside graphics memory of {limit:#x} bytes"
            ),
            Reason::AddressOutOfRange {
                space: AddressSpace::Ppgtt,
                addr,
                len,
                limit,
            } => write!(
                f,
                "PPGTT address {addr:#x}+{len} outside the PPGTT of {limit:#x} bytes"
            ),
            Reason::RegisterNotAllowed { reg } => {
                write!(f, "register {reg:#x} is not on the allow list")
            }
            Reason::Unsupported { what } => write!(f, "unsupported: {what}"),
            Reason::BadField { field, value } => write!(f, "bad {field}: {value:#x}"),
            Reason::BatchTooDeep { depth, limit } => {
                write!(f, "batch level {depth} is deeper than the limit of {limit}")
            }
            Reason::TooManyCommands { limit } => {
                write!(f, "more than {limit} commands in one submission")
            }
            Reason::TooManyBatches { limit } => {
                write!(
                    f,
                    "more than {limit} distinct batch buffers in one submission"
                )
            }
            Reason::MemoryFault {
                space: AddressSpace::Ggtt,
                addr,
            } => {
                write!(f, "graphics memory at {addr:#x} could not be read")
            }
            Reason::MemoryFault {
                space: AddressSpace::Ppgtt,
                addr,
            } => {
                write!(f, "PPGTT address {addr:#x} could not be read")
            }
            Reason::TooManyEntries { limit } => write!(
                f,
                "more than {limit} validated commands (register loads count per pair) in one submission"
            ),
            Reason::SinkFull => f.write_str("too many validated commands for the sink"),
            Reason::BadConfig { what } => write!(f, "bad audit configuration: {what}"),
        }
    }
}

/// A rejected submission: where, which command, why. The whole submission
/// is rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuditError {
    /// Address space of `gfx_addr` (GGTT in the ring).
    pub space: AddressSpace,
    /// Graphics address of the offending command.
    pub gfx_addr: u64,
    /// Its header, if it could be read.
    pub header: Option<u32>,
    /// Why.
    pub reason: Reason,
}

impl AuditError {
    /// The PRM name of the offending command.
    pub fn command_name(&self) -> &'static str {
        match self.header {
            Some(h) => command_name(h),
            None => "command",
        }
    }
}

impl fmt::Display for AuditError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Reason::BadConfig { .. } = self.reason {
            return write!(f, "{}", self.reason);
        }
        // GGTT addresses are written bare, as before PPGTT support.
        let space = match self.space {
            AddressSpace::Ggtt => "",
            AddressSpace::Ppgtt => "PPGTT ",
        };
        match self.header {
            Some(h) if Op::from_header(h).is_none() => write!(
                f,
                "command {h:#010x} at {space}{:#x}: {}",
                self.gfx_addr, self.reason
            ),
            _ => write!(
                f,
                "{} at {space}{:#x}: {}",
                self.command_name(),
                self.gfx_addr,
                self.reason
            ),
        }
    }
}
