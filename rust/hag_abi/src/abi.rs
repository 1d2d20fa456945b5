//! `/dev/hag` ioctls and the `hag` generic netlink family.
//!
//! Plain `core` only: this file is compiled into the kernel module as well.
//! Every structure is `#[repr(C)]`, made of fixed-size integers with explicit
//! padding fields, so its bytes mean the same on both sides and it has no
//! uninitialised padding to leak from the kernel.

/// The version of everything in this file. Bump on any change to a number,
/// a layout or a meaning; `hagctl` refuses a module of another version.
/// Structures grow only at their end (3: [`HagVgpuStats`] gained
/// `precise_workloads` and `fallback_workloads`), so every field keeps its
/// offset across versions.
pub const ABI_VERSION: u32 = 3;

/// The misc device's name; userspace opens `/dev/` + this.
pub const DEVICE_NAME: &str = "hag";
/// The path `hagctl` opens.
pub const DEVICE_PATH: &str = "/dev/hag";
/// The same names NUL-terminated, for the C interfaces that take them.
pub const DEVICE_NAME_C: &[u8] = b"hag\0";

/// The mdev type id of hag's simulated vGPU: its directory is
/// `/sys/class/mdev_bus/hag/mdev_supported_types/hag-sim`.
pub const SIM_TYPE_NAME: &str = "hag-sim";
/// What the module registers as the type's `sysfs_name`: the mdev core
/// prefixes the parent's class name and a dash, giving [`SIM_TYPE_NAME`].
pub const SIM_TYPE_SYSFS_NAME_C: &[u8] = b"sim\0";
/// The mdev parent device's name (under `/sys/devices/virtual/hag/`).
pub const PARENT_NAME_C: &[u8] = b"hag\0";

/// Graphics memory of one simulated vGPU, in bytes (aperture and hidden
/// graphics memory together).
pub const SIM_GFX_MEM_SIZE: u64 = 64 << 20;
/// How many simulated vGPUs the parent offers at once.
pub const SIM_MAX_INSTANCES: u32 = 8;

// ---------------------------------------------------------------------------
// ioctl numbers (asm-generic encoding, as on x86, arm64 and riscv)

const IOC_NRBITS: u32 = 8;
const IOC_TYPEBITS: u32 = 8;
const IOC_SIZEBITS: u32 = 14;
const IOC_NRSHIFT: u32 = 0;
const IOC_TYPESHIFT: u32 = IOC_NRSHIFT + IOC_NRBITS;
const IOC_SIZESHIFT: u32 = IOC_TYPESHIFT + IOC_TYPEBITS;
const IOC_DIRSHIFT: u32 = IOC_SIZESHIFT + IOC_SIZEBITS;
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// The ioctl type byte of `/dev/hag` (unused in the kernel's
/// `ioctl-number.rst` table as of 6.12).
pub const IOC_MAGIC: u8 = 0xB8;

const fn ioc(dir: u32, nr: u8, size: usize) -> u32 {
    // Sizes come from the structures below; a structure too large for the
    // 14-bit field would be a bug in this file, caught at compile time.
    assert!(size < (1 << IOC_SIZEBITS));
    (dir << IOC_DIRSHIFT)
        | ((IOC_MAGIC as u32) << IOC_TYPESHIFT)
        | ((nr as u32) << IOC_NRSHIFT)
        | ((size as u32) << IOC_SIZESHIFT)
}

/// `_IOR(IOC_MAGIC, 0, HagVersion)`: read the module's ABI version and build.
pub const IOC_VERSION: u32 = ioc(IOC_READ, 0x00, core::mem::size_of::<HagVersion>());
/// `_IOWR(IOC_MAGIC, 1, HagVgpuList)`: list the vGPUs.
pub const IOC_LIST_VGPUS: u32 = ioc(
    IOC_READ | IOC_WRITE,
    0x01,
    core::mem::size_of::<HagVgpuList>(),
);

