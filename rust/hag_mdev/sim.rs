// SPDX-License-Identifier: GPL-2.0-only
//! The simulated vGPU `hag-sim`: register file, GTT, PCI config space and
//! the path from the doorbell to the engine. `docs/sim-vgpu.md` is the
//! guest-visible contract; `hag_abi::sim_regs` holds its numbers.
//!
//! A submission goes doorbell → read the ring (and, through the auditor,
//! every batch) via the GTT → audit (all or nothing) → mark every page of
//! the write set dirty → engine. Only [`audit::ValidatedCommand`]s reach the
//! engine ([`engine`]), which runs them in bounded slices from the vGPU's
//! work item, so a guest can hang its vGPU but never the kernel.

mod engine;
mod snapshot;
pub(crate) mod vfio;

use kernel::prelude::*;
use kernel::fmt;
use kernel::str::CString;
use kernel::time::Ktime;

use crate::abi;
use crate::sim_regs as r;
use crate::audit::{self, AddressSpace, AuditConfig, AuditError, GfxMemory, MemoryFault, ValidatedCommand};
use crate::glue;
use crate::dirty::DirtyLog;
use crate::events::Event;
use crate::backoff::HangBackoff;
use crate::ratelimit::{LeftOut, LogBudget, Verdict};
use crate::glue::{EventFd, VgpuIo};

pub(crate) use engine::Submission;
pub(crate) use snapshot::SNAPSHOT_BYTES;

const PAGE: u64 = 4096;
/// The most bytes one VFIO region access moves: all of config space (a
/// BAR0 access is one 4-byte register).
pub(crate) const REGION_ACCESS_MAX: usize = r::CONFIG_SIZE as usize;
/// Graphics pages of one vGPU.
const GTT_ENTRIES: usize = (abi::SIM_GFX_MEM_SIZE / PAGE) as usize;
/// Memory one submission's validated commands may take: the auditor's
/// entry limit is derived from it, so a guest's ring costs the host at most
/// this much (in vmalloc'd pages, never a large kmalloc).
const SUBMISSION_LIST_BYTES: usize = 2 << 20;
/// Rows walked per blit when marking a submission's pages; past that a
/// blit's remaining rows are marked as one range (more pages, never fewer).
const MARK_ROW_STEPS: u32 = 64;
/// Commands (or batch pages read) between two chances to reschedule while
/// a doorbell's audit runs.
const RESCHED_EVERY: u32 = 256;
/// Registers MI_LOAD_REGISTER_* and MI_STORE_REGISTER_MEM may name: the
/// general-purpose registers, low and high halves.
const ALLOWED_REGISTERS: [u32; 2 * r::GPR_COUNT as usize] = {
    let mut regs = [0; 2 * r::GPR_COUNT as usize];
    let mut i = 0;
    while i < regs.len() {
        regs[i] = r::GPR_BASE + 4 * i as u32;
        i += 1;
    }
    regs
};

/// Why the engine is not running.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Halt {
    /// Nothing to do.
    Idle,
    /// Stopped on an error (`ERROR_STATUS` says which) until `RESET`.
    Stopped,
    /// The watchdog (or an injected hang) stopped it, until `RESET`.
    Hung,
}

/// Counters reported by the stats ioctl.
#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) submissions: u64,
    pub(crate) rejected: u64,
    pub(crate) commands: u64,
    pub(crate) pages_marked: u64,
    pub(crate) interrupts: u64,
    pub(crate) hangs: u64,
    /// Bytes the engine wrote to guest memory (sim/engine.rs).
    pub(crate) bytes_written: u64,
    /// Submissions the auditor accepted and whose write set was marked
    /// before they ran: all of hag-sim's work is modelled precisely (what
    /// the auditor cannot model it rejects), so it has no fallback count.
    pub(crate) precise: u64,
}

/// The guest-visible registers that are plain storage.
#[derive(Default)]
struct Regs {
    int_mask: u32,
    int_identity: u32,
    int_enable: u32,
    error_status: u32,
    error_addr: u64,
    error_header: u32,
    error_reason: u32,
    ring_tail: u32,
    ring_head: u32,
    ring_start: u32,
    ring_ctl: u32,
    hws_pga: u32,
    gpr: [u32; 2 * r::GPR_COUNT as usize],
}

