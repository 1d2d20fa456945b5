//! The VFIO user API that hag-vmm uses, from `include/uapi/linux/vfio.h` of
//! Linux 6.12: ioctl numbers, flags and `#[repr(C)]` structures (with layout
//! tests), and a thin wrapper per ioctl.
//!
//! This file holds hag-vmm's VFIO `unsafe` blocks (but for the one ioctl its
//! migration check adds; the guest RAM mapping's are in the `guest-ram`
//! crate). Each wrapper takes a live, correctly typed argument, so callers
//! stay safe; errors come back as [`Errno`] for [`crate::vfio`] to name.

use std::ffi::CStr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

/// `VFIO_API_VERSION`.
pub const VFIO_API_VERSION: i32 = 0;
/// `VFIO_TYPE1_IOMMU` extension / IOMMU type.
pub const VFIO_TYPE1_IOMMU: u32 = 1;
/// `VFIO_TYPE1v2_IOMMU` extension / IOMMU type.
pub const VFIO_TYPE1V2_IOMMU: u32 = 3;

/// `VFIO_GROUP_FLAGS_VIABLE`: every device of the group is bound to a VFIO
/// driver.
pub const VFIO_GROUP_FLAGS_VIABLE: u32 = 1 << 0;
/// `VFIO_GROUP_FLAGS_CONTAINER_SET`.
pub const VFIO_GROUP_FLAGS_CONTAINER_SET: u32 = 1 << 1;

/// `VFIO_DEVICE_FLAGS_RESET`.
pub const VFIO_DEVICE_FLAGS_RESET: u32 = 1 << 0;
/// `VFIO_DEVICE_FLAGS_PCI`: a vfio-pci (API) device.
pub const VFIO_DEVICE_FLAGS_PCI: u32 = 1 << 1;

/// `VFIO_REGION_INFO_FLAG_READ`.
pub const VFIO_REGION_INFO_FLAG_READ: u32 = 1 << 0;
/// `VFIO_REGION_INFO_FLAG_WRITE`.
pub const VFIO_REGION_INFO_FLAG_WRITE: u32 = 1 << 1;
/// `VFIO_REGION_INFO_FLAG_MMAP`.
pub const VFIO_REGION_INFO_FLAG_MMAP: u32 = 1 << 2;

/// `VFIO_IRQ_INFO_EVENTFD`.
pub const VFIO_IRQ_INFO_EVENTFD: u32 = 1 << 0;

/// `VFIO_IRQ_SET_DATA_NONE`.
pub const VFIO_IRQ_SET_DATA_NONE: u32 = 1 << 0;
/// `VFIO_IRQ_SET_DATA_EVENTFD`.
pub const VFIO_IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;
/// `VFIO_IRQ_SET_ACTION_TRIGGER`.
pub const VFIO_IRQ_SET_ACTION_TRIGGER: u32 = 1 << 5;

/// `VFIO_PCI_BAR0_REGION_INDEX`.
pub const VFIO_PCI_BAR0_REGION_INDEX: u32 = 0;
/// `VFIO_PCI_CONFIG_REGION_INDEX`.
pub const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;
/// `VFIO_PCI_MSI_IRQ_INDEX`.
pub const VFIO_PCI_MSI_IRQ_INDEX: u32 = 1;

/// `VFIO_DMA_MAP_FLAG_READ`.
pub const VFIO_DMA_MAP_FLAG_READ: u32 = 1 << 0;
/// `VFIO_DMA_MAP_FLAG_WRITE`.
pub const VFIO_DMA_MAP_FLAG_WRITE: u32 = 1 << 1;

/// `VFIO_TYPE`, the ioctl type byte `';'`.
const VFIO_TYPE: u8 = b';';
/// `VFIO_BASE`.
const VFIO_BASE: u8 = 100;

/// `_IO(VFIO_TYPE, VFIO_BASE + n)`: every VFIO ioctl is encoded without a
/// size (the structures carry `argsz` instead).
pub const fn vfio_io(n: u8) -> u32 {
    ((VFIO_TYPE as u32) << 8) | (VFIO_BASE as u32 + n as u32)
}

