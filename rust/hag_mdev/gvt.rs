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
//! What hag cannot model (a command the auditor refuses, an address GVT
//! cannot translate, too many pages: on Gen9 every 3D or media workload)
//! takes a bounded conservative set instead: every guest page GVT has
//! mapped for this vGPU's GPU ([`Reach`], kept from GVT's map and unmap
//! reports), which is all the GPU can write. Pages are marked when GVT
//! unmaps them too. Only if hag lost track of that set (no memory) does it
//! mark the whole log.
//!
//! GVT reports when a workload is done (completed and its context written
//! back, or dropped), and hag keeps each workload's write set
//! ([`track::InFlight`]) until then: every read-and-clear marks the pages of
//! the workloads still in flight again, so a workload that outlives any
//! number of reads is reported after its last write. GVT's own writes to
//! guest memory (context write-back, context status buffer) are reported
//! and marked as they happen.
//!
//! The guest's CPU writes guest pages through the aperture (BAR2, mapped
//! into the VM with no trap: no dirty log of the VM's sees those writes).
//! GVT reports every page the mappable GGTT range maps before each read of
//! either log, and each page a guest GGTT write stops it mapping, and hag
//! marks them ([`GvtVgpu::aperture_mapped`]): a conservative set, all the
//! pages the guest could have written that way.
//!
//! Context snapshots of a GVT-g vGPU are GVT's own parts (virtual
//! registers, config space, GGTT entries, execlist state) saved through the
//! functions the patch exports, each in a section of hag's snapshot format;
//! GVT checks what it is given back.

use kernel::alloc::flags::GFP_KERNEL_ACCOUNT;
use kernel::prelude::*;
use kernel::rbtree::RBTree;
use kernel::sync::{Arc, Mutex};
use kernel::{new_mutex, pin_init};

use crate::abi;
use crate::dirty::{self, DirtyLog};
pub(crate) use crate::glue::GvtPart;
use crate::glue::{self, GvtHandle, GvtTranslate, GvtVgpuPtr, GvtWorkload};
use crate::migration::VfioVgpu;
use crate::State;
use crate::handoff::{self, Limits, Outcome, Workload};
use crate::snapshot::{self as fmt, Snapshot, SnapshotError, Writer};
use crate::track::{Coverage, FrameCounts, InFlight, Marked, Reach, Remark, Writes, MAX_MAP_PAGES};

/// How many unmodelled workloads of one vGPU are logged with their reason
/// (the rest are counted only).
const LOG_UNMODELLED: u64 = 8;

/// Workloads of one vGPU tracked in flight; more are counted as
/// unmodelled until done (see [`track`](crate::track)).
const IN_FLIGHT: usize = 64;


/// Most pages kept of those GTT entries were made to map while workloads
/// were in flight.
const MAX_REMAPPED: usize = 65536;

/// Most pages one report of a GVT write marks one by one (a context image
/// is 20 pages on Gen9); a longer one marks the logs whole.
const MAX_GVT_WRITE_PAGES: u64 = 1024;

/// Counters of one GVT-g vGPU.
#[derive(Default, Clone, Copy)]
pub(crate) struct GvtStats {
    /// Workloads GVT handed over.
    pub(crate) workloads: u64,
    /// Workloads hag could not model (the reachable set marked).
    pub(crate) unmodelled: u64,
    /// Commands validated in audited workloads.
    pub(crate) commands: u64,
    /// Dirty bits set (each page a workload's sink got that lies in the
    /// log, each page of the reachable set for an unmodelled workload,
    /// each page GVT wrote or unmapped).
    pub(crate) pages_marked: u64,
    /// Guest writes GVT reported (context write-back, status buffer).
    pub(crate) gvt_writes: u64,
    /// Pages the aperture mapped when it was reported (at each read, and
    /// as a GGTT entry stopped mapping one), each marked.
    pub(crate) aperture_pages: u64,
    /// Workloads whose PPGTT batch the guest changed after the scan.
    pub(crate) changed_batches: u64,
}

/// hag's [`Reach`] storage: an rbtree of guest frame to mapping count,
/// and how many frames it holds (the rbtree counts only by walking).
pub(crate) struct Frames {
    tree: RBTree<u64, u32>,
    len: usize,
}