/// One simulated vGPU's whole state, guarded by its mutex.
pub(crate) struct Sim {
    pub(crate) id: u32,
    pub(crate) uuid: [u8; 16],
    /// The VFIO device is open; DMA and interrupts only then.
    pub(crate) open: bool,
    config: [u8; r::CONFIG_SIZE as usize],
    regs: Regs,
    gtt: KVVec<u64>,
    /// The running submission, if any.
    run: Option<Submission>,
    halt: Halt,
    /// A tail written while a submission ran (or while quiesced): the next
    /// submission.
    queued_tail: Option<u32>,
    /// Submissions are held (for a snapshot); the current one finishes.
    pub(crate) quiesced: bool,
    /// The `/dev/hag` opener whose `IOC_QUIESCE` or `IOC_RESTORE_CONTEXT`
    /// holds the vGPU: its file's release lets the vGPU go.
    pub(crate) held_by: Option<u64>,
    /// VFIO migration holds the vGPU stopped (any state but RUNNING):
    /// only VFIO lets it run again (or close or reset), not `IOC_RESUME`.
    pub(crate) vfio_stopped: bool,
    msi: Option<EventFd>,
    /// The log `/dev/hag` reads.
    pub(crate) dirty: Option<DirtyLog>,
    /// The log VFIO's DMA-logging feature reads: the same marks, its own
    /// bits, so the two readers never take each other's.
    pub(crate) vfio_dirty: Option<DirtyLog>,
    pub(crate) watchdog_ms: u32,
    /// When `RING_HEAD` last moved (or work started), for the watchdog.
    last_progress_ns: i64,
    /// Hangs in a row: what the next submissions may do (a guest that
    /// keeps hanging the vGPU gets less and less engine time).
    backoff: HangBackoff,
    pub(crate) stats: Stats,
    /// What the guest can make the host's log print (rejections, hangs):
    /// a burst per interval, the rest counted in `stats`.
    log_budget: LogBudget,
}

impl Sim {
    pub(crate) fn new(id: u32, uuid: [u8; 16]) -> Result<Self> {
        let mut sim = Self {
            id,
            uuid,
            open: false,
            config: [0; r::CONFIG_SIZE as usize],
            regs: Regs::default(),
            gtt: KVVec::from_elem(0u64, GTT_ENTRIES, GFP_KERNEL)?,
            run: None,
            halt: Halt::Idle,
            queued_tail: None,
            quiesced: false,
            held_by: None,
            vfio_stopped: false,
            msi: None,
            dirty: None,
            vfio_dirty: None,
            watchdog_ms: abi::WATCHDOG_DEFAULT_MS,
            last_progress_ns: 0,
            backoff: HangBackoff::default(),
            stats: Stats::default(),
            log_budget: LogBudget::new(),
        };
        sim.reset_config();
        sim.reset_engine();
        Ok(sim)
    }

    pub(crate) fn vgpu_state(&self) -> u32 {
        if self.open {
            abi::VGPU_STATE_OPEN
        } else {
            abi::VGPU_STATE_IDLE
        }
    }

    /// The VMM opened or closed the device. Closing stops everything that
    /// would touch the VM: its memory mappings go away with it.
    pub(crate) fn set_open(&mut self, open: bool) {
        self.open = open;
        if !open {
            self.msi = None;
            self.quiesced = false;
            self.held_by = None;
            // VFIO's DMA logging belongs to the closing VMM (as in the
            // in-tree migration drivers); hag's own log is /dev/hag's.
            self.vfio_dirty = None;
            self.vfio_stopped = false;
            self.reset_engine();
            self.reset_config();
        }
    }

    fn reset_config(&mut self) {
        let c = &mut self.config;
        c.fill(0);
        c[0x00..0x02].copy_from_slice(&r::PCI_VENDOR_ID.to_le_bytes());
        c[0x02..0x04].copy_from_slice(&r::PCI_DEVICE_ID.to_le_bytes());
        c[0x08] = r::PCI_REVISION;
        c[0x09..0x0c].copy_from_slice(&r::PCI_CLASS.to_le_bytes()[..3]);
        c[0x2c..0x2e].copy_from_slice(&r::PCI_VENDOR_ID.to_le_bytes());
        c[0x2e..0x30].copy_from_slice(&r::PCI_DEVICE_ID.to_le_bytes());
    }

    /// `RESET`, device reset and close: the engine stops, errors and
    /// interrupts clear, the ring is disabled. GTT and dirty log stay.
    fn reset_engine(&mut self) {
        self.run = None;
        self.queued_tail = None;
        self.halt = Halt::Idle;
        let gpr = self.regs.gpr;
        self.regs = Regs {
            int_mask: !0,
            gpr,
            ..Regs::default()
        };
    }