/// `_IOW(IOC_MAGIC, 2, HagDirtyStart)`: start GPU dirty logging of a vGPU
/// over one guest RAM range (replacing any earlier range; bits start clear).
pub const IOC_DIRTY_START: u32 = ioc(IOC_WRITE, 0x02, core::mem::size_of::<HagDirtyStart>());
/// `_IOW(IOC_MAGIC, 3, HagVgpuRef)`: stop dirty logging and free the bitmap.
pub const IOC_DIRTY_STOP: u32 = ioc(IOC_WRITE, 0x03, core::mem::size_of::<HagVgpuRef>());
/// `_IOWR(IOC_MAGIC, 4, HagDirtyRead)`: copy the dirty bitmap out and clear
/// it, atomically with respect to the engine (no bit is lost in between).
pub const IOC_DIRTY_READ_CLEAR: u32 = ioc(
    IOC_READ | IOC_WRITE,
    0x04,
    core::mem::size_of::<HagDirtyRead>(),
);
/// `_IOWR(IOC_MAGIC, 5, HagVgpuStats)`: a vGPU's counters.
pub const IOC_VGPU_STATS: u32 = ioc(
    IOC_READ | IOC_WRITE,
    0x05,
    core::mem::size_of::<HagVgpuStats>(),
);
/// `_IOW(IOC_MAGIC, 6, HagWatchdog)`: set a vGPU's hang timeout.
pub const IOC_SET_WATCHDOG: u32 = ioc(IOC_WRITE, 0x06, core::mem::size_of::<HagWatchdog>());
/// `_IOW(IOC_MAGIC, 7, HagVgpuRef)`: declare the vGPU hung now, as the
/// watchdog would. Refused with `EPERM` unless the module was loaded with
/// `allow_hang_injection=1` (for tests).
pub const IOC_INJECT_HANG: u32 = ioc(IOC_WRITE, 0x07, core::mem::size_of::<HagVgpuRef>());

/// `_IOW(IOC_MAGIC, 8, HagQuiesce)`: hold new submissions of a vGPU and
/// wait until its engine is idle. Fails with `ETIMEDOUT` (and holds
/// nothing) if the engine is still busy after `timeout_ms`; a hung or
/// stopped engine counts as idle (it runs nothing). The hold belongs to the
/// open file of `/dev/hag` that took it (the last to quiesce or restore):
/// when that file is released (closed, or its process died) the vGPU is
/// resumed. If the hold goes while the call waits (the VMM closed the
/// device, which resets it, or another opener resumed it) it fails with
/// `ECANCELED`. Every per-vGPU ioctl fails with `ENODEV` once its vGPU is
/// removed, also one already in progress when the remove happened (ABI 3).
pub const IOC_QUIESCE: u32 = ioc(IOC_WRITE, 0x08, core::mem::size_of::<HagQuiesce>());
/// `_IOW(IOC_MAGIC, 9, HagVgpuRef)`: release a quiesced vGPU; submissions
/// held meanwhile start.
pub const IOC_RESUME: u32 = ioc(IOC_WRITE, 0x09, core::mem::size_of::<HagVgpuRef>());
/// `_IOWR(IOC_MAGIC, 10, HagContextBuf)`: write a quiesced vGPU's context
/// snapshot (format: [`crate::snapshot`]) to `buf`; `EINVAL` if `reserved`
/// is not 0, `EBUSY` if not quiesced, `ENOSPC` (with `used_bytes` set to the
/// size needed) if `buf` is too small.
pub const IOC_SAVE_CONTEXT: u32 = ioc(
    IOC_READ | IOC_WRITE,
    0x0a,
    core::mem::size_of::<HagContextBuf>(),
);
/// `_IOW(IOC_MAGIC, 11, HagContextBuf)`: restore a snapshot into a vGPU
/// that is quiesced or has no work. Refused with `EINVAL` when the snapshot
/// is damaged (magic, checksum, lengths), `EPROTO` for an unknown version,
/// `EXDEV` when the vGPU does not match (type, graphics memory size). The vGPU stays quiesced after a restore, held as by [`IOC_QUIESCE`].
pub const IOC_RESTORE_CONTEXT: u32 = ioc(IOC_WRITE, 0x0b, core::mem::size_of::<HagContextBuf>());

/// Argument of [`IOC_QUIESCE`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HagQuiesce {
    /// The vGPU's id.
    pub vgpu_id: u32,
    /// How long to wait for the engine, in milliseconds (at most
    /// [`QUIESCE_MAX_MS`]).
    pub timeout_ms: u32,
}

/// Longest quiesce wait accepted.
pub const QUIESCE_MAX_MS: u32 = 60_000;