/// `VFIO_GET_API_VERSION` (container).
pub const VFIO_GET_API_VERSION: u32 = vfio_io(0);
/// `VFIO_CHECK_EXTENSION` (container).
pub const VFIO_CHECK_EXTENSION: u32 = vfio_io(1);
/// `VFIO_SET_IOMMU` (container).
pub const VFIO_SET_IOMMU: u32 = vfio_io(2);
/// `VFIO_GROUP_GET_STATUS` (group).
pub const VFIO_GROUP_GET_STATUS: u32 = vfio_io(3);
/// `VFIO_GROUP_SET_CONTAINER` (group).
pub const VFIO_GROUP_SET_CONTAINER: u32 = vfio_io(4);
/// `VFIO_GROUP_UNSET_CONTAINER` (group).
pub const VFIO_GROUP_UNSET_CONTAINER: u32 = vfio_io(5);
/// `VFIO_GROUP_GET_DEVICE_FD` (group).
pub const VFIO_GROUP_GET_DEVICE_FD: u32 = vfio_io(6);
/// `VFIO_DEVICE_GET_INFO` (device).
pub const VFIO_DEVICE_GET_INFO: u32 = vfio_io(7);
/// `VFIO_DEVICE_GET_REGION_INFO` (device).
pub const VFIO_DEVICE_GET_REGION_INFO: u32 = vfio_io(8);
/// `VFIO_DEVICE_GET_IRQ_INFO` (device).
pub const VFIO_DEVICE_GET_IRQ_INFO: u32 = vfio_io(9);
/// `VFIO_DEVICE_SET_IRQS` (device).
pub const VFIO_DEVICE_SET_IRQS: u32 = vfio_io(10);
/// `VFIO_DEVICE_RESET` (device).
pub const VFIO_DEVICE_RESET: u32 = vfio_io(11);
/// `VFIO_IOMMU_MAP_DMA` (container, type1).
pub const VFIO_IOMMU_MAP_DMA: u32 = vfio_io(13);
/// `VFIO_IOMMU_UNMAP_DMA` (container, type1).
pub const VFIO_IOMMU_UNMAP_DMA: u32 = vfio_io(14);

/// `struct vfio_group_status`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioGroupStatus {
    /// Size of this structure.
    pub argsz: u32,
    /// `VFIO_GROUP_FLAGS_*`.
    pub flags: u32,
}

/// `struct vfio_device_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioDeviceInfo {
    /// Size of this structure.
    pub argsz: u32,
    /// `VFIO_DEVICE_FLAGS_*`.
    pub flags: u32,
    /// Highest region index + 1.
    pub num_regions: u32,
    /// Highest IRQ index + 1.
    pub num_irqs: u32,
    /// Offset of the first capability.
    pub cap_offset: u32,
    /// Padding.
    pub pad: u32,
}

/// `struct vfio_region_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioRegionInfo {
    /// Size of this structure.
    pub argsz: u32,
    /// `VFIO_REGION_INFO_FLAG_*`.
    pub flags: u32,
    /// In: the region index.
    pub index: u32,
    /// Offset of the first capability.
    pub cap_offset: u32,
    /// Region size in bytes.
    pub size: u64,
    /// Region offset in the device fd.
    pub offset: u64,
}

/// `struct vfio_irq_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioIrqInfo {
    /// Size of this structure.
    pub argsz: u32,
    /// `VFIO_IRQ_INFO_*`.
    pub flags: u32,
    /// In: the IRQ index.
    pub index: u32,
    /// Number of IRQs in the index.
    pub count: u32,
}

/// `struct vfio_irq_set` with a one-element `__s32 data[]`: one eventfd for
/// sub-index `start`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioIrqSetEventfd {
    /// Size of this structure including `data`.
    pub argsz: u32,
    /// `VFIO_IRQ_SET_DATA_* | VFIO_IRQ_SET_ACTION_*`.
    pub flags: u32,
    /// IRQ index.
    pub index: u32,
    /// First sub-index.
    pub start: u32,
    /// Number of sub-indexes (1, or 0 to disable the index).
    pub count: u32,
    /// The eventfd (-1 to de-assign).
    pub fd: i32,
}

/// `struct vfio_iommu_type1_dma_map`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioDmaMap {
    /// Size of this structure.
    pub argsz: u32,
    /// `VFIO_DMA_MAP_FLAG_*`.
    pub flags: u32,
    /// Process virtual address.
    pub vaddr: u64,
    /// IO virtual address (guest physical, as QEMU maps it).
    pub iova: u64,
    /// Bytes.
    pub size: u64,
}

/// `struct vfio_iommu_type1_dma_unmap` (without the `data[]` of the
/// dirty-bitmap form).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioDmaUnmap {
    /// Size of this structure.
    pub argsz: u32,
    /// `VFIO_DMA_UNMAP_FLAG_*`.
    pub flags: u32,
    /// IO virtual address.
    pub iova: u64,
    /// Bytes.
    pub size: u64,
}

