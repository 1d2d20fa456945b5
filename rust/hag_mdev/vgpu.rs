// SPDX-License-Identifier: GPL-2.0-only
//! The table of vGPUs and the module state that callbacks share.
//!
//! A vGPU enters the table when its mdev is probed and leaves it when the
//! mdev is removed; every change is announced on the netlink events group.
//! Ids are never reused while the module is loaded, so an id in an event or
//! an ioctl answer names one vGPU only.
//!
//! The table holds simulated vGPUs (hag's own mdev) and GVT-g vGPUs (i915's,
//! which hag only logs), as an [`Entry`] of either kind: what only one kind
//! has is reached by matching, so a GVT-g vGPU cannot be handed to the
//! simulated device model by mistake.
//!
//! Locking: the table's mutex is taken before a vGPU's own mutex, never
//! after; callers look a vGPU up (cloning its `Arc`), drop the table lock,
//! then lock the vGPU.

use kernel::prelude::*;
use kernel::sync::lock::{mutex::MutexBackend, Guard};
use kernel::sync::{Arc, Mutex};
use kernel::time::Ktime;
use kernel::uaccess::UserSlice;
use kernel::{new_mutex, pin_init};

use crate::abi;
use crate::dirty::{self, DirtyLog};
use crate::events::Event;
use crate::glue::{self, File, GvtHandle, VfioDeviceRef, VgpuHandle, VgpuIo};
use crate::migration::{MigFile, VfioVgpu};
use crate::gvt::GvtVgpu;
use crate::sim::{self, vfio, Sim};

/// Most vGPUs the module tracks at once (simulated and GVT-g together).
pub(crate) const MAX_VGPUS: usize = 32;

/// How long VFIO migration's RUNNING to STOP waits for the engine.
const MIG_QUIESCE_MS: u32 = 2000;

/// One vGPU: its C side and its simulated device.
///
/// The device model is reached only through [`Vgpu::lock`], which refuses
/// once the vGPU was removed: callers look a vGPU up and may hold its `Arc`
/// long after (a quiesce's wait, a `/dev/hag` ioctl's user copies), and
/// every use after the remove must find nothing, not a device whose VM and
/// C object are gone.
#[pin_data]
pub(crate) struct Vgpu {
    pub(crate) id: u32,
    pub(crate) uuid: [u8; 16],
    /// Private to this module: the device model's DMA and tick
    /// ([`VgpuIo`]) are made from it only by [`Locked`], under the mutex.
    handle: VgpuHandle,
    #[pin]
    sim: Mutex<Sim>,
}

/// A locked simulated device: the device model, and what it reaches
/// outside itself (guest memory, its tick) for as long as the lock is held.
pub(crate) struct Locked<'a> {
    sim: Guard<'a, Sim, MutexBackend>,
    handle: &'a VgpuHandle,
}

impl core::ops::Deref for Locked<'_> {
    type Target = Sim;
    fn deref(&self) -> &Sim {
        &self.sim
    }
}

impl core::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Sim {
        &mut self.sim
    }
}

impl Locked<'_> {
    /// See [`Sim::resume`].
    pub(crate) fn resume(&mut self) {
        self.sim.resume(&VgpuIo::new(self.handle));
    }

    /// See [`Sim::tick`].
    pub(crate) fn tick(&mut self) {
        self.sim.tick(&VgpuIo::new(self.handle));
    }

    /// See [`Sim::region_rw`].
    pub(crate) fn region_rw(&mut self, buf: &mut [u8], pos: u64, write: bool) -> Result {
        self.sim.region_rw(&VgpuIo::new(self.handle), buf, pos, write)
    }
}

