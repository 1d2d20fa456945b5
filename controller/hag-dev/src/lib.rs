//! `/dev/hag`, the control device of the hag_mdev kernel module: open it,
//! check its ABI version, list its vGPUs, run their GPU dirty logs, read
//! their counters and set their watchdogs.
//!
//! Shared by `hagctl` and `hag-vmm`. The ioctl calls are the only `unsafe`
//! here, each with its `// SAFETY:` note. Everything that decides something
//! about their answers ([`check_version`], [`next_capacity`],
//! [`parse_uuid`], [`bitmap_words`]) is a plain function of values, so it is
//! tested without the module.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use hag_abi::abi::{
    self, HagDirtyRead, HagDirtyStart, HagVersion, HagVgpuInfo, HagVgpuList, HagVgpuRef,
    HagVgpuStats, HagWatchdog,
};
use nix::errno::Errno;

mod ioctl {
    use hag_abi::abi::{
        HagDirtyRead, HagDirtyStart, HagVersion, HagVgpuList, HagVgpuRef, HagVgpuStats,
        HagWatchdog, IOC_DIRTY_READ_CLEAR, IOC_DIRTY_START, IOC_DIRTY_STOP, IOC_INJECT_HANG,
        IOC_LIST_VGPUS, IOC_SET_WATCHDOG, IOC_VERSION, IOC_VGPU_STATS,
    };

    nix::ioctl_read_bad!(
        /// `IOC_VERSION`: the module fills a [`HagVersion`].
        version,
        IOC_VERSION,
        HagVersion
    );
    nix::ioctl_readwrite_bad!(
        /// `IOC_LIST_VGPUS`: the module fills the array a [`HagVgpuList`]
        /// points to and sets its `count`.
        list_vgpus,
        IOC_LIST_VGPUS,
        HagVgpuList
    );
    nix::ioctl_write_ptr_bad!(
        /// `IOC_DIRTY_START`: start a vGPU's GPU dirty log over a range.
        dirty_start,
        IOC_DIRTY_START,
        HagDirtyStart
    );
    nix::ioctl_write_ptr_bad!(
        /// `IOC_DIRTY_STOP`: stop a vGPU's dirty log.
        dirty_stop,
        IOC_DIRTY_STOP,
        HagVgpuRef
    );
    nix::ioctl_readwrite_bad!(
        /// `IOC_DIRTY_READ_CLEAR`: copy the bitmap out and clear it.
        dirty_read_clear,
        IOC_DIRTY_READ_CLEAR,
        HagDirtyRead
    );
    nix::ioctl_readwrite_bad!(
        /// `IOC_VGPU_STATS`: a vGPU's counters.
        vgpu_stats,
        IOC_VGPU_STATS,
        HagVgpuStats
    );
    nix::ioctl_write_ptr_bad!(
        /// `IOC_SET_WATCHDOG`: a vGPU's hang timeout.
        set_watchdog,
        IOC_SET_WATCHDOG,
        HagWatchdog
    );
    nix::ioctl_write_ptr_bad!(
        /// `IOC_INJECT_HANG`: declare a vGPU hung (tests only).
        inject_hang,
        IOC_INJECT_HANG,
        HagVgpuRef
    );
}

/// The module speaks another ABI than this program; nothing it answers can
/// be trusted to mean what this build thinks.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "hag_mdev speaks ABI {module}, this program speaks ABI {}: use the hagctl and hag-vmm built with the module",
    abi::ABI_VERSION
)]
pub struct AbiMismatch {
    /// The ABI version the module reported.
    pub module: u32,
}

/// Why `/dev/hag` could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// No device node, or a node with no driver behind it.
    #[error(
        "{} not found: the hag_mdev module is not loaded (insmod hag_mdev.ko)",
        abi::DEVICE_PATH
    )]
    NotLoaded,
    /// The node exists but this user may not open it.
    #[error("cannot open {}: permission denied (run as root)", abi::DEVICE_PATH)]
    PermissionDenied,
    /// Any other failure of `open(2)`.
    #[error("cannot open {}", abi::DEVICE_PATH)]
    Other(#[source] io::Error),
}