/// `VFIO_DEVICE_FEATURE` (device): `_IO(VFIO_TYPE, VFIO_BASE + 17)`.
pub const VFIO_DEVICE_FEATURE: u32 = vfio_io(17);
/// `VFIO_DEVICE_FEATURE_GET`: get the feature into `data[]`.
pub const VFIO_DEVICE_FEATURE_GET: u32 = 1 << 16;
/// `VFIO_DEVICE_FEATURE_SET`: set the feature from `data[]`.
pub const VFIO_DEVICE_FEATURE_SET: u32 = 1 << 17;
/// `VFIO_DEVICE_FEATURE_PROBE`: only ask whether the feature is supported.
pub const VFIO_DEVICE_FEATURE_PROBE: u32 = 1 << 18;
/// `VFIO_DEVICE_FEATURE_DMA_LOGGING_START` (SET).
pub const VFIO_DEVICE_FEATURE_DMA_LOGGING_START: u32 = 6;
/// `VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP` (SET).
pub const VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP: u32 = 7;
/// `VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT` (GET).
pub const VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT: u32 = 8;

/// `struct vfio_device_feature` (the header; `data[]` follows).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioDeviceFeature {
    /// Size of the header plus the data that follows.
    pub argsz: u32,
    /// Feature index (`VFIO_DEVICE_FEATURE_MASK`) and GET / SET / PROBE.
    pub flags: u32,
}

/// `struct vfio_device_feature` followed by one feature structure as its
/// `data[]` (at offset 8: every feature structure is at most 8-aligned).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioDeviceFeatureWith<T> {
    /// The header; `argsz` covers `data`.
    pub header: VfioDeviceFeature,
    /// The feature's data.
    pub data: T,
}

/// `struct vfio_device_feature_dma_logging_control`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioDmaLoggingControl {
    /// In: the tracking granularity hinted; out: the one the device chose.
    pub page_size: u64,
    /// Entries at `ranges`.
    pub num_ranges: u32,
    /// `__reserved`.
    pub reserved: u32,
    /// User pointer to `num_ranges` [`VfioDmaLoggingRange`]s.
    pub ranges: u64,
}

/// `struct vfio_device_feature_dma_logging_range`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioDmaLoggingRange {
    /// First IOVA, aligned to the page size.
    pub iova: u64,
    /// Bytes, a multiple of the page size.
    pub length: u64,
}

/// `struct vfio_device_feature_dma_logging_report`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioDmaLoggingReport {
    /// First IOVA asked about.
    pub iova: u64,
    /// Bytes asked about.
    pub length: u64,
    /// Bytes per bit of the bitmap (a power of two, at least 4096).
    pub page_size: u64,
    /// User pointer to the `u64` bitmap, one bit per `page_size` of IOVA.
    pub bitmap: u64,
}

/// `argsz` of a structure: its size.
pub const fn argsz<T>() -> u32 {
    core::mem::size_of::<T>() as u32
}

mod raw {
    use super::*;

    nix::ioctl_none_bad!(get_api_version, VFIO_GET_API_VERSION);
    nix::ioctl_write_int_bad!(check_extension, VFIO_CHECK_EXTENSION);
    nix::ioctl_write_int_bad!(set_iommu, VFIO_SET_IOMMU);
    nix::ioctl_readwrite_bad!(group_get_status, VFIO_GROUP_GET_STATUS, VfioGroupStatus);
    nix::ioctl_write_ptr_bad!(group_set_container, VFIO_GROUP_SET_CONTAINER, i32);
    nix::ioctl_none_bad!(group_unset_container, VFIO_GROUP_UNSET_CONTAINER);
    nix::ioctl_write_ptr_bad!(
        group_get_device_fd,
        VFIO_GROUP_GET_DEVICE_FD,
        core::ffi::c_char
    );
    nix::ioctl_readwrite_bad!(device_get_info, VFIO_DEVICE_GET_INFO, VfioDeviceInfo);
    nix::ioctl_readwrite_bad!(
        device_get_region_info,
        VFIO_DEVICE_GET_REGION_INFO,
        VfioRegionInfo
    );
    nix::ioctl_readwrite_bad!(device_get_irq_info, VFIO_DEVICE_GET_IRQ_INFO, VfioIrqInfo);
    nix::ioctl_write_ptr_bad!(device_set_irqs, VFIO_DEVICE_SET_IRQS, VfioIrqSetEventfd);
    nix::ioctl_none_bad!(device_reset, VFIO_DEVICE_RESET);
    nix::ioctl_write_ptr_bad!(iommu_map_dma, VFIO_IOMMU_MAP_DMA, VfioDmaMap);
    nix::ioctl_readwrite_bad!(iommu_unmap_dma, VFIO_IOMMU_UNMAP_DMA, VfioDmaUnmap);
}

/// `VFIO_GET_API_VERSION` on a container fd.
pub fn get_api_version(container: BorrowedFd<'_>) -> Result<i32, Errno> {
    // SAFETY: the ioctl takes no argument; `container` is an open fd for the
    // duration of the call.
    unsafe { raw::get_api_version(container.as_raw_fd()) }
}

