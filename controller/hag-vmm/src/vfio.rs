//! Attaching an mdev through VFIO's legacy container API, the way QEMU
//! does: sysfs → IOMMU group → container (`/dev/vfio/vfio`) → group
//! (`/dev/vfio/<n>`) → device fd; guest RAM mapped for DMA at IOVA = guest
//! physical 0; BAR0 and config space by `pread`/`pwrite` at the region
//! offsets; MSI delivered to an eventfd.
//!
//! The ioctls themselves are in [`crate::vfio_sys`]; this file decides what
//! to call and names what failed.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use hag_abi::sim_regs as r;
use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::uio::{pread, pwrite};

use crate::vfio_sys as sys;
use guest_gpu::driver::{RegError, Registers};
use guest_ram::GuestRam;

/// Why the mdev could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    /// The mdev does not exist.
    #[error("mdev {uuid} not found: {path} does not exist (create it through /sys/class/mdev_bus/*/mdev_supported_types/*/create)")]
    NoMdev {
        /// The UUID.
        uuid: String,
        /// The sysfs path looked at.
        path: String,
    },
    /// A sysfs read or a file open failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The group link does not end in a number.
    #[error("cannot parse the IOMMU group number from {path} -> {target}")]
    BadGroup {
        /// The link.
        path: String,
        /// Its target.
        target: String,
    },
    /// An ioctl failed.
    #[error("{ioctl}{detail}: {errno}")]
    Ioctl {
        /// The ioctl's name.
        ioctl: &'static str,
        /// What it was called on / with (starting with a space or empty).
        detail: String,
        /// What the kernel said.
        errno: Errno,
    },
    /// The kernel answered, but not what hag-vmm needs.
    #[error("{0}")]
    Unusable(String),
}

fn ioctl_err(ioctl: &'static str, detail: impl Into<String>) -> impl FnOnce(Errno) -> VfioError {
    let detail = detail.into();
    move |errno| VfioError::Ioctl {
        ioctl,
        detail,
        errno,
    }
}

/// Reads the IOMMU group number of mdev `uuid` from `sysfs_root`
/// (`/sys` normally): the `iommu_group` link of
/// `bus/mdev/devices/<uuid>` ends in the group number.
pub fn iommu_group(sysfs_root: &Path, uuid: &str) -> Result<u32, VfioError> {
    let dev = sysfs_root.join("bus/mdev/devices").join(uuid);
    if !dev.exists() {
        return Err(VfioError::NoMdev {
            uuid: uuid.to_owned(),
            path: dev.display().to_string(),
        });
    }
    let link = dev.join("iommu_group");
    let target = std::fs::read_link(&link).map_err(|source| VfioError::Io {
        what: "cannot read the IOMMU group link",
        path: link.display().to_string(),
        source,
    })?;
    target
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| VfioError::BadGroup {
            path: link.display().to_string(),
            target: target.display().to_string(),
        })
}

fn open_rw(path: &Path, what: &'static str) -> Result<File, VfioError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|source| VfioError::Io {
            what,
            path: path.display().to_string(),
            source,
        })
}

/// A VFIO region's place in the device fd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Region index.
    pub index: u32,
    /// Offset in the device fd.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
}

/// A group attached to a container with guest RAM mapped for DMA.
/// Dropping it unmaps the DMA, then closes the group (which leaves the
/// container) and the container.
struct Attached {
    dma: Option<(u64, u64)>,
    group: File,
    group_path: PathBuf,
    container: File,
}

impl Drop for Attached {
    fn drop(&mut self) {
        if let Some((iova, size)) = self.dma.take() {
            let _ = sys::iommu_unmap_dma(self.container.as_fd(), iova, size);
        }
    }
}

/// An attached mdev. Dropping it disables its MSI and closes the device
/// before the group and container go (fields drop in declaration order).
pub struct VfioDevice {
    uuid: String,
    eventfd: Option<EventFd>,
    device: File,
    bar0: Region,
    config: Region,
    attached: Attached,
}

impl VfioDevice {
    /// Attaches mdev `uuid` and maps `ram` for its DMA at IOVA 0.
    pub fn attach(uuid: &str, ram: &GuestRam) -> Result<Self, VfioError> {
        Self::attach_at(Path::new("/sys"), Path::new("/dev/vfio"), uuid, ram)
    }

