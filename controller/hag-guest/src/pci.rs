//! The hag-sim vGPU as the guest sees it: PCI device `1234:4847`, found in
//! sysfs, enabled there, and its BAR0 (registers and GTT, 2 MiB) mapped
//! from `resource0`. QEMU traps every access to that BAR and forwards it
//! to the mdev as a 4-byte region read or write, so [`Bar0`] makes exactly
//! one 32-bit volatile access per register access.

use std::fs::{File, OpenOptions};
use std::io;
use std::num::NonZeroUsize;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{fence, Ordering};

use anyhow::{bail, Context};
use guest_gpu::driver::{RegError, Registers};
use hag_abi::sim_regs as r;
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

/// Where the kernel lists PCI devices.
pub const SYSFS_PCI: &str = "/sys/bus/pci/devices";

/// PCI command register bits: memory space decoding, bus mastering (DMA).
const COMMAND_MEMORY: u16 = 1 << 1;
const COMMAND_MASTER: u16 = 1 << 2;

/// `EACCES: Permission denied` for an OS error, the error's own words
/// otherwise.
pub fn os_error(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(n) => nix::errno::Errno::from_raw(n).to_string(),
        None => e.to_string(),
    }
}

/// A BDF as sysfs names it: `00:03.0` gets PCI domain `0000:`.
pub fn full_bdf(bdf: &str) -> String {
    if bdf.matches(':').count() == 1 {
        format!("0000:{bdf}")
    } else {
        bdf.to_string()
    }
}

/// Reads a sysfs ID file (`0x1234\n`).
fn read_id(path: &Path) -> anyhow::Result<u16> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {}", path.display(), os_error(&e)))?;
    let hex = text.trim().trim_start_matches("0x");
    u16::from_str_radix(hex, 16)
        .with_context(|| format!("{} holds {:?}, not a hex ID", path.display(), text.trim()))
}

/// Whether the device directory `dev` is a hag-sim vGPU.
fn is_hag_sim(dev: &Path) -> anyhow::Result<bool> {
    Ok(read_id(&dev.join("vendor"))? == r::PCI_VENDOR_ID
        && read_id(&dev.join("device"))? == r::PCI_DEVICE_ID)
}