/// Argument of [`IOC_SAVE_CONTEXT`] and [`IOC_RESTORE_CONTEXT`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HagContextBuf {
    /// The vGPU's id.
    pub vgpu_id: u32,
    /// Explicit padding; must be zero.
    pub reserved: u32,
    /// User address of the snapshot bytes.
    pub buf: u64,
    /// Size of that buffer (restore: of the snapshot).
    pub buf_bytes: u64,
    /// Save: bytes written (or needed, with `ENOSPC`).
    pub used_bytes: u64,
}

/// Largest snapshot either ioctl handles, for any kind of vGPU: a GVT-g
/// vGPU's virtual registers (2 MiB) and GGTT entries (8 MiB for a 4 GiB
/// GGTT) must fit, with room for GVT's parts to grow.
pub const CONTEXT_MAX_BYTES: u64 = 64 << 20;

/// Largest snapshot a simulated vGPU accepts, through the ioctls or its VFIO
/// migration data file (its own snapshots are a few KiB).
pub const SIM_CONTEXT_MAX_BYTES: u64 = 1 << 20;

/// Names one vGPU by its id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HagVgpuRef {
    /// The vGPU's id.
    pub vgpu_id: u32,
    /// Explicit padding; must be zero.
    pub reserved: u32,
}

/// Argument of [`IOC_DIRTY_START`]: log writes to guest physical addresses
/// `[gpa, gpa + size)`, one bit per 4 KiB page. `gpa` and `size` are page
/// aligned and `size` is at most [`DIRTY_MAX_BYTES`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HagDirtyStart {
    /// The vGPU's id.
    pub vgpu_id: u32,
    /// Explicit padding; must be zero.
    pub reserved: u32,
    /// First guest physical address logged.
    pub gpa: u64,
    /// Bytes logged.
    pub size: u64,
}

/// Largest range one vGPU's dirty log covers (64 GiB: a 2 MiB bitmap).
pub const DIRTY_MAX_BYTES: u64 = 64 << 30;
/// Page size of the dirty log.
pub const DIRTY_PAGE_SIZE: u64 = 4096;

/// Argument of [`IOC_DIRTY_READ_CLEAR`]. Bit `i` of the bitmap (bit `i % 64`
/// of little-endian u64 word `i / 64`) is page `gpa + i * 4096` of the logged
/// range. `bitmap_bytes` must be at least `ceil(pages / 64) * 8`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HagDirtyRead {
    /// In: the vGPU's id.
    pub vgpu_id: u32,
    /// Explicit padding; must be zero.
    pub reserved: u32,
    /// In: user address of the bitmap buffer.
    pub bitmap: u64,
    /// In: size of that buffer in bytes.
    pub bitmap_bytes: u64,
    /// Out: pages set in the copied bitmap.
    pub dirty_pages: u64,
}

/// Argument of [`IOC_VGPU_STATS`]: `vgpu_id` in, counters out (since the
/// vGPU was created).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HagVgpuStats {
    /// In: the vGPU's id.
    pub vgpu_id: u32,
    /// Out: one of `VGPU_STATE_*`.
    pub state: u32,
    /// Submissions (doorbell writes) audited.
    pub submissions: u64,
    /// Submissions rejected by the auditor.
    pub rejected: u64,
    /// Commands executed by the engine.
    pub commands: u64,
    /// Pages marked dirty by audited write sets (counted at each marking).
    pub pages_marked: u64,
    /// Interrupts delivered to the VMM.
    pub interrupts: u64,
    /// Hangs (watchdog or injected).
    pub hangs: u64,
    /// Watchdog timeout in milliseconds.
    pub watchdog_ms: u32,
    /// Explicit padding; always zero.
    pub reserved: u32,
    /// Bytes the vGPU's engine really wrote to guest memory (every write
    /// counted, rewrites too; hag-sim only, 0 for a GVT-g vGPU). Against
    /// `pages_marked` it shows how much the audit over-approximates.
    pub bytes_written: u64,
    /// Workloads whose write set the audit modelled precisely: only their
    /// own audited pages were marked. hag-sim: every submission the
    /// auditor accepted (it runs only audited commands, so there is no
    /// other kind). GVT-g: counted when GVT says the workload is done
    /// (until then it may still take the fallback).
    pub precise_workloads: u64,
    /// Workloads that took the fallback: hag could not model them (on
    /// Gen9, 3D, compute and media work), or lost track of them, and
    /// marked every page the vGPU can reach instead. GVT-g only; always 0
    /// for hag-sim, which rejects what it cannot model. `submissions -
    /// precise_workloads - fallback_workloads` are still in flight (GVT-g)
    /// or were rejected (hag-sim: `rejected`).
    pub fallback_workloads: u64,
}

