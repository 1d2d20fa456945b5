// SPDX-License-Identifier: GPL-2.0-only
//! GVT-g vGPUs: i915's GVT runs them, hag logs what their GPU work writes.
//!
//! With the i915 patch, GVT calls hag after it has scanned and shadowed each
//! workload (glue.c's trampolines, then the `glue::GvtObserver` callbacks). GVT's own
//! scanner is the security gate and has already accepted the workload, so
//! hag never fails one: [`GvtVgpu::workload`] runs the hand-off (hag's
//! auditor over GVT's shadow copies, pages translated by GVT) and sets the
//! dirty bit of every guest page the workload may write. What hag cannot
//! model (a command the auditor refuses, an address GVT cannot translate,
//! too many pages) marks every logged page dirty instead, so no write is
//! missed, and is counted.
//!
//! Context snapshots of a GVT-g vGPU are GVT's own parts (virtual
//! registers, config space, GGTT entries, execlist state) saved through the
//! functions the patch exports, each in a section of hag's snapshot format;
//! GVT checks what it is given back.
//!
//! GVT tells hag when a workload is scanned, not when it completes: bits
//! are set before the GPU runs the workload, and a read-and-clear while it
//! still runs would hand them out before the writes land. So every read
//! reports the pages of the interval before it once more ([`GvtInner::carry`]):
//! a workload's pages reach the reader at the first read after its scan and
//! again at the next one. Known gap: a workload that is still running at
//! that second read (it outlived a whole read interval) can still write
//! after both; closing this needs a completion hook in GVT.

use kernel::prelude::*;
use kernel::sync::Mutex;
use kernel::{new_mutex, pin_init};

use crate::abi;
use crate::dirty::DirtyLog;
pub(crate) use crate::glue::GvtPart;
use crate::glue::{self, GvtHandle, GvtTranslate, GvtVgpuPtr, GvtWorkload};
use crate::State;
use crate::handoff::{self, Limits, Outcome, Workload};
use crate::snapshot::{self as fmt, Snapshot, SnapshotError, Writer};

/// How many unmodelled workloads of one vGPU are logged with their reason
/// (the rest are counted only).
const LOG_UNMODELLED: u64 = 8;

/// Counters of one GVT-g vGPU.
#[derive(Default, Clone, Copy)]
pub(crate) struct GvtStats {
    /// Workloads GVT handed over.
    pub(crate) workloads: u64,
    /// Workloads whose write set was audited and translated in full.
    pub(crate) audited: u64,
    /// Workloads hag could not model (every logged page marked).
    pub(crate) unmodelled: u64,
    /// Commands validated in audited workloads.
    pub(crate) commands: u64,
    /// Dirty bits set (each page a workload's sink got that lies in the
    /// log, and every page of the log for an unmodelled workload).
    pub(crate) pages_marked: u64,
}

/// What the workload path changes, under the vGPU's mutex.
pub(crate) struct GvtInner {
    /// The log `/dev/hag` reads.
    pub(crate) dirty: Option<DirtyLog>,
    /// The bits the last read handed out, handed out again by the next
    /// (see the module docs); as many words as the log has.
    carry: KVVec<u64>,
    pub(crate) stats: GvtStats,
}

impl GvtInner {
    /// Starts logging. Workloads already handed over may still be
    /// running, and their pages are not known any more: everything starts
    /// dirty (the first copy of a migration copies everything anyway).
    pub(crate) fn start_dirty_log(&mut self, mut log: DirtyLog) -> Result {
        self.carry = KVVec::from_elem(0u64, log.bitmap_bytes() / 8, GFP_KERNEL)?;
        log.mark_all();
        self.dirty = Some(log);
        Ok(())
    }

    /// Stops logging; returns the log, to be freed without the lock.
    pub(crate) fn stop_dirty_log(&mut self) -> Option<DirtyLog> {
        self.carry = KVVec::new();
        self.dirty.take()
    }

    /// Moves the dirty bits, with those the previous read handed out, into
    /// `words`; returns how many pages that is. As `Entry::dirty_read_clear`.
    pub(crate) fn read_and_clear(&mut self, room: u64, words: &mut KVVec<u64>) -> Result<u64> {
        let log = self.dirty.as_mut().ok_or(ENOENT)?;
        if room < log.bitmap_bytes() as u64 {
            return Err(ENOSPC);
        }
        log.read_and_clear(words)?;
        let mut dirty = 0;
        for (word, carried) in words.iter_mut().zip(self.carry.iter_mut()) {
            let fresh = *word;
            *word |= *carried;
            *carried = fresh;
            dirty += u64::from(word.count_ones());
        }
        Ok(dirty)
    }
}