/// The sysfs directory of the hag-sim vGPU under `root` (normally
/// [`SYSFS_PCI`]): the device `bdf` if given (which must be one), else the
/// only one there is.
pub fn find(root: &Path, bdf: Option<&str>) -> anyhow::Result<PathBuf> {
    let ids = format!("{:04x}:{:04x}", r::PCI_VENDOR_ID, r::PCI_DEVICE_ID);
    if let Some(bdf) = bdf {
        let dev = root.join(full_bdf(bdf));
        if !dev.exists() {
            bail!("no PCI device {} ({} does not exist)", bdf, dev.display());
        }
        if !is_hag_sim(&dev)? {
            bail!("PCI device {} is not a hag-sim vGPU ({ids})", dev.display());
        }
        return Ok(dev);
    }
    let entries = std::fs::read_dir(root)
        .map_err(|e| anyhow::anyhow!("cannot list {}: {}", root.display(), os_error(&e)))?;
    let mut names: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    names.sort();
    let mut found = Vec::new();
    for dev in names {
        // Devices without readable IDs are not ours; skip them.
        if is_hag_sim(&dev).unwrap_or(false) {
            found.push(dev);
        }
    }
    match found.len() {
        0 => bail!(
            "no PCI device {ids} under {} (is the hag-sim vGPU attached, -device vfio-pci,sysfsdev=/sys/bus/mdev/devices/UUID?)",
            root.display()
        ),
        1 => Ok(found.remove(0)),
        _ => bail!(
            "{} hag-sim vGPUs under {} ({}): choose one with --device",
            found.len(),
            root.display(),
            found
                .iter()
                .map(|d| d.file_name().unwrap_or_default().to_string_lossy())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Enables the device for this process: refuses one a kernel driver has
/// bound, writes `1` to `enable` (memory decoding on), and turns on bus
/// mastering in the command register through `config` if it is off (the
/// simulated vGPU DMAs whatever the bit says; a real GPU would not).
pub fn enable(dev: &Path) -> anyhow::Result<()> {
    let driver = dev.join("driver");
    if let Ok(target) = std::fs::read_link(&driver) {
        bail!(
            "{} is bound to kernel driver {}: unbind it first (echo {} > {}/unbind)",
            dev.display(),
            target.file_name().unwrap_or_default().to_string_lossy(),
            dev.file_name().unwrap_or_default().to_string_lossy(),
            driver.display()
        );
    }
    let enable = dev.join("enable");
    std::fs::write(&enable, "1")
        .map_err(|e| anyhow::anyhow!("cannot write 1 to {}: {}", enable.display(), os_error(&e)))?;
    let config = dev.join("config");
    let io_err = |what: &str, e: io::Error| {
        anyhow::anyhow!("cannot {what} {}: {}", config.display(), os_error(&e))
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&config)
        .map_err(|e| io_err("open", e))?;
    let mut cmd = [0u8; 2];
    file.read_exact_at(&mut cmd, 4)
        .map_err(|e| io_err("read the command register from", e))?;
    let cmd = u16::from_le_bytes(cmd);
    if cmd & (COMMAND_MEMORY | COMMAND_MASTER) != COMMAND_MEMORY | COMMAND_MASTER {
        let new = cmd | COMMAND_MEMORY | COMMAND_MASTER;
        file.write_all_at(&new.to_le_bytes(), 4)
            .map_err(|e| io_err("write the command register of", e))?;
    }
    Ok(())
}

/// BAR0 of the vGPU, mapped into this process.
pub struct Bar0 {
    base: NonNull<u8>,
    len: NonZeroUsize,
    path: PathBuf,
}

impl Bar0 {
    /// Maps `path` (a device's `resource0`; any file of at least 2 MiB
    /// in tests) shared, read-write: `O_RDWR | O_SYNC`, `MAP_SHARED`.
    pub fn map(path: &Path) -> anyhow::Result<Self> {
        let fail = |what: &str, e: String| anyhow::anyhow!("cannot {what} {}: {e}", path.display());
        let file: File = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(nix::libc::O_SYNC)
            .open(path)
            .map_err(|e| fail("open", os_error(&e)))?;
        let size = file
            .metadata()
            .map_err(|e| fail("stat", os_error(&e)))?
            .len();
        if size < r::BAR0_SIZE {
            bail!(
                "{} is {size:#x} bytes, BAR0 of a hag-sim vGPU is {:#x}",
                path.display(),
                r::BAR0_SIZE
            );
        }
        let len = NonZeroUsize::new(r::BAR0_SIZE as usize).expect("BAR0_SIZE is not zero");
        // SAFETY: a fresh shared mapping at an address the kernel chooses
        // aliases no Rust object. Its bytes are device registers (or, in
        // tests, a file), changed behind our back: no Rust reference into
        // it is ever made, every access is a volatile read or write of an
        // aligned dword inside it ([`Bar0::reg`]). The file is at least
        // `len` bytes, so no access is past its end. Unmapped only in
        // `Drop`; the mapping outlives `file`, which may close now.
        let ptr = unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &file,
                0,
            )
        }
        .map_err(|errno| fail("mmap", errno.to_string()))?;
        Ok(Bar0 {
            base: ptr.cast(),
            len,
            path: path.to_path_buf(),
        })
    }

    /// The register at byte offset `off`, checked: 4-byte aligned, inside
    /// BAR0.
    fn reg(&self, off: u32) -> Result<*mut u32, RegError> {
        let off = off as usize;
        if off % 4 != 0 || off + 4 > self.len.get() {
            return Err(RegError(format!(
                "BAR0 access at {off:#x} of {}: not an aligned dword inside {:#x} bytes",
                self.path.display(),
                self.len.get()
            )));
        }
        // SAFETY: `off + 4 <= len`: the result stays inside the mapping.
        Ok(unsafe { self.base.as_ptr().add(off) }.cast())
    }
}

impl Registers for Bar0 {
    fn read(&self, off: u32) -> Result<u32, RegError> {
        let reg = self.reg(off)?;
        // SAFETY: `reg` is an aligned dword inside the live mapping
        // (`Bar0::reg`); volatile, so it is exactly one 32-bit load.
        let v = unsafe { reg.read_volatile() };
        // As Linux's readl(): no later memory access (of guest memory the
        // device wrote) is done before this read.
        fence(Ordering::SeqCst);
        Ok(v)
    }

    fn write(&self, off: u32, v: u32) -> Result<(), RegError> {
        let reg = self.reg(off)?;
        // As Linux's writel(): everything written to memory before (ring
        // commands) is visible before the device sees this write (the
        // doorbell).
        fence(Ordering::SeqCst);
        // SAFETY: as in `read`: one aligned 32-bit store inside the mapping.
        unsafe { reg.write_volatile(v) };
        Ok(())
    }
}

impl Drop for Bar0 {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are exactly the mapping made in `map`, and
        // no pointer into it outlives `self`.
        let _ = unsafe { munmap(self.base.cast(), self.len.get()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh scratch directory.
    pub(crate) fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("hag-guest-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn fake_device(root: &Path, bdf: &str, vendor: &str, device: &str) {
        let dev = root.join(bdf);
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("vendor"), format!("{vendor}\n")).unwrap();
        std::fs::write(dev.join("device"), format!("{device}\n")).unwrap();
    }

    #[test]
    fn finds_the_vgpu_by_its_ids() {
        let root = scratch("find");
        fake_device(&root, "0000:00:01.0", "0x8086", "0x29c0");
        fake_device(&root, "0000:00:02.0", "0x1234", "0x1111");
        std::fs::create_dir_all(root.join("0000:00:04.0")).unwrap(); // no IDs
        let err = find(&root, None).unwrap_err().to_string();
        assert!(err.starts_with("no PCI device 1234:4847 under "), "{err}");
        fake_device(&root, "0000:00:03.0", "0x1234", "0x4847");
        assert_eq!(find(&root, None).unwrap(), root.join("0000:00:03.0"));
        assert_eq!(
            find(&root, Some("00:03.0")).unwrap(),
            root.join("0000:00:03.0")
        );
        let err = find(&root, Some("00:02.0")).unwrap_err().to_string();
        assert!(err.ends_with("is not a hag-sim vGPU (1234:4847)"), "{err}");
        let err = find(&root, Some("00:09.0")).unwrap_err().to_string();
        assert!(err.starts_with("no PCI device 00:09.0 ("), "{err}");
        fake_device(&root, "0000:00:05.0", "0x1234", "0x4847");
        let err = find(&root, None).unwrap_err().to_string();
        assert!(
            err.ends_with("(0000:00:03.0, 0000:00:05.0): choose one with --device"),
            "{err}"
        );
        std::fs::write(root.join("0000:00:05.0/vendor"), "zz\n").unwrap();
        let err = find(&root, Some("0000:00:05.0")).unwrap_err().to_string();
        assert!(err.ends_with("vendor holds \"zz\", not a hex ID"), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn enable_sets_decoding_and_bus_mastering() {
        let root = scratch("enable");
        let dev = root.join("0000:00:03.0");
        std::fs::create_dir_all(&dev).unwrap();
        let mut config = vec![0u8; 256];
        config[4] = 0x00;
        config[5] = 0x04; // INTx disable, kept
        std::fs::write(dev.join("config"), &config).unwrap();
        enable(&dev).unwrap();
        assert_eq!(std::fs::read_to_string(dev.join("enable")).unwrap(), "1");
        let config = std::fs::read(dev.join("config")).unwrap();
        assert_eq!(u16::from_le_bytes([config[4], config[5]]), 0x0406);
        std::os::unix::fs::symlink("../../drivers/bochs-drm", dev.join("driver")).unwrap();
        let err = enable(&dev).unwrap_err().to_string();
        assert!(err.contains("is bound to kernel driver bochs-drm"), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn bar0_accesses_are_dwords_inside_the_bar() {
        let root = scratch("bar");
        let path = root.join("resource0");
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        let err = Bar0::map(&path).err().unwrap().to_string();
        assert!(
            err.ends_with("is 0x1000 bytes, BAR0 of a hag-sim vGPU is 0x200000"),
            "{err}"
        );
        let err = Bar0::map(&root.join("nothing")).err().unwrap().to_string();
        assert!(
            err.ends_with("nothing: ENOENT: No such file or directory"),
            "{err}"
        );
        std::fs::write(&path, vec![0u8; r::BAR0_SIZE as usize]).unwrap();
        let bar = Bar0::map(&path).unwrap();
        bar.write(r::RING_TAIL, 0x1234_5678).unwrap();
        bar.write(0x1f_fffc, 7).unwrap();
        assert_eq!(bar.read(r::RING_TAIL).unwrap(), 0x1234_5678);
        assert_eq!(bar.read(0x1f_fffc).unwrap(), 7);
        assert!(bar.read(0x20_0000).is_err());
        assert!(bar.write(0x2031, 0).is_err());
        drop(bar);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[0x2030..0x2034], &0x1234_5678u32.to_le_bytes());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
