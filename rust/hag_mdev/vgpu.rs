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
use kernel::uaccess::UserSlice;
use kernel::{new_mutex, pin_init};

use crate::abi;
use crate::dirty::DirtyLog;
use crate::events::Event;
use crate::glue::VgpuHandle;
use crate::sim::{vfio, Sim};

/// Most vGPUs the module tracks at once (simulated and GVT-g together).
pub(crate) const MAX_VGPUS: usize = 32;

/// One vGPU: its C side and its simulated device.
#[pin_data]
pub(crate) struct Vgpu {
    pub(crate) id: u32,
    pub(crate) uuid: [u8; 16],
    pub(crate) handle: VgpuHandle,
    #[pin]
    pub(crate) sim: Mutex<Sim>,
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
        self.vgpu(id)?.sim.lock().start_vfio_dirty_log(log);
        Ok(())
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
        Ok(())
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