    // ---- PCI config space ------------------------------------------------

    fn config_read(&self, offset: usize, out: &mut [u8]) -> Result {
        let end = offset.checked_add(out.len()).ok_or(EINVAL)?;
        out.copy_from_slice(self.config.get(offset..end).ok_or(EINVAL)?);
        Ok(())
    }

    /// Whether config space byte `at` takes writes: the command register
    /// and BAR0. The rest (ids, class, header, capabilities) is read-only,
    /// for a guest's writes and for a snapshot's restore alike.
    fn config_writable(at: usize) -> bool {
        (0x04..0x06).contains(&at) || (0x10..0x14).contains(&at)
    }

    /// Writes the command register and BAR0 (with BAR sizing); the rest of
    /// config space is read-only.
    fn config_write(&mut self, offset: usize, data: &[u8]) -> Result {
        let end = offset.checked_add(data.len()).ok_or(EINVAL)?;
        if end > self.config.len() {
            return Err(EINVAL);
        }
        for (i, byte) in data.iter().enumerate() {
            if Self::config_writable(offset + i) {
                self.config[offset + i] = *byte;
            }
        }
        // BAR0 is 2 MiB, 32-bit memory: the low 21 bits read as zero, which
        // is also how a VMM sizes it by writing all ones.
        let bar = u32::from_le_bytes([self.config[0x10], self.config[0x11], self.config[0x12], self.config[0x13]]);
        let bar = bar & !(r::BAR0_SIZE as u32 - 1);
        self.config[0x10..0x14].copy_from_slice(&bar.to_le_bytes());
        Ok(())
    }

    // ---- BAR0 --------------------------------------------------------------

    fn bar0_read(&self, offset: u32) -> u32 {
        if let Some(entry) = self.gtt_entry_index(offset) {
            let value = self.gtt.get(entry / 2).copied().unwrap_or(0);
            return if entry % 2 == 0 { value as u32 } else { (value >> 32) as u32 };
        }
        let engine_status = match self.halt {
            _ if self.run.is_some() => 0,
            Halt::Idle => r::ENGINE_IDLE,
            Halt::Stopped => r::ENGINE_STOPPED,
            Halt::Hung => r::ENGINE_HUNG,
        } | if self.quiesced { r::ENGINE_QUIESCED } else { 0 };
        let gpr_end = r::GPR_BASE + 8 * r::GPR_COUNT;
        match offset {
            r::HAG_ID => r::HAG_ID_VALUE,
            r::HAG_REVISION => r::HAG_REVISION_VALUE,
            r::GFX_MEM_SIZE_LO => abi::SIM_GFX_MEM_SIZE as u32,
            r::GFX_MEM_SIZE_HI => (abi::SIM_GFX_MEM_SIZE >> 32) as u32,
            r::GTT_OFFSET_REG => r::GTT_OFFSET,
            r::GTT_ENTRIES_REG => GTT_ENTRIES as u32,
            r::INT_MASK => self.regs.int_mask,
            r::INT_IDENTITY => self.regs.int_identity,
            r::INT_ENABLE => self.regs.int_enable,
            r::ERROR_STATUS => self.regs.error_status,
            r::ERROR_ADDR_LO => self.regs.error_addr as u32,
            r::ERROR_ADDR_HI => (self.regs.error_addr >> 32) as u32,
            r::ERROR_HEADER => self.regs.error_header,
            r::ERROR_REASON => self.regs.error_reason,
            r::ENGINE_STATUS => engine_status,
            r::RING_TAIL => self.regs.ring_tail,
            r::RING_HEAD => self.regs.ring_head,
            r::RING_START => self.regs.ring_start,
            r::RING_CTL => self.regs.ring_ctl,
            r::HWS_PGA => self.regs.hws_pga,
            o if (r::GPR_BASE..gpr_end).contains(&o) => {
                self.regs.gpr[((o - r::GPR_BASE) / 4) as usize]
            }
            _ => 0,
        }
    }