impl Vgpu {
    /// Locks the simulated device; `ENODEV` once the vGPU was removed
    /// (its handle forgotten, which happens under this mutex, so the
    /// answer holds for as long as the guard lives).
    pub(crate) fn lock(&self) -> Result<Locked<'_>> {
        let sim = self.sim.lock();
        if !self.handle.is_live() {
            return Err(ENODEV);
        }
        Ok(Locked { sim, handle: &self.handle })
    }

    /// Holds new submissions and waits up to `timeout_ms` for the one in
    /// flight to end (sleeping, so process context only). On timeout the
    /// hold this call took is let go again and `ETIMEDOUT` returned: work
    /// in flight is never snapshotted. If the hold goes while it waits
    /// (the VMM closed the device, which resets it, or `IOC_RESUME`), it
    /// fails with `ECANCELED`; once the vGPU is removed, with `ENODEV`; if
    /// the calling process is killed, with `EINTR` (its hold let go). A
    /// hold taken for a `/dev/hag` opener (`holder`) is that opener's: it
    /// goes when the opener's file is released.
    pub(crate) fn quiesce(&self, timeout_ms: u32, holder: Option<u64>) -> Result {
        let held_before = core::mem::replace(&mut self.lock()?.quiesced, true);
        let deadline = Ktime::ktime_get().to_ns() + i64::from(timeout_ms) * 1_000_000;
        loop {
            {
                let mut sim = self.lock()?;
                if !sim.quiesced {
                    return Err(crate::errno(kernel::bindings::ECANCELED));
                }
                if !sim.busy() {
                    if holder.is_some() {
                        sim.held_by = holder;
                    }
                    return Ok(());
                }
                // Killed meanwhile (the VMM, or whoever asked): its
                // process must be able to exit, not sleep out the timeout.
                let killed = crate::glue::fatal_signal_pending();
                if killed || Ktime::ktime_get().to_ns() >= deadline {
                    if !held_before {
                        sim.resume();
                    }
                    let code = if killed { kernel::bindings::EINTR } else { kernel::bindings::ETIMEDOUT };
                    return Err(crate::errno(code));
                }
            }
            crate::glue::msleep(2);
        }
    }

    fn event(&self, what: &str) {
        Event::new(abi::EVENT_STATE_CHANGED, self.id, &self.uuid).message(what).send();
    }

    /// Whether the vGPU was removed.
    pub(crate) fn is_removed(&self) -> bool {
        !self.handle.is_live()
    }

    /// `/dev/hag` opener `holder` is gone: if it holds the vGPU quiesced
    /// (and VFIO migration does not hold it stopped), it runs again.
    pub(crate) fn let_go(&self, holder: u64) {
        let released = {
            let Ok(mut sim) = self.lock() else { return };
            let held = sim.quiesced && sim.held_by == Some(holder) && !sim.vfio_stopped;
            if held {
                sim.resume();
            }
            held
        };
        if released {
            self.event("resumed: the process that quiesced it closed /dev/hag");
        }
    }

    /// VFIO migration's RUNNING -> STOP: quiesced and held until STOP ->
    /// RUNNING ([`Self::vfio_run`]) or a reset.
    fn vfio_stop(&self) -> Result {
        if let Err(e) = self.quiesce(MIG_QUIESCE_MS, None) {
            pr_info!(
                "vGPU {}: VFIO migration: the engine did not go idle within {} ms; staying RUNNING\n",
                self.id,
                MIG_QUIESCE_MS
            );
            return Err(e);
        }
        let mut sim = self.lock()?;
        // IOC_RESUME may have let it go meanwhile.
        if !sim.quiesced || sim.busy() {
            return Err(EBUSY);
        }
        sim.vfio_stopped = true;
        drop(sim);
        self.event("stopped for VFIO migration");
        Ok(())
    }

    /// VFIO migration's STOP -> RUNNING.
    fn vfio_run(&self) -> Result {
        let mut sim = self.lock()?;
        sim.vfio_stopped = false;
        // A /dev/hag opener's quiesce is its own to let go (IOC_RESUME, or
        // closing /dev/hag).
        let held = sim.held_by.is_some();
        if !held {
            sim.resume();
        }
        drop(sim);
        self.event(if held {
            "VFIO migration ran again; still quiesced by a /dev/hag opener"
        } else {
            "resumed by VFIO migration"
        });
        Ok(())
    }
}