    /// [`VfioDevice::attach`] with other sysfs and `/dev/vfio` roots.
    pub fn attach_at(
        sysfs: &Path,
        dev_vfio: &Path,
        uuid: &str,
        ram: &GuestRam,
    ) -> Result<Self, VfioError> {
        let group_num = iommu_group(sysfs, uuid)?;

        let container_path = dev_vfio.join("vfio");
        let container = open_rw(&container_path, "cannot open the VFIO container")?;
        let cpath = container_path.display().to_string();
        let version = sys::get_api_version(container.as_fd())
            .map_err(ioctl_err("VFIO_GET_API_VERSION", format!(" on {cpath}")))?;
        if version != sys::VFIO_API_VERSION {
            return Err(VfioError::Unusable(format!(
                "VFIO_GET_API_VERSION on {cpath} is {version}, expected {}",
                sys::VFIO_API_VERSION
            )));
        }
        let mut iommu = None;
        for kind in [sys::VFIO_TYPE1V2_IOMMU, sys::VFIO_TYPE1_IOMMU] {
            if sys::check_extension(container.as_fd(), kind).map_err(ioctl_err(
                "VFIO_CHECK_EXTENSION",
                format!(" of IOMMU type {kind} on {cpath}"),
            ))? {
                iommu = Some(kind);
                break;
            }
        }
        let iommu = iommu.ok_or_else(|| {
            VfioError::Unusable(format!(
                "{cpath} supports neither VFIO_TYPE1v2_IOMMU nor VFIO_TYPE1_IOMMU (is vfio_iommu_type1 loaded?)"
            ))
        })?;

        let group_path = dev_vfio.join(group_num.to_string());
        let group = open_rw(&group_path, "cannot open the VFIO group")?;
        let gpath = group_path.display().to_string();
        let status = sys::group_get_status(group.as_fd())
            .map_err(ioctl_err("VFIO_GROUP_GET_STATUS", format!(" on {gpath}")))?;
        if status.flags & sys::VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(VfioError::Unusable(format!(
                "VFIO group {gpath} is not viable (flags {:#x}): not every device in it is bound to a VFIO driver",
                status.flags
            )));
        }
        sys::group_set_container(group.as_fd(), container.as_fd()).map_err(ioctl_err(
            "VFIO_GROUP_SET_CONTAINER",
            format!(" of {gpath} to {cpath}"),
        ))?;
        sys::set_iommu(container.as_fd(), iommu).map_err(ioctl_err(
            "VFIO_SET_IOMMU",
            format!(" to type {iommu} on {cpath}"),
        ))?;

        let mut attached = Attached {
            dma: None,
            group,
            group_path,
            container,
        };
        sys::iommu_map_dma(attached.container.as_fd(), ram.host_addr(), 0, ram.size()).map_err(
            ioctl_err(
                "VFIO_IOMMU_MAP_DMA",
                format!(" of {} MiB at IOVA 0x0", ram.size() >> 20),
            ),
        )?;
        attached.dma = Some((0, ram.size()));

        let name = CString::new(uuid)
            .map_err(|_| VfioError::Unusable(format!("mdev name {uuid:?} contains a NUL byte")))?;
        let device = sys::group_get_device_fd(attached.group.as_fd(), &name).map_err(ioctl_err(
            "VFIO_GROUP_GET_DEVICE_FD",
            format!(" of {uuid} on {gpath}"),
        ))?;
        let unset = Region {
            index: 0,
            offset: 0,
            size: 0,
        };
        let mut this = VfioDevice {
            uuid: uuid.to_owned(),
            eventfd: None,
            device: File::from(device),
            bar0: unset,
            config: unset,
            attached,
        };

