// SPDX-License-Identifier: GPL-2.0-only
//! The table of vGPUs and the module state that callbacks share.
//!
//! A vGPU enters the table when its mdev is probed and leaves it when the
//! mdev is removed; every change is announced on the netlink events group.
//! Ids are never reused while the module is loaded, so an id in an event or
//! an ioctl answer names one vGPU only.
//!
//! Locking: the table's mutex is taken before a vGPU's own mutex, never
//! after; callers look a vGPU up (cloning its `Arc`), drop the table lock,
//! then lock the vGPU.

use kernel::prelude::*;
use kernel::sync::{Arc, Mutex};
use kernel::time::Ktime;
use kernel::uaccess::UserSlice;
use kernel::{new_mutex, pin_init};

use crate::abi;
use crate::dirty::DirtyLog;
use crate::events::Event;
use crate::glue::{MigAction, VgpuHandle};
use crate::sim::vfio::mig_state;
use crate::sim::{vfio, Sim};

/// Most vGPUs the module tracks at once (simulated and GVT-g together).
pub(crate) const MAX_VGPUS: usize = 32;

/// How long VFIO migration's RUNNING to STOP waits for the engine.
const MIG_QUIESCE_MS: u32 = 2000;

/// One vGPU: its C side and its simulated device.
#[pin_data]
pub(crate) struct Vgpu {
    pub(crate) id: u32,
    pub(crate) uuid: [u8; 16],
    pub(crate) handle: VgpuHandle,
    #[pin]
    pub(crate) sim: Mutex<Sim>,
}

impl Vgpu {
    /// Holds new submissions and waits up to `timeout_ms` for the one in
    /// flight to end (sleeping, so process context only). On timeout the
    /// hold this call took is let go again and `ETIMEDOUT` returned: work
    /// in flight is never snapshotted.
    pub(crate) fn quiesce(&self, timeout_ms: u32) -> Result {
        let held_before = core::mem::replace(&mut self.sim.lock().quiesced, true);
        let deadline = Ktime::ktime_get().to_ns() + i64::from(timeout_ms) * 1_000_000;
        loop {
            {
                let mut sim = self.sim.lock();
                if !sim.busy() {
                    return Ok(());
                }
                if Ktime::ktime_get().to_ns() >= deadline {
                    if !held_before {
                        sim.resume(&self.handle);
                    }
                    return Err(crate::errno(kernel::bindings::ETIMEDOUT));
                }
            }
            crate::glue::msleep(2);
        }
    }

    fn event(&self, what: &str) {
        Event::new(abi::EVENT_STATE_CHANGED, self.id, &self.uuid).message(what).send();
    }
}

/// Fixed slots: adding a vGPU never grows the table, and removal is O(1).
struct Table {
    slots: [Option<Arc<Vgpu>>; MAX_VGPUS],
    next_id: u32,
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

    /// The vGPU with this id, if it exists.
    pub(crate) fn vgpu(&self, id: u32) -> Result<Arc<Vgpu>> {
        let table = self.table.lock();
        let found = table.slots.iter().flatten().find(|v| v.id == id);
        found.cloned().ok_or(ENODEV)
    }

    /// Adds a simulated vGPU; returns its id.
    pub(crate) fn vgpu_created(&self, uuid: [u8; 16], handle: VgpuHandle) -> Result<u32> {
        let mut table = self.table.lock();
        let free = table.slots.iter().position(Option::is_none).ok_or(ENOSPC)?;
        let id = table.next_id;
        let next_id = id.checked_add(1).ok_or(ENOSPC)?;
        let sim = Sim::new(id, uuid)?;
        let vgpu = Arc::pin_init(
            pin_init!(Vgpu { id, uuid, handle, sim <- new_mutex!(sim, "hag_vgpu") }),
            GFP_KERNEL,
        )?;
        table.next_id = next_id;
        table.slots[free] = Some(vgpu);
        drop(table);
        Event::new(abi::EVENT_VGPU_CREATED, id, &uuid).send();
        Ok(id)
    }