/// Why the module's version could not be learned or was refused.
#[derive(Debug, thiserror::Error)]
pub enum VersionError {
    /// The ioctl failed; `ENOTTY` means `/dev/hag` is not hag_mdev's device.
    #[error("IOC_VERSION on {} failed", abi::DEVICE_PATH)]
    Ioctl(#[source] Errno),
    /// The module answered with another ABI version.
    #[error(transparent)]
    Abi(#[from] AbiMismatch),
}

/// Why the vGPUs could not be listed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ListError {
    /// The ioctl failed.
    #[error("IOC_LIST_VGPUS on {} failed", abi::DEVICE_PATH)]
    Ioctl(#[source] Errno),
    /// More vGPUs exist than the module lets one call return.
    #[error("hag_mdev reports {count} vGPUs, more than the {max} one list can hold", max = abi::LIST_MAX_CAPACITY)]
    TooMany {
        /// How many vGPUs the module reported.
        count: u32,
    },
    /// vGPUs kept being created faster than the list was re-read.
    #[error("the vGPU list kept growing while it was read ({attempts} attempts): try again")]
    KeptGrowing {
        /// How many calls were made.
        attempts: u32,
    },
}

/// Why a vGPU could not be found by UUID.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FindError {
    /// The text is not a UUID.
    #[error("'{0}' is not a UUID (expected xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")]
    BadUuid(String),
    /// Listing failed.
    #[error(transparent)]
    List(#[from] ListError),
    /// No vGPU has that UUID.
    #[error("hag_mdev has no vGPU with UUID {0} (see hagctl status)")]
    NotFound(String),
}

/// A per-vGPU ioctl (dirty log, stats, watchdog) failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DirtyError {
    /// The ioctl returned an error.
    #[error("{ioctl} for vGPU {vgpu_id} on {path} failed: {errno}", path = abi::DEVICE_PATH)]
    Ioctl {
        /// Which ioctl.
        ioctl: &'static str,
        /// The vGPU it named.
        vgpu_id: u32,
        /// What the kernel said.
        errno: Errno,
    },
}

impl DirtyError {
    /// The errno the kernel returned.
    pub fn errno(&self) -> Errno {
        match self {
            DirtyError::Ioctl { errno, .. } => *errno,
        }
    }
}

/// What the module said about itself, after its ABI version was accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleInfo {
    /// Always [`abi::ABI_VERSION`]: anything else is refused.
    pub abi_version: u32,
    /// Bit set of `abi::FEATURE_*`.
    pub features: u32,
    /// The module's version string (lossily decoded; empty if the module
    /// sent none).
    pub module_version: String,
}

/// An open `/dev/hag`.
pub struct Device {
    file: File,
}

/// First array size for `IOC_LIST_VGPUS`: room for every simulated vGPU
/// twice over, so a host without GVT-g lists in one call.
const INITIAL_CAPACITY: u32 = abi::SIM_MAX_INSTANCES * 2;
/// Extra room asked for on a retry, for vGPUs created meanwhile.
const GROWTH_SLACK: u32 = 4;
/// How many times to re-read a list that grew under us before giving up.
const MAX_ATTEMPTS: u32 = 4;

impl Device {
    /// Opens [`abi::DEVICE_PATH`].
    pub fn open() -> Result<Self, OpenError> {
        match File::open(abi::DEVICE_PATH) {
            Ok(file) => Ok(Self { file }),
            Err(err) => Err(match err.raw_os_error().map(Errno::from_raw) {
                // ENODEV/ENXIO: a stale node whose driver is gone.
                Some(Errno::ENOENT | Errno::ENODEV | Errno::ENXIO) => OpenError::NotLoaded,
                Some(Errno::EACCES | Errno::EPERM) => OpenError::PermissionDenied,
                _ => OpenError::Other(err),
            }),
        }
    }

    /// Asks the module's version and refuses a module of another ABI.
    pub fn version(&self) -> Result<ModuleInfo, VersionError> {
        let mut raw = HagVersion::default();
        // SAFETY: `self.file` is an open descriptor for the duration of the
        // call, and `raw` is a live, writable `HagVersion`, the type whose
        // size IOC_VERSION encodes, so the kernel writes only inside it.
        unsafe { ioctl::version(self.file.as_raw_fd(), &mut raw) }.map_err(VersionError::Ioctl)?;
        Ok(check_version(&raw)?)
    }

    /// Lists every vGPU, growing the array until the module's answer fits.
    pub fn list_vgpus(&self) -> Result<Vec<HagVgpuInfo>, ListError> {
        let mut capacity = INITIAL_CAPACITY;
        for _ in 0..MAX_ATTEMPTS {
            let mut entries = vec![HagVgpuInfo::default(); capacity as usize];
            let mut list = HagVgpuList {
                capacity,
                count: 0,
                entries: entries.as_mut_ptr().expose_provenance() as u64,
            };
            // SAFETY: `self.file` is open for the duration of the call;
            // `list` is a live `HagVgpuList`, and `list.entries` is the
            // address of `entries`, `capacity` initialised, writable
            // `HagVgpuInfo` that are neither freed nor moved before the call
            // returns. The module writes at most `capacity` of them.
            unsafe { ioctl::list_vgpus(self.file.as_raw_fd(), &mut list) }
                .map_err(ListError::Ioctl)?;
            match next_capacity(capacity, list.count)? {
                None => {
                    entries.truncate(list.count as usize);
                    return Ok(entries);
                }
                Some(bigger) => capacity = bigger,
            }
        }
        Err(ListError::KeptGrowing {
            attempts: MAX_ATTEMPTS,
        })
    }