/// A vGPU in the table, of either kind.
#[derive(Clone)]
pub(crate) enum Entry {
    /// hag's simulated vGPU.
    Sim(Arc<Vgpu>),
    /// A GVT-g vGPU of i915.
    Gvt(Arc<GvtVgpu>),
}

impl Entry {
    pub(crate) fn id(&self) -> u32 {
        match self {
            Entry::Sim(v) => v.id,
            Entry::Gvt(g) => g.id,
        }
    }

    /// The mdev UUID (GVT-g does not tell hag its vGPUs' UUIDs: zeros).
    pub(crate) fn uuid(&self) -> [u8; 16] {
        match self {
            Entry::Sim(v) => v.uuid,
            Entry::Gvt(_) => [0; 16],
        }
    }

    /// Announces a state change on the events group.
    pub(crate) fn event(&self, what: &str) {
        let uuid = self.uuid();
        Event::new(abi::EVENT_STATE_CHANGED, self.id(), &uuid).message(what).send();
    }

    /// Starts the `/dev/hag` dirty log (replacing one already running).
    pub(crate) fn dirty_start(&self, log: DirtyLog) -> Result {
        match self {
            Entry::Sim(v) => {
                v.lock()?.start_dirty_log(log);
                Ok(())
            }
            Entry::Gvt(g) => g.inner.lock().start_dirty_log(log),
        }
    }

    /// Stops the `/dev/hag` dirty log.
    pub(crate) fn dirty_stop(&self) -> Result {
        // Freed after the lock is released.
        let log = match self {
            Entry::Sim(v) => v.lock()?.dirty.take(),
            Entry::Gvt(g) => {
                let log = g.inner.lock().stop_dirty_log();
                g.log_stats("dirty log stopped");
                log
            }
        };
        drop(log);
        Ok(())
    }

    /// Moves the dirty bits into `words` and clears them; returns how many
    /// pages were dirty. `ENOENT` without a log, `ENOSPC` if the log needs
    /// more than `room` bytes of bitmap.
    pub(crate) fn dirty_read_clear(&self, room: u64, words: &mut KVVec<u64>) -> Result<u64> {
        match self {
            Entry::Sim(v) => {
                let mut sim = v.lock()?;
                let log = sim.dirty.as_mut().ok_or(ENOENT)?;
                if room < log.bitmap_bytes() as u64 {
                    return Err(ENOSPC);
                }
                let dirty = log.read_and_clear(words)?;
                // A submission still running writes after this read: its
                // pages must be dirty again, or a copy made now would miss
                // its writes.
                sim.mark_running_write_set();
                Ok(dirty)
            }
            // Workloads still running, the aperture: see gvt.rs.
            Entry::Gvt(g) => g.read_and_clear(room, words),
        }
    }

    /// Bytes a context snapshot of the vGPU takes.
    pub(crate) fn snapshot_bytes(&self) -> Result<usize> {
        match self {
            Entry::Sim(_) => Ok(crate::sim::SNAPSHOT_BYTES),
            Entry::Gvt(g) => g.snapshot_bytes(),
        }
    }

    /// The most a snapshot restored into this vGPU may take.
    pub(crate) fn snapshot_max_bytes(&self) -> u64 {
        match self {
            Entry::Sim(_) => abi::SIM_CONTEXT_MAX_BYTES,
            Entry::Gvt(_) => crate::gvt::SNAPSHOT_MAX_BYTES,
        }
    }

    /// Writes the context snapshot into `out`; returns the bytes used.
    pub(crate) fn save(&self, out: &mut [u8]) -> Result<usize> {
        match self {
            Entry::Sim(v) => v.lock()?.save(out),
            Entry::Gvt(g) => g.save(out),
        }
    }

