//! `/dev/hag`: open it, check its ABI version, list its vGPUs.
//!
//! The two ioctls are the only `unsafe` in hagctl. Everything that decides
//! something about their answers ([`check_version`], [`next_capacity`]) is a
//! plain function of values, so it is tested without the module.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use hag_abi::abi::{self, HagVersion, HagVgpuInfo, HagVgpuList};
use nix::errno::Errno;

mod ioctl {
    use hag_abi::abi::{HagVersion, HagVgpuList, IOC_LIST_VGPUS, IOC_VERSION};

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
}

/// The module speaks another ABI than this hagctl; nothing it answers can be
/// trusted to mean what this build thinks.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "hag_mdev speaks ABI {module}, this hagctl speaks ABI {}: use the hagctl built with the module",
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
    #[error(
        "cannot open {}: permission denied (run hagctl as root)",
        abi::DEVICE_PATH
    )]
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
                "hag_mdev speaks ABI {}, this hagctl speaks ABI {}: use the hagctl built with the module",
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
}
