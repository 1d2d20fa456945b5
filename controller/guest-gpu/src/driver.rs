//! The guest GPU driver for `hag-sim`, written from `docs/sim-vgpu.md`:
//! probe, GTT, ring and status page, interrupts, submission with
//! wrap-around, completion and error reporting.
//!
//! It talks to the device only through [`Registers`] (VFIO implements it,
//! `hag-guest` a mapped PCI BAR, unit tests a fake), and keeps all its
//! state in guest RAM, which it reaches through its own GTT ([`GfxMem`]).
//! Guest RAM is addressed by offset; only the GTT entries it writes carry
//! guest physical addresses ([`GuestRam::frame`]), so the same driver runs
//! on `hag-vmm`'s contiguous RAM and on a `hag-guest` process's buffer
//! whose pages are scattered in the VM's physical memory.

use std::time::{Duration, Instant};

use hag_abi::sim_regs as r;
use hag_audit::audit::{self, encode, AddressSpace, GfxMemory, MemoryFault};

use guest_ram::{GuestRam, RamError, PAGE_SIZE};

/// A BAR0 register access failed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RegError(pub String);

/// The device's register file (BAR0), 32-bit accesses at byte offsets.
pub trait Registers {
    /// Reads the register at `off`.
    fn read(&self, off: u32) -> Result<u32, RegError>;
    /// Writes `v` to the register at `off`.
    fn write(&self, off: u32, v: u32) -> Result<(), RegError>;
    /// Waits up to `timeout` for an interrupt (MSI); returns how many
    /// arrived. Without an interrupt source, just pauses briefly.
    fn wait_interrupt(&self, timeout: Duration) -> Result<u64, RegError> {
        std::thread::sleep(timeout.min(Duration::from_millis(1)));
        Ok(0)
    }
}

impl<T: Registers + ?Sized> Registers for &T {
    fn read(&self, off: u32) -> Result<u32, RegError> {
        (**self).read(off)
    }
    fn write(&self, off: u32, v: u32) -> Result<(), RegError> {
        (**self).write(off, v)
    }
    fn wait_interrupt(&self, timeout: Duration) -> Result<u64, RegError> {
        (**self).wait_interrupt(timeout)
    }
}

/// What the driver could not do.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// A register access failed.
    #[error(transparent)]
    Regs(#[from] RegError),
    /// A guest RAM access failed.
    #[error(transparent)]
    Ram(#[from] RamError),
    /// The device is not a hag-sim vGPU or breaks its contract.
    #[error("not a usable hag-sim vGPU: {0}")]
    BadDevice(String),
    /// The auditor rejected a submission.
    #[error(
        "submission rejected: command at gfx {addr:#x}, header {header:#010x} ({name}), reason {reason}"
    )]
    Rejected {
        /// `ERROR_ADDR`.
        addr: u64,
        /// `ERROR_HEADER`.
        header: u32,
        /// `ERROR_REASON`.
        reason: u32,
        /// The command's PRM name, from its header.
        name: &'static str,
    },
    /// The watchdog declared the vGPU hung.
    #[error("vGPU hung (ERROR_STATUS 2): ring head {head:#x}, tail {tail:#x}, engine status {engine:#x}")]
    Hung {
        /// `RING_HEAD`.
        head: u32,
        /// The tail last written.
        tail: u32,
        /// `ENGINE_STATUS`.
        engine: u32,
    },
    /// A DMA fault.
    #[error("vGPU DMA fault (ERROR_STATUS 3): command at gfx {addr:#x}, header {header:#010x}")]
    DmaFault {
        /// `ERROR_ADDR`.
        addr: u64,
        /// `ERROR_HEADER`.
        header: u32,
    },
    /// An `ERROR_STATUS` this driver does not know.
    #[error("vGPU reports unknown ERROR_STATUS {0}")]
    UnknownError(u32),
    /// The engine did not finish in time.
    #[error("submission did not complete in {waited:?}: ring head {head:#x}, tail {tail:#x}, engine status {engine:#x}")]
    Timeout {
        /// How long the driver waited.
        waited: Duration,
        /// `RING_HEAD` when it gave up.
        head: u32,
        /// The tail last written.
        tail: u32,
        /// `ENGINE_STATUS` when it gave up.
        engine: u32,
    },
    /// The commands do not fit in the ring's free space.
    #[error("{need} bytes of commands do not fit in the ring ({free} of {size} bytes free)")]
    RingFull {
        /// Bytes asked for.
        need: u64,
        /// Bytes free.
        free: u64,
        /// Ring size.
        size: u64,
    },
    /// Graphics memory ran out.
    #[error("out of mapped graphics memory: {want} bytes asked, {free} free")]
    OutOfGfxMemory {
        /// Bytes asked for.
        want: u64,
        /// Bytes free.
        free: u64,
    },
    /// A graphics address is not mapped to guest RAM by the driver's GTT.
    #[error("graphics address {0:#x} is not mapped by the GTT")]
    Unmapped(u64),
}

/// What probing found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `HAG_REVISION`.
    pub revision: u32,
    /// `GFX_MEM_SIZE`.
    pub gfx_mem_size: u64,
    /// `GTT_ENTRIES`.
    pub gtt_entries: u32,
}