    fn bar0_write(&mut self, offset: u32, value: u32, handle: &VgpuIo<'_>) {
        if let Some(entry) = self.gtt_entry_index(offset) {
            self.gtt_write(entry, value, handle);
            return;
        }
        let gpr_end = r::GPR_BASE + 8 * r::GPR_COUNT;
        match offset {
            r::INT_MASK => {
                self.regs.int_mask = value;
                self.update_interrupt();
            }
            r::INT_IDENTITY => self.regs.int_identity &= !value,
            r::INT_ENABLE => {
                self.regs.int_enable = value & 1;
                self.update_interrupt();
            }
            r::RESET if value & 1 != 0 => self.reset_engine(),
            r::RING_START => self.regs.ring_start = value & !(PAGE as u32 - 1),
            r::RING_CTL => self.regs.ring_ctl = value & ((r::RING_CTL_PAGES_MASK << r::RING_CTL_PAGES_SHIFT) | r::RING_CTL_ENABLE),
            r::HWS_PGA => {
                // A status page outside graphics memory is refused (the
                // register keeps its value), as a snapshot holding one is.
                let page = value & !(PAGE as u32 - 1);
                if hws_pga_valid(page) {
                    self.regs.hws_pga = page;
                }
            }
            r::RING_TAIL => self.doorbell(value, handle),
            o if (r::GPR_BASE..gpr_end).contains(&o) => {
                self.regs.gpr[((o - r::GPR_BASE) / 4) as usize] = value
            }
            _ => {}
        }
    }

    /// Which half-entry (entry * 2 + high) a BAR0 offset names, if it is in
    /// the GTT.
    fn gtt_entry_index(&self, offset: u32) -> Option<usize> {
        let rel = offset.checked_sub(r::GTT_OFFSET)? as usize / 4;
        (rel < GTT_ENTRIES * 2).then_some(rel)
    }

    fn gtt_write(&mut self, half: usize, value: u32, handle: &VgpuIo<'_>) {
        let Some(entry) = self.gtt.get_mut(half / 2) else { return };
        *entry = if half % 2 == 0 {
            (*entry & !0xffff_ffff) | u64::from(value)
        } else {
            (*entry & 0xffff_ffff) | (u64::from(value) << 32)
        };
        // A submission in flight was marked through the old translation;
        // if it may write this graphics page, the page the entry maps now
        // is dirty too. (Only this entry changed: one step.)
        let page = half / 2;
        let writes_page = self
            .run
            .as_ref()
            .and_then(|run| run.pages.get(page / 64))
            .is_some_and(|word| word & (1 << (page % 64)) != 0);
        if writes_page && self.mark_page(page) {
            self.stats.pages_marked += 1;
        }
        let _ = handle;
    }

    /// Guest physical address of graphics address `gfx`, if mapped.
    fn translate(&self, gfx: u64) -> Option<u64> {
        if gfx >= abi::SIM_GFX_MEM_SIZE {
            return None;
        }
        let pte = *self.gtt.get((gfx / PAGE) as usize)?;
        (pte & r::GTT_PRESENT != 0).then_some((pte & r::GTT_ADDR_MASK) + gfx % PAGE)
    }

    /// Reads or writes graphics memory through the GTT, page by page.
    fn gfx_access(&self, handle: &VgpuIo<'_>, mut gfx: u64, buf: &mut [u8], write: bool) -> core::result::Result<(), u64> {
        let mut done = 0;
        while done < buf.len() {
            let in_page = (PAGE - gfx % PAGE) as usize;
            let chunk = in_page.min(buf.len() - done);
            let gpa = self.translate(gfx).ok_or(gfx)?;
            let part = &mut buf[done..done + chunk];
            let res = if write { handle.dma_write(gpa, part) } else { handle.dma_read(gpa, part) };
            res.map_err(|_| gfx)?;
            done += chunk;
            gfx += chunk as u64;
        }
        Ok(())
    }

    // ---- interrupts --------------------------------------------------------

    fn raise(&mut self, cause: u32) {
        self.regs.int_identity |= cause;
        if cause & !self.regs.int_mask != 0 {
            self.update_interrupt();
        }
    }

    fn update_interrupt(&mut self) {
        let pending = self.regs.int_identity & !self.regs.int_mask;
        if pending != 0 && self.regs.int_enable & 1 != 0 {
            if let Some(msi) = &self.msi {
                msi.signal();
                self.stats.interrupts += 1;
            }
        }
    }

    pub(crate) fn set_msi(&mut self, msi: Option<EventFd>) {
        self.msi = msi;
    }

    // ---- submissions -------------------------------------------------------

    fn ring_bytes(&self) -> u32 {
        (((self.regs.ring_ctl >> r::RING_CTL_PAGES_SHIFT) & r::RING_CTL_PAGES_MASK) + 1) * PAGE as u32
    }