/// One GVT-g vGPU in hag's table.
#[pin_data]
pub(crate) struct GvtVgpu {
    /// hag's id (from the same sequence as simulated vGPUs).
    pub(crate) id: u32,
    /// GVT's own id of the vGPU.
    pub(crate) gvt_id: u32,
    /// Bytes of graphics address space its GGTT spans.
    pub(crate) ggtt_size: u64,
    /// GVT's vGPU, valid until GVT says it is removed.
    #[pin]
    pub(crate) handle: GvtHandle,
    #[pin]
    pub(crate) inner: Mutex<GvtInner>,
}

impl GvtVgpu {
    pub(crate) fn new(
        id: u32,
        gvt_id: u32,
        ggtt_size: u64,
        handle: impl PinInit<GvtHandle>,
    ) -> impl PinInit<Self> {
        pin_init!(Self {
            id,
            gvt_id,
            ggtt_size,
            handle <- handle,
            inner <- new_mutex!(
                GvtInner { dirty: None, carry: KVVec::new(), stats: GvtStats::default() },
                "hag_gvt_vgpu"
            ),
        })
    }

    /// A workload GVT scanned and shadowed (or why glue.rs could not make
    /// one of what GVT passed); see the module docs.
    pub(crate) fn workload(
        &self,
        engine: u32,
        wl: core::result::Result<&Workload<'_>, &'static str>,
        translate: &mut GvtTranslate,
    ) {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        inner.stats.workloads += 1;
        let mut marked = 0u64;
        let outcome = {
            let dirty = &mut inner.dirty;
            let mut sink = |gfn: u64| {
                let gpa = gfn.saturating_mul(abi::DIRTY_PAGE_SIZE);
                if dirty.as_mut().is_some_and(|log| log.mark(gpa)) {
                    marked += 1;
                }
            };
            wl.map(|wl| handoff::hand_off(wl, &Limits::DEFAULT, translate, &mut sink))
        };
        match outcome {
            Ok(Outcome::Audited { commands, .. }) => {
                inner.stats.audited += 1;
                inner.stats.commands += u64::from(commands);
            }
            Ok(Outcome::Unmodelled { reason }) => {
                self.unmodelled(inner, engine, &reason);
                return;
            }
            Err(why) => {
                self.unmodelled(inner, engine, &why);
                return;
            }
        }
        inner.stats.pages_marked += marked;
    }

    /// Marks every logged page for a workload not modelled.
    fn unmodelled(&self, inner: &mut GvtInner, engine: u32, reason: &dyn core::fmt::Display) {
        inner.stats.unmodelled += 1;
        if let Some(log) = inner.dirty.as_mut() {
            inner.stats.pages_marked += log.mark_all();
        }
        if inner.stats.unmodelled <= LOG_UNMODELLED {
            pr_info!(
                "GVT vGPU {} (hag vGPU {}), engine {}: workload not modelled, every logged page marked dirty: {}\n",
                self.gvt_id,
                self.id,
                engine,
                reason
            );
        }
    }

    /// Logs the counters (the stats ioctl has no field for them).
    pub(crate) fn log_stats(&self, why: &str) {
        let s = self.inner.lock().stats;
        pr_info!(
            "GVT vGPU {} (hag vGPU {}) {}: {} workloads, {} audited, {} not modelled, {} commands, {} pages marked\n",
            self.gvt_id,
            self.id,
            why,
            s.workloads,
            s.audited,
            s.unmodelled,
            s.commands,
            s.pages_marked
        );
    }

    /// Waits until GVT has no workload of this vGPU in flight.
    pub(crate) fn quiesce(&self) -> Result {
        self.handle.wait_idle()
    }

    /// Bytes a snapshot of the vGPU takes now.
    pub(crate) fn snapshot_bytes(&self) -> Result<usize> {
        let mut total = fmt::HEADER_BYTES;
        for part in GvtPart::RESTORE_ORDER {
            let len = self.handle.part_size(part)?;
            total = len
                .checked_add(7)
                .map(|len| len & !7)
                .and_then(|len| total.checked_add(8)?.checked_add(len))
                .ok_or(EINVAL)?;
        }
        if total as u64 > SNAPSHOT_MAX_BYTES {
            return Err(EFBIG);
        }
        Ok(total)
    }

    /// Writes the vGPU's snapshot into `out`; returns the bytes used. The
    /// caller keeps the VM from submitting (its vCPUs paused): GVT cannot
    /// hold workloads, so this only waits for those in flight.
    pub(crate) fn save(&self, out: &mut [u8]) -> Result<usize> {
        self.handle.wait_idle()?;
        let mut w = Writer::new(out, abi::VGPU_SOURCE_GVT as u16, self.ggtt_size).map_err(errno)?;
        for part in GvtPart::RESTORE_ORDER {
            let len = self.handle.part_size(part)?;
            let mut saved = Ok(());
            w.section(part.tag(), len, |body| saved = self.handle.save_part(part, body))
                .map_err(errno)?;
            saved?;
        }
        Ok(w.finish())
    }