impl Frames {
    fn new() -> Self {
        Frames {
            tree: RBTree::new(),
            len: 0,
        }
    }
}

impl FrameCounts for Frames {
    fn count_mut(&mut self, gfn: u64) -> Option<&mut u32> {
        self.tree.get_mut(&gfn)
    }

    fn insert(&mut self, gfn: u64) -> bool {
        // About 64 bytes a mapped page: charged to the task mapping it
        // (the VM's QEMU, through VFIO), as the mapping itself is.
        let inserted = self.tree.try_create_and_insert(gfn, 1, GFP_KERNEL_ACCOUNT).is_ok();
        self.len += usize::from(inserted);
        inserted
    }

    fn remove(&mut self, gfn: u64) {
        if self.tree.remove(&gfn).is_some() {
            self.len -= 1;
        }
    }

    fn for_each(&self, f: &mut dyn FnMut(u64)) {
        self.tree.keys().for_each(|&gfn| f(gfn));
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// The bit of `/dev/hag`'s log, and of VFIO DMA logging's, in the masks
/// [`Reach::cover`] and [`Logs::mark_gfn_in`] take.
const DEV_LOG: u8 = 1;
const VFIO_LOG: u8 = 2;

/// The vGPU's dirty logs: `/dev/hag`'s and VFIO DMA logging's. Every GPU
/// write goes to both; each reader reads and clears its own.
#[derive(Default)]
pub(crate) struct Logs {
    /// The log `/dev/hag` reads.
    pub(crate) dev: Option<DirtyLog>,
    /// The log VFIO DMA logging reports (a VMM migrating the VM).
    pub(crate) vfio: Option<DirtyLog>,
}

impl Logs {
    /// The logs there are, as [`DEV_LOG`] and [`VFIO_LOG`] bits.
    fn present(&self) -> u8 {
        (if self.dev.is_some() { DEV_LOG } else { 0 }) | (if self.vfio.is_some() { VFIO_LOG } else { 0 })
    }

    /// Marks guest frame `gfn` in both; whether either logs it.
    fn mark_gfn(&mut self, gfn: u64) -> bool {
        self.mark_gfn_in(gfn, DEV_LOG | VFIO_LOG)
    }

    /// Marks guest frame `gfn` in the logs of `which`; whether either logs
    /// it.
    fn mark_gfn_in(&mut self, gfn: u64, which: u8) -> bool {
        let gpa = gfn.saturating_mul(abi::DIRTY_PAGE_SIZE);
        let mark = |log: &mut Option<DirtyLog>, bit: u8| {
            which & bit != 0 && log.as_mut().is_some_and(|log| log.mark(gpa))
        };
        let dev = mark(&mut self.dev, DEV_LOG);
        let vfio = mark(&mut self.vfio, VFIO_LOG);
        dev || vfio
    }

    /// Marks every page of both; returns the larger count.
    fn mark_all(&mut self) -> u64 {
        self.mark_all_in(DEV_LOG | VFIO_LOG)
    }

    /// Marks every page of the logs of `which`; returns the larger count.
    fn mark_all_in(&mut self, which: u8) -> u64 {
        let mark = |log: &mut Option<DirtyLog>, bit: u8| {
            log.as_mut().filter(|_| which & bit != 0).map_or(0, |log| log.mark_all())
        };
        mark(&mut self.dev, DEV_LOG).max(mark(&mut self.vfio, VFIO_LOG))
    }
}

/// What the workload path changes, under the vGPU's mutex.
pub(crate) struct GvtInner {
    pub(crate) logs: Logs,
    /// What each workload handed over and not yet done may still write.
    inflight: InFlight<KVVec<u64>, IN_FLIGHT>,
    /// Every page the GPU can reach.
    reach: Reach<Frames>,
    /// Pages GTT entries were made to map while workloads were in flight
    /// (see [`GvtVgpu::gtt_mapped`]), each with when ([`InFlight::now`]),
    /// oldest first; marked again after every read until every workload
    /// scanned before it is done. Those before `remapped_from` are.
    remapped: KVVec<(u64, u64)>,
    remapped_from: usize,
    /// Since when more of them came than are kept: until every workload
    /// scanned before then is done, the reachable set stands in.
    remapped_lost: Option<u64>,
    /// Stopped by VFIO migration (the VMM stopped the VM, hag drained it).
    pub(crate) vfio_stopped: bool,
    pub(crate) stats: GvtStats,
}

impl GvtInner {
    /// Starts `/dev/hag`'s log: everything starts dirty (the first copy of
    /// a migration copies everything anyway).
    pub(crate) fn start_dirty_log(&mut self, mut log: DirtyLog) -> Result {
        log.mark_all();
        self.reach.taken(DEV_LOG);
        self.logs.dev = Some(log);
        Ok(())
    }

    /// Stops `/dev/hag`'s log; returns it, to be freed without the lock.
    pub(crate) fn stop_dirty_log(&mut self) -> Option<DirtyLog> {
        self.reach.taken(DEV_LOG);
        self.logs.dev.take()
    }

    /// Starts VFIO DMA logging. The VMM copies all memory after this, but
    /// a workload already running may write a page after its copy: what
    /// the workloads in flight may write starts dirty. VFIO allows one
    /// start until a stop (`include/uapi/linux/vfio.h`), as for a
    /// simulated vGPU: a second is refused, not allowed to replace the log
    /// and lose its bits; its log is handed back, to be freed without the
    /// lock.
    pub(crate) fn start_vfio_log(&mut self, mut log: DirtyLog) -> core::result::Result<(), DirtyLog> {
        if self.logs.vfio.is_some() {
            return Err(log);
        }
        self.reach.taken(VFIO_LOG);
        self.remark(&mut log, VFIO_LOG);
        self.logs.vfio = Some(log);
        Ok(())
    }

    /// Marks in `log` (the one of bit `which`, out of [`Logs`] while its
    /// bits are taken) what the workloads in flight may still write.
    fn remark(&mut self, log: &mut DirtyLog, which: u8) {
        let mark = |log: &mut DirtyLog, gfn: u64| {
            log.mark(gfn.saturating_mul(abi::DIRTY_PAGE_SIZE));
        };
        let remark = self.inflight.remark(|gfn| mark(log, gfn));
        self.remapped[self.remapped_from..].iter().for_each(|&(_, gfn)| mark(log, gfn));
        if remark == Remark::Reachable || self.remapped_lost.is_some() {
            if let Some((_, Marked::Everything)) = self.reach.cover(which, |gfn, _| mark(log, gfn)) {
                log.mark_all();
            }
        }
    }

    /// Moves `/dev/hag`'s dirty bits into `words`; returns how many pages
    /// that is. As `Entry::dirty_read_clear`. The pages of every workload
    /// still in flight are marked again at once, so the next read reports
    /// them too.
    pub(crate) fn read_and_clear(&mut self, room: u64, words: &mut KVVec<u64>) -> Result<u64> {
        let mut log = self.logs.dev.take().ok_or(ENOENT)?;
        let read = if room < log.bitmap_bytes() as u64 {
            Err(ENOSPC)
        } else {
            log.read_and_clear(words)
        };
        if read.is_ok() {
            self.reach.taken(DEV_LOG);
            self.remark(&mut log, DEV_LOG);
        }
        self.logs.dev = Some(log);
        read
    }

    /// Takes the VFIO log's dirty pages in `[iova, iova + length)`, to be
    /// reported without the lock ([`DirtyLog::take_range`]); what the
    /// workloads in flight may still write stays dirty.
    pub(crate) fn vfio_take(&mut self, iova: u64, length: u64) -> Result<DirtyLog> {
        let mut log = self.logs.vfio.take().ok_or(EINVAL)?;
        let taken = log.take_range(iova, length);
        self.reach.taken(VFIO_LOG);
        self.remark(&mut log, VFIO_LOG);
        self.logs.vfio = Some(log);
        taken
    }

    /// How many workloads were modelled precisely and how many took the
    /// fallback (see [`Coverage`]: counted once each is final).
    pub(crate) fn coverage(&self) -> Coverage {
        self.inflight.coverage()
    }

    /// Forgets the remapped pages every workload scanned before which is
    /// done (the oldest first: a prefix), and the loss of them likewise.
    /// Under constant load the table is never empty, yet each remap stops
    /// mattering. Returns what the list no longer needs, to be freed
    /// without the lock.
    fn forget_outlived_remaps(&mut self) -> Option<KVVec<(u64, u64)>> {
        let live = &self.inflight;
        if self.remapped_lost.is_some_and(|at| live.outlived(at)) {
            self.remapped_lost = None;
        }
        let outlived = self.remapped[self.remapped_from..]
            .iter()
            .take_while(|&&(at, _)| live.outlived(at))
            .count();
        self.remapped_from += outlived;
        if self.remapped_from == self.remapped.len() {
            self.remapped_from = 0;
            return Some(core::mem::replace(&mut self.remapped, KVVec::new()));
        }
        // Half of it outlived: the rest is copied down (amortised), if
        // there is memory for it; else kept as it is.
        if self.remapped_from > self.remapped.len() / 2 {
            let mut rest = KVVec::new();
            if rest.extend_from_slice(&self.remapped[self.remapped_from..], GFP_KERNEL_ACCOUNT).is_ok() {
                self.remapped_from = 0;
                return Some(core::mem::replace(&mut self.remapped, rest));
            }
        }
        None
    }

    /// Marks the reachable set for a workload not modelled, in the logs
    /// that do not hold it yet (each walks it once per read cycle).
    fn mark_reachable(&mut self) {
        let logs = &mut self.logs;
        let mut marked = 0u64;
        let cover = self.reach.cover(logs.present(), |gfn, which| {
            marked += u64::from(logs.mark_gfn_in(gfn, which));
        });
        if let Some((which, Marked::Everything)) = cover {
            marked = logs.mark_all_in(which);
        }
        self.stats.pages_marked += marked;
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
                GvtInner {
                    logs: Logs::default(),
                    inflight: InFlight::new(),
                    reach: Reach::new(Frames::new()),
                    remapped: KVVec::new(),
                    remapped_from: 0,
                    remapped_lost: None,
                    vfio_stopped: false,
                    stats: GvtStats::default(),
                },
                "hag_gvt_vgpu"
            ),
        })
    }

    /// A workload GVT scanned and shadowed (or why it could not be handed
    /// over in full); see the module docs.
    pub(crate) fn workload(
        &self,
        engine: u32,
        cookie: u64,
        wl: core::result::Result<&Workload<'_>, &'static str>,
        translate: &mut GvtTranslate,
    ) {
        // The write set is kept while the workload runs; without memory
        // for it, the workload counts as unmodelled.
        let mut pages = KVVec::new();
        let mut kept = true;
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        inner.stats.workloads += 1;
        let mut marked = 0u64;
        let outcome = {
            let logs = &mut inner.logs;
            let mut sink = |gfn: u64| {
                if logs.mark_gfn(gfn) {
                    marked += 1;
                }
                if kept && pages.push(gfn, GFP_KERNEL_ACCOUNT).is_err() {
                    kept = false;
                }
            };
            wl.map(|wl| handoff::hand_off(wl, &Limits::DEFAULT, translate, &mut sink))
        };
        inner.stats.pages_marked += marked;
        let writes = match outcome {
            Ok(Outcome::Audited { commands, .. }) => {
                inner.stats.commands += u64::from(commands);
                if kept {
                    Writes::Pages(pages)
                } else {
                    inner.mark_reachable();
                    Writes::Reachable
                }
            }
            Ok(Outcome::Unmodelled { reason }) => {
                self.unmodelled(inner, engine, &reason);
                Writes::Reachable
            }
            Err(why) => {
                self.unmodelled(inner, engine, &why);
                Writes::Reachable
            }
        };
        // A full table counts the workload as unmodelled until it is done.
        if let Some(Writes::Pages(_)) = inner.inflight.scanned(cookie, writes) {
            inner.mark_reachable();
        }
    }

    /// GVT says workload `cookie` is done: its pages stay marked until the
    /// next read, and are not marked again after it. If a PPGTT batch it
    /// ran was `changed` after the scan, what it wrote is not known: the
    /// reachable set is marked now, after its last write.
    pub(crate) fn workload_done(&self, cookie: u64, changed: bool) {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let writes = inner.inflight.done(cookie, changed);
        if changed {
            inner.stats.changed_batches += 1;
            inner.mark_reachable();
        }
        let dropped = inner.forget_outlived_remaps();
        drop(guard);
        drop(writes);
        drop(dropped);
    }

    /// Whether a dirty log of the vGPU is on: only then does a workload's
    /// done need to know whether a PPGTT batch changed under it (GVT reads
    /// every such batch back to tell).
    pub(crate) fn logging(&self) -> bool {
        self.inner.lock().logs.present() != 0
    }

    /// A GTT entry now maps `nr` pages from `gfn`. A workload in flight
    /// was translated before: it may write these pages through addresses
    /// that mapped others then. They are marked, and again after every
    /// read, until no workload of that time is in flight.
    pub(crate) fn gtt_mapped(&self, gfn: u64, nr: u64) {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        if inner.inflight.is_empty() {
            return;
        }
        let now = inner.inflight.now();
        for page in gfn..gfn.saturating_add(nr.min(MAX_MAP_PAGES)) {
            inner.stats.pages_marked += u64::from(inner.logs.mark_gfn(page));
            let kept = inner.remapped.len() - inner.remapped_from;
            // Not kept: the loss's time is the latest such remap's, so
            // that it lasts until every workload scanned before that one
            // is done (times only grow).
            if inner.remapped_lost.is_some()
                || kept >= MAX_REMAPPED
                || inner.remapped.push((now, page), GFP_KERNEL_ACCOUNT).is_err()
            {
                inner.remapped_lost = Some(now);
            }
        }
        if nr > MAX_MAP_PAGES {
            inner.remapped_lost = Some(now);
        }
    }

    /// GVT wrote `len` bytes of guest memory at `gpa` itself.
    pub(crate) fn guest_written(&self, gpa: u64, len: u64) {
        let mut inner = self.inner.lock();
        inner.stats.gvt_writes += 1;
        let page = abi::DIRTY_PAGE_SIZE;
        let first = gpa / page;
        let last = gpa.saturating_add(len.max(1) - 1) / page;
        // GVT's writes are a context image (a few pages) or a few bytes;
        // anything longer marks the logs whole.
        let marked = if last - first >= MAX_GVT_WRITE_PAGES {
            inner.logs.mark_all()
        } else {
            (first..=last).map(|gfn| u64::from(inner.logs.mark_gfn(gfn))).sum()
        };
        inner.stats.pages_marked += marked;
    }

    /// The mappable GGTT range maps, or mapped until now, `nr` pages from
    /// `gfn`: the guest's CPU may have written them through the aperture
    /// (BAR2), which no dirty log of the VM's sees. They are marked. GVT
    /// reports every page the range maps at each read of either log,
    /// before the read, and each page an entry stops mapping as it does,
    /// so a page written through the aperture is marked after the write
    /// and reported by the next read that takes the log after that mark.
    pub(crate) fn aperture_mapped(&self, gfn: u64, nr: u64) {
        // No run is longer than the GGTT has entries.
        let nr = nr.min(self.ggtt_size / abi::DIRTY_PAGE_SIZE);
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        if inner.logs.present() == 0 {
            return;
        }
        inner.stats.aperture_pages += nr;
        let marked: u64 = (gfn..gfn.saturating_add(nr)).map(|page| u64::from(inner.logs.mark_gfn(page))).sum();
        inner.stats.pages_marked += marked;
    }

    /// Moves `/dev/hag`'s dirty bits into `words`; returns how many pages
    /// that is ([`GvtInner::read_and_clear`]). GVT reports what the
    /// aperture maps first (kvmgt's DMA-logging read does the same for
    /// VFIO's log), with neither lock held: its callback takes them.
    pub(crate) fn read_and_clear(&self, room: u64, words: &mut KVVec<u64>) -> Result<u64> {
        self.handle.mark_aperture()?;
        self.inner.lock().read_and_clear(room, words)
    }

    /// GVT mapped (`map`) or is unmapping `nr` guest pages from `gfn`.
    pub(crate) fn pages_mapped(&self, gfn: u64, nr: u64, map: bool) {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let logs = &mut inner.logs;
        let mut marked = 0;
        if map {
            inner.reach.map(gfn, nr, |page, which| marked += u64::from(logs.mark_gfn_in(page, which)));
        } else {
            inner.reach.unmap(gfn, nr, |page| marked += u64::from(logs.mark_gfn(page)));
        }
        inner.stats.pages_marked += marked;
    }

    /// Marks the reachable set for a workload not modelled.
    fn unmodelled(&self, inner: &mut GvtInner, engine: u32, reason: &dyn core::fmt::Display) {
        inner.stats.unmodelled += 1;
        inner.mark_reachable();
        if inner.stats.unmodelled <= LOG_UNMODELLED {
            pr_info!(
                "GVT vGPU {} (hag vGPU {}), engine {}: workload not modelled, the {} pages the GPU can reach marked dirty: {}\n",
                self.gvt_id,
                self.id,
                engine,
                inner.reach.len(),
                reason
            );
        }
    }

    /// Logs the counters (`IOC_VGPU_STATS` has the main ones; this line
    /// also splits why workloads took the fallback).
    pub(crate) fn log_stats(&self, why: &str) {
        let (s, c) = {
            let inner = self.inner.lock();
            (inner.stats, inner.coverage())
        };
        pr_info!(
            "GVT vGPU {} (hag vGPU {}) {}: {} workloads, {} precise, {} fallback ({} not modelled, {} PPGTT batches changed), {} commands, {} pages marked, {} GVT writes, {} aperture pages\n",
            self.gvt_id,
            self.id,
            why,
            s.workloads,
            c.precise,
            c.fallback,
            s.unmodelled,
            s.changed_batches,
            s.commands,
            s.pages_marked,
            s.gvt_writes,
            s.aperture_pages
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
    /// hold workloads, so this waits for those queued or running.
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

    /// The snapshot's parts, in the order GVT restores them, once
    /// everything hag can check is: format, checksum, source, GGTT size and
    /// every part's length but the execlist state's. GVT checks the
    /// contents.
    fn parts<'a>(&self, bytes: &'a [u8]) -> Result<[&'a [u8]; GvtPart::RESTORE_ORDER.len()]> {
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
            *body = match part {
                // Its size follows the PPGTTs the source's guest had: GVT
                // checks it against their count (and caps it).
                GvtPart::Execlist => snap.section_as_saved(part.tag()),
                _ => snap.section(part.tag(), self.handle.part_size(part)?),
            }
            .map_err(errno)?;
        }
        Ok(bodies)
    }

    /// Loads a snapshot into a vGPU that has not run yet (GVT refuses
    /// otherwise). Every part is checked before the first is handed to GVT.
    pub(crate) fn restore(&self, bytes: &[u8]) -> Result {
        let bodies = self.parts(bytes)?;
        self.check_parts(&bodies)?;
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

    /// GVT's own checks of every part, changing nothing (what it can
    /// only find while restoring, such as memory for the PPGTTs' shadows,
    /// it finds then).
    fn check_parts(&self, bodies: &[&[u8]; GvtPart::RESTORE_ORDER.len()]) -> Result {
        for (body, part) in bodies.iter().zip(GvtPart::RESTORE_ORDER) {
            self.handle.check_part(part, body).inspect_err(|e| {
                pr_info!(
                    "GVT vGPU {} (hag vGPU {}): GVT would refuse the {} of the snapshot (error {})\n",
                    self.gvt_id,
                    self.id,
                    part.name(),
                    e.to_errno()
                );
            })?;
        }
        Ok(())
    }
}