/// `VFIO_CHECK_EXTENSION`: whether the container supports `ext`.
pub fn check_extension(container: BorrowedFd<'_>, ext: u32) -> Result<bool, Errno> {
    // SAFETY: the argument is passed by value (an integer), not a pointer;
    // `container` is open for the duration of the call.
    let r = unsafe { raw::check_extension(container.as_raw_fd(), ext as _) }?;
    Ok(r > 0)
}

/// `VFIO_SET_IOMMU` to IOMMU type `kind`.
pub fn set_iommu(container: BorrowedFd<'_>, kind: u32) -> Result<(), Errno> {
    // SAFETY: the argument is an integer passed by value; `container` is
    // open for the duration of the call.
    unsafe { raw::set_iommu(container.as_raw_fd(), kind as _) }?;
    Ok(())
}

/// `VFIO_GROUP_GET_STATUS`.
pub fn group_get_status(group: BorrowedFd<'_>) -> Result<VfioGroupStatus, Errno> {
    let mut status = VfioGroupStatus {
        argsz: argsz::<VfioGroupStatus>(),
        flags: 0,
    };
    // SAFETY: `status` is a live, writable `vfio_group_status` whose `argsz`
    // says its true size, so the kernel writes only inside it; `group` is
    // open for the duration of the call.
    unsafe { raw::group_get_status(group.as_raw_fd(), &mut status) }?;
    Ok(status)
}

/// `VFIO_GROUP_SET_CONTAINER`: attaches the group to `container`.
pub fn group_set_container(group: BorrowedFd<'_>, container: BorrowedFd<'_>) -> Result<(), Errno> {
    let fd: RawFd = container.as_raw_fd();
    // SAFETY: the kernel reads one `int` (the container fd) through the
    // pointer, which points at the live local `fd`; both fds are open for
    // the duration of the call.
    unsafe { raw::group_set_container(group.as_raw_fd(), &fd) }?;
    Ok(())
}

/// `VFIO_GROUP_UNSET_CONTAINER`.
pub fn group_unset_container(group: BorrowedFd<'_>) -> Result<(), Errno> {
    // SAFETY: no argument; `group` is open for the duration of the call.
    unsafe { raw::group_unset_container(group.as_raw_fd()) }?;
    Ok(())
}