/// Reads and checks the identification registers.
pub fn probe<R: Registers>(regs: &R) -> Result<DeviceInfo, DriverError> {
    let id = regs.read(r::HAG_ID)?;
    if id != r::HAG_ID_VALUE {
        return Err(DriverError::BadDevice(format!(
            "HAG_ID is {id:#010x}, expected {:#010x} (\"HAGS\")",
            r::HAG_ID_VALUE
        )));
    }
    let revision = regs.read(r::HAG_REVISION)?;
    if revision != r::HAG_REVISION_VALUE {
        return Err(DriverError::BadDevice(format!(
            "HAG_REVISION is {revision}, this driver speaks revision {}",
            r::HAG_REVISION_VALUE
        )));
    }
    let gfx_mem_size = u64::from(regs.read(r::GFX_MEM_SIZE_LO)?)
        | (u64::from(regs.read(r::GFX_MEM_SIZE_HI)?) << 32);
    let gtt_offset = regs.read(r::GTT_OFFSET_REG)?;
    if gtt_offset != r::GTT_OFFSET {
        return Err(DriverError::BadDevice(format!(
            "GTT_OFFSET is {gtt_offset:#x}, expected {:#x}",
            r::GTT_OFFSET
        )));
    }
    let gtt_entries = regs.read(r::GTT_ENTRIES_REG)?;
    if gfx_mem_size == 0 || u64::from(gtt_entries) != gfx_mem_size / PAGE_SIZE {
        return Err(DriverError::BadDevice(format!(
            "GTT_ENTRIES is {gtt_entries}, but GFX_MEM_SIZE {gfx_mem_size:#x} needs {}",
            gfx_mem_size / PAGE_SIZE
        )));
    }
    let gtt_end = u64::from(r::GTT_OFFSET) + u64::from(gtt_entries) * u64::from(r::GTT_ENTRY_BYTES);
    if gtt_end > r::BAR0_SIZE {
        return Err(DriverError::BadDevice(format!(
            "{gtt_entries} GTT entries do not fit in BAR0"
        )));
    }
    Ok(DeviceInfo {
        revision,
        gfx_mem_size,
        gtt_entries,
    })
}

/// How graphics pages map to guest pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GttLayout {
    /// Graphics page `i` is guest page `i`.
    Identity,
    /// Graphics page `i` is guest page `i * stride mod n` for an odd stride
    /// coprime with `n`: consecutive graphics pages land on scattered guest
    /// pages, so a missing GTT translation on the device side shows.
    #[default]
    Scattered,
}

/// The driver's copy of the GTT it programmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GttMap {
    /// Guest page (page of guest RAM) of each mapped graphics page;
    /// graphics pages past the end are not mapped.
    guest_page: Vec<u64>,
    /// Guest physical frame of each mapped graphics page, what its PTE
    /// holds: `guest_page` itself unless guest RAM's pages are scattered
    /// ([`GttMap::for_ram`]).
    frame: Vec<u64>,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl GttMap {
    /// Maps the first `pages` graphics pages onto guest pages `0..pages`.
    pub fn new(pages: u64, layout: GttLayout) -> Self {
        let stride = match layout {
            GttLayout::Identity => 1,
            GttLayout::Scattered => {
                // About 3/8 of the way round, odd, coprime with `pages`.
                let mut s = (pages * 3 / 8) | 1;
                while pages > 1 && gcd(s, pages) != 1 {
                    s += 2;
                }
                s.max(1)
            }
        };
        let guest_page: Vec<u64> = (0..pages)
            .map(|g| ((u128::from(g) * u128::from(stride)) % u128::from(pages.max(1))) as u64)
            .collect();
        GttMap {
            frame: guest_page.clone(),
            guest_page,
        }
    }

    /// [`GttMap::new`] over `ram` (at most its pages): PTEs carry the
    /// guest physical frame of each page ([`GuestRam::frame`]), which is
    /// the page number itself for contiguous RAM.
    pub fn for_ram(ram: &GuestRam, pages: u64, layout: GttLayout) -> Self {
        let mut map = GttMap::new(pages.min(ram.pages()), layout);
        if ram.frame_table().is_some() {
            // Every guest page is below `ram.pages()`, so `frame` finds it.
            map.frame = map
                .guest_page
                .iter()
                .map(|&p| ram.frame(p).unwrap_or(p))
                .collect();
        }
        map
    }

    /// Number of mapped graphics pages.
    pub fn pages(&self) -> u64 {
        self.guest_page.len() as u64
    }

    /// The guest page behind graphics page `page`.
    pub fn guest_page(&self, page: u64) -> Option<u64> {
        self.guest_page.get(usize::try_from(page).ok()?).copied()
    }

    /// The guest RAM address (offset in [`GuestRam`]; the guest physical
    /// address when RAM is contiguous) of graphics address `gfx`.
    pub fn translate(&self, gfx: u64) -> Option<u64> {
        Some(self.guest_page(gfx / PAGE_SIZE)? * PAGE_SIZE + gfx % PAGE_SIZE)
    }

    /// The GEN8 PTE of graphics page `page` (0 when not mapped): the guest
    /// physical address of its page.
    pub fn pte(&self, page: u64) -> u64 {
        match self.frame.get(usize::try_from(page).unwrap_or(usize::MAX)) {
            Some(f) => (f.wrapping_mul(PAGE_SIZE) & r::GTT_ADDR_MASK) | r::GTT_PRESENT,
            None => 0,
        }
    }
}

/// Graphics memory as the driver sees it: guest RAM through its GTT.
#[derive(Clone, Copy)]
pub struct GfxMem<'a> {
    /// Guest RAM.
    pub ram: &'a GuestRam,
    /// The driver's GTT.
    pub gtt: &'a GttMap,
}