/// VFIO migration v2 of a GVT-g vGPU: kvmgt's VFIO device hands its
/// migration and DMA logging to hag (scripts/gvt/0009), and glue.c runs
/// them as for a simulated vGPU. The VMM stops the VM's vCPUs before the
/// device, so nothing new is submitted; RUNNING -> STOP waits for GVT's
/// queue to drain, and the snapshot is GVT's parts as `/dev/hag` saves them.
impl GvtVgpu {
    /// RUNNING -> STOP: GVT's queue drained, and nothing new scheduled
    /// until STOP -> RUNNING ([`Self::vfio_run`]).
    pub(crate) fn vfio_stop(&self) -> Result {
        self.handle.wait_idle()?;
        self.inner.lock().vfio_stopped = true;
        Ok(())
    }

    /// STOP -> RUNNING.
    pub(crate) fn vfio_run(&self) {
        self.inner.lock().vfio_stopped = false;
    }

    /// The snapshot of the stopped vGPU into `out`.
    pub(crate) fn mig_save(&self, out: &mut [u8]) -> Result<usize> {
        if !self.inner.lock().vfio_stopped {
            return Err(EBUSY);
        }
        self.save(out)
    }

    /// Loads what the VMM wrote into the stopped vGPU.
    pub(crate) fn mig_restore(&self, bytes: &[u8]) -> Result {
        if !self.inner.lock().vfio_stopped {
            return Err(EBUSY);
        }
        self.restore(bytes)
    }