/// `VFIO_GROUP_GET_DEVICE_FD`: opens the device named `name` (for an mdev,
/// its UUID).
pub fn group_get_device_fd(group: BorrowedFd<'_>, name: &CStr) -> Result<OwnedFd, Errno> {
    // SAFETY: `name` is a NUL-terminated string that lives across the call;
    // the kernel reads it up to the NUL. `group` is open for the call.
    let fd = unsafe { raw::group_get_device_fd(group.as_raw_fd(), name.as_ptr()) }?;
    // SAFETY: on success the ioctl returns a new file descriptor that
    // nothing else owns; it is wrapped exactly once.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `VFIO_DEVICE_GET_INFO`.
pub fn device_get_info(device: BorrowedFd<'_>) -> Result<VfioDeviceInfo, Errno> {
    let mut info = VfioDeviceInfo {
        argsz: argsz::<VfioDeviceInfo>(),
        ..VfioDeviceInfo::default()
    };
    // SAFETY: `info` is a live, writable `vfio_device_info` and its `argsz`
    // is its true size, so the kernel writes only inside it (a capability
    // chain that does not fit is not copied); `device` is open.
    unsafe { raw::device_get_info(device.as_raw_fd(), &mut info) }?;
    Ok(info)
}

/// `VFIO_DEVICE_GET_REGION_INFO` of region `index`.
pub fn device_get_region_info(device: BorrowedFd<'_>, index: u32) -> Result<VfioRegionInfo, Errno> {
    let mut info = VfioRegionInfo {
        argsz: argsz::<VfioRegionInfo>(),
        index,
        ..VfioRegionInfo::default()
    };
    // SAFETY: as for `device_get_info`: a live, writable structure whose
    // `argsz` is its true size; `device` is open for the call.
    unsafe { raw::device_get_region_info(device.as_raw_fd(), &mut info) }?;
    Ok(info)
}

/// `VFIO_DEVICE_GET_IRQ_INFO` of IRQ index `index`.
pub fn device_get_irq_info(device: BorrowedFd<'_>, index: u32) -> Result<VfioIrqInfo, Errno> {
    let mut info = VfioIrqInfo {
        argsz: argsz::<VfioIrqInfo>(),
        index,
        ..VfioIrqInfo::default()
    };
    // SAFETY: a live, writable `vfio_irq_info` whose `argsz` is its true
    // size; `device` is open for the call.
    unsafe { raw::device_get_irq_info(device.as_raw_fd(), &mut info) }?;
    Ok(info)
}

/// `VFIO_DEVICE_SET_IRQS` with `DATA_EVENTFD | ACTION_TRIGGER`: sub-index 0
/// of IRQ index `index` signals `eventfd`.
pub fn device_set_irq_eventfd(
    device: BorrowedFd<'_>,
    index: u32,
    eventfd: BorrowedFd<'_>,
) -> Result<(), Errno> {
    let set = VfioIrqSetEventfd {
        argsz: argsz::<VfioIrqSetEventfd>(),
        flags: VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
        index,
        start: 0,
        count: 1,
        fd: eventfd.as_raw_fd(),
    };
    // SAFETY: `set` is a live `vfio_irq_set` followed by exactly `count` (1)
    // `__s32` of data, and `argsz` covers both; the kernel only reads it.
    // Both fds are open for the call (the kernel takes its own reference to
    // the eventfd).
    unsafe { raw::device_set_irqs(device.as_raw_fd(), &set) }?;
    Ok(())
}

/// `VFIO_DEVICE_SET_IRQS` with `DATA_NONE | ACTION_TRIGGER`, `count` 0:
/// disables IRQ index `index`.
pub fn device_disable_irq(device: BorrowedFd<'_>, index: u32) -> Result<(), Errno> {
    let set = VfioIrqSetEventfd {
        // No data follows when count is 0.
        argsz: argsz::<VfioIrqSetEventfd>() - 4,
        flags: VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
        index,
        start: 0,
        count: 0,
        fd: -1,
    };
    // SAFETY: `set` is a live structure at least `argsz` bytes long; the
    // kernel only reads it. `device` is open for the call.
    unsafe { raw::device_set_irqs(device.as_raw_fd(), &set) }?;
    Ok(())
}

/// `VFIO_DEVICE_RESET`.
pub fn device_reset(device: BorrowedFd<'_>) -> Result<(), Errno> {
    // SAFETY: no argument; `device` is open for the call.
    unsafe { raw::device_reset(device.as_raw_fd()) }?;
    Ok(())
}

/// `VFIO_IOMMU_MAP_DMA` of `size` bytes at process address `vaddr` to
/// `iova`, readable and writable by the device.
///
/// The caller keeps the memory mapped until it is unmapped again (VFIO pins
/// the pages; unmapping the process memory first only leaves them pinned).
pub fn iommu_map_dma(
    container: BorrowedFd<'_>,
    vaddr: u64,
    iova: u64,
    size: u64,
) -> Result<(), Errno> {
    let map = VfioDmaMap {
        argsz: argsz::<VfioDmaMap>(),
        flags: VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
        vaddr,
        iova,
        size,
    };
    // SAFETY: `map` is a live `vfio_iommu_type1_dma_map` that the kernel
    // only reads. The kernel validates `vaddr..vaddr+size` against this
    // process's mappings itself (it pins them with the user's permissions),
    // so a wrong address is an error, not memory unsafety here.
    unsafe { raw::iommu_map_dma(container.as_raw_fd(), &map) }?;
    Ok(())
}

/// `VFIO_IOMMU_UNMAP_DMA` of `[iova, iova + size)`.
pub fn iommu_unmap_dma(container: BorrowedFd<'_>, iova: u64, size: u64) -> Result<(), Errno> {
    let mut unmap = VfioDmaUnmap {
        argsz: argsz::<VfioDmaUnmap>(),
        flags: 0,
        iova,
        size,
    };
    // SAFETY: `unmap` is a live, writable `vfio_iommu_type1_dma_unmap`
    // whose `argsz` is its true size (the kernel writes back `size`).
    unsafe { raw::iommu_unmap_dma(container.as_raw_fd(), &mut unmap) }?;
    Ok(())
}

/// `VFIO_DEVICE_FEATURE` with `arg` (header and data), read and written
/// by the kernel.
///
/// # Safety
///
/// Every user pointer inside `arg.data` must be valid for what the feature
/// does with it (read or write) for the duration of the call.
unsafe fn device_feature<T>(
    device: BorrowedFd<'_>,
    arg: &mut VfioDeviceFeatureWith<T>,
) -> Result<(), Errno> {
    // SAFETY: `arg` is a live, writable `vfio_device_feature` followed by
    // its data, and `argsz` (set by every caller to the size of the whole
    // structure) bounds what the kernel reads and writes; `device` is open
    // for the call. Pointers inside the data are the caller's promise.
    let ret = unsafe {
        nix::libc::ioctl(
            device.as_raw_fd(),
            VFIO_DEVICE_FEATURE as _,
            core::ptr::from_mut(arg),
        )
    };
    Errno::result(ret).map(drop)
}

/// `VFIO_DEVICE_FEATURE_DMA_LOGGING_START` (SET) over `ranges`, hinting
/// `page_size`; returns the page size the device chose.
pub fn dma_logging_start(
    device: BorrowedFd<'_>,
    ranges: &[VfioDmaLoggingRange],
    page_size: u64,
) -> Result<u64, Errno> {
    let num_ranges = u32::try_from(ranges.len()).map_err(|_| Errno::E2BIG)?;
    let mut arg = VfioDeviceFeatureWith {
        header: VfioDeviceFeature {
            argsz: argsz::<VfioDeviceFeatureWith<VfioDmaLoggingControl>>(),
            flags: VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_DMA_LOGGING_START,
        },
        data: VfioDmaLoggingControl {
            page_size,
            num_ranges,
            reserved: 0,
            ranges: ranges.as_ptr() as u64,
        },
    };
    // SAFETY: `data.ranges` points at `ranges`, `num_ranges` live
    // `vfio_device_feature_dma_logging_range`s that the kernel only reads
    // (copy_from_user) during the call; it writes back only the control
    // structure, inside `arg`.
    unsafe { device_feature(device, &mut arg) }?;
    Ok(arg.data.page_size)
}

/// `VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP` (SET).
pub fn dma_logging_stop(device: BorrowedFd<'_>) -> Result<(), Errno> {
    let mut arg = VfioDeviceFeatureWith {
        header: VfioDeviceFeature {
            argsz: argsz::<VfioDeviceFeature>(),
            flags: VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP,
        },
        data: (),
    };
    // SAFETY: the feature has no data and no pointer; `argsz` is the
    // header's size, inside `arg`.
    unsafe { device_feature(device, &mut arg) }
}

/// `VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT` (GET): ORs the pages of
/// `[iova, iova + length)` the device wrote since the last report into
/// `bitmap` (bit `i` of word `i / 64` = page `i`, of `page_size` bytes)
/// and clears them in the device. Nothing is cleared in `bitmap`.
///
/// `bitmap` must hold at least one bit per page of the range, else
/// `EINVAL` without calling the kernel.
pub fn dma_logging_report(
    device: BorrowedFd<'_>,
    iova: u64,
    length: u64,
    page_size: u64,
    bitmap: &mut [u64],
) -> Result<(), Errno> {
    if page_size == 0 || length == 0 {
        return Err(Errno::EINVAL);
    }
    let bits = length.div_ceil(page_size);
    if (bitmap.len() as u64) < bits.div_ceil(64) {
        return Err(Errno::EINVAL);
    }
    let mut arg = VfioDeviceFeatureWith {
        header: VfioDeviceFeature {
            argsz: argsz::<VfioDeviceFeatureWith<VfioDmaLoggingReport>>(),
            flags: VFIO_DEVICE_FEATURE_GET | VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT,
        },
        data: VfioDmaLoggingReport {
            iova,
            length,
            page_size,
            bitmap: bitmap.as_mut_ptr() as u64,
        },
    };
    // SAFETY: `data.bitmap` points at `bitmap`, which is exclusively
    // borrowed for the call and, as checked above, holds at least one bit
    // per `page_size` of `length`: the kernel pins and writes only those
    // bits (iova_bitmap), all inside it. The data is otherwise only read.
    unsafe { device_feature(device, &mut arg) }
}

/// Largest argument size an ioctl number can encode: a scratch buffer this
/// large holds whatever a command names.
pub const IOCTL_SCRATCH_BYTES: usize = (1 << 14) - 1;

/// `VFIO_DEVICE_GET_INFO` with `argsz` as given (capped at the structure's
/// size), returning the kernel's answer: for checking that a short `argsz`
/// is refused.
pub fn device_get_info_raw(device: BorrowedFd<'_>, argsz: u32) -> Result<VfioDeviceInfo, Errno> {
    let mut info = VfioDeviceInfo {
        argsz: argsz.min(self::argsz::<VfioDeviceInfo>()),
        ..VfioDeviceInfo::default()
    };
    // SAFETY: `info` is a live, writable `vfio_device_info` whose `argsz`
    // is at most its true size, so the kernel writes only inside it;
    // `device` is open for the call.
    unsafe { raw::device_get_info(device.as_raw_fd(), &mut info) }?;
    Ok(info)
}

/// `VFIO_DEVICE_GET_REGION_INFO` with every field of `info` as given.
/// `info.argsz` must not exceed the structure's size.
pub fn device_get_region_info_raw(
    device: BorrowedFd<'_>,
    mut info: VfioRegionInfo,
) -> Result<VfioRegionInfo, Errno> {
    info.argsz = info.argsz.min(argsz::<VfioRegionInfo>());
    // SAFETY: `info` is a live, writable `vfio_region_info` and its `argsz`
    // is at most its true size, so the kernel writes only inside it;
    // `device` is open for the call.
    unsafe { raw::device_get_region_info(device.as_raw_fd(), &mut info) }?;
    Ok(info)
}

/// `VFIO_DEVICE_GET_IRQ_INFO` with every field of `info` as given.
/// `info.argsz` is capped at the structure's size.
pub fn device_get_irq_info_raw(
    device: BorrowedFd<'_>,
    mut info: VfioIrqInfo,
) -> Result<VfioIrqInfo, Errno> {
    info.argsz = info.argsz.min(argsz::<VfioIrqInfo>());
    // SAFETY: `info` is a live, writable `vfio_irq_info` whose `argsz` is
    // at most its true size; `device` is open for the call.
    unsafe { raw::device_get_irq_info(device.as_raw_fd(), &mut info) }?;
    Ok(info)
}

/// `VFIO_DEVICE_SET_IRQS` with every field of `set` as given (`argsz`
/// capped at the structure's size, which holds one `__s32` of data).
pub fn device_set_irqs_raw(
    device: BorrowedFd<'_>,
    mut set: VfioIrqSetEventfd,
) -> Result<(), Errno> {
    set.argsz = set.argsz.min(argsz::<VfioIrqSetEventfd>());
    // SAFETY: `set` is a live structure at least `argsz` bytes long; the
    // kernel only reads it (and takes its own reference to any fd in it).
    // `device` is open for the call.
    unsafe { raw::device_set_irqs(device.as_raw_fd(), &set) }?;
    Ok(())
}

/// Issues ioctl number `cmd` on the device with a pointer to a zeroed
/// scratch buffer of [`IOCTL_SCRATCH_BYTES`]: for numbers the device does
/// not know (it must answer `ENOTTY`).
pub fn device_ioctl_scratch(device: BorrowedFd<'_>, cmd: u32) -> Result<i32, Errno> {
    let mut scratch = vec![0u8; IOCTL_SCRATCH_BYTES];
    // SAFETY: `device` is open for the call; the argument points at
    // `scratch`, a live writable buffer as large as any size an ioctl
    // number can encode, so whatever the kernel accesses for `cmd` lies
    // inside it; zeroed structures carry no pointer into this process.
    let ret = unsafe { nix::libc::ioctl(device.as_raw_fd(), cmd as _, scratch.as_mut_ptr()) };
    Errno::result(ret)
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, offset_of, size_of};

    #[test]
    fn layouts_match_the_c_structures() {
        assert_eq!(size_of::<VfioGroupStatus>(), 8);
        assert_eq!(size_of::<VfioDeviceInfo>(), 24);
        assert_eq!(offset_of!(VfioDeviceInfo, num_regions), 8);
        assert_eq!(offset_of!(VfioDeviceInfo, cap_offset), 16);
        // __aligned_u64 size and offset.
        assert_eq!(size_of::<VfioRegionInfo>(), 32);
        assert_eq!(align_of::<VfioRegionInfo>(), 8);
        assert_eq!(offset_of!(VfioRegionInfo, index), 8);
        assert_eq!(offset_of!(VfioRegionInfo, size), 16);
        assert_eq!(offset_of!(VfioRegionInfo, offset), 24);
        assert_eq!(size_of::<VfioIrqInfo>(), 16);
        // vfio_irq_set is 20 bytes; one __s32 of data follows at offset 20.
        assert_eq!(offset_of!(VfioIrqSetEventfd, count), 16);
        assert_eq!(offset_of!(VfioIrqSetEventfd, fd), 20);
        assert_eq!(size_of::<VfioIrqSetEventfd>(), 24);
        assert_eq!(size_of::<VfioDmaMap>(), 32);
        assert_eq!(offset_of!(VfioDmaMap, vaddr), 8);
        assert_eq!(offset_of!(VfioDmaMap, iova), 16);
        assert_eq!(offset_of!(VfioDmaMap, size), 24);
        assert_eq!(size_of::<VfioDmaUnmap>(), 24);
        assert_eq!(offset_of!(VfioDmaUnmap, iova), 8);
    }

    #[test]
    fn dma_logging_layouts_match_the_c_structures() {
        // struct vfio_device_feature: 8 bytes of header, data[] at 8.
        assert_eq!(size_of::<VfioDeviceFeature>(), 8);
        assert_eq!(size_of::<VfioDeviceFeatureWith<()>>(), 8);
        // vfio_device_feature_dma_logging_control: __aligned_u64 page_size,
        // __u32 num_ranges, __u32 __reserved, __aligned_u64 ranges.
        assert_eq!(size_of::<VfioDmaLoggingControl>(), 24);
        assert_eq!(align_of::<VfioDmaLoggingControl>(), 8);
        assert_eq!(offset_of!(VfioDmaLoggingControl, page_size), 0);
        assert_eq!(offset_of!(VfioDmaLoggingControl, num_ranges), 8);
        assert_eq!(offset_of!(VfioDmaLoggingControl, reserved), 12);
        assert_eq!(offset_of!(VfioDmaLoggingControl, ranges), 16);
        // vfio_device_feature_dma_logging_range: iova, length.
        assert_eq!(size_of::<VfioDmaLoggingRange>(), 16);
        assert_eq!(align_of::<VfioDmaLoggingRange>(), 8);
        assert_eq!(offset_of!(VfioDmaLoggingRange, iova), 0);
        assert_eq!(offset_of!(VfioDmaLoggingRange, length), 8);
        // vfio_device_feature_dma_logging_report: iova, length, page_size,
        // bitmap.
        assert_eq!(size_of::<VfioDmaLoggingReport>(), 32);
        assert_eq!(align_of::<VfioDmaLoggingReport>(), 8);
        assert_eq!(offset_of!(VfioDmaLoggingReport, iova), 0);
        assert_eq!(offset_of!(VfioDmaLoggingReport, length), 8);
        assert_eq!(offset_of!(VfioDmaLoggingReport, page_size), 16);
        assert_eq!(offset_of!(VfioDmaLoggingReport, bitmap), 24);
        // The data sits right after the header, as data[] does in C.
        type Control = VfioDeviceFeatureWith<VfioDmaLoggingControl>;
        type Report = VfioDeviceFeatureWith<VfioDmaLoggingReport>;
        assert_eq!(offset_of!(Control, data), 8);
        assert_eq!(size_of::<Control>(), 8 + 24);
        assert_eq!(offset_of!(Report, data), 8);
        assert_eq!(size_of::<Report>(), 8 + 32);
    }

    #[test]
    fn dma_logging_numbers_match_the_c_macros() {
        assert_eq!(VFIO_DEVICE_FEATURE, 0x3b75);
        assert_eq!(VFIO_DEVICE_FEATURE_GET, 0x1_0000);
        assert_eq!(VFIO_DEVICE_FEATURE_SET, 0x2_0000);
        assert_eq!(VFIO_DEVICE_FEATURE_PROBE, 0x4_0000);
        assert_eq!(VFIO_DEVICE_FEATURE_DMA_LOGGING_START, 6);
        assert_eq!(VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP, 7);
        assert_eq!(VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT, 8);
    }

    #[test]
    fn a_short_report_bitmap_is_refused_before_the_kernel() {
        // 65 pages need two words; the fd is never reached (stdin would
        // answer ENOTTY).
        // SAFETY: fd 0 is not closed by this test; it is only borrowed.
        let fd = unsafe { BorrowedFd::borrow_raw(0) };
        let mut one = [0u64; 1];
        assert_eq!(
            dma_logging_report(fd, 0, 65 * 4096, 4096, &mut one),
            Err(Errno::EINVAL)
        );
        assert_eq!(
            dma_logging_report(fd, 0, 4096, 0, &mut one),
            Err(Errno::EINVAL)
        );
    }

    #[test]
    fn ioctl_numbers_match_the_c_macros() {
        // _IO(';', 100 + n) = 0x3b00 | (100 + n).
        assert_eq!(VFIO_GET_API_VERSION, 0x3b64);
        assert_eq!(VFIO_CHECK_EXTENSION, 0x3b65);
        assert_eq!(VFIO_SET_IOMMU, 0x3b66);
        assert_eq!(VFIO_GROUP_GET_STATUS, 0x3b67);
        assert_eq!(VFIO_GROUP_SET_CONTAINER, 0x3b68);
        assert_eq!(VFIO_GROUP_GET_DEVICE_FD, 0x3b6a);
        assert_eq!(VFIO_DEVICE_GET_INFO, 0x3b6b);
        assert_eq!(VFIO_DEVICE_GET_REGION_INFO, 0x3b6c);
        assert_eq!(VFIO_DEVICE_GET_IRQ_INFO, 0x3b6d);
        assert_eq!(VFIO_DEVICE_SET_IRQS, 0x3b6e);
        assert_eq!(VFIO_DEVICE_RESET, 0x3b6f);
        assert_eq!(VFIO_IOMMU_MAP_DMA, 0x3b71);
        assert_eq!(VFIO_IOMMU_UNMAP_DMA, 0x3b72);
    }

    #[test]
    fn indexes_match_the_sim_contract() {
        assert_eq!(VFIO_PCI_BAR0_REGION_INDEX, hag_abi::sim_regs::BAR0_REGION);
        assert_eq!(
            VFIO_PCI_CONFIG_REGION_INDEX,
            hag_abi::sim_regs::CONFIG_REGION
        );
    }
}