impl GfxMem<'_> {
    /// Calls `f(gpa, range)` for each page-sized piece of
    /// `[gfx, gfx + len)`; `range` indexes the caller's buffer.
    fn pieces(
        &self,
        gfx: u64,
        len: usize,
        mut f: impl FnMut(u64, std::ops::Range<usize>) -> Result<(), DriverError>,
    ) -> Result<(), DriverError> {
        let mut done = 0usize;
        while done < len {
            let addr = gfx
                .checked_add(done as u64)
                .ok_or(DriverError::Unmapped(gfx))?;
            let in_page = (PAGE_SIZE - addr % PAGE_SIZE) as usize;
            let n = in_page.min(len - done);
            let gpa = self
                .gtt
                .translate(addr)
                .ok_or(DriverError::Unmapped(addr))?;
            f(gpa, done..done + n)?;
            done += n;
        }
        Ok(())
    }

    /// Reads bytes at graphics address `gfx`.
    pub fn read(&self, gfx: u64, out: &mut [u8]) -> Result<(), DriverError> {
        let len = out.len();
        self.pieces(gfx, len, |gpa, range| {
            Ok(self.ram.read(gpa, &mut out[range])?)
        })
    }

    /// Writes bytes at graphics address `gfx`.
    pub fn write(&self, gfx: u64, data: &[u8]) -> Result<(), DriverError> {
        self.pieces(gfx, data.len(), |gpa, range| {
            Ok(self.ram.write(gpa, &data[range])?)
        })
    }

    /// Reads the dword at `gfx`.
    pub fn read_u32(&self, gfx: u64) -> Result<u32, DriverError> {
        let mut b = [0u8; 4];
        self.read(gfx, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// Reads the qword at `gfx`.
    pub fn read_u64(&self, gfx: u64) -> Result<u64, DriverError> {
        let mut b = [0u8; 8];
        self.read(gfx, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Writes the dword `v` at `gfx`.
    pub fn write_u32(&self, gfx: u64, v: u32) -> Result<(), DriverError> {
        self.write(gfx, &v.to_le_bytes())
    }

    /// Writes dwords at `gfx`.
    pub fn write_dwords(&self, gfx: u64, dwords: &[u32]) -> Result<(), DriverError> {
        let bytes: Vec<u8> = dwords.iter().flat_map(|d| d.to_le_bytes()).collect();
        self.write(gfx, &bytes)
    }
}

impl GfxMemory for GfxMem<'_> {
    /// Reads through the simulated vGPU's GTT; it has no PPGTT.
    fn read_dwords(
        &mut self,
        space: AddressSpace,
        gfx_addr: u64,
        out: &mut [u32],
    ) -> Result<(), MemoryFault> {
        if space != AddressSpace::Ggtt {
            return Err(MemoryFault { gfx_addr });
        }
        let mut bytes = vec![0u8; out.len() * 4];
        self.read(gfx_addr, &mut bytes)
            .map_err(|_| MemoryFault { gfx_addr })?;
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }
}

/// A bump allocator of graphics memory (page granular). Graphics memory is
/// backed by guest RAM through the GTT, so this allocates guest RAM too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BumpAlloc {
    next_page: u64,
    end_page: u64,
}

impl BumpAlloc {
    /// Allocates from graphics pages `[0, pages)`.
    pub fn new(pages: u64) -> Self {
        BumpAlloc {
            next_page: 0,
            end_page: pages,
        }
    }

    /// Allocates `bytes` (rounded up to pages; at least one page) and
    /// returns the graphics address.
    pub fn alloc(&mut self, bytes: u64) -> Result<u64, DriverError> {
        let pages = bytes.div_ceil(PAGE_SIZE).max(1);
        let free = self.end_page - self.next_page;
        if pages > free {
            return Err(DriverError::OutOfGfxMemory {
                want: bytes,
                free: free * PAGE_SIZE,
            });
        }
        let gfx = self.next_page * PAGE_SIZE;
        self.next_page += pages;
        Ok(gfx)
    }
}

/// Driver settings.
#[derive(Clone, Copy, Debug)]
pub struct DriverConfig {
    /// Ring size in pages (1 to 512).
    pub ring_pages: u32,
    /// GTT layout.
    pub gtt_layout: GttLayout,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            ring_pages: 2,
            gtt_layout: GttLayout::Scattered,
        }
    }
}

/// Commands written into the ring but not yet announced to the device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    /// Byte offset in the ring where they start (the old tail).
    pub start: u32,
    /// The new tail to write to `RING_TAIL`.
    pub tail: u32,
    /// Ring byte offset of each command, in order.
    pub offsets: Vec<u32>,
    /// The contiguous runs of ring written (at most two: before and after
    /// the wrap), as ring byte offset and dwords, MI_NOOP padding included.
    pub parts: Vec<(u32, Vec<u32>)>,
}