    /// Whether a complete snapshot the VMM wrote can be restored here; 0
    /// if so. Checked as the restore will check it (hag's checks and GVT's
    /// before it changes anything), so that a stream this vGPU would refuse
    /// fails the migration as it arrives, while the source VM can still
    /// run on, not at RESUMING -> STOP once the target VM is starting.
    pub(crate) fn mig_check(&self, bytes: &[u8]) -> Result<usize> {
        self.check_parts(&self.parts(bytes)?)?;
        Ok(0)
    }

    /// Back to RUNNING without an arc (device closed or reset).
    pub(crate) fn mig_reset(&self) {
        self.inner.lock().vfio_stopped = false;
    }

    /// VFIO DMA logging over `ranges` starts.
    pub(crate) fn dma_log_start(&self, ranges: &[dirty::Range]) -> Result {
        let log = DirtyLog::with_ranges(ranges)?;
        let started = self.inner.lock().start_vfio_log(log);
        started.map_err(|_refused| EINVAL)
    }

    /// VFIO DMA logging stops.
    pub(crate) fn dma_log_stop(&self) {
        let log = {
            let mut inner = self.inner.lock();
            inner.reach.taken(VFIO_LOG);
            inner.logs.vfio.take()
        };
        drop(log);
    }

    /// VFIO DMA logging: hands out and clears the dirty pages of a range.
    pub(crate) fn dma_log_report(&self, iova: u64, length: u64, report: &mut dyn FnMut(u64)) -> Result {
        let mut taken = self.inner.lock().vfio_take(iova, length)?;
        if glue::gpu_dirty_withheld() {
            // Tests only, as for a simulated vGPU.
            return Ok(());
        }
        taken.drain_range(iova, length, report);
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
    fn gvt_vgpu_added(&self, gvt_id: u32, ggtt_size: u64, vgpu: GvtVgpuPtr) -> Result<Arc<VfioVgpu>> {
        State::gvt_vgpu_added(self, gvt_id, ggtt_size, GvtHandle::new(vgpu))
    }

    fn gvt_vgpu_removed(&self, vgpu: usize, device: Option<Arc<VfioVgpu>>) {
        if let Some(device) = device {
            device.end_session();
        }
        State::gvt_vgpu_removed(self, vgpu)
    }

    fn gvt_workload(
        &self,
        vgpu: usize,
        engine: u32,
        cookie: u64,
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
            indirect_ctx: w.indirect_ctx,
        });
        gvt.workload(engine, cookie, workload.as_ref().map_err(|why| *why), translate);
    }

    fn gvt_workload_done(&self, vgpu: usize, cookie: u64, changed: bool) {
        if let Some(gvt) = self.gvt_vgpu(vgpu) {
            gvt.workload_done(cookie, changed);
        }
    }

    fn gvt_gtt_mapped(&self, vgpu: usize, gfn: u64, nr: u64) {
        if let Some(gvt) = self.gvt_vgpu(vgpu) {
            gvt.gtt_mapped(gfn, nr);
        }
    }

    fn gvt_batch_check(&self, vgpu: usize) -> bool {
        // A vGPU hag does not know: GVT decides as without the hook.
        self.gvt_vgpu(vgpu).is_none_or(|gvt| gvt.logging())
    }

    fn gvt_guest_written(&self, vgpu: usize, gpa: u64, len: u64) {
        if let Some(gvt) = self.gvt_vgpu(vgpu) {
            gvt.guest_written(gpa, len);
        }
    }

    fn gvt_pages_mapped(&self, vgpu: usize, gfn: u64, nr: u64, map: bool) {
        if let Some(gvt) = self.gvt_vgpu(vgpu) {
            gvt.pages_mapped(gfn, nr, map);
        }
    }

    fn gvt_aperture_mapped(&self, vgpu: usize, gfn: u64, nr: u64) {
        if let Some(gvt) = self.gvt_vgpu(vgpu) {
            gvt.aperture_mapped(gfn, nr);
        }
    }
}