/// Argument of [`IOC_SET_WATCHDOG`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HagWatchdog {
    /// The vGPU's id.
    pub vgpu_id: u32,
    /// Hang timeout in milliseconds, [`WATCHDOG_MIN_MS`]..=[`WATCHDOG_MAX_MS`].
    pub timeout_ms: u32,
}

/// Default hang timeout.
pub const WATCHDOG_DEFAULT_MS: u32 = 2000;
/// Shortest hang timeout accepted.
pub const WATCHDOG_MIN_MS: u32 = 50;
/// Longest hang timeout accepted.
pub const WATCHDOG_MAX_MS: u32 = 600_000;

/// Answer of [`IOC_VERSION`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HagVersion {
    /// [`ABI_VERSION`] of the module.
    pub abi_version: u32,
    /// Bit set of `FEATURE_*`.
    pub features: u32,
    /// Number of vGPUs that exist now.
    pub vgpu_count: u32,
    /// Explicit padding; always zero.
    pub reserved: u32,
    /// The module's version string, NUL-padded.
    pub module_version: [u8; 32],
}

/// Feature bit: the simulated vGPU type `hag-sim` is offered.
pub const FEATURE_SIM_VGPU: u32 = 1 << 0;
/// Feature bit: the module was built with i915 GVT-g support.
pub const FEATURE_GVT: u32 = 1 << 1;

/// Every feature bit with its name, as `hagctl status` prints it.
pub const FEATURES: [(u32, &str); 2] = [(FEATURE_SIM_VGPU, "sim"), (FEATURE_GVT, "gvt")];

/// Argument of [`IOC_LIST_VGPUS`]. Userspace sets `entries` to an array of
/// `capacity` [`HagVgpuInfo`]; the module fills `min(capacity, count)` of
/// them and sets `count` to how many vGPUs exist (so a caller whose array was
/// too small learns the size to retry with).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HagVgpuList {
    /// In: length of the array at `entries`, in entries.
    pub capacity: u32,
    /// Out: number of vGPUs.
    pub count: u32,
    /// In: user address of the array.
    pub entries: u64,
}

/// Upper bound on `capacity` the module accepts, so a hostile caller cannot
/// make it walk a huge user range.
pub const LIST_MAX_CAPACITY: u32 = 1024;

/// One vGPU in the answer of [`IOC_LIST_VGPUS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HagVgpuInfo {
    /// The module's id for the vGPU, unique while the module is loaded.
    pub id: u32,
    /// One of `VGPU_SOURCE_*`.
    pub source: u32,
    /// One of `VGPU_STATE_*`.
    pub state: u32,
    /// Explicit padding; always zero.
    pub reserved: u32,
    /// The mdev's UUID, in the byte order of its text form.
    pub uuid: [u8; 16],
    /// Graphics memory size in bytes.
    pub gfx_mem_size: u64,
}

/// The vGPU is hag's simulated vGPU (mdev type [`SIM_TYPE_NAME`]).
pub const VGPU_SOURCE_SIM: u32 = 1;
/// The vGPU is an i915 GVT-g vGPU.
pub const VGPU_SOURCE_GVT: u32 = 2;

/// Created, no VMM has opened it.
pub const VGPU_STATE_IDLE: u32 = 1;
/// A VMM has the VFIO device open.
pub const VGPU_STATE_OPEN: u32 = 2;

/// Name of a `VGPU_SOURCE_*` value.
pub const fn source_name(source: u32) -> &'static str {
    match source {
        VGPU_SOURCE_SIM => "sim",
        VGPU_SOURCE_GVT => "gvt",
        _ => "unknown",
    }
}