        let info = sys::device_get_info(this.device.as_fd())
            .map_err(ioctl_err("VFIO_DEVICE_GET_INFO", format!(" of {uuid}")))?;
        if info.flags & sys::VFIO_DEVICE_FLAGS_PCI == 0 {
            return Err(VfioError::Unusable(format!(
                "mdev {uuid} is not a vfio-pci device (flags {:#x})",
                info.flags
            )));
        }
        if info.num_regions <= sys::VFIO_PCI_CONFIG_REGION_INDEX {
            return Err(VfioError::Unusable(format!(
                "mdev {uuid} has {} regions, needs BAR0 and config (index 7)",
                info.num_regions
            )));
        }
        this.bar0 = this.region(sys::VFIO_PCI_BAR0_REGION_INDEX, "BAR0")?;
        if this.bar0.size != r::BAR0_SIZE {
            return Err(VfioError::Unusable(format!(
                "BAR0 of {uuid} is {:#x} bytes, hag-sim has {:#x}",
                this.bar0.size,
                r::BAR0_SIZE
            )));
        }
        this.config = this.region(sys::VFIO_PCI_CONFIG_REGION_INDEX, "config space")?;
        if this.config.size < r::CONFIG_SIZE {
            return Err(VfioError::Unusable(format!(
                "config space of {uuid} is {} bytes, expected {}",
                this.config.size,
                r::CONFIG_SIZE
            )));
        }
        let ids = this.config_read(0)?;
        let (vendor, device) = (ids as u16, (ids >> 16) as u16);
        if (vendor, device) != (r::PCI_VENDOR_ID, r::PCI_DEVICE_ID) {
            return Err(VfioError::Unusable(format!(
                "mdev {uuid} is PCI {vendor:04x}:{device:04x}, not hag-sim ({:04x}:{:04x})",
                r::PCI_VENDOR_ID,
                r::PCI_DEVICE_ID
            )));
        }
        this.enable_msi()?;
        Ok(this)
    }

    fn region(&self, index: u32, what: &str) -> Result<Region, VfioError> {
        let info = sys::device_get_region_info(self.device.as_fd(), index).map_err(ioctl_err(
            "VFIO_DEVICE_GET_REGION_INFO",
            format!(" of region {index} ({what}) of {}", self.uuid),
        ))?;
        let rw = sys::VFIO_REGION_INFO_FLAG_READ | sys::VFIO_REGION_INFO_FLAG_WRITE;
        if info.flags & rw != rw {
            return Err(VfioError::Unusable(format!(
                "region {index} ({what}) of {} is not readable and writable (flags {:#x})",
                self.uuid, info.flags
            )));
        }
        Ok(Region {
            index,
            offset: info.offset,
            size: info.size,
        })
    }

    fn enable_msi(&mut self) -> Result<(), VfioError> {
        let irq = sys::device_get_irq_info(self.device.as_fd(), sys::VFIO_PCI_MSI_IRQ_INDEX)
            .map_err(ioctl_err(
                "VFIO_DEVICE_GET_IRQ_INFO",
                format!(" of the MSI index of {}", self.uuid),
            ))?;
        if irq.count < 1 || irq.flags & sys::VFIO_IRQ_INFO_EVENTFD == 0 {
            return Err(VfioError::Unusable(format!(
                "mdev {} offers no MSI vector with eventfd signalling (count {}, flags {:#x})",
                self.uuid, irq.count, irq.flags
            )));
        }
        let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
            .map_err(ioctl_err("eventfd", ""))?;
        sys::device_set_irq_eventfd(
            self.device.as_fd(),
            sys::VFIO_PCI_MSI_IRQ_INDEX,
            efd.as_fd(),
        )
        .map_err(ioctl_err(
            "VFIO_DEVICE_SET_IRQS",
            format!(
                " (MSI index {}, DATA_EVENTFD | ACTION_TRIGGER) of {}",
                sys::VFIO_PCI_MSI_IRQ_INDEX,
                self.uuid
            ),
        ))?;
        self.eventfd = Some(efd);
        Ok(())
    }

    /// The mdev's UUID.
    pub fn uuid(&self) -> &str {
        &self.uuid
    }

    /// The VFIO group path.
    pub fn group_path(&self) -> &Path {
        &self.attached.group_path
    }

    /// BAR0's region.
    pub fn bar0(&self) -> Region {
        self.bar0
    }

    /// Config space's region.
    pub fn config(&self) -> Region {
        self.config
    }

    /// The VFIO device fd, for raw accesses (`hag-vmm hostile`).
    pub fn device_fd(&self) -> BorrowedFd<'_> {
        self.device.as_fd()
    }

    fn region_read(&self, region: Region, what: &str, off: u32) -> Result<u32, RegError> {
        check_access(region, what, off)?;
        let mut b = [0u8; 4];
        let pos = region.offset + u64::from(off);
        match pread(&self.device, &mut b, pos as i64) {
            Ok(4) => Ok(u32::from_le_bytes(b)),
            Ok(n) => Err(RegError(format!(
                "pread of {what} register {off:#x} of {}: {n} of 4 bytes",
                self.uuid
            ))),
            Err(e) => Err(RegError(format!(
                "pread of {what} register {off:#x} (fd offset {pos:#x}) of {}: {e}",
                self.uuid
            ))),
        }
    }

    fn region_write(&self, region: Region, what: &str, off: u32, v: u32) -> Result<(), RegError> {
        check_access(region, what, off)?;
        let pos = region.offset + u64::from(off);
        match pwrite(&self.device, &v.to_le_bytes(), pos as i64) {
            Ok(4) => Ok(()),
            Ok(n) => Err(RegError(format!(
                "pwrite of {v:#x} to {what} register {off:#x} of {}: {n} of 4 bytes",
                self.uuid
            ))),
            Err(e) => Err(RegError(format!(
                "pwrite of {v:#x} to {what} register {off:#x} (fd offset {pos:#x}) of {}: {e}",
                self.uuid
            ))),
        }
    }

    /// Reads the config space dword at `off`.
    pub fn config_read(&self, off: u32) -> Result<u32, VfioError> {
        self.region_read(self.config, "config", off)
            .map_err(|e| VfioError::Unusable(e.0))
    }
}