/// Lays commands out in a ring of `size_dw` dwords from dword `pos`:
/// a command that does not fit before the ring's end is moved to its start
/// and the gap filled with MI_NOOP (the device audits the two runs of a
/// wrapped submission separately, so no command may straddle the end), and
/// a final MI_NOOP keeps the tail 8-byte aligned. Returns the layout and
/// the dwords it uses (padding included).
pub fn layout<C: AsRef<[u32]>>(
    size_dw: u32,
    mut pos: u32,
    cmds: &[C],
) -> Result<(Pending, u32), DriverError> {
    let noop = encode::noop()[0];
    let start = pos;
    let mut used = 0u32;
    let mut offsets = Vec::with_capacity(cmds.len());
    let mut parts: Vec<(u32, Vec<u32>)> = vec![(pos * 4, Vec::new())];
    let too_big = |need: u64| DriverError::RingFull {
        need,
        free: u64::from(size_dw - 2) * 4,
        size: u64::from(size_dw) * 4,
    };
    let place =
        |dwords: &[u32], pos: &mut u32, used: &mut u32, parts: &mut Vec<(u32, Vec<u32>)>| {
            if let Some(part) = parts.last_mut() {
                part.1.extend_from_slice(dwords);
            }
            *pos += dwords.len() as u32;
            *used += dwords.len() as u32;
            if *pos == size_dw {
                *pos = 0;
                parts.push((0, Vec::new()));
            }
        };
    for cmd in cmds {
        let cmd = cmd.as_ref();
        let n = u32::try_from(cmd.len()).map_err(|_| too_big(u64::MAX))?;
        if n > size_dw - 2 {
            return Err(too_big(u64::from(n) * 4));
        }
        if n > size_dw - pos {
            let gap = vec![noop; (size_dw - pos) as usize];
            place(&gap, &mut pos, &mut used, &mut parts);
        }
        offsets.push(pos * 4);
        place(cmd, &mut pos, &mut used, &mut parts);
    }
    if used % 2 == 1 {
        place(&[noop], &mut pos, &mut used, &mut parts);
    }
    parts.retain(|(_, d)| !d.is_empty());
    Ok((
        Pending {
            start: start * 4,
            tail: pos * 4,
            offsets,
            parts,
        },
        used,
    ))
}

/// A submission that ran to the end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    /// `INT_IDENTITY` at completion (then cleared).
    pub identity: u32,
    /// MSIs received while waiting.
    pub interrupts: u64,
}

/// A failed submission with the interrupt state seen with it.
#[derive(Debug)]
pub struct Failure {
    /// What happened.
    pub error: DriverError,
    /// `INT_IDENTITY` when the error was seen (0 if unread).
    pub identity: u32,
    /// MSIs received while waiting.
    pub interrupts: u64,
}

/// What a workload needs to set itself up: graphics memory, an allocator
/// and the status page, borrowed from the driver.
pub struct Setup<'a> {
    /// Graphics memory through the driver's GTT.
    pub mem: GfxMem<'a>,
    /// The driver's allocator.
    pub alloc: &'a mut BumpAlloc,
    /// Graphics address of the hardware status page.
    pub hws_gfx: u64,
    /// Size of graphics memory.
    pub gfx_mem_size: u64,
    seqno: &'a mut u32,
}

impl Setup<'_> {
    /// The next sequence number (1, 2, …) for the status page.
    pub fn next_seqno(&mut self) -> u32 {
        *self.seqno = self.seqno.wrapping_add(1);
        *self.seqno
    }
}

/// The guest GPU driver.
pub struct Driver<'m, R: Registers> {
    regs: R,
    ram: &'m GuestRam,
    info: DeviceInfo,
    gtt: GttMap,
    alloc: BumpAlloc,
    ring_gfx: u64,
    ring_pages: u32,
    tail: u32,
    hws_gfx: u64,
    seqno: u32,
}

/// Offset of the driver's sequence number in the hardware status page.
pub const HWS_SEQNO: u16 = 0x100;

/// MMIO offsets of the general-purpose registers (low and high halves),
/// the registers commands may name.
pub fn gpr_registers() -> Vec<u32> {
    (0..r::GPR_COUNT * 2).map(|i| r::GPR_BASE + 4 * i).collect()
}

impl<'m, R: Registers> Driver<'m, R> {
    /// Probes the device, resets it, programs the GTT over guest RAM and
    /// sets up the status page, the ring and interrupts.
    pub fn init(regs: R, ram: &'m GuestRam, cfg: DriverConfig) -> Result<Self, DriverError> {
        if !(1..=512).contains(&cfg.ring_pages) {
            return Err(DriverError::BadDevice(format!(
                "a ring of {} pages is outside 1..=512",
                cfg.ring_pages
            )));
        }
        let info = probe(&regs)?;
        regs.write(r::RESET, 1)?;
        let mapped = ram.pages().min(u64::from(info.gtt_entries));
        let gtt = GttMap::for_ram(ram, mapped, cfg.gtt_layout);
        if let Some((g, f)) = gtt
            .frame
            .iter()
            .enumerate()
            .find(|(_, &f)| f > r::GTT_ADDR_MASK >> 12)
        {
            return Err(RamError::BadFrames(format!(
                "guest page {} is guest physical frame {f:#x}, beyond the addresses a GTT entry holds",
                gtt.guest_page[g]
            ))
            .into());
        }
        for page in 0..u64::from(info.gtt_entries) {
            let pte = gtt.pte(page);
            let off = r::GTT_OFFSET + (page as u32) * r::GTT_ENTRY_BYTES;
            regs.write(off, pte as u32)?;
            regs.write(off + 4, (pte >> 32) as u32)?;
        }
        // Spot-check that entries read back as written.
        for page in [0, mapped.saturating_sub(1)] {
            let off = r::GTT_OFFSET + (page as u32) * r::GTT_ENTRY_BYTES;
            let got = u64::from(regs.read(off)?) | (u64::from(regs.read(off + 4)?) << 32);
            if got != gtt.pte(page) {
                return Err(DriverError::BadDevice(format!(
                    "GTT entry {page} reads back {got:#x}, written {:#x}",
                    gtt.pte(page)
                )));
            }
        }
        let mut alloc = BumpAlloc::new(mapped);
        let hws_gfx = alloc.alloc(PAGE_SIZE)?;
        let ring_gfx = alloc.alloc(u64::from(cfg.ring_pages) * PAGE_SIZE)?;
        let mut driver = Driver {
            regs,
            ram,
            info,
            gtt,
            alloc,
            ring_gfx,
            ring_pages: cfg.ring_pages,
            tail: 0,
            hws_gfx,
            seqno: 0,
        };
        driver.program_engine()?;
        Ok(driver)
    }