    /// Finds the vGPU whose mdev has the UUID `uuid` (canonical text form).
    pub fn find_vgpu(&self, uuid: &str) -> Result<HagVgpuInfo, FindError> {
        let want = parse_uuid(uuid).ok_or_else(|| FindError::BadUuid(uuid.to_owned()))?;
        let vgpus = self.list_vgpus()?;
        vgpus
            .into_iter()
            .find(|v| v.uuid == want)
            .ok_or_else(|| FindError::NotFound(uuid.to_owned()))
    }

    /// Starts (or restarts, with every bit clear) the GPU dirty log of vGPU
    /// `vgpu_id` over guest physical `[gpa, gpa + size)`.
    pub fn dirty_start(&self, vgpu_id: u32, gpa: u64, size: u64) -> Result<(), DirtyError> {
        let arg = HagDirtyStart {
            vgpu_id,
            reserved: 0,
            gpa,
            size,
        };
        // SAFETY: `self.file` is open for the duration of the call and `arg`
        // is a live `HagDirtyStart`, the type IOC_DIRTY_START encodes; the
        // kernel only reads it.
        unsafe { ioctl::dirty_start(self.file.as_raw_fd(), &arg) }.map_err(|errno| {
            DirtyError::Ioctl {
                ioctl: "IOC_DIRTY_START",
                vgpu_id,
                errno,
            }
        })?;
        Ok(())
    }

    /// Stops the GPU dirty log of vGPU `vgpu_id`.
    pub fn dirty_stop(&self, vgpu_id: u32) -> Result<(), DirtyError> {
        let arg = HagVgpuRef {
            vgpu_id,
            reserved: 0,
        };
        // SAFETY: `self.file` is open for the duration of the call and `arg`
        // is a live `HagVgpuRef`, the type IOC_DIRTY_STOP encodes; the kernel
        // only reads it.
        unsafe { ioctl::dirty_stop(self.file.as_raw_fd(), &arg) }.map_err(|errno| {
            DirtyError::Ioctl {
                ioctl: "IOC_DIRTY_STOP",
                vgpu_id,
                errno,
            }
        })?;
        Ok(())
    }

    /// Copies vGPU `vgpu_id`'s dirty bitmap into `bitmap` and clears it
    /// (atomically in the module). Bit `i % 64` of `bitmap[i / 64]` is page
    /// `i` of the logged range; size `bitmap` with [`bitmap_words`]. Returns
    /// the number of dirty pages the module reported.
    pub fn dirty_read_clear(&self, vgpu_id: u32, bitmap: &mut [u64]) -> Result<u64, DirtyError> {
        let mut arg = HagDirtyRead {
            vgpu_id,
            reserved: 0,
            bitmap: bitmap.as_mut_ptr().expose_provenance() as u64,
            bitmap_bytes: (bitmap.len() * 8) as u64,
            dirty_pages: 0,
        };
        // SAFETY: `self.file` is open for the duration of the call; `arg` is
        // a live `HagDirtyRead`, and `arg.bitmap` is the address of
        // `bitmap`, `bitmap_bytes` initialised, writable bytes borrowed
        // mutably for the whole call. The module writes at most
        // `bitmap_bytes` bytes there.
        unsafe { ioctl::dirty_read_clear(self.file.as_raw_fd(), &mut arg) }.map_err(|errno| {
            DirtyError::Ioctl {
                ioctl: "IOC_DIRTY_READ_CLEAR",
                vgpu_id,
                errno,
            }
        })?;
        Ok(arg.dirty_pages)
    }

    /// Reads vGPU `vgpu_id`'s counters.
    pub fn vgpu_stats(&self, vgpu_id: u32) -> Result<HagVgpuStats, DirtyError> {
        let mut arg = HagVgpuStats {
            vgpu_id,
            ..HagVgpuStats::default()
        };
        // SAFETY: `self.file` is open for the duration of the call and `arg`
        // is a live, writable `HagVgpuStats`, the type IOC_VGPU_STATS
        // encodes, so the kernel writes only inside it.
        unsafe { ioctl::vgpu_stats(self.file.as_raw_fd(), &mut arg) }.map_err(|errno| {
            DirtyError::Ioctl {
                ioctl: "IOC_VGPU_STATS",
                vgpu_id,
                errno,
            }
        })?;
        Ok(arg)
    }