/// Bytes per bit of VFIO's DMA log as hag-vmm asks for it.
pub const DMA_LOG_PAGE_SIZE: u64 = 4096;

/// Where hag-vmm puts the third range it asks VFIO to log: QEMU with OVMF
/// logs a 64-bit PCI hole near the top of the address space beside RAM
/// below and above 4 GiB, so a driver must take ranges whose span is far
/// larger than what they cover.
pub const DMA_LOG_PCI_HOLE: (u64, u64) = (1 << 40, 1 << 30);

/// VFIO's standard DMA-logging interface (`VFIO_DEVICE_FEATURE_DMA_LOGGING_*`)
/// on one attached device over one IOVA range, as a VMM without hag's own
/// `/dev/hag` uses it for live migration. Dropping it stops the logging.
pub struct VfioDmaLog<'d> {
    device: &'d VfioDevice,
    iova: u64,
    length: u64,
    page_size: u64,
    bitmap: Vec<u64>,
}

/// What starting VFIO DMA logging gave.
pub enum DmaLogStart<'d> {
    /// Logging runs.
    Started(VfioDmaLog<'d>),
    /// The kernel has no DMA-logging support for the device (`ENOTTY`: a
    /// kernel without `CONFIG_IOMMUFD_DRIVER`, or a driver without log ops).
    Unsupported,
}

impl<'d> VfioDmaLog<'d> {
    /// `VFIO_DEVICE_FEATURE_DMA_LOGGING_START` at [`DMA_LOG_PAGE_SIZE`] over
    /// `[iova, iova + length)`, asked for as QEMU with OVMF does: two
    /// ranges (its halves, as RAM below and above 4 GiB) and
    /// [`DMA_LOG_PCI_HOLE`], three ranges spanning over a TiB. The device
    /// may choose another page size; reports then still ask for 4 KiB bits.
    pub fn start(
        device: &'d VfioDevice,
        iova: u64,
        length: u64,
    ) -> Result<DmaLogStart<'d>, VfioError> {
        let half = (length / 2).next_multiple_of(DMA_LOG_PAGE_SIZE).min(length);
        let mut ranges = vec![sys::VfioDmaLoggingRange { iova, length: half }];
        if half < length {
            ranges.push(sys::VfioDmaLoggingRange {
                iova: iova + half,
                length: length - half,
            });
        }
        let (hole, hole_length) = DMA_LOG_PCI_HOLE;
        if iova.saturating_add(length) <= hole {
            ranges.push(sys::VfioDmaLoggingRange {
                iova: hole,
                length: hole_length,
            });
        }
        let granted =
            match sys::dma_logging_start(device.device.as_fd(), &ranges, DMA_LOG_PAGE_SIZE) {
                Ok(granted) => granted,
                Err(Errno::ENOTTY) => return Ok(DmaLogStart::Unsupported),
                Err(e) => {
                    return Err(ioctl_err(
                        "VFIO_DEVICE_FEATURE_DMA_LOGGING_START",
                        format!(
                            " of {} at page size {DMA_LOG_PAGE_SIZE} on {}",
                            ranges
                                .iter()
                                .map(|r| format!("[{:#x}, {:#x})", r.iova, r.iova + r.length))
                                .collect::<Vec<_>>()
                                .join(", "),
                            device.uuid
                        ),
                    )(e))
                }
            };
        let pages = length.div_ceil(DMA_LOG_PAGE_SIZE);
        Ok(DmaLogStart::Started(VfioDmaLog {
            device,
            iova,
            length,
            page_size: granted,
            bitmap: vec![0; pages.div_ceil(64) as usize],
        }))
    }

    /// The page size the device chose at start.
    pub fn granted_page_size(&self) -> u64 {
        self.page_size
    }

    /// `VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT` of the whole range into a
    /// zeroed bitmap: the numbers of the 4 KiB pages (relative to IOVA 0)
    /// the device wrote since the last report, which the kernel clears.
    pub fn report(&mut self) -> Result<std::collections::BTreeSet<u64>, VfioError> {
        // The kernel only sets bits.
        self.bitmap.fill(0);
        sys::dma_logging_report(
            self.device.device.as_fd(),
            self.iova,
            self.length,
            DMA_LOG_PAGE_SIZE,
            &mut self.bitmap,
        )
        .map_err(ioctl_err(
            "VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT",
            format!(
                " of [{:#x}, {:#x}) on {}",
                self.iova,
                self.iova.saturating_add(self.length),
                self.device.uuid
            ),
        ))?;
        let first = self.iova / DMA_LOG_PAGE_SIZE;
        Ok(hag_dev::bitmap_pages(&self.bitmap)
            .map(|bit| first + bit)
            .collect())
    }
}