    fn doorbell(&mut self, tail: u32, handle: &VgpuIo<'_>) {
        let tail = tail & !7;
        if tail >= self.ring_bytes() {
            self.stop(r::ERROR_COMMAND_REJECTED, u64::from(self.regs.ring_start) + u64::from(tail), 0, 0);
            return;
        }
        self.regs.ring_tail = tail;
        if self.run.is_some() || self.quiesced {
            self.queued_tail = Some(tail);
        } else if self.halt == Halt::Idle {
            self.start_submission(handle);
        }
    }

    /// Audits the ring from head to tail and, if it passes, marks its write
    /// set dirty and starts the engine.
    fn start_submission(&mut self, handle: &VgpuIo<'_>) {
        let (head, tail) = (self.regs.ring_head, self.regs.ring_tail);
        if head == tail || self.regs.ring_ctl & r::RING_CTL_ENABLE == 0 || !self.open {
            return;
        }
        // RING_CTL may have shrunk the ring under an old head.
        if head >= self.ring_bytes() || tail >= self.ring_bytes() {
            self.stop(r::ERROR_COMMAND_REJECTED, u64::from(self.regs.ring_start) + u64::from(head), 0, 0);
            return;
        }
        self.stats.submissions += 1;
        let ring = u64::from(self.regs.ring_start);
        // A wrapped submission is two runs of whole commands (drivers pad
        // the ring's end with MI_NOOP rather than split a command).
        let parts = if tail > head {
            [(head, tail), (0, 0)]
        } else {
            [(head, self.ring_bytes()), (0, tail)]
        };
        let mut cmds = KVVec::new();
        for (from, to) in parts {
            if from == to {
                continue;
            }
            if let Err(e) = self.audit_part(handle, ring + u64::from(from), (to - from) as usize, &mut cmds) {
                self.reject(e);
                return;
            }
        }
        let Ok(pages) = write_pages(&cmds) else {
            self.reject(out_of_memory(ring + u64::from(head)));
            return;
        };
        self.run = Some(Submission::new(cmds, pages, tail));
        self.stats.precise += 1;
        self.mark_running_write_set();
        self.last_progress_ns = Ktime::ktime_get().to_ns();
        // After hangs, a pause before it starts too: a guest resubmitting
        // at once after each hang and reset gets no more than a slice per
        // pause.
        handle.kick(self.backoff.slice_gap_ms());
    }

    fn audit_part(&self, handle: &VgpuIo<'_>, gfx: u64, bytes: usize, cmds: &mut KVVec<ValidatedCommand>) -> core::result::Result<(), AuditError> {
        let ggtt = AddressSpace::Ggtt;
        let fault = |gfx_addr| AuditError { space: ggtt, gfx_addr, header: None, reason: audit::Reason::MemoryFault { space: ggtt, addr: gfx_addr } };
        let mut raw = KVVec::from_elem(0u8, bytes, GFP_KERNEL).map_err(|_| out_of_memory(gfx))?;
        self.gfx_access(handle, gfx, &mut raw, false).map_err(fault)?;
        let mut dwords = KVVec::from_elem(0u32, bytes / 4, GFP_KERNEL).map_err(|_| out_of_memory(gfx))?;
        for (i, dw) in dwords.iter_mut().enumerate() {
            *dw = le_dword(&raw, i);
        }
        drop(raw);
        let max_entries = (SUBMISSION_LIST_BYTES / core::mem::size_of::<ValidatedCommand>()) as u32;
        // Both parts of a wrapped ring share the one list and its limit.
        let listed = u32::try_from(cmds.len()).unwrap_or(u32::MAX);
        let cfg = AuditConfig {
            max_entries: max_entries.saturating_sub(listed),
            ..AuditConfig::new(abi::SIM_GFX_MEM_SIZE, u64::from(self.regs.hws_pga)).with_registers(&ALLOWED_REGISTERS)
        };
        let page = KVVec::from_elem(0u8, PAGE as usize, GFP_KERNEL).map_err(|_| out_of_memory(gfx))?;
        let mut memory = GttMemory { sim: self, handle, page, cached: None, loads: 0 };
        let mut sink = VecSink { cmds };
        audit::audit(&dwords, gfx, &cfg, &mut memory, &mut sink).map(|_| ())
    }

    fn reject(&mut self, e: AuditError) {
        self.stats.rejected += 1;
        if let Some(left_out) = self.may_log() {
            pr_info!("vGPU {}: submission rejected: {}{}\n", self.id, e, left_out);
        }
        self.stop(r::ERROR_COMMAND_REJECTED, e.gfx_addr, e.header.unwrap_or(0), e.reason.code());
        Event::new(abi::EVENT_COMMAND_REJECTED, self.id, &self.uuid).send();
    }