    /// Programs status page, ring and interrupts (after init or `RESET`,
    /// which leaves `RING_HEAD = RING_TAIL = 0` and the ring disabled).
    fn program_engine(&mut self) -> Result<(), DriverError> {
        self.tail = 0;
        self.regs.write(r::HWS_PGA, self.hws_gfx as u32)?;
        self.regs.write(r::RING_START, self.ring_gfx as u32)?;
        self.regs.write(
            r::RING_CTL,
            ((self.ring_pages - 1) << r::RING_CTL_PAGES_SHIFT) | r::RING_CTL_ENABLE,
        )?;
        self.regs.write(r::INT_MASK, 0)?;
        self.regs.write(r::INT_IDENTITY, u32::MAX)?;
        self.regs.write(r::INT_ENABLE, 1)?;
        Ok(())
    }

    /// Writes `RESET` and sets the engine up again (the GTT is kept).
    pub fn reset(&mut self) -> Result<(), DriverError> {
        self.regs.write(r::RESET, 1)?;
        self.program_engine()
    }

    /// What probing found.
    pub fn info(&self) -> DeviceInfo {
        self.info
    }

    /// The register file.
    pub fn regs(&self) -> &R {
        &self.regs
    }

    /// Guest RAM.
    pub fn ram(&self) -> &'m GuestRam {
        self.ram
    }

    /// The driver's GTT.
    pub fn gtt(&self) -> &GttMap {
        &self.gtt
    }

    /// Graphics memory through the driver's GTT.
    pub fn mem(&self) -> GfxMem<'_> {
        GfxMem {
            ram: self.ram,
            gtt: &self.gtt,
        }
    }

    /// Allocates graphics memory.
    pub fn alloc(&mut self, bytes: u64) -> Result<u64, DriverError> {
        self.alloc.alloc(bytes)
    }

    /// Graphics address of the hardware status page.
    pub fn hws_gfx(&self) -> u64 {
        self.hws_gfx
    }

    /// Graphics address of the ring.
    pub fn ring_gfx(&self) -> u64 {
        self.ring_gfx
    }

    /// Ring size in bytes.
    pub fn ring_size(&self) -> u32 {
        self.ring_pages * PAGE_SIZE as u32
    }

    /// The current tail (byte offset).
    pub fn tail(&self) -> u32 {
        self.tail
    }

    /// Lends graphics memory, the allocator and the status page to a
    /// workload's setup.
    pub fn setup(&mut self) -> Setup<'_> {
        Setup {
            mem: GfxMem {
                ram: self.ram,
                gtt: &self.gtt,
            },
            alloc: &mut self.alloc,
            hws_gfx: self.hws_gfx,
            gfx_mem_size: self.info.gfx_mem_size,
            seqno: &mut self.seqno,
        }
    }

    /// The graphics address of ring byte offset `off` (wrapped).
    pub fn ring_addr(&self, off: u64) -> u64 {
        self.ring_gfx + off % u64::from(self.ring_size())
    }

    /// The audit configuration the device applies to this driver's work.
    pub fn audit_config<'a>(&self, registers: &'a [u32]) -> audit::AuditConfig<'a> {
        audit::AuditConfig::new(self.info.gfx_mem_size, self.hws_gfx).with_registers(registers)
    }

    /// Writes commands into the ring at the tail, wrapping at its end
    /// without splitting a command and padding with MI_NOOP to an 8-byte
    /// aligned tail (see [`layout`]). The device is not told yet: see
    /// [`Driver::doorbell`].
    pub fn write_commands<C: AsRef<[u32]>>(&mut self, cmds: &[C]) -> Result<Pending, DriverError> {
        let size = self.ring_size();
        let (pending, used) = layout(size / 4, self.tail / 4, cmds)?;
        let need = u64::from(used) * 4;
        let head = self.regs.read(r::RING_HEAD)? % size;
        let in_use = (self.tail + size - head) % size;
        // One qword stays free so that a full ring never looks empty.
        let free = u64::from(size - in_use - 8);
        if need > free {
            return Err(DriverError::RingFull {
                need,
                free,
                size: u64::from(size),
            });
        }
        let mem = self.mem();
        for (off, dwords) in &pending.parts {
            mem.write_dwords(self.ring_gfx + u64::from(*off), dwords)?;
        }
        Ok(pending)
    }

    /// Rings the doorbell: writes the new tail.
    pub fn doorbell(&mut self, pending: &Pending) -> Result<(), DriverError> {
        self.regs.write(r::RING_TAIL, pending.tail)?;
        self.tail = pending.tail;
        Ok(())
    }

    /// Reads the error registers into a [`DriverError`], if any is set.
    pub fn error_state(&self) -> Result<Option<DriverError>, DriverError> {
        let status = self.regs.read(r::ERROR_STATUS)?;
        if status == r::ERROR_NONE {
            return Ok(None);
        }
        let addr = u64::from(self.regs.read(r::ERROR_ADDR_LO)?)
            | (u64::from(self.regs.read(r::ERROR_ADDR_HI)?) << 32);
        let header = self.regs.read(r::ERROR_HEADER)?;
        Ok(Some(match status {
            r::ERROR_COMMAND_REJECTED => DriverError::Rejected {
                addr,
                header,
                reason: self.regs.read(r::ERROR_REASON)?,
                name: audit::command_name(header),
            },
            r::ERROR_HANG => DriverError::Hung {
                head: self.regs.read(r::RING_HEAD)?,
                tail: self.tail,
                engine: self.regs.read(r::ENGINE_STATUS)?,
            },
            r::ERROR_DMA_FAULT => DriverError::DmaFault { addr, header },
            other => DriverError::UnknownError(other),
        }))
    }

    /// Reads `INT_IDENTITY` and clears the causes it shows.
    fn take_identity(&self) -> Result<u32, DriverError> {
        let identity = self.regs.read(r::INT_IDENTITY)?;
        if identity != 0 {
            self.regs.write(r::INT_IDENTITY, identity)?;
        }
        Ok(identity)
    }

    /// Waits until the engine is idle with `RING_HEAD` at the tail, an
    /// error is reported, or `timeout` passes. Interrupts wake the wait;
    /// registers are polled between them.
    pub fn wait(&mut self, timeout: Duration) -> Result<Completion, Failure> {
        let start = Instant::now();
        let mut interrupts = 0u64;
        let fail = |error: DriverError, identity, interrupts| Failure {
            error,
            identity,
            interrupts,
        };
        loop {
            let step = (|| -> Result<Option<Completion>, DriverError> {
                if let Some(err) = self.error_state()? {
                    return Err(err);
                }
                let engine = self.regs.read(r::ENGINE_STATUS)?;
                let head = self.regs.read(r::RING_HEAD)?;
                if engine & r::ENGINE_IDLE != 0 && head == self.tail {
                    return Ok(Some(Completion {
                        identity: self.take_identity()?,
                        interrupts: 0,
                    }));
                }
                Ok(None)
            })();
            match step {
                Ok(Some(mut done)) => {
                    // Collect an MSI that raced with the last poll.
                    interrupts += self.regs.wait_interrupt(Duration::ZERO).unwrap_or(0);
                    done.interrupts = interrupts;
                    return Ok(done);
                }
                Ok(None) => {}
                Err(error) => {
                    let identity = self.take_identity().unwrap_or(0);
                    interrupts += self.regs.wait_interrupt(Duration::ZERO).unwrap_or(0);
                    return Err(fail(error, identity, interrupts));
                }
            }
            let waited = start.elapsed();
            if waited >= timeout {
                let head = self.regs.read(r::RING_HEAD).unwrap_or(u32::MAX);
                let engine = self.regs.read(r::ENGINE_STATUS).unwrap_or(u32::MAX);
                return Err(fail(
                    DriverError::Timeout {
                        waited,
                        head,
                        tail: self.tail,
                        engine,
                    },
                    0,
                    interrupts,
                ));
            }
            let slice = (timeout - waited).min(Duration::from_millis(10));
            match self.regs.wait_interrupt(slice) {
                Ok(n) => interrupts += n,
                Err(e) => return Err(fail(e.into(), 0, interrupts)),
            }
        }
    }

    /// Writes, announces and waits for one submission.
    pub fn submit<C: AsRef<[u32]>>(
        &mut self,
        cmds: &[C],
        timeout: Duration,
    ) -> Result<Completion, Failure> {
        let pending = self.write_commands(cmds).map_err(|error| Failure {
            error,
            identity: 0,
            interrupts: 0,
        })?;
        self.doorbell(&pending).map_err(|error| Failure {
            error,
            identity: 0,
            interrupts: 0,
        })?;
        self.wait(timeout)
    }
}