impl crate::check::DirtyLog for VfioDmaLog<'_> {
    fn read_clear(&mut self) -> anyhow::Result<std::collections::BTreeSet<u64>> {
        Ok(self.report()?)
    }
}

impl Drop for VfioDmaLog<'_> {
    fn drop(&mut self) {
        let _ = sys::dma_logging_stop(self.device.device.as_fd());
    }
}

fn check_access(region: Region, what: &str, off: u32) -> Result<(), RegError> {
    if off % 4 != 0 || u64::from(off) + 4 > region.size {
        return Err(RegError(format!(
            "{what} register offset {off:#x} is not a 4-byte aligned offset inside the region of {:#x} bytes",
            region.size
        )));
    }
    Ok(())
}

impl Registers for VfioDevice {
    fn read(&self, off: u32) -> Result<u32, RegError> {
        self.region_read(self.bar0, "BAR0", off)
    }

    fn write(&self, off: u32, v: u32) -> Result<(), RegError> {
        self.region_write(self.bar0, "BAR0", off, v)
    }

    fn wait_interrupt(&self, timeout: Duration) -> Result<u64, RegError> {
        let Some(efd) = &self.eventfd else {
            std::thread::sleep(timeout.min(Duration::from_millis(1)));
            return Ok(0);
        };
        let ms = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(efd.as_fd(), PollFlags::POLLIN)];
        loop {
            match poll(&mut fds, ms) {
                Ok(0) => return Ok(0),
                Ok(_) => break,
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(RegError(format!("poll of the MSI eventfd: {e}"))),
            }
        }
        match efd.read() {
            Ok(n) => Ok(n),
            Err(Errno::EAGAIN) => Ok(0),
            Err(e) => Err(RegError(format!("read of the MSI eventfd: {e}"))),
        }
    }
}

impl Drop for VfioDevice {
    fn drop(&mut self) {
        if self.eventfd.is_some() {
            let _ = sys::device_disable_irq(self.device.as_fd(), sys::VFIO_PCI_MSI_IRQ_INDEX);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_number_comes_from_the_sysfs_link() {
        let dir = std::env::temp_dir().join(format!("hag-vmm-test-{}", std::process::id()));
        let uuid = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001";
        let dev = dir.join("bus/mdev/devices").join(uuid);
        std::fs::create_dir_all(&dev).unwrap();
        std::os::unix::fs::symlink(
            "../../../../kernel/iommu_groups/17",
            dev.join("iommu_group"),
        )
        .unwrap();
        assert_eq!(iommu_group(&dir, uuid).unwrap(), 17);

        let other = "00000000-0000-0000-0000-000000000000";
        let err = iommu_group(&dir, other).unwrap_err();
        assert!(err.to_string().starts_with(&format!(
            "mdev {other} not found: {}/bus/mdev/devices/{other} does not exist",
            dir.display()
        )));

        let bad = dir.join("bus/mdev/devices/bad");
        std::fs::create_dir_all(&bad).unwrap();
        std::os::unix::fs::symlink("../groups/x", bad.join("iommu_group")).unwrap();
        assert!(matches!(
            iommu_group(&dir, "bad"),
            Err(VfioError::BadGroup { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn ioctl_errors_name_the_call_and_value() {
        let e = ioctl_err("VFIO_IOMMU_MAP_DMA", " of 64 MiB at IOVA 0x0")(Errno::EINVAL);
        assert_eq!(
            e.to_string(),
            "VFIO_IOMMU_MAP_DMA of 64 MiB at IOVA 0x0: EINVAL: Invalid argument"
        );
    }

    #[test]
    fn register_accesses_are_checked_against_the_region() {
        let bar0 = Region {
            index: 0,
            offset: 0,
            size: r::BAR0_SIZE,
        };
        assert!(check_access(bar0, "BAR0", r::RING_TAIL).is_ok());
        assert!(check_access(bar0, "BAR0", 0x1f_fffc).is_ok());
        assert!(check_access(bar0, "BAR0", 0x20_0000).is_err());
        assert!(check_access(bar0, "BAR0", 2).is_err());
    }
}