    /// Stops the engine on an error until `RESET`.
    fn stop(&mut self, status: u32, addr: u64, header: u32, reason: u32) {
        self.run = None;
        self.queued_tail = None;
        self.halt = Halt::Stopped;
        self.regs.error_status = status;
        self.regs.error_addr = addr;
        self.regs.error_header = header;
        self.regs.error_reason = reason;
        self.raise(if status == r::ERROR_DMA_FAULT { r::INT_DMA_FAULT } else { r::INT_COMMAND_ERROR });
    }

    /// Marks the dirty log for every page the running submission may write,
    /// through the GTT as it is now: at most one step per graphics page,
    /// whatever the commands.
    pub(crate) fn mark_running_write_set(&mut self) {
        if self.dirty.is_none() && self.vfio_dirty.is_none() {
            return;
        }
        let Some(run) = self.run.take() else { return };
        let mut marked = 0;
        for (w, word) in run.pages.iter().enumerate() {
            let mut bits = *word;
            while bits != 0 {
                let page = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if self.mark_page(page) {
                    marked += 1;
                }
            }
        }
        self.run = Some(run);
        self.stats.pages_marked += marked;
    }

    /// Marks the guest page graphics page `page` maps now, if it is mapped
    /// and logged.
    fn mark_page(&mut self, page: usize) -> bool {
        let pte = self.gtt.get(page).copied().unwrap_or(0);
        if pte & r::GTT_PRESENT == 0 {
            return false;
        }
        let gpa = pte & r::GTT_ADDR_MASK;
        let in_hag = self.dirty.as_mut().is_some_and(|log| log.mark(gpa));
        let in_vfio = self.vfio_dirty.as_mut().is_some_and(|log| log.mark(gpa));
        in_hag || in_vfio
    }

    /// Starts logging; a submission already running is marked at once, so
    /// its writes are not missed.
    pub(crate) fn start_dirty_log(&mut self, log: DirtyLog) {
        self.dirty = Some(log);
        self.mark_running_write_set();
    }

    /// Starts VFIO's DMA log, marking a running submission at once.
    /// VFIO allows one start until a stop (`include/uapi/linux/vfio.h`).
    pub(crate) fn start_vfio_dirty_log(&mut self, log: DirtyLog) -> Result {
        if self.vfio_dirty.is_some() {
            return Err(EINVAL);
        }
        self.vfio_dirty = Some(log);
        self.mark_running_write_set();
        Ok(())
    }

    /// Whether a line the guest caused may go to the host's log now
    /// ([`LogBudget`]): if so, what to append about lines left out.
    fn may_log(&mut self) -> Option<LeftOut> {
        // ktime_get() is monotonic and never negative.
        let now = u64::try_from(Ktime::ktime_get().to_ns()).unwrap_or(0);
        match self.log_budget.check(now) {
            Verdict::Print { suppressed } => Some(LeftOut(suppressed)),
            Verdict::Suppress => None,
        }
    }

    /// The operations the current submission may do before it counts as
    /// hung: the full budget, less after hangs in a row ([`HangBackoff`]).
    fn work_allowed(&self) -> u64 {
        self.backoff.work_limit(engine::SUBMISSION_OPS, engine::SLICE_OPS.into())
    }

    /// Declares the vGPU hung, as the watchdog does.
    pub(crate) fn hang(&mut self, why: &str) {
        let work = self.run.take().map_or(0, |run| run.work);
        self.queued_tail = None;
        self.halt = Halt::Hung;
        self.stats.hangs += 1;
        self.regs.error_status = r::ERROR_HANG;
        self.regs.error_addr = u64::from(self.regs.ring_start) + u64::from(self.regs.ring_head);
        self.raise(r::INT_HANG);
        self.backoff.hung();
        let next = self.work_allowed();
        let gap = self.backoff.slice_gap_ms();
        let detail = CString::try_from_fmt(fmt!(
            "{why} (after {work} operations; hang {} in a row: the next submission may do {next}, its slices {gap} ms apart)",
            self.backoff.streak()
        ));
        let message = detail.as_deref().ok().and_then(|c| c.to_str().ok()).unwrap_or(why);
        if let Some(left_out) = self.may_log() {
            pr_info!("vGPU {} hung: {}{}\n", self.id, message, left_out);
        }
        Event::new(abi::EVENT_VGPU_HUNG, self.id, &self.uuid).message(message).send();
    }