    /// Forgets a vGPU. Unknown ids are ignored: glue.c only passes ids that
    /// `vgpu_created` returned.
    pub(crate) fn vgpu_removed(&self, id: u32) {
        let removed = {
            let mut table = self.table.lock();
            let slot = table.slots.iter_mut().find(|s| s.as_ref().is_some_and(|v| v.id == id));
            slot.and_then(Option::take)
        };
        if let Some(vgpu) = removed {
            Event::new(abi::EVENT_VGPU_REMOVED, vgpu.id, &vgpu.uuid).send();
        }
    }

    /// Records that a VMM opened (or closed) the vGPU's VFIO device.
    pub(crate) fn vgpu_opened(&self, id: u32, open: bool) {
        let Ok(vgpu) = self.vgpu(id) else { return };
        vgpu.sim.lock().set_open(open);
        let what = if open { "opened" } else { "closed" };
        Event::new(abi::EVENT_STATE_CHANGED, id, &vgpu.uuid).message(what).send();
    }

    /// A VFIO region access.
    pub(crate) fn vfio_rw(&self, id: u32, user: UserSlice, count: usize, pos: u64, write: bool) -> Result<usize> {
        let vgpu = self.vgpu(id)?;
        let mut sim = vgpu.sim.lock();
        sim.region_rw(&vgpu.handle, user, count, pos, write)
    }

    /// A VFIO device ioctl.
    pub(crate) fn vfio_ioctl(&self, id: u32, cmd: u32, arg: usize) -> Result<i64> {
        let vgpu = self.vgpu(id)?;
        let mut sim = vgpu.sim.lock();
        vfio::vfio_ioctl(&mut sim, cmd, arg)
    }

    /// VFIO DMA logging: start over `[iova, iova + length)`.
    pub(crate) fn dma_log_start(&self, id: u32, iova: u64, length: u64) -> Result {
        let log = DirtyLog::new(iova, length)?;
        self.vgpu(id)?.sim.lock().start_vfio_dirty_log(log)
    }

    /// VFIO DMA logging: stop.
    pub(crate) fn dma_log_stop(&self, id: u32) -> Result {
        let log = self.vgpu(id)?.sim.lock().vfio_dirty.take();
        drop(log);
        Ok(())
    }

    /// VFIO DMA logging: hand out and clear the dirty pages of a range.
    pub(crate) fn dma_log_report(&self, id: u32, iova: u64, length: u64, report: &mut dyn FnMut(u64)) -> Result {
        let vgpu = self.vgpu(id)?;
        let mut sim = vgpu.sim.lock();
        let log = sim.vfio_dirty.as_mut().ok_or(EINVAL)?;
        log.drain_range(iova, length, report);
        // As for /dev/hag's log: a running submission's pages stay dirty.
        sim.mark_running_write_set();
        Ok(())
    }

    /// VFIO migration: acts on the arc `cur` to `next` and tells glue.c
    /// what to do with the data files. Only the arcs of
    /// `VFIO_MIGRATION_STOP_COPY` exist; VFIO's core picks nothing else.
    pub(crate) fn mig_step(&self, id: u32, cur: u32, next: u32) -> Result<MigAction> {
        use mig_state::{RESUMING, RUNNING, STOP, STOP_COPY};
        let vgpu = self.vgpu(id)?;
        let action = match (cur, next) {
            (RUNNING, STOP) => {
                if let Err(e) = vgpu.quiesce(MIG_QUIESCE_MS) {
                    pr_info!(
                        "vGPU {}: VFIO migration: the engine did not go idle within {} ms; staying RUNNING\n",
                        id,
                        MIG_QUIESCE_MS
                    );
                    return Err(e);
                }
                let mut sim = vgpu.sim.lock();
                // IOC_RESUME may have let it go meanwhile.
                if !sim.quiesced || sim.busy() {
                    return Err(EBUSY);
                }
                sim.vfio_stopped = true;
                drop(sim);
                vgpu.event("stopped for VFIO migration");
                MigAction::None
            }
            (STOP, RUNNING) => {
                let mut sim = vgpu.sim.lock();
                sim.vfio_stopped = false;
                sim.resume(&vgpu.handle);
                drop(sim);
                vgpu.event("resumed by VFIO migration");
                MigAction::None
            }
            (STOP, STOP_COPY) => MigAction::Save,
            (STOP_COPY, STOP) => MigAction::Close,
            (STOP, RESUMING) => MigAction::Resume,
            (RESUMING, STOP) => MigAction::Load,
            _ => {
                pr_warn!(
                    "vGPU {}: VFIO migration arc {} -> {} is not supported\n",
                    id,
                    mig_state::name(cur),
                    mig_state::name(next)
                );
                return Err(EINVAL);
            }
        };
        Ok(action)
    }

