// SPDX-License-Identifier: GPL-2.0-only
//! `/dev/hag` ioctls.
//!
//! Each ioctl reads its argument structure from userspace once, checks it
//! and answers; user addresses and sizes are never trusted (the kernel's
//! user-copy routines fault cleanly on a bad address, and the list ioctl
//! caps how much it writes at what the caller said it has room for).

use kernel::prelude::*;
use kernel::types::{AsBytes, FromBytes};
use kernel::uaccess::UserSlice;

use crate::abi;
use crate::State;

/// Dispatches one ioctl. Unknown commands get `ENOTTY`, as the kernel's
/// convention for "not my ioctl" asks.
pub(crate) fn ioctl(state: &State, cmd: u32, arg: usize) -> Result {
    match cmd {
        abi::IOC_VERSION => version(state, arg),
        abi::IOC_LIST_VGPUS => list_vgpus(state, arg),
        _ => Err(ENOTTY),
    }
}

fn version(state: &State, arg: usize) -> Result {
    let mut answer = abi::HagVersion {
        abi_version: abi::ABI_VERSION,
        features: abi::FEATURE_SIM_VGPU,
        vgpu_count: u32::try_from(state.vgpu_count()).unwrap_or(u32::MAX),
        ..Default::default()
    };
    let version = crate::MODULE_VERSION.as_bytes();
    // Always leaves at least one NUL at the end.
    let len = version.len().min(answer.module_version.len() - 1);
    answer.module_version[..len].copy_from_slice(&version[..len]);
    write_user(arg, &answer)
}

fn list_vgpus(state: &State, arg: usize) -> Result {
    let mut request: abi::HagVgpuList = read_user(arg)?;
    if request.capacity > abi::LIST_MAX_CAPACITY {
        return Err(EINVAL);
    }
    let entries = usize::try_from(request.entries).map_err(|_| EINVAL)?;
    let entry_size = core::mem::size_of::<abi::HagVgpuInfo>();

    let (infos, count) = state.infos();
    request.count = u32::try_from(count).unwrap_or(u32::MAX);
    let room = usize::try_from(request.capacity).unwrap_or(usize::MAX);
    for (i, info) in infos.iter().take(count.min(room)).enumerate() {
        let addr = i
            .checked_mul(entry_size)
            .and_then(|offset| entries.checked_add(offset))
            .ok_or(EFAULT)?;
        write_user(addr, info)?;
    }
    write_user(arg, &request)
}

fn read_user<T: FromBytes>(addr: usize) -> Result<T> {
    UserSlice::new(addr, core::mem::size_of::<T>()).reader().read()
}

fn write_user<T: AsBytes>(addr: usize, value: &T) -> Result {
    UserSlice::new(addr, core::mem::size_of::<T>()).writer().write(value)
}