    /// Sets vGPU `vgpu_id`'s hang timeout.
    pub fn set_watchdog(&self, vgpu_id: u32, timeout_ms: u32) -> Result<(), DirtyError> {
        let arg = HagWatchdog {
            vgpu_id,
            timeout_ms,
        };
        // SAFETY: `self.file` is open for the duration of the call and `arg`
        // is a live `HagWatchdog`, the type IOC_SET_WATCHDOG encodes; the
        // kernel only reads it.
        unsafe { ioctl::set_watchdog(self.file.as_raw_fd(), &arg) }.map_err(|errno| {
            DirtyError::Ioctl {
                ioctl: "IOC_SET_WATCHDOG",
                vgpu_id,
                errno,
            }
        })?;
        Ok(())
    }
}

/// A user address through which the kernel can neither read nor write, for
/// checking that the module answers a bad pointer with `EFAULT`.
///
/// Every variant is unusable by construction, which is what makes passing it
/// to an ioctl safe whatever the module does with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadAddress {
    /// Address 0.
    Null,
    /// Address 1, in page 0, which this process never maps (the kernel's
    /// `vm.mmap_min_addr` keeps the low pages unmapped, and nothing here
    /// asks for them).
    Low,
    /// An address in the kernel half of the address space: user-copy
    /// routines refuse it before touching memory.
    Kernel,
    /// An address past the 64-bit user/kernel split that is not canonical.
    NonCanonical,
    /// A page of this process mapped `PROT_NONE` for the duration of the
    /// call: a valid mapping that faults on any access.
    NoAccess,
}

impl BadAddress {
    /// Every kind, for tests that try them all.
    pub const ALL: [BadAddress; 5] = [
        BadAddress::Null,
        BadAddress::Low,
        BadAddress::Kernel,
        BadAddress::NonCanonical,
        BadAddress::NoAccess,
    ];

    /// A short name for messages.
    pub fn name(self) -> &'static str {
        match self {
            BadAddress::Null => "NULL",
            BadAddress::Low => "0x1",
            BadAddress::Kernel => "a kernel address",
            BadAddress::NonCanonical => "a non-canonical address",
            BadAddress::NoAccess => "a PROT_NONE page",
        }
    }

    /// Calls `f` with the address (as the `u64` an ioctl structure carries);
    /// for [`BadAddress::NoAccess`] the `PROT_NONE` page exists exactly for
    /// the duration of `f`.
    pub fn with<R>(self, f: impl FnOnce(u64) -> R) -> Result<R, Errno> {
        match self {
            BadAddress::Null => Ok(f(0)),
            BadAddress::Low => Ok(f(1)),
            BadAddress::Kernel => Ok(f(0xffff_8880_0000_0000)),
            BadAddress::NonCanonical => Ok(f(0x8000_0000_0000_0000)),
            BadAddress::NoAccess => {
                let page = NoAccessPage::new()?;
                Ok(f(page.addr()))
            }
        }
    }
}

/// One page mapped `PROT_NONE`, unmapped on drop.
struct NoAccessPage {
    ptr: std::ptr::NonNull<core::ffi::c_void>,
}

const PAGE: usize = 4096;

impl NoAccessPage {
    fn new() -> Result<Self, Errno> {
        use nix::sys::mman::{mmap_anonymous, MapFlags, ProtFlags};
        let len = std::num::NonZeroUsize::new(PAGE).ok_or(Errno::EINVAL)?;
        // SAFETY: a fresh private anonymous mapping at an address the kernel
        // chooses aliases no Rust object; it is never dereferenced, only
        // handed to the kernel as an address, and unmapped in `Drop`.
        let ptr = unsafe {
            mmap_anonymous(
                None,
                len,
                ProtFlags::PROT_NONE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE,
            )
        }?;
        Ok(NoAccessPage { ptr })
    }

    fn addr(&self) -> u64 {
        self.ptr.as_ptr().expose_provenance() as u64
    }
}