    /// Loads a snapshot into a vGPU that has not run yet (GVT refuses
    /// otherwise). Everything hag can check (format, checksum, source, GGTT
    /// size, every part's length) is checked before the first part is
    /// handed to GVT; GVT checks the contents.
    pub(crate) fn restore(&self, bytes: &[u8]) -> Result {
        let snap = Snapshot::parse(bytes).map_err(errno)?;
        if u32::from(snap.source) != abi::VGPU_SOURCE_GVT || snap.gfx_mem_size != self.ggtt_size {
            pr_info!(
                "GVT vGPU {} (hag vGPU {}): snapshot of source {} with a GGTT of {:#x} bytes refused (this vGPU: GVT-g, {:#x})\n",
                self.gvt_id,
                self.id,
                snap.source,
                snap.gfx_mem_size,
                self.ggtt_size
            );
            return Err(EINVAL);
        }
        let mut bodies: [&[u8]; GvtPart::RESTORE_ORDER.len()] = [&[]; GvtPart::RESTORE_ORDER.len()];
        for (body, part) in bodies.iter_mut().zip(GvtPart::RESTORE_ORDER) {
            *body = snap.section(part.tag(), self.handle.part_size(part)?).map_err(errno)?;
        }
        for (body, part) in bodies.iter().zip(GvtPart::RESTORE_ORDER) {
            if let Err(e) = self.handle.restore_part(part, body) {
                pr_warn!(
                    "GVT vGPU {} (hag vGPU {}): GVT refused the {} of the snapshot (error {}); parts before it are restored, so the vGPU must not be used\n",
                    self.gvt_id,
                    self.id,
                    part.name(),
                    e.to_errno()
                );
                return Err(e);
            }
        }
        Ok(())
    }
}

/// The most a GVT-g snapshot may take (see [`abi::CONTEXT_MAX_BYTES`]).
pub(crate) const SNAPSHOT_MAX_BYTES: u64 = abi::CONTEXT_MAX_BYTES;

impl GvtPart {
    /// Every part, in the order GVT restores them (glue.h).
    const RESTORE_ORDER: [GvtPart; 4] = [GvtPart::Vregs, GvtPart::CfgSpace, GvtPart::Ggtt, GvtPart::Execlist];

    /// Its section in the snapshot format.
    const fn tag(self) -> u32 {
        match self {
            GvtPart::Vregs => fmt::TAG_GVT_VREGS,
            GvtPart::CfgSpace => fmt::TAG_GVT_CFG_SPACE,
            GvtPart::Ggtt => fmt::TAG_GVT_GGTT,
            GvtPart::Execlist => fmt::TAG_GVT_EXECLIST,
        }
    }

    const fn name(self) -> &'static str {
        match self {
            GvtPart::Vregs => "virtual registers",
            GvtPart::CfgSpace => "config space",
            GvtPart::Ggtt => "GGTT entries",
            GvtPart::Execlist => "execlist state",
        }
    }
}

/// The errno for a snapshot the format code refused.
fn errno(e: SnapshotError) -> Error {
    match e {
        SnapshotError::UnknownVersion(_) => crate::errno(kernel::bindings::EPROTO),
        SnapshotError::NoSpace { .. } => ENOSPC,
        _ => EINVAL,
    }
}

impl glue::GvtObserver for State {
    fn gvt_vgpu_added(&self, gvt_id: u32, ggtt_size: u64, vgpu: GvtVgpuPtr) -> Result<u32> {
        State::gvt_vgpu_added(self, gvt_id, ggtt_size, GvtHandle::new(vgpu))
    }

    fn gvt_vgpu_removed(&self, vgpu: usize) {
        State::gvt_vgpu_removed(self, vgpu)
    }

    fn gvt_workload(
        &self,
        vgpu: usize,
        engine: u32,
        workload: core::result::Result<GvtWorkload<'_>, &'static str>,
        translate: &mut GvtTranslate,
    ) {
        let Some(gvt) = self.gvt_vgpu(vgpu) else { return };
        let workload = workload.map(|w| Workload {
            ring: w.ring,
            ring_gma: w.ring_gma,
            hwsp_gma: w.hwsp_gma,
            bbs: w.bbs,
            ggtt_size: gvt.ggtt_size,
        });
        gvt.workload(engine, workload.as_ref().map_err(|why| *why), translate);
    }
}