/// Name of a `VGPU_STATE_*` value.
pub const fn state_name(state: u32) -> &'static str {
    match state {
        VGPU_STATE_IDLE => "idle",
        VGPU_STATE_OPEN => "open",
        _ => "unknown",
    }
}

// ---------------------------------------------------------------------------
// The `hag` generic netlink family

/// Family name, as resolved through `nlctrl`.
pub const GENL_NAME: &str = "hag";
/// [`GENL_NAME`], NUL-terminated.
pub const GENL_NAME_C: &[u8] = b"hag\0";
/// Family version (the genetlink header's `version`); equals [`ABI_VERSION`].
pub const GENL_VERSION: u8 = ABI_VERSION as u8;
/// The multicast group that carries events.
pub const GENL_MCGRP_EVENTS: &str = "events";
/// [`GENL_MCGRP_EVENTS`], NUL-terminated.
pub const GENL_MCGRP_EVENTS_C: &[u8] = b"events\0";

/// Command 0 is reserved as invalid.
pub const CMD_UNSPEC: u8 = 0;
/// An event, multicast to [`GENL_MCGRP_EVENTS`].
pub const CMD_EVENT: u8 = 1;

/// Attribute 0 is reserved as invalid.
pub const ATTR_UNSPEC: u16 = 0;
/// u32: one of `EVENT_*`.
pub const ATTR_EVENT: u16 = 1;
/// u32: the vGPU's id.
pub const ATTR_VGPU_ID: u16 = 2;
/// binary, 16 bytes: the vGPU's UUID.
pub const ATTR_VGPU_UUID: u16 = 3;
/// u64: `ktime_get_ns()` when the event happened.
pub const ATTR_TIMESTAMP_NS: u16 = 4;
/// NUL-terminated string: a human-readable detail.
pub const ATTR_MESSAGE: u16 = 5;
/// Padding attribute for 64-bit alignment (`nla_put_u64_64bit`); skip it.
pub const ATTR_PAD: u16 = 6;
/// Highest attribute number.
pub const ATTR_MAX: u16 = ATTR_PAD;

/// A vGPU was created.
pub const EVENT_VGPU_CREATED: u32 = 1;
/// A vGPU was removed.
pub const EVENT_VGPU_REMOVED: u32 = 2;
/// A vGPU hung (its ring stopped advancing).
pub const EVENT_VGPU_HUNG: u32 = 3;
/// A command buffer was rejected by the auditor.
pub const EVENT_COMMAND_REJECTED: u32 = 4;
/// A vGPU changed state (opened, closed, quiesced, resumed).
pub const EVENT_STATE_CHANGED: u32 = 5;

/// Name of an `EVENT_*` value, as `hagctl events` prints it.
pub const fn event_name(event: u32) -> &'static str {
    match event {
        EVENT_VGPU_CREATED => "vgpu-created",
        EVENT_VGPU_REMOVED => "vgpu-removed",
        EVENT_VGPU_HUNG => "vgpu-hung",
        EVENT_COMMAND_REJECTED => "command-rejected",
        EVENT_STATE_CHANGED => "state-changed",
        _ => "unknown",
    }
}

/// Converts the kernel's `guid_t` (how mdev stores its UUID: the first three
/// fields little-endian, as `guid_parse` writes them) to the text-order bytes
/// that [`HagVgpuInfo::uuid`] and [`ATTR_VGPU_UUID`] carry.
pub fn uuid_from_guid(guid: [u8; 16]) -> [u8; 16] {
    let mut uuid = guid;
    uuid[0..4].reverse();
    uuid[4..6].reverse();
    uuid[6..8].reverse();
    uuid
}