    /// Loads a context snapshot for `/dev/hag` opener `opener` (a
    /// simulated vGPU stays quiesced, held by it); refused ones leave the
    /// vGPU unchanged.
    pub(crate) fn restore(&self, bytes: &[u8], opener: u64) -> Result {
        match self {
            Entry::Sim(v) => {
                let mut sim = v.lock()?;
                sim.restore(bytes)?;
                sim.held_by = Some(opener);
                Ok(())
            }
            Entry::Gvt(g) => g.restore(bytes),
        }
    }

    /// ORs bits [`Self::dirty_read_clear`] took back in (handing them out
    /// failed).
    pub(crate) fn dirty_merge(&self, words: &[u64]) {
        let merge = |log: Option<&mut DirtyLog>| {
            if let Some(log) = log {
                log.merge(words);
            }
        };
        match self {
            // Removed meanwhile: the bits have no log to go back to.
            Entry::Sim(v) => {
                if let Ok(mut sim) = v.lock() {
                    merge(sim.dirty.as_mut());
                }
            }
            Entry::Gvt(g) => merge(g.inner.lock().logs.dev.as_mut()),
        }
    }

    /// VFIO DMA logging: start over `ranges`.
    pub(crate) fn dma_log_start(&self, ranges: &[dirty::Range]) -> Result {
        match self {
            Entry::Gvt(g) => g.dma_log_start(ranges),
            Entry::Sim(v) => {
                let log = DirtyLog::with_ranges(ranges)?;
                v.lock()?.start_vfio_dirty_log(log)
            }
        }
    }

    /// VFIO DMA logging: stop.
    pub(crate) fn dma_log_stop(&self) -> Result {
        match self {
            Entry::Gvt(g) => g.dma_log_stop(),
            Entry::Sim(v) => {
                // Freed after the lock is released.
                let log = v.lock()?.vfio_dirty.take();
                drop(log);
            }
        }
        Ok(())
    }

    /// VFIO DMA logging: hand out and clear the dirty pages of a range.
    pub(crate) fn dma_log_report(&self, iova: u64, length: u64, report: &mut dyn FnMut(u64)) -> Result {
        let vgpu = match self {
            Entry::Gvt(g) => return g.dma_log_report(iova, length, report),
            Entry::Sim(v) => v,
        };
        let mut taken = {
            let mut sim = vgpu.lock()?;
            let taken = sim.vfio_dirty.as_mut().ok_or(EINVAL)?.take_range(iova, length)?;
            // As for /dev/hag's log: a running submission's pages stay dirty.
            sim.mark_running_write_set();
            taken
        };
        if glue::gpu_dirty_withheld() {
            // Tests only: the bits are taken and dropped, so the VMM sees a
            // GPU that never writes (qemu_migrate_no_gpu_dirty).
            return Ok(());
        }
        // Without the lock: setting the VMM's bitmap may fault (see
        // DirtyLog::take_range).
        taken.drain_range(iova, length, report);
        Ok(())
    }

    /// VFIO migration's RUNNING -> STOP: the vGPU idle and kept so.
    pub(crate) fn vfio_stop(&self) -> Result {
        match self {
            Entry::Gvt(g) => g.vfio_stop(),
            Entry::Sim(v) => v.vfio_stop(),
        }
    }

    /// VFIO migration's STOP -> RUNNING.
    pub(crate) fn vfio_run(&self) -> Result {
        match self {
            Entry::Gvt(g) => {
                g.vfio_run();
                Ok(())
            }
            Entry::Sim(v) => v.vfio_run(),
        }
    }

    /// VFIO migration: the snapshot of a stopped vGPU into `out`; returns
    /// the bytes used.
    pub(crate) fn mig_save(&self, out: &mut [u8]) -> Result<usize> {
        match self {
            Entry::Gvt(g) => g.mig_save(out),
            Entry::Sim(v) => {
                let sim = v.lock()?;
                if !sim.vfio_stopped {
                    return Err(EBUSY);
                }
                sim.save(out)
            }
        }
    }