    /// One tick of the work item: a slice of the engine, then the watchdog.
    pub(crate) fn tick(&mut self, handle: &VgpuIo<'_>) {
        if !self.open || self.run.is_none() {
            return;
        }
        let outcome = engine::run_slice(self, handle);
        let delay_ms;
        let now = Ktime::ktime_get().to_ns();
        match outcome {
            engine::Outcome::Finished => {
                self.run = None;
                self.backoff.finished();
                self.regs.ring_head = self.regs.ring_tail;
                self.start_queued(handle);
                return;
            }
            engine::Outcome::Fault(gfx) => {
                self.stop(r::ERROR_DMA_FAULT, gfx, 0, 0);
                Event::new(abi::EVENT_STATE_CHANGED, self.id, &self.uuid).message("dma fault").send();
                return;
            }
            engine::Outcome::Broken(e) => {
                pr_err!("vGPU {}: the engine's walk disagrees with the audit ({:?}): a hag bug\n", self.id, e);
                self.hang("the engine's walk disagrees with the audit");
                return;
            }
            engine::Outcome::Progress { head_moved, stalled } => {
                if head_moved {
                    self.last_progress_ns = now;
                }
                // Busy: run on at once; waiting on memory: poll a bit
                // later; after hangs, only after a pause (HangBackoff).
                delay_ms = u32::from(stalled).max(self.backoff.slice_gap_ms());
            }
        }
        // Work, not only the head: a submission that re-runs batches can
        // move its head and still never end.
        let limit = self.work_allowed();
        if self.run.as_ref().is_some_and(|run| run.work >= limit) {
            self.hang("the submission did more work than any submission may");
            return;
        }
        let stalled_ms = (now - self.last_progress_ns) / 1_000_000;
        if stalled_ms >= i64::from(self.watchdog_ms) {
            self.hang("ring head did not advance within the watchdog timeout");
            return;
        }
        handle.kick(delay_ms);
    }

    /// Starts the submission a doorbell queued, unless held or halted.
    fn start_queued(&mut self, handle: &VgpuIo<'_>) {
        if self.quiesced || self.run.is_some() || self.halt != Halt::Idle {
            return;
        }
        if let Some(tail) = self.queued_tail.take() {
            self.regs.ring_tail = tail;
            self.start_submission(handle);
        }
    }

    /// `IOC_RESUME`: submissions held while quiesced start now.
    pub(crate) fn resume(&mut self, handle: &VgpuIo<'_>) {
        self.quiesced = false;
        self.held_by = None;
        self.start_queued(handle);
    }

    /// Whether the engine has a submission in flight.
    pub(crate) fn busy(&self) -> bool {
        self.run.is_some()
    }

    // ---- VFIO region access ------------------------------------------------

    /// `pread`/`pwrite` on the VFIO device fd: BAR0 (4-byte registers) or
    /// config space (any bytes, at most [`REGION_ACCESS_MAX`]). `buf` holds
    /// the bytes to write, or receives those read: the caller moves them
    /// from or to the VMM without the vGPU's lock.
    pub(crate) fn region_rw(&mut self, handle: &VgpuIo<'_>, buf: &mut [u8], pos: u64, write: bool) -> Result {
        let index = (pos >> r::REGION_SHIFT) as u32;
        let offset = pos & ((1u64 << r::REGION_SHIFT) - 1);
        match index {
            r::CONFIG_REGION => {
                let offset = usize::try_from(offset).map_err(|_| EINVAL)?;
                if write {
                    self.config_write(offset, buf)
                } else {
                    self.config_read(offset, buf)
                }
            }
            r::BAR0_REGION => {
                let Ok(bytes) = <&mut [u8; 4]>::try_from(buf) else {
                    return Err(EINVAL);
                };
                if offset % 4 != 0 || offset + 4 > r::BAR0_SIZE {
                    return Err(EINVAL);
                }
                let offset = offset as u32;
                if write {
                    self.bar0_write(offset, u32::from_le_bytes(*bytes), handle);
                } else {
                    *bytes = self.bar0_read(offset).to_le_bytes();
                }
                Ok(())
            }
            _ => Err(EINVAL),
        }
    }
}