impl Drop for NoAccessPage {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`; nothing refers into it.
        let _ = unsafe { nix::sys::mman::munmap(self.ptr, PAGE) };
    }
}

/// Largest argument size an ioctl number can encode (its 14-bit size
/// field): a scratch buffer this large holds whatever a command names.
pub const IOCTL_SCRATCH_BYTES: usize = (1 << 14) - 1;

/// Raw calls with malformed arguments, for testing that the module rejects
/// them (`hag-vmm hostile`). Each returns the kernel's answer unchanged.
impl Device {
    /// Issues ioctl number `cmd` with a pointer to a zeroed, writable
    /// scratch buffer of [`IOCTL_SCRATCH_BYTES`]: meant for numbers the
    /// module does not know (it must answer `ENOTTY`).
    pub fn raw_ioctl_scratch(&self, cmd: u32) -> Result<i32, Errno> {
        let mut scratch = vec![0u8; IOCTL_SCRATCH_BYTES];
        // SAFETY: `self.file` is open for the duration of the call; the
        // argument points at `scratch`, a live writable buffer as large as
        // any size an ioctl number can encode, so whatever the kernel reads
        // or writes for `cmd` lies inside it. Zeroed structures carry only
        // null pointers, which the kernel cannot follow into this process.
        let ret =
            unsafe { nix::libc::ioctl(self.file.as_raw_fd(), cmd as _, scratch.as_mut_ptr()) };
        Errno::result(ret)
    }

    /// Issues ioctl number `cmd` with the unusable address `addr` as its
    /// argument pointer (expected answer: `EFAULT`).
    pub fn raw_ioctl_bad_arg(&self, cmd: u32, addr: BadAddress) -> Result<i32, Errno> {
        addr.with(|a| {
            // SAFETY: `self.file` is open for the call; the argument is an
            // address the kernel can neither read nor write (see
            // [`BadAddress`]), so the call cannot touch this process's
            // memory.
            let ret = unsafe { nix::libc::ioctl(self.file.as_raw_fd(), cmd as _, a as usize) };
            Errno::result(ret)
        })?
    }

    /// `IOC_LIST_VGPUS` with `capacity` and the entries at `entries`: a real
    /// array of `capacity` entries when `None` (so `capacity` must be
    /// allocatable), else an unusable address. Returns the module's answer.
    pub fn list_vgpus_raw(
        &self,
        capacity: u32,
        entries: Option<BadAddress>,
    ) -> Result<HagVgpuList, Errno> {
        let call = |addr: u64, list: &mut HagVgpuList| {
            list.entries = addr;
            // SAFETY: `self.file` is open for the call and `list` is a live
            // `HagVgpuList`. `list.entries` is either the address of an
            // array of `list.capacity` writable entries that outlives the
            // call (below) or an address the kernel cannot write.
            unsafe { ioctl::list_vgpus(self.file.as_raw_fd(), list) }
        };
        let mut list = HagVgpuList {
            capacity,
            count: 0,
            entries: 0,
        };
        match entries {
            None => {
                let mut array = vec![HagVgpuInfo::default(); capacity as usize];
                let addr = array.as_mut_ptr().expose_provenance() as u64;
                call(addr, &mut list)?;
                drop(array);
            }
            Some(bad) => {
                bad.with(|addr| call(addr, &mut list))??;
            }
        }
        Ok(list)
    }

    /// `IOC_SAVE_CONTEXT` with every field as given (reserved included):
    /// `arg.buf` must be 0 or address `arg.buf_bytes` writable bytes that
    /// outlive the call (the module writes at most that many there).
    pub fn save_context_raw(&self, arg: &mut abi::HagContextBuf) -> Result<(), Errno> {
        // SAFETY: `self.file` is open for the call and `arg` is a live
        // `HagContextBuf`; per this method's contract its buffer is either
        // absent or writable for `buf_bytes`.
        unsafe { ioctl_ctx::save_context(self.file.as_raw_fd(), arg) }?;
        Ok(())
    }

    /// `IOC_DIRTY_START` with every field as given (reserved included).
    pub fn dirty_start_raw(&self, arg: HagDirtyStart) -> Result<(), Errno> {
        // SAFETY: `self.file` is open for the call and `arg` is a live
        // `HagDirtyStart` that the kernel only reads.
        unsafe { ioctl::dirty_start(self.file.as_raw_fd(), &arg) }?;
        Ok(())
    }

    /// `IOC_DIRTY_READ_CLEAR` into `bitmap`, telling the module it has only
    /// `claimed_bytes` (at most the slice's size; larger claims are cut to
    /// it), to check that a too-small buffer is refused.
    pub fn dirty_read_clear_claiming(
        &self,
        vgpu_id: u32,
        bitmap: &mut [u64],
        claimed_bytes: u64,
    ) -> Result<u64, Errno> {
        let mut arg = HagDirtyRead {
            vgpu_id,
            reserved: 0,
            bitmap: bitmap.as_mut_ptr().expose_provenance() as u64,
            bitmap_bytes: claimed_bytes.min((bitmap.len() * 8) as u64),
            dirty_pages: 0,
        };
        // SAFETY: `self.file` is open for the call; `arg` is a live
        // `HagDirtyRead` and `arg.bitmap` the address of `bitmap`, borrowed
        // mutably for the call and at least `bitmap_bytes` long; even a
        // module that ignored the claim could write only what it has
        // promised never to exceed, `bitmap_bytes`.
        unsafe { ioctl::dirty_read_clear(self.file.as_raw_fd(), &mut arg) }?;
        Ok(arg.dirty_pages)
    }

    /// `IOC_DIRTY_READ_CLEAR` with the bitmap at an unusable address.
    pub fn dirty_read_clear_bad(
        &self,
        vgpu_id: u32,
        bitmap_bytes: u64,
        bitmap: BadAddress,
    ) -> Result<u64, Errno> {
        bitmap.with(|addr| {
            let mut arg = HagDirtyRead {
                vgpu_id,
                reserved: 0,
                bitmap: addr,
                bitmap_bytes,
                dirty_pages: 0,
            };
            // SAFETY: `self.file` is open for the call; `arg` is a live
            // `HagDirtyRead` whose bitmap address the kernel cannot write.
            unsafe { ioctl::dirty_read_clear(self.file.as_raw_fd(), &mut arg) }
                .map(|_| arg.dirty_pages)
        })?
    }

    /// `IOC_INJECT_HANG`: declares vGPU `vgpu_id` hung (only if the module
    /// was loaded with `allow_hang_injection=1`; `EPERM` otherwise).
    pub fn inject_hang(&self, vgpu_id: u32) -> Result<(), DirtyError> {
        let arg = HagVgpuRef {
            vgpu_id,
            reserved: 0,
        };
        // SAFETY: `self.file` is open for the call and `arg` is a live
        // `HagVgpuRef`, the type IOC_INJECT_HANG encodes; the kernel only
        // reads it.
        unsafe { ioctl::inject_hang(self.file.as_raw_fd(), &arg) }.map_err(|errno| {
            DirtyError::Ioctl {
                ioctl: "IOC_INJECT_HANG",
                vgpu_id,
                errno,
            }
        })?;
        Ok(())
    }
}

mod ioctl_ctx {
    use hag_abi::abi::{
        HagContextBuf, HagQuiesce, HagVgpuRef, IOC_QUIESCE, IOC_RESTORE_CONTEXT, IOC_RESUME,
        IOC_SAVE_CONTEXT,
    };

    nix::ioctl_write_ptr_bad!(
        /// `IOC_QUIESCE`: hold submissions and wait for the engine.
        quiesce,
        IOC_QUIESCE,
        HagQuiesce
    );
    nix::ioctl_write_ptr_bad!(
        /// `IOC_RESUME`: release a quiesced vGPU.
        resume,
        IOC_RESUME,
        HagVgpuRef
    );
    nix::ioctl_readwrite_bad!(
        /// `IOC_SAVE_CONTEXT`: write a quiesced vGPU's snapshot.
        save_context,
        IOC_SAVE_CONTEXT,
        HagContextBuf
    );
    nix::ioctl_write_ptr_bad!(
        /// `IOC_RESTORE_CONTEXT`: restore a snapshot into a vGPU.
        restore_context,
        IOC_RESTORE_CONTEXT,
        HagContextBuf
    );
}

/// vGPU context snapshots: quiesce, save, restore, resume (for migration).
impl Device {
    fn ctx_err(ioctl: &'static str, vgpu_id: u32) -> impl FnOnce(Errno) -> DirtyError {
        move |errno| DirtyError::Ioctl {
            ioctl,
            vgpu_id,
            errno,
        }
    }

    /// Holds vGPU `vgpu_id`'s new submissions and waits up to `timeout_ms`
    /// for its engine to go idle. `ETIMEDOUT`: still busy, nothing held.
    pub fn quiesce(&self, vgpu_id: u32, timeout_ms: u32) -> Result<(), DirtyError> {
        let arg = abi::HagQuiesce {
            vgpu_id,
            timeout_ms,
        };
        // SAFETY: `self.file` is open for the call and `arg` is a live
        // `HagQuiesce`, the type IOC_QUIESCE encodes; the kernel only reads
        // it.
        unsafe { ioctl_ctx::quiesce(self.file.as_raw_fd(), &arg) }
            .map_err(Self::ctx_err("IOC_QUIESCE", vgpu_id))?;
        Ok(())
    }

    /// Releases a quiesced vGPU.
    pub fn resume(&self, vgpu_id: u32) -> Result<(), DirtyError> {
        let arg = HagVgpuRef {
            vgpu_id,
            reserved: 0,
        };
        // SAFETY: `self.file` is open for the call and `arg` is a live
        // `HagVgpuRef`, the type IOC_RESUME encodes; the kernel only reads
        // it.
        unsafe { ioctl_ctx::resume(self.file.as_raw_fd(), &arg) }
            .map_err(Self::ctx_err("IOC_RESUME", vgpu_id))?;
        Ok(())
    }

    /// Saves the context snapshot of quiesced vGPU `vgpu_id`, growing the
    /// buffer once if the module asks for more (up to
    /// [`abi::CONTEXT_MAX_BYTES`]).
    pub fn save_context(&self, vgpu_id: u32) -> Result<Vec<u8>, DirtyError> {
        let mut size = 64 << 10;
        for _ in 0..2 {
            let mut buf = vec![0u8; size];
            let mut arg = abi::HagContextBuf {
                vgpu_id,
                reserved: 0,
                buf: buf.as_mut_ptr().expose_provenance() as u64,
                buf_bytes: buf.len() as u64,
                used_bytes: 0,
            };
            // SAFETY: `self.file` is open for the call; `arg` is a live
            // `HagContextBuf` and `arg.buf` the address of `buf`,
            // `buf_bytes` initialised writable bytes that outlive the call.
            // The module writes at most `buf_bytes` there.
            let res = unsafe { ioctl_ctx::save_context(self.file.as_raw_fd(), &mut arg) };
            match res {
                Ok(_) if arg.used_bytes <= buf.len() as u64 => {
                    buf.truncate(arg.used_bytes as usize);
                    return Ok(buf);
                }
                Err(Errno::ENOSPC)
                    if arg.used_bytes > size as u64 && arg.used_bytes <= abi::CONTEXT_MAX_BYTES =>
                {
                    size = arg.used_bytes as usize;
                }
                Ok(_) => return Err(Self::ctx_err("IOC_SAVE_CONTEXT", vgpu_id)(Errno::EOVERFLOW)),
                Err(e) => return Err(Self::ctx_err("IOC_SAVE_CONTEXT", vgpu_id)(e)),
            }
        }
        Err(Self::ctx_err("IOC_SAVE_CONTEXT", vgpu_id)(Errno::ENOSPC))
    }

    /// Restores `snapshot` into vGPU `vgpu_id`, which stays quiesced
    /// (release it with [`Device::resume`]). `EINVAL`: damaged; `EPROTO`:
    /// unknown version; `EXDEV`: the vGPU does not match.
    pub fn restore_context(&self, vgpu_id: u32, snapshot: &[u8]) -> Result<(), DirtyError> {
        let arg = abi::HagContextBuf {
            vgpu_id,
            reserved: 0,
            buf: snapshot.as_ptr().expose_provenance() as u64,
            buf_bytes: snapshot.len() as u64,
            used_bytes: 0,
        };
        // SAFETY: `self.file` is open for the call; `arg` is a live
        // `HagContextBuf` whose `buf` is the address of `snapshot`,
        // `buf_bytes` readable bytes borrowed for the call; the kernel only
        // reads them.
        unsafe { ioctl_ctx::restore_context(self.file.as_raw_fd(), &arg) }
            .map_err(Self::ctx_err("IOC_RESTORE_CONTEXT", vgpu_id))?;
        Ok(())
    }
}

/// Accepts a version answer only from a module of this build's ABI.
pub fn check_version(raw: &HagVersion) -> Result<ModuleInfo, AbiMismatch> {
    if raw.abi_version != abi::ABI_VERSION {
        return Err(AbiMismatch {
            module: raw.abi_version,
        });
    }
    Ok(ModuleInfo {
        abi_version: raw.abi_version,
        features: raw.features,
        module_version: decode_module_version(&raw.module_version),
    })
}

/// Decodes the NUL-padded version string. A module is not trusted to send
/// UTF-8 or a terminating NUL; bad bytes become U+FFFD rather than an error,
/// since the string is only ever shown.
pub fn decode_module_version(bytes: &[u8; 32]) -> String {
    let len = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..len]).into_owned()
}

/// Given the array size just used and the module's `count`, returns `None`
/// if the answer was complete, or the size to retry with.
pub fn next_capacity(capacity: u32, count: u32) -> Result<Option<u32>, ListError> {
    if count <= capacity {
        return Ok(None);
    }
    if count > abi::LIST_MAX_CAPACITY {
        return Err(ListError::TooMany { count });
    }
    Ok(Some(
        count
            .saturating_add(GROWTH_SLACK)
            .min(abi::LIST_MAX_CAPACITY),
    ))
}

/// Parses a UUID's canonical text form (case-insensitive) into the
/// text-order bytes [`HagVgpuInfo::uuid`] carries.
pub fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let b = text.as_bytes();
    if b.len() != 36 {
        return None;
    }
    let mut out = [0u8; 16];
    let mut n = 0;
    let mut i = 0;
    while i < 36 {
        if matches!(i, 8 | 13 | 18 | 23) {
            if b[i] != b'-' {
                return None;
            }
            i += 1;
            continue;
        }
        let hi = char::from(b[i]).to_digit(16)?;
        let lo = char::from(*b.get(i + 1)?).to_digit(16)?;
        *out.get_mut(n)? = (hi * 16 + lo) as u8;
        n += 1;
        i += 2;
    }
    (n == 16).then_some(out)
}

/// Number of `u64` words a dirty bitmap of `bytes` bytes of guest memory
/// (one bit per [`abi::DIRTY_PAGE_SIZE`] page) needs.
pub fn bitmap_words(bytes: u64) -> usize {
    let pages = bytes.div_ceil(abi::DIRTY_PAGE_SIZE);
    pages.div_ceil(64) as usize
}

/// The page numbers set in a dirty bitmap, ascending: bit `i % 64` of the
/// little-endian word `i / 64` is page `i`.
pub fn bitmap_pages(bitmap: &[u64]) -> impl Iterator<Item = u64> + '_ {
    bitmap.iter().enumerate().flat_map(|(w, &word)| {
        (0..64u64)
            .filter(move |bit| word & (1 << bit) != 0)
            .map(move |bit| w as u64 * 64 + bit)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version_bytes(s: &[u8]) -> [u8; 32] {
        let mut out = [0u8; 32];
        out[..s.len()].copy_from_slice(s);
        out
    }

    #[test]
    fn same_abi_is_accepted() {
        let raw = HagVersion {
            abi_version: abi::ABI_VERSION,
            features: abi::FEATURE_SIM_VGPU,
            vgpu_count: 2,
            reserved: 0,
            module_version: version_bytes(b"0.1.0"),
        };
        let info = check_version(&raw).unwrap();
        assert_eq!(info.abi_version, abi::ABI_VERSION);
        assert_eq!(info.features, abi::FEATURE_SIM_VGPU);
        assert_eq!(info.module_version, "0.1.0");
    }

    #[test]
    fn other_abi_is_refused_with_both_numbers() {
        let raw = HagVersion {
            abi_version: abi::ABI_VERSION + 1,
            ..HagVersion::default()
        };
        let err = check_version(&raw).unwrap_err();
        assert_eq!(err.module, abi::ABI_VERSION + 1);
        assert_eq!(
            err.to_string(),
            format!(
                "hag_mdev speaks ABI {}, this program speaks ABI {}: use the hagctl and hag-vmm built with the module",
                abi::ABI_VERSION + 1,
                abi::ABI_VERSION
            )
        );
    }

    #[test]
    fn module_version_stops_at_first_nul() {
        assert_eq!(
            decode_module_version(&version_bytes(b"1.2.3\0junk")),
            "1.2.3"
        );
        assert_eq!(decode_module_version(&[0; 32]), "");
    }

    #[test]
    fn module_version_without_nul_uses_all_32_bytes() {
        assert_eq!(decode_module_version(&[b'a'; 32]), "a".repeat(32));
    }

    #[test]
    fn module_version_non_utf8_is_replaced_not_fatal() {
        let s = decode_module_version(&version_bytes(b"0.1\xff\xfe"));
        assert_eq!(s, "0.1\u{fffd}\u{fffd}");
    }

    #[test]
    fn list_that_fits_needs_no_retry() {
        assert_eq!(next_capacity(16, 0), Ok(None));
        assert_eq!(next_capacity(16, 16), Ok(None));
    }

    #[test]
    fn list_that_overflows_grows_with_slack_within_the_cap() {
        assert_eq!(next_capacity(16, 17), Ok(Some(17 + GROWTH_SLACK)));
        assert_eq!(
            next_capacity(16, abi::LIST_MAX_CAPACITY),
            Ok(Some(abi::LIST_MAX_CAPACITY))
        );
    }

    #[test]
    fn list_larger_than_the_cap_is_refused() {
        assert_eq!(
            next_capacity(16, abi::LIST_MAX_CAPACITY + 1),
            Err(ListError::TooMany {
                count: abi::LIST_MAX_CAPACITY + 1
            })
        );
    }
    #[test]
    fn uuid_text_round_trips() {
        let text = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001";
        let uuid = parse_uuid(text).unwrap();
        let mut out = [0u8; 36];
        abi::format_uuid(&uuid, &mut out);
        assert_eq!(&out, text.as_bytes());
        assert_eq!(parse_uuid(&text.to_uppercase()), Some(uuid));
    }

    #[test]
    fn bad_uuids_are_refused() {
        for bad in [
            "",
            "83b8f4f2-509f-382f-3c1e-e6bfe0fa100",
            "83b8f4f2-509f-382f-3c1e-e6bfe0fa10011",
            "83b8f4f2x509f-382f-3c1e-e6bfe0fa1001",
            "83b8f4f2-509f-382f-3c1e-e6bfe0fa100g",
            "83b8f4f2-509f-382f-3c1e-e6bfe0fa10é",
        ] {
            assert_eq!(parse_uuid(bad), None, "{bad}");
        }
    }

    #[test]
    fn bitmap_sizes() {
        assert_eq!(bitmap_words(0), 0);
        assert_eq!(bitmap_words(4096), 1);
        assert_eq!(bitmap_words(64 * 4096), 1);
        assert_eq!(bitmap_words(64 * 4096 + 1), 2);
        assert_eq!(bitmap_words(64 << 20), 256);
    }

    #[test]
    fn bitmap_bits_are_pages() {
        let bitmap = [0b1001u64, 0, 1 << 63, 1];
        let pages: Vec<u64> = bitmap_pages(&bitmap).collect();
        assert_eq!(pages, vec![0, 3, 2 * 64 + 63, 3 * 64]);
        assert_eq!(bitmap_pages(&[]).count(), 0);
    }
}