    /// VFIO migration: loads a snapshot a VMM wrote into a stopped vGPU.
    /// A snapshot that does not check out is refused, the vGPU unchanged.
    pub(crate) fn mig_restore(&self, bytes: &[u8]) -> Result {
        let vgpu = match self {
            Entry::Gvt(g) => return g.mig_restore(bytes),
            Entry::Sim(v) => v,
        };
        let mut sim = vgpu.lock()?;
        if !sim.vfio_stopped {
            return Err(EBUSY);
        }
        if let Err(e) = sim.restore(bytes) {
            pr_info!(
                "vGPU {}: VFIO migration: snapshot of {} bytes refused (error {}); the vGPU keeps its context\n",
                vgpu.id,
                bytes.len(),
                e.to_errno()
            );
            return Err(e);
        }
        drop(sim);
        vgpu.event("restored by VFIO migration");
        Ok(())
    }

    /// VFIO migration, while the VMM writes a snapshot (RESUMING): how
    /// many more bytes the snapshot's header says are to come, or, once
    /// all are there, whether it checks out (version, checksum, layout, a
    /// vGPU like this one). Refusing the write that completes a damaged
    /// snapshot fails the VMM's load of the device state, so the migration
    /// fails while the source VM can still run on; a refusal only at
    /// RESUMING -> STOP comes after QEMU has finished loading and started
    /// the VM, too late to fail the migration.
    pub(crate) fn mig_check(&self, bytes: &[u8]) -> Result<usize> {
        use crate::snapshot::{declared_len, HEADER_BYTES};
        let id = self.id();
        let total = match declared_len(bytes) {
            Some(total) => total,
            None if bytes.len() < HEADER_BYTES => return Ok(HEADER_BYTES - bytes.len()),
            None => {
                pr_info!("vGPU {}: VFIO migration: the device state written is not a hag snapshot (bad magic)\n", id);
                return Err(EINVAL);
            }
        };
        if bytes.len() < total {
            return Ok(total - bytes.len());
        }
        if bytes.len() > total {
            pr_info!(
                "vGPU {}: VFIO migration: {} bytes of device state written, its header says {}\n",
                id,
                bytes.len(),
                total
            );
            return Err(EINVAL);
        }
        let checked = match self {
            Entry::Gvt(g) => g.mig_check(bytes),
            Entry::Sim(v) => v.lock()?.parse_compatible(bytes).map(|_| 0),
        };
        checked.inspect_err(|e| {
            pr_info!(
                "vGPU {}: VFIO migration: device state of {} bytes refused as it arrived (error {})\n",
                id,
                bytes.len(),
                e.to_errno()
            );
        })
    }

    /// VFIO migration state reset to RUNNING (close or device reset):
    /// VFIO's hold on the vGPU goes.
    pub(crate) fn mig_reset(&self) {
        match self {
            Entry::Gvt(g) => g.mig_reset(),
            Entry::Sim(v) => {
                let Ok(mut sim) = v.lock() else { return };
                if sim.vfio_stopped {
                    sim.vfio_stopped = false;
                    sim.resume();
                }
            }
        }
    }
}

/// Fixed slots: adding a vGPU never grows the table, and removal is O(1).
struct Table {
    slots: [Option<Entry>; MAX_VGPUS],
    next_id: u32,
}

impl Table {
    /// Puts the vGPU `make` builds with the next id into a free slot.
    fn insert(&mut self, make: impl FnOnce(u32) -> Result<Entry>) -> Result<u32> {
        let free = self.slots.iter().position(Option::is_none).ok_or(ENOSPC)?;
        let id = self.next_id;
        let next_id = id.checked_add(1).ok_or(ENOSPC)?;
        let entry = make(id)?;
        self.next_id = next_id;
        self.slots[free] = Some(entry);
        Ok(id)
    }

    /// Takes the first entry `pick` chooses out of the table.
    fn remove(&mut self, pick: impl Fn(&Entry) -> bool) -> Option<Entry> {
        let slot = self.slots.iter_mut().find(|s| s.as_ref().is_some_and(&pick));
        slot.and_then(Option::take)
    }
}