/// Batch buffers, read through the GTT for the auditor. The simulated vGPU
/// has no PPGTT (its audit configuration refuses PPGTT addresses), so a PPGTT
/// read faults. The last page read is kept: one DMA call per page, not per
/// command (a batch of register loads reads its pairs one by one).
struct GttMemory<'a> {
    sim: &'a Sim,
    handle: &'a VgpuIo<'a>,
    /// One graphics page's bytes,
    page: KVVec<u8>,
    /// ...of this graphics page number.
    cached: Option<u64>,
    /// Pages read, to reschedule now and then.
    loads: u32,
}

impl GfxMemory for GttMemory<'_> {
    fn read_dwords(&mut self, space: AddressSpace, gfx_addr: u64, out: &mut [u32]) -> core::result::Result<(), MemoryFault> {
        if space != AddressSpace::Ggtt {
            return Err(MemoryFault { gfx_addr });
        }
        let mut addr = gfx_addr;
        for dw in out.iter_mut() {
            let page = addr / PAGE;
            if self.cached != Some(page) {
                self.cached = None;
                self.loads = self.loads.wrapping_add(1);
                if self.loads % RESCHED_EVERY == 0 {
                    glue::cond_resched();
                }
                self.sim.gfx_access(self.handle, page * PAGE, &mut self.page, false).map_err(|at| MemoryFault { gfx_addr: at.max(addr) })?;
                self.cached = Some(page);
            }
            *dw = le_dword(&self.page, ((addr % PAGE) / 4) as usize);
            addr = addr.checked_add(4).ok_or(MemoryFault { gfx_addr: addr })?;
        }
        Ok(())
    }
}

/// Collects validated commands for the engine. The auditor's `max_entries`
/// keeps the list within [`SUBMISSION_LIST_BYTES`]; the sink checks again
/// before it grows, so no guest can make it ask for more.
struct VecSink<'a> {
    cmds: &'a mut KVVec<ValidatedCommand>,
}

impl audit::AuditSink for VecSink<'_> {
    fn command(&mut self, cmd: &ValidatedCommand) -> core::result::Result<(), audit::SinkFull> {
        if (self.cmds.len() + 1) * core::mem::size_of::<ValidatedCommand>() > SUBMISSION_LIST_BYTES {
            return Err(audit::SinkFull);
        }
        if self.cmds.len() % (RESCHED_EVERY as usize * 16) == 0 {
            glue::cond_resched();
        }
        self.cmds.push(*cmd, GFP_KERNEL).map_err(|_| audit::SinkFull)
    }
}

/// The graphics pages a submission may write, one bit each, from every
/// command's write set in bounded steps (see `WriteSet::page_runs`): built
/// once, so marking them again (on a GTT write, after each dirty-log read)
/// costs one step per page, not per row of every blit.
fn write_pages(cmds: &[ValidatedCommand]) -> Result<KVVec<u64>> {
    let mut pages = KVVec::from_elem(0u64, GTT_ENTRIES / 64, GFP_KERNEL)?;
    for (i, cmd) in cmds.iter().enumerate() {
        if i % RESCHED_EVERY as usize == RESCHED_EVERY as usize - 1 {
            glue::cond_resched();
        }
        for run in cmd.kind.write_set().page_runs(MARK_ROW_STEPS) {
            // The audit kept every write inside graphics memory (GGTT).
            let last = run.last.min(GTT_ENTRIES as u64 - 1);
            let mut page = run.first;
            while page <= last {
                let (w, bit) = ((page / 64) as usize, page % 64);
                let Some(word) = pages.get_mut(w) else { break };
                if bit == 0 && last - page >= 63 {
                    *word = u64::MAX;
                    page += 64;
                } else {
                    *word |= 1 << bit;
                    page += 1;
                }
            }
        }
    }
    Ok(pages)
}

/// A submission refused because the host had no memory for its audit.
fn out_of_memory(gfx_addr: u64) -> AuditError {
    AuditError { space: AddressSpace::Ggtt, gfx_addr, header: None, reason: audit::Reason::SinkFull }
}

/// Whether `HWS_PGA` may hold `value`: a page-aligned status page inside
/// graphics memory.
pub(crate) fn hws_pga_valid(value: u32) -> bool {
    value % PAGE as u32 == 0 && u64::from(value) + PAGE <= abi::SIM_GFX_MEM_SIZE
}

/// Little-endian dword `i` of `bytes` (0 past the end).
fn le_dword(bytes: &[u8], i: usize) -> u32 {
    let at = i * 4;
    match bytes.get(at..at + 4) {
        Some(&[a, b, c, d]) => u32::from_le_bytes([a, b, c, d]),
        _ => 0,
    }
}
