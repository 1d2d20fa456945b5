// SPDX-License-Identifier: GPL-2.0-only
//! The VFIO device ioctls of a `hag-sim` vGPU, as vfio-pci answers them
//! (`include/uapi/linux/vfio.h`): device, region and IRQ info, MSI through
//! an eventfd, reset.
//!
//! Each ioctl reads the fixed part of its argument once, checks `argsz`
//! and every field, then answers; nothing the VMM passes is trusted, and
//! the VMM's memory is never touched with the vGPU's lock held ([`Ioctl`]).

use kernel::prelude::*;
use kernel::uaccess::UserSlice;

use super::Sim;
use crate::sim_regs as r;
use crate::glue::EventFd;

const VFIO_TYPE: u32 = b';' as u32;
const VFIO_BASE: u32 = 100;
const fn vfio_io(nr: u32) -> u32 {
    (VFIO_TYPE << 8) | (VFIO_BASE + nr)
}
const VFIO_DEVICE_GET_INFO: u32 = vfio_io(7);
const VFIO_DEVICE_GET_REGION_INFO: u32 = vfio_io(8);
const VFIO_DEVICE_GET_IRQ_INFO: u32 = vfio_io(9);
const VFIO_DEVICE_SET_IRQS: u32 = vfio_io(10);
pub(crate) const VFIO_DEVICE_RESET: u32 = vfio_io(11);

const VFIO_DEVICE_FLAGS_RESET: u32 = 1 << 0;
const VFIO_DEVICE_FLAGS_PCI: u32 = 1 << 1;
const VFIO_REGION_INFO_FLAG_READ: u32 = 1 << 0;
const VFIO_REGION_INFO_FLAG_WRITE: u32 = 1 << 1;
const VFIO_IRQ_INFO_EVENTFD: u32 = 1 << 0;
const VFIO_IRQ_INFO_NORESIZE: u32 = 1 << 3;
const VFIO_IRQ_SET_DATA_NONE: u32 = 1 << 0;
const VFIO_IRQ_SET_DATA_BOOL: u32 = 1 << 1;
const VFIO_IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;
const VFIO_IRQ_SET_ACTION_TRIGGER: u32 = 1 << 5;
const VFIO_IRQ_SET_DATA_TYPE_MASK: u32 = 0x7;
const VFIO_IRQ_SET_ACTION_TYPE_MASK: u32 = 0x38;
/// vfio-pci's region and IRQ counts (BAR0-5, ROM, config, VGA; INTx, MSI,
/// MSI-X, ERR, REQ).
const VFIO_PCI_NUM_REGIONS: u32 = 9;
const VFIO_PCI_NUM_IRQS: u32 = 5;
const VFIO_PCI_MSI_IRQ_INDEX: u32 = 1;

/// `enum vfio_device_mig_state`: the states of VFIO migration v2 that
/// `VFIO_MIGRATION_STOP_COPY` alone uses.
pub(crate) mod mig_state {
    /// Stopped: no submission runs, the context may be saved or loaded.
    pub(crate) const STOP: u32 = 1;
    /// Running normally.
    pub(crate) const RUNNING: u32 = 2;
    /// Stopped, the snapshot is being read out.
    pub(crate) const STOP_COPY: u32 = 3;
    /// Stopped, a snapshot is being written in.
    pub(crate) const RESUMING: u32 = 4;

    /// The state's uapi name, for messages.
    pub(crate) fn name(state: u32) -> &'static str {
        match state {
            0 => "ERROR",
            STOP => "STOP",
            RUNNING => "RUNNING",
            STOP_COPY => "STOP_COPY",
            RESUMING => "RESUMING",
            5 => "RUNNING_P2P",
            6 => "PRE_COPY",
            7 => "PRE_COPY_P2P",
            _ => "unknown",
        }
    }
}

pub(crate) use crate::glue::uapi::{DeviceInfo, IrqInfo, IrqSet, RegionInfo};

/// Reads the fixed part `T` of an ioctl argument and checks `argsz`, its
/// first field, covers it.
fn read_arg<T: kernel::types::FromBytes>(arg: usize, argsz: impl Fn(&T) -> u32) -> Result<T> {
    let value: T = UserSlice::new(arg, core::mem::size_of::<T>()).reader().read()?;
    if (argsz(&value) as usize) < core::mem::size_of::<T>() {
        return Err(EINVAL);
    }
    Ok(value)
}

fn write_arg<T: kernel::types::AsBytes>(arg: usize, value: &T) -> Result<i64> {
    UserSlice::new(arg, core::mem::size_of::<T>()).writer().write(value)?;
    Ok(0)
}

/// A VFIO device ioctl with its argument read in: what it changes on the
/// vGPU and what it answers. Reading the argument (and writing the answer)
/// may fault on the VMM's memory, which a userfaultfd or FUSE mapping can
/// make last forever, so both happen without the vGPU's lock: only
/// [`Ioctl::apply`] takes it.
pub(crate) struct Ioctl {
    change: Change,
    reply: Reply,
}

/// What an ioctl changes on the vGPU.
enum Change {
    Nothing,
    Reset,
    SetMsi(Option<EventFd>),
}