/// Everything the module's callbacks share.
#[pin_data]
pub(crate) struct State {
    #[pin]
    table: Mutex<Table>,
}

impl State {
    pub(crate) fn new() -> impl PinInit<Self> {
        pin_init!(Self {
            table <- new_mutex!(
                Table { slots: [const { None }; MAX_VGPUS], next_id: 1 },
                "hag_vgpu_table"
            ),
        })
    }

    /// The vGPU with this id, of either kind.
    pub(crate) fn entry(&self, id: u32) -> Result<Entry> {
        let table = self.table.lock();
        let found = table.slots.iter().flatten().find(|e| e.id() == id);
        found.cloned().ok_or(ENODEV)
    }

    /// Adds a simulated vGPU; returns it as its VFIO device reaches it.
    pub(crate) fn vgpu_created(&self, uuid: [u8; 16], handle: VgpuHandle) -> Result<Arc<VfioVgpu>> {
        let mut device = None;
        let id = self.table.lock().insert(|id| {
            let sim = Sim::new(id, uuid)?;
            let vgpu = Arc::pin_init(
                pin_init!(Vgpu { id, uuid, handle, sim <- new_mutex!(sim, "hag_vgpu") }),
                GFP_KERNEL,
            )?;
            let entry = Entry::Sim(vgpu);
            device = Some(VfioVgpu::new(entry.clone())?);
            Ok(entry)
        })?;
        Event::new(abi::EVENT_VGPU_CREATED, id, &uuid).send();
        device.ok_or(EINVAL)
    }

    /// Forgets a simulated vGPU, and ends its VFIO data session.
    pub(crate) fn vgpu_removed(&self, device: &VfioVgpu) {
        let Entry::Sim(vgpu) = &device.entry else { return };
        let removed = self.table.lock().remove(|e| matches!(e, Entry::Sim(v) if Arc::ptr_eq(v, vgpu)));
        {
            // Clones of the vGPU may live on (a quiesce in flight, an
            // ioctl in a user copy, a migration file): from here their
            // uses of the C side and of the device model find nothing
            // (`Vgpu::lock`). The one lock not taken through `Vgpu::lock`:
            // it ends the vGPU's liveness, under the mutex every use holds.
            let _sim = vgpu.sim.lock();
            vgpu.handle.forget();
        }
        device.end_session();
        if removed.is_some() {
            Event::new(abi::EVENT_VGPU_REMOVED, vgpu.id, &vgpu.uuid).send();
        }
    }

    /// Adds a GVT-g vGPU (GVT's id `gvt_id`); returns it as kvmgt's VFIO
    /// device reaches it through hag.
    pub(crate) fn gvt_vgpu_added(
        &self,
        gvt_id: u32,
        ggtt_size: u64,
        handle: impl PinInit<GvtHandle>,
    ) -> Result<Arc<VfioVgpu>> {
        let mut device = None;
        let id = self.table.lock().insert(|id| {
            let vgpu = Arc::pin_init(GvtVgpu::new(id, gvt_id, ggtt_size, handle), GFP_KERNEL)?;
            let entry = Entry::Gvt(vgpu);
            device = Some(VfioVgpu::new(entry.clone())?);
            Ok(entry)
        })?;
        pr_info!("GVT vGPU {} is hag vGPU {} (GGTT of {:#x} bytes)\n", gvt_id, id, ggtt_size);
        Event::new(abi::EVENT_VGPU_CREATED, id, &[0; 16]).send();
        device.ok_or(EINVAL)
    }

    /// The GVT-g vGPU whose GVT pointer is `vgpu`.
    pub(crate) fn gvt_vgpu(&self, vgpu: usize) -> Option<Arc<GvtVgpu>> {
        let table = self.table.lock();
        table.slots.iter().flatten().find_map(|e| match e {
            Entry::Gvt(g) if g.handle.is(vgpu) => Some(g.clone()),
            _ => None,
        })
    }