/// Everything the driver keeps outside guest RAM: with the device's own
/// context (restored through `/dev/hag`) and guest RAM, enough to continue
/// driving the same vGPU state from another process ([`Driver::restore`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DriverState {
    /// Ring size in pages.
    pub ring_pages: u32,
    /// The GTT maps graphics page `i` to guest page `i`.
    pub identity_gtt: bool,
    /// Graphics pages mapped by the GTT.
    pub gtt_pages: u64,
    /// The allocator's next free graphics page.
    pub next_page: u64,
    /// Graphics address of the ring.
    pub ring_gfx: u64,
    /// Graphics address of the status page.
    pub hws_gfx: u64,
    /// Ring tail last written (byte offset).
    pub tail: u32,
    /// Last sequence number handed out.
    pub seqno: u32,
}

impl<'m, R: Registers> Driver<'m, R> {
    /// The driver's state outside guest RAM.
    pub fn state(&self) -> DriverState {
        DriverState {
            ring_pages: self.ring_pages,
            identity_gtt: self.gtt.guest_page(1) == Some(1) || self.gtt.pages() < 2,
            gtt_pages: self.gtt.pages(),
            next_page: self.alloc.next_page,
            ring_gfx: self.ring_gfx,
            hws_gfx: self.hws_gfx,
            tail: self.tail,
            seqno: self.seqno,
        }
    }

