// SPDX-License-Identifier: GPL-2.0-only
//! The table of vGPUs and the module state that callbacks share.
//!
//! A vGPU enters the table when its mdev is probed and leaves it when the
//! mdev is removed; every change is announced on the netlink events group.
//! Ids are never reused while the module is loaded, so an id in an event or
//! an ioctl answer names one vGPU only.

use kernel::prelude::*;
use kernel::sync::Mutex;
use kernel::{new_mutex, pin_init};

use crate::abi;
use crate::events::Event;

/// One vGPU as the module tracks it.
#[derive(Clone, Copy)]
pub(crate) struct Vgpu {
    pub(crate) id: u32,
    pub(crate) uuid: [u8; 16],
    pub(crate) source: u32,
    pub(crate) state: u32,
    pub(crate) gfx_mem_size: u64,
}

impl Vgpu {
    /// The vGPU as the list ioctl reports it.
    pub(crate) fn info(&self) -> abi::HagVgpuInfo {
        abi::HagVgpuInfo {
            id: self.id,
            source: self.source,
            state: self.state,
            reserved: 0,
            uuid: self.uuid,
            gfx_mem_size: self.gfx_mem_size,
        }
    }
}

/// Most vGPUs the module tracks at once (simulated and GVT-g together).
pub(crate) const MAX_VGPUS: usize = 32;

/// Fixed slots: adding a vGPU never allocates, and removal is O(1).
struct Table {
    slots: [Option<Vgpu>; MAX_VGPUS],
    next_id: u32,
}

impl Table {
    fn vgpus(&self) -> impl Iterator<Item = &Vgpu> {
        self.slots.iter().flatten()
    }

    fn find_mut(&mut self, id: u32) -> Option<&mut Option<Vgpu>> {
        self.slots.iter_mut().find(|slot| slot.is_some_and(|v| v.id == id))
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
                Table { slots: [None; MAX_VGPUS], next_id: 1 },
                "hag_vgpu_table"
            ),
        })
    }

    /// Adds a simulated vGPU; returns its id.
    pub(crate) fn vgpu_created(&self, uuid: [u8; 16]) -> Result<u32> {
        let vgpu = {
            let mut table = self.table.lock();
            let id = table.next_id;
            let free = table.slots.iter().position(Option::is_none).ok_or(ENOSPC)?;
            table.next_id = id.checked_add(1).ok_or(ENOSPC)?;
            let vgpu = Vgpu {
                id,
                uuid,
                source: abi::VGPU_SOURCE_SIM,
                state: abi::VGPU_STATE_IDLE,
                gfx_mem_size: abi::SIM_GFX_MEM_SIZE,
            };
            table.slots[free] = Some(vgpu);
            vgpu
        };
        Event::new(abi::EVENT_VGPU_CREATED, &vgpu).send();
        Ok(vgpu.id)
    }

    /// Forgets a vGPU. Unknown ids are ignored: glue.c only passes ids that
    /// `vgpu_created` returned.
    pub(crate) fn vgpu_removed(&self, id: u32) {
        let removed = {
            let mut table = self.table.lock();
            table.find_mut(id).and_then(Option::take)
        };
        if let Some(vgpu) = removed {
            Event::new(abi::EVENT_VGPU_REMOVED, &vgpu).send();
        }
    }

    /// Records that a VMM opened (or closed) the vGPU's VFIO device.
    pub(crate) fn vgpu_opened(&self, id: u32, open: bool) {
        let changed = {
            let mut table = self.table.lock();
            table.find_mut(id).and_then(|slot| slot.as_mut()).map(|v| {
                v.state = if open { abi::VGPU_STATE_OPEN } else { abi::VGPU_STATE_IDLE };
                *v
            })
        };
        if let Some(vgpu) = changed {
            Event::new(abi::EVENT_STATE_CHANGED, &vgpu)
                .message(abi::state_name(vgpu.state))
                .send();
        }
    }

    /// Number of vGPUs now.
    pub(crate) fn vgpu_count(&self) -> usize {
        self.table.lock().vgpus().count()
    }

    /// A copy of every vGPU's info, in creation (id) order, and how many
    /// vGPUs there are. Copies, so callers can fault on user memory without
    /// holding the table lock.
    pub(crate) fn infos(&self) -> ([abi::HagVgpuInfo; MAX_VGPUS], usize) {
        let mut infos = [abi::HagVgpuInfo::default(); MAX_VGPUS];
        let table = self.table.lock();
        let mut count = 0;
        for (out, vgpu) in infos.iter_mut().zip(table.vgpus()) {
            *out = vgpu.info();
            count += 1;
        }
        infos[..count].sort_unstable_by_key(|info| info.id);
        (infos, count)
    }
}