    /// GVT removes a vGPU: it leaves the table, and no call reaches GVT's
    /// vGPU after this returns.
    pub(crate) fn gvt_vgpu_removed(&self, vgpu: usize) {
        let removed = self.table.lock().remove(|e| matches!(e, Entry::Gvt(g) if g.handle.is(vgpu)));
        if let Some(Entry::Gvt(g)) = removed {
            g.handle.forget();
            g.log_stats("removed");
            Event::new(abi::EVENT_VGPU_REMOVED, g.id, &[0; 16]).send();
        }
    }

    /// Records that a VMM opened (or closed) the vGPU's VFIO device; a
    /// close also ends its migration (back to RUNNING, no data session).
    pub(crate) fn vgpu_opened(&self, device: &VfioVgpu, open: bool) {
        if let Entry::Sim(vgpu) = &device.entry {
            if let Ok(mut sim) = vgpu.lock() {
                sim.set_open(open);
                drop(sim);
                let what = if open { "opened" } else { "closed" };
                Event::new(abi::EVENT_STATE_CHANGED, vgpu.id, &vgpu.uuid).message(what).send();
            }
        }
        if !open {
            device.reset();
        }
    }

    /// A VFIO region access. The VMM's buffer is read before the vGPU's
    /// lock is taken and written after it is let go: a fault on it that
    /// never ends (a userfaultfd or FUSE mapping) stalls only this call,
    /// never the vGPU, its work item or `/dev/hag`.
    pub(crate) fn vfio_rw(vgpu: &Vgpu, user: UserSlice, count: usize, pos: u64, write: bool) -> Result<usize> {
        let mut bytes = [0u8; sim::REGION_ACCESS_MAX];
        let buf = bytes.get_mut(..count).ok_or(EINVAL)?;
        if write {
            user.reader().read_slice(buf)?;
            vgpu.lock()?.region_rw(buf, pos, true)?;
        } else {
            vgpu.lock()?.region_rw(buf, pos, false)?;
            user.writer().write_slice(buf)?;
        }
        Ok(count)
    }

    /// A VFIO device ioctl: its argument read and its answer written
    /// without the vGPU's lock, as for [`Self::vfio_rw`]. A reset device
    /// is RUNNING again, with no data session (uapi/linux/vfio.h).
    pub(crate) fn vfio_ioctl(device: &VfioVgpu, vgpu: &Vgpu, cmd: u32, arg: usize) -> Result<i64> {
        let ioctl = vfio::Ioctl::read(cmd, arg)?;
        let reply = ioctl.apply(&mut *vgpu.lock()?);
        let answer = reply.write(arg)?;
        if cmd == vfio::VFIO_DEVICE_RESET {
            device.reset();
        }
        Ok(answer)
    }

    /// Every vGPU now, in slot order: clones, so callers may lock the vGPUs
    /// (or fault on user memory) without the table lock.
    fn entries(&self) -> [Option<Entry>; MAX_VGPUS] {
        let mut vgpus: [Option<Entry>; MAX_VGPUS] = [const { None }; MAX_VGPUS];
        let table = self.table.lock();
        for (out, slot) in vgpus.iter_mut().zip(table.slots.iter()) {
            *out = slot.clone();
        }
        vgpus
    }

    /// Number of vGPUs now.
    pub(crate) fn vgpu_count(&self) -> usize {
        self.table.lock().slots.iter().flatten().count()
    }