    /// VFIO migration: the snapshot of a stopped vGPU into `out`; returns
    /// the bytes used.
    pub(crate) fn mig_save(&self, id: u32, out: &mut [u8]) -> Result<usize> {
        let vgpu = self.vgpu(id)?;
        let sim = vgpu.sim.lock();
        if !sim.vfio_stopped {
            return Err(EBUSY);
        }
        sim.save(out)
    }

    /// VFIO migration: loads a snapshot a VMM wrote into a stopped vGPU.
    /// A snapshot that does not check out is refused, the vGPU unchanged.
    pub(crate) fn mig_restore(&self, id: u32, bytes: &[u8]) -> Result {
        let vgpu = self.vgpu(id)?;
        let mut sim = vgpu.sim.lock();
        if !sim.vfio_stopped {
            return Err(EBUSY);
        }
        if let Err(e) = sim.restore(bytes) {
            pr_info!(
                "vGPU {}: VFIO migration: snapshot of {} bytes refused (error {}); the vGPU keeps its context\n",
                id,
                bytes.len(),
                e.to_errno()
            );
            return Err(e);
        }
        drop(sim);
        vgpu.event("restored by VFIO migration");
        Ok(())
    }

    /// VFIO migration state reset to RUNNING (close or device reset):
    /// VFIO's hold on the vGPU goes.
    pub(crate) fn mig_reset(&self, id: u32) {
        let Ok(vgpu) = self.vgpu(id) else { return };
        let mut sim = vgpu.sim.lock();
        if sim.vfio_stopped {
            sim.vfio_stopped = false;
            sim.resume(&vgpu.handle);
        }
    }

    /// The vGPU's work item ran.
    pub(crate) fn vgpu_tick(&self, id: u32) {
        let Ok(vgpu) = self.vgpu(id) else { return };
        vgpu.sim.lock().tick(&vgpu.handle);
    }

    /// Number of vGPUs now.
    pub(crate) fn vgpu_count(&self) -> usize {
        self.table.lock().slots.iter().flatten().count()
    }

    /// A copy of every vGPU's info, in creation (id) order, and how many
    /// vGPUs there are. Copies, so callers can fault on user memory without
    /// holding a lock.
    pub(crate) fn infos(&self) -> ([abi::HagVgpuInfo; MAX_VGPUS], usize) {
        let mut vgpus: [Option<Arc<Vgpu>>; MAX_VGPUS] = [const { None }; MAX_VGPUS];
        {
            let table = self.table.lock();
            for (out, slot) in vgpus.iter_mut().zip(table.slots.iter()) {
                *out = slot.clone();
            }
        }
        let mut infos = [abi::HagVgpuInfo::default(); MAX_VGPUS];
        let mut count = 0;
        for vgpu in vgpus.iter().flatten() {
            infos[count] = abi::HagVgpuInfo {
                id: vgpu.id,
                source: abi::VGPU_SOURCE_SIM,
                state: vgpu.sim.lock().vgpu_state(),
                reserved: 0,
                uuid: vgpu.uuid,
                gfx_mem_size: abi::SIM_GFX_MEM_SIZE,
            };
            count += 1;
        }
        infos[..count].sort_unstable_by_key(|info| info.id);
        (infos, count)
    }
}