    /// Takes over a device whose context was restored from another driver
    /// that had `state`, over the same guest RAM: probes (reads only), and
    /// checks that `state` fits this device and RAM, but writes no
    /// register: GTT, ring and interrupts are as the context left them.
    pub fn restore(regs: R, ram: &'m GuestRam, state: &DriverState) -> Result<Self, DriverError> {
        let info = probe(&regs)?;
        let mapped = ram.pages().min(u64::from(info.gtt_entries));
        let bad = |what: String| Err(DriverError::BadDevice(format!("driver state: {what}")));
        if state.gtt_pages != mapped {
            return bad(format!(
                "{} mapped graphics pages, this VM maps {mapped}",
                state.gtt_pages
            ));
        }
        if !(1..=512).contains(&state.ring_pages) || state.tail >= state.ring_pages * 4096 {
            return bad(format!(
                "ring of {} pages with tail {:#x}",
                state.ring_pages, state.tail
            ));
        }
        let ring_end = state.ring_gfx + u64::from(state.ring_pages) * PAGE_SIZE;
        if state.next_page > mapped
            || ring_end > state.next_page * PAGE_SIZE
            || state.hws_gfx >= state.next_page * PAGE_SIZE
        {
            return bad(format!(
                "ring {:#x}, status page {:#x} or allocator page {} outside the {mapped} mapped pages",
                state.ring_gfx, state.hws_gfx, state.next_page
            ));
        }
        let layout = if state.identity_gtt {
            GttLayout::Identity
        } else {
            GttLayout::Scattered
        };
        Ok(Driver {
            regs,
            ram,
            info,
            gtt: GttMap::for_ram(ram, mapped, layout),
            alloc: BumpAlloc {
                next_page: state.next_page,
                end_page: mapped,
            },
            ring_gfx: state.ring_gfx,
            ring_pages: state.ring_pages,
            tail: state.tail,
            hws_gfx: state.hws_gfx,
            seqno: state.seqno,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeGpu;

    fn ram() -> GuestRam {
        GuestRam::with_mib(4).unwrap()
    }

    #[test]
    fn probe_reads_the_contract() {
        let ram = ram();
        let gpu = FakeGpu::new(&ram);
        let info = probe(&gpu).unwrap();
        assert_eq!(info.gfx_mem_size, 64 << 20);
        assert_eq!(info.gtt_entries, 16384);
        gpu.poke(r::HAG_ID, 0x1234);
        let err = probe(&gpu).unwrap_err();
        assert_eq!(
            err.to_string(),
            "not a usable hag-sim vGPU: HAG_ID is 0x00001234, expected 0x48414753 (\"HAGS\")"
        );
    }

    #[test]
    fn gtt_maps_every_ram_page_once() {
        for layout in [GttLayout::Identity, GttLayout::Scattered] {
            for pages in [1u64, 2, 3, 1024, 12288, 16384] {
                let gtt = GttMap::new(pages, layout);
                let mut seen = vec![false; pages as usize];
                for g in 0..pages {
                    let p = gtt.guest_page(g).unwrap() as usize;
                    assert!(!seen[p], "{layout:?} {pages}: guest page {p} twice");
                    seen[p] = true;
                }
                assert_eq!(gtt.guest_page(pages), None);
            }
        }
        let gtt = GttMap::new(1024, GttLayout::Scattered);
        assert_ne!(gtt.guest_page(1), Some(1), "scattered is not identity");
        assert_eq!(
            gtt.translate(0x1234),
            Some(gtt.guest_page(1).unwrap() * 4096 + 0x234)
        );
        assert_eq!(gtt.pte(1), (gtt.guest_page(1).unwrap() * 4096) | 1);
        assert_eq!(gtt.pte(1024), 0);
    }

    #[test]
    fn gtt_entries_carry_guest_physical_frames() {
        let ram = crate::fake::scattered_ram(1);
        for layout in [GttLayout::Identity, GttLayout::Scattered] {
            let gtt = GttMap::for_ram(&ram, 1024, layout);
            assert_eq!(gtt.pages(), 256, "at most the pages of RAM");
            for g in 0..256 {
                let page = gtt.guest_page(g).unwrap();
                assert_eq!(gtt.translate(g * 4096 + 8), Some(page * 4096 + 8));
                assert_eq!(gtt.pte(g), (ram.frame(page).unwrap() << 12) | 1);
            }
            assert_eq!(gtt.pte(256), 0);
        }
        // Contiguous RAM: the frame is the page, as GttMap::new says.
        let plain = GuestRam::with_mib(1).unwrap();
        let gtt = GttMap::for_ram(&plain, 256, GttLayout::Scattered);
        assert_eq!(gtt, GttMap::new(256, GttLayout::Scattered));
        // A frame beyond what a PTE can hold is refused, not truncated.
        let ram = GuestRam::with_mib(1).unwrap();
        let far = ram
            .with_frames((0..256).map(|p| (1 << 27) + p).collect())
            .unwrap();
        let err = Driver::init(FakeGpu::new(&far), &far, DriverConfig::default())
            .err()
            .unwrap();
        assert!(
            err.to_string().starts_with("bad frame table: guest page "),
            "{err}"
        );
    }

    #[test]
    fn init_programs_gtt_ring_status_page_and_interrupts() {
        let ram = ram();
        let drv = Driver::init(FakeGpu::new(&ram), &ram, DriverConfig::default()).unwrap();
        let gpu = drv.regs();
        // 4 MiB of RAM: 1024 mapped entries, the rest not present.
        for page in 0..16384u64 {
            let want = drv.gtt().pte(page);
            assert_eq!(gpu.gtt_entry(page), want, "entry {page}");
        }
        assert_eq!(gpu.gtt_entry(1023) & 1, 1);
        assert_eq!(gpu.gtt_entry(1024), 0);
        assert_eq!(gpu.peek(r::HWS_PGA), 0);
        assert_eq!(gpu.peek(r::RING_START), 0x1000);
        assert_eq!(gpu.peek(r::RING_CTL), (1 << 12) | 1);
        assert_eq!(gpu.peek(r::INT_MASK), 0);
        assert_eq!(gpu.peek(r::INT_ENABLE), 1);
        assert_eq!(gpu.resets(), 1);
    }

    #[test]
    fn layout_never_splits_a_command_at_the_ring_end() {
        let noop = encode::noop()[0];
        // 16-dword ring, tail at dword 13: a 4-dword command does not fit in
        // the 3 dwords left, so they become MI_NOOPs and it starts at 0.
        let (p, used) = layout(16, 13, &[[1u32, 2, 3, 4]]).unwrap();
        assert_eq!(p.offsets, vec![0]);
        assert_eq!(
            p.parts,
            vec![(52, vec![noop; 3]), (0, vec![1, 2, 3, 4, noop])]
        );
        assert_eq!((p.start, p.tail, used), (52, 20, 8));
        // A command that fits exactly at the end wraps the tail to 0.
        let (p, used) = layout(16, 12, &[[1u32, 2, 3, 4]]).unwrap();
        assert_eq!(p.parts, vec![(48, vec![1, 2, 3, 4])]);
        assert_eq!((p.tail, used), (0, 4));
        // Odd totals get one MI_NOOP, which may itself sit at the end.
        let (p, _) = layout(16, 12, &[vec![1u32, 2, 3]]).unwrap();
        assert_eq!(p.parts, vec![(48, vec![1, 2, 3, noop])]);
        assert_eq!(p.tail, 0);
        // A command longer than the ring can never be placed.
        assert!(layout(16, 0, &[vec![0u32; 15]]).is_err());
    }

    #[test]
    fn ring_wraps_and_pads_to_qwords() {
        let ram = ram();
        let cfg = DriverConfig {
            ring_pages: 1,
            gtt_layout: GttLayout::Scattered,
        };
        let mut drv = Driver::init(FakeGpu::new(&ram), &ram, cfg).unwrap();
        let size = drv.ring_size();
        assert_eq!(size, 4096);
        let mut wrapped = 0;
        for round in 0..400u32 {
            let store = encode::store_data_imm(0x10_0000 + 4 * u64::from(round), round);
            let cmds = [store.to_vec(), encode::user_interrupt().to_vec()];
            let pending = drv.write_commands(&cmds).unwrap();
            assert_eq!(pending.start, drv.tail());
            assert_eq!(pending.tail % 8, 0);
            if pending.parts.len() == 2 {
                wrapped += 1;
            }
            // Each command lies whole inside the ring, in guest RAM through
            // the GTT.
            for (cmd, off) in cmds.iter().zip(&pending.offsets) {
                assert!(off + 4 * cmd.len() as u32 <= size);
                for (i, d) in cmd.iter().enumerate() {
                    let addr = drv.ring_addr(u64::from(*off) + 4 * i as u64);
                    assert_eq!(drv.mem().read_u32(addr).unwrap(), *d);
                }
            }
            drv.doorbell(&pending).unwrap();
            assert_eq!(drv.regs().peek(r::RING_TAIL), pending.tail);
            drv.wait(Duration::from_secs(1)).unwrap();
            assert_eq!(
                drv.mem()
                    .read_u32(0x10_0000 + 4 * u64::from(round))
                    .unwrap(),
                round
            );
        }
        assert!(wrapped >= 2, "400 submissions must wrap a 4 KiB ring");
    }

    #[test]
    fn a_full_ring_is_refused() {
        let ram = ram();
        let cfg = DriverConfig {
            ring_pages: 1,
            gtt_layout: GttLayout::Identity,
        };
        let mut drv = Driver::init(FakeGpu::new(&ram), &ram, cfg).unwrap();
        let big = vec![encode::noop().to_vec(); 1024];
        let err = drv.write_commands(&big).unwrap_err();
        assert_eq!(
            err.to_string(),
            "4096 bytes of commands do not fit in the ring (4088 of 4096 bytes free)"
        );
        drv.write_commands(&big[..1022]).unwrap();
    }

    #[test]
    fn rejection_is_reported_with_address_header_and_reason() {
        let ram = ram();
        let mut drv = Driver::init(FakeGpu::new(&ram), &ram, DriverConfig::default()).unwrap();
        let bad = encode::store_data_imm(64 << 20, 1);
        let failure = drv.submit(&[bad], Duration::from_secs(1)).unwrap_err();
        let DriverError::Rejected { addr, header, .. } = failure.error else {
            panic!("{:?}", failure.error);
        };
        assert_eq!(addr, drv.ring_gfx());
        assert_eq!(header, bad[0]);
        assert_eq!(
            failure.identity & r::INT_COMMAND_ERROR,
            r::INT_COMMAND_ERROR
        );
        assert!(failure
            .error
            .to_string()
            .starts_with("submission rejected: command at gfx 0x1000, header 0x10400002 (MI_STORE_DATA_IMM), reason "));
        drv.reset().unwrap();
        drv.submit(&[encode::store_data_imm(0x8000, 1)], Duration::from_secs(1))
            .unwrap();
    }
}