    /// A copy of every vGPU's info, in creation (id) order, and how many
    /// vGPUs there are. Copies, so callers can fault on user memory without
    /// holding a lock.
    pub(crate) fn infos(&self) -> ([abi::HagVgpuInfo; MAX_VGPUS], usize) {
        let vgpus = self.entries();
        let mut infos = [abi::HagVgpuInfo::default(); MAX_VGPUS];
        let mut count = 0;
        for entry in vgpus.iter().flatten() {
            infos[count] = match entry {
                Entry::Sim(vgpu) => abi::HagVgpuInfo {
                    id: vgpu.id,
                    source: abi::VGPU_SOURCE_SIM,
                    // Removed since the table was read: not listed.
                    state: match vgpu.lock() {
                        Ok(sim) => sim.vgpu_state(),
                        Err(_) => continue,
                    },
                    reserved: 0,
                    uuid: vgpu.uuid,
                    gfx_mem_size: abi::SIM_GFX_MEM_SIZE,
                },
                Entry::Gvt(gvt) => abi::HagVgpuInfo {
                    id: gvt.id,
                    source: abi::VGPU_SOURCE_GVT,
                    // GVT does not tell hag whether a VMM has it open.
                    state: abi::VGPU_STATE_IDLE,
                    reserved: 0,
                    uuid: [0; 16],
                    gfx_mem_size: gvt.ggtt_size,
                },
            };
            count += 1;
        }
        infos[..count].sort_unstable_by_key(|info| info.id);
        (infos, count)
    }
}

/// The simulated vGPU behind a hag-sim VFIO device (GVT-g's kvmgt devices
/// reach hag only for migration and DMA logging).
fn sim_of(device: &VfioVgpu) -> Result<&Arc<Vgpu>> {
    match &device.entry {
        Entry::Sim(vgpu) => Ok(vgpu),
        Entry::Gvt(_) => Err(ENODEV),
    }
}

impl glue::MdevParent for State {
    fn vgpu_probe(&self, uuid: [u8; 16], handle: VgpuHandle) -> Result<Arc<VfioVgpu>> {
        self.vgpu_created(uuid, handle)
    }

    fn vgpu_remove(&self, device: &VfioVgpu) {
        self.vgpu_removed(device)
    }
}

impl glue::VfioDevice for State {
    type Vgpu = VfioVgpu;
    type MigFile = MigFile;

    fn vgpu_open(&self, device: &VfioVgpu, open: bool) {
        self.vgpu_opened(device, open)
    }

    fn region_rw(&self, device: &VfioVgpu, user: UserSlice, count: usize, pos: u64, write: bool) -> Result<usize> {
        State::vfio_rw(sim_of(device)?, user, count, pos, write)
    }

    fn device_ioctl(&self, device: &VfioVgpu, cmd: u32, arg: usize) -> Result<i64> {
        State::vfio_ioctl(device, sim_of(device)?, cmd, arg)
    }

    fn tick(&self, device: &VfioVgpu) {
        let Ok(vgpu) = sim_of(device) else { return };
        let Ok(mut sim) = vgpu.lock() else { return };
        sim.tick();
    }

    fn dma_log_start(&self, device: &VfioVgpu, ranges: &[dirty::Range]) -> Result {
        device.entry.dma_log_start(ranges)
    }

    fn dma_log_stop(&self, device: &VfioVgpu) -> Result {
        device.entry.dma_log_stop()
    }

    fn dma_log_report(&self, device: &VfioVgpu, iova: u64, length: u64, report: &mut dyn FnMut(u64)) -> Result {
        device.entry.dma_log_report(iova, length, report)
    }

    fn mig_set_state(&self, device: &VfioVgpu, vdev: &VfioDeviceRef<'_>, target: u32) -> Result<Option<File>> {
        device.set_state(vdev, target)
    }

    fn mig_state(&self, device: &VfioVgpu) -> u32 {
        device.state()
    }

    fn mig_data_bytes(&self, device: &VfioVgpu) -> Result<usize> {
        device.data_bytes()
    }

    fn mig_reset(&self, device: &VfioVgpu) {
        device.reset()
    }

    fn mig_file_read(&self, file: &MigFile, user: UserSlice, len: usize) -> Result<usize> {
        file.read(user, len)
    }

    fn mig_file_write(&self, file: &MigFile, user: UserSlice, len: usize) -> Result<usize> {
        file.write(user, len)
    }
}