/// What an ioctl writes back into its argument.
pub(crate) enum Reply {
    Nothing,
    Device(DeviceInfo),
    Region(RegionInfo),
    Irq(IrqInfo),
}

impl Ioctl {
    /// Reads and checks the argument of `cmd` at `arg`.
    pub(crate) fn read(cmd: u32, arg: usize) -> Result<Self> {
        let answer = |reply| Ok(Self { change: Change::Nothing, reply });
        match cmd {
            VFIO_DEVICE_GET_INFO => {
                let mut info: DeviceInfo = read_arg(arg, |i: &DeviceInfo| i.argsz)?;
                info.flags = VFIO_DEVICE_FLAGS_PCI | VFIO_DEVICE_FLAGS_RESET;
                info.num_regions = VFIO_PCI_NUM_REGIONS;
                info.num_irqs = VFIO_PCI_NUM_IRQS;
                answer(Reply::Device(info))
            }
            VFIO_DEVICE_GET_REGION_INFO => {
                let mut info: RegionInfo = read_arg(arg, |i: &RegionInfo| i.argsz)?;
                if info.index >= VFIO_PCI_NUM_REGIONS {
                    return Err(EINVAL);
                }
                let rw = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
                (info.size, info.flags) = match info.index {
                    r::BAR0_REGION => (r::BAR0_SIZE, rw),
                    r::CONFIG_REGION => (r::CONFIG_SIZE, rw),
                    _ => (0, 0),
                };
                info.offset = u64::from(info.index) << r::REGION_SHIFT;
                info.cap_offset = 0;
                answer(Reply::Region(info))
            }
            VFIO_DEVICE_GET_IRQ_INFO => {
                let mut info: IrqInfo = read_arg(arg, |i: &IrqInfo| i.argsz)?;
                if info.index >= VFIO_PCI_NUM_IRQS {
                    return Err(EINVAL);
                }
                (info.flags, info.count) = if info.index == VFIO_PCI_MSI_IRQ_INDEX {
                    (VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_NORESIZE, 1)
                } else {
                    (0, 0)
                };
                answer(Reply::Irq(info))
            }
            VFIO_DEVICE_SET_IRQS => {
                let set: IrqSet = read_arg(arg, |s: &IrqSet| s.argsz)?;
                Ok(Self {
                    change: read_set_irqs(arg, &set)?,
                    reply: Reply::Nothing,
                })
            }
            VFIO_DEVICE_RESET => Ok(Self {
                change: Change::Reset,
                reply: Reply::Nothing,
            }),
            _ => Err(ENOTTY),
        }
    }

    /// Carries the ioctl out on the vGPU (its lock held); returns the
    /// answer, to be written once the lock is let go.
    pub(crate) fn apply(self, sim: &mut Sim) -> Reply {
        match self.change {
            Change::Nothing => {}
            Change::Reset => sim.reset_engine(),
            Change::SetMsi(msi) => sim.set_msi(msi),
        }
        self.reply
    }
}

impl Reply {
    /// Writes the answer into the ioctl's argument at `arg`.
    pub(crate) fn write(self, arg: usize) -> Result<i64> {
        match self {
            Reply::Nothing => Ok(0),
            Reply::Device(info) => write_arg(arg, &info),
            Reply::Region(info) => write_arg(arg, &info),
            Reply::Irq(info) => write_arg(arg, &info),
        }
    }
}

/// MSI only: trigger with an eventfd (fd -1 or DATA_NONE with count 0
/// disables), or trigger now with DATA_NONE / DATA_BOOL (for testing).
fn read_set_irqs(arg: usize, set: &IrqSet) -> Result<Change> {
    let data_type = set.flags & VFIO_IRQ_SET_DATA_TYPE_MASK;
    let action = set.flags & VFIO_IRQ_SET_ACTION_TYPE_MASK;
    if set.flags & !(VFIO_IRQ_SET_DATA_TYPE_MASK | VFIO_IRQ_SET_ACTION_TYPE_MASK) != 0
        || data_type.count_ones() != 1
        || action != VFIO_IRQ_SET_ACTION_TRIGGER
        || set.index != VFIO_PCI_MSI_IRQ_INDEX
        || set.start != 0
        || set.count > 1
    {
        return Err(EINVAL);
    }
    match data_type {
        VFIO_IRQ_SET_DATA_NONE if set.count == 0 => Ok(Change::SetMsi(None)),
        VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_DATA_BOOL => Ok(Change::Nothing),
        VFIO_IRQ_SET_DATA_EVENTFD if set.count == 1 => {
            if (set.argsz as usize) < core::mem::size_of::<IrqSet>() + 4 {
                return Err(EINVAL);
            }
            let fd_addr = arg.checked_add(core::mem::size_of::<IrqSet>()).ok_or(EFAULT)?;
            let fd: i32 = UserSlice::new(fd_addr, 4).reader().read()?;
            Ok(Change::SetMsi(if fd < 0 { None } else { Some(EventFd::from_fd(fd)?) }))
        }
        VFIO_IRQ_SET_DATA_EVENTFD => Ok(Change::SetMsi(None)),
        _ => Err(EINVAL),
    }
}