/// Formats a UUID in its canonical text form into `out`.
pub fn format_uuid(uuid: &[u8; 16], out: &mut [u8; 36]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut pos = 0;
    for (i, byte) in uuid.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            out[pos] = b'-';
            pos += 1;
        }
        out[pos] = HEX[usize::from(byte >> 4)];
        out[pos + 1] = HEX[usize::from(byte & 0xf)];
        pos += 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_are_fixed() {
        // These sizes are ABI: a change here must bump ABI_VERSION.
        assert_eq!(size_of::<HagVersion>(), 48);
        assert_eq!(size_of::<HagVgpuList>(), 16);
        assert_eq!(size_of::<HagVgpuInfo>(), 40);
        assert_eq!(size_of::<HagVgpuRef>(), 8);
        assert_eq!(size_of::<HagDirtyStart>(), 24);
        assert_eq!(size_of::<HagDirtyRead>(), 32);
        assert_eq!(size_of::<HagVgpuStats>(), 88);
        // Fields are only ever appended: the ones of ABI 2 keep their
        // offsets.
        assert_eq!(core::mem::offset_of!(HagVgpuStats, bytes_written), 64);
        assert_eq!(core::mem::offset_of!(HagVgpuStats, precise_workloads), 72);
        assert_eq!(core::mem::offset_of!(HagVgpuStats, fallback_workloads), 80);
        assert_eq!(size_of::<HagWatchdog>(), 8);
        assert_eq!(size_of::<HagQuiesce>(), 8);
        assert_eq!(size_of::<HagContextBuf>(), 32);
    }

    #[test]
    fn ioctl_numbers_match_the_c_macros() {
        // _IOR(0xB8, 0, 48) and _IOWR(0xB8, 1, 16) as computed by <linux/ioctl.h>.
        assert_eq!(IOC_VERSION, 0x8030_B800);
        assert_eq!(IOC_LIST_VGPUS, 0xC010_B801);
        // _IOWR(0xB8, 5, 88): the size is in the number, so an ABI 2 caller
        // (72 bytes) gets ENOTTY rather than a short answer.
        assert_eq!(IOC_VGPU_STATS, 0xC058_B805);
    }

    #[test]
    fn c_names_match_rust_names() {
        for (c, s) in [
            (DEVICE_NAME_C, DEVICE_NAME),
            (GENL_NAME_C, GENL_NAME),
            (GENL_MCGRP_EVENTS_C, GENL_MCGRP_EVENTS),
        ] {
            assert_eq!(&c[..c.len() - 1], s.as_bytes());
            assert_eq!(c[c.len() - 1], 0);
        }
        assert_eq!(DEVICE_PATH.strip_prefix("/dev/"), Some(DEVICE_NAME));
        // The mdev type directory is "<parent class>-<sysfs_name>".
        let class = &PARENT_NAME_C[..PARENT_NAME_C.len() - 1];
        let sysfs = &SIM_TYPE_SYSFS_NAME_C[..SIM_TYPE_SYSFS_NAME_C.len() - 1];
        let (prefix, rest) = SIM_TYPE_NAME.as_bytes().split_at(class.len());
        assert_eq!(prefix, class);
        assert_eq!(rest.split_first(), Some((&b'-', sysfs)));
    }

    #[test]
    fn uuid_text_form() {
        let uuid = [
            0x83, 0xb8, 0xf4, 0xf2, 0x50, 0x9f, 0x38, 0x2f, 0x3c, 0x1e, 0xe6, 0xbf, 0xe0, 0xfa,
            0x10, 0x01,
        ];
        let mut out = [0u8; 36];
        format_uuid(&uuid, &mut out);
        assert_eq!(&out, b"83b8f4f2-509f-382f-3c1e-e6bfe0fa1001");
    }

    #[test]
    fn guid_bytes_become_text_order() {
        // guid_parse("b54d4a7a-6c3d-41bd-8840-5ea38cd9e9b2") stores these bytes.
        let guid = [
            0x7a, 0x4a, 0x4d, 0xb5, 0x3d, 0x6c, 0xbd, 0x41, 0x88, 0x40, 0x5e, 0xa3, 0x8c, 0xd9,
            0xe9, 0xb2,
        ];
        let mut out = [0u8; 36];
        format_uuid(&uuid_from_guid(guid), &mut out);
        assert_eq!(&out, b"b54d4a7a-6c3d-41bd-8840-5ea38cd9e9b2");
    }

    #[test]
    fn names_cover_every_value() {
        for e in [
            EVENT_VGPU_CREATED,
            EVENT_VGPU_REMOVED,
            EVENT_VGPU_HUNG,
            EVENT_COMMAND_REJECTED,
            EVENT_STATE_CHANGED,
        ] {
            assert_ne!(event_name(e), "unknown");
        }
        assert_eq!(event_name(0), "unknown");
        assert_eq!(source_name(VGPU_SOURCE_SIM), "sim");
        assert_eq!(state_name(VGPU_STATE_OPEN), "open");
    }
}
