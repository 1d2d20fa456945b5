//! The guest-visible interface of the simulated vGPU `hag-sim`: PCI IDs,
//! BAR0 register offsets and bits, GTT layout. `docs/sim-vgpu.md` explains
//! each one; this file is the single source of the numbers, used by the
//! module's device model and by the guest driver (controller/guest-gpu).

/// PCI vendor id (QEMU's own ID for emulated devices).
pub const PCI_VENDOR_ID: u16 = 0x1234;
/// PCI device id ("HG").
pub const PCI_DEVICE_ID: u16 = 0x4847;
/// PCI class code: display controller, other.
pub const PCI_CLASS: u32 = 0x03_8000;
/// PCI revision.
pub const PCI_REVISION: u8 = 1;

/// VFIO region index of BAR0.
pub const BAR0_REGION: u32 = 0;
/// VFIO region index of PCI config space.
pub const CONFIG_REGION: u32 = 7;
/// VFIO regions are at file offset `index << REGION_SHIFT` (as vfio-pci).
pub const REGION_SHIFT: u32 = 40;
/// BAR0 size.
pub const BAR0_SIZE: u64 = 2 << 20;
/// Config space size.
pub const CONFIG_SIZE: u64 = 256;

/// `"HAGS"`.
pub const HAG_ID: u32 = 0x0000;
/// Interface revision, 1.
pub const HAG_REVISION: u32 = 0x0004;
/// Graphics memory size in bytes, low half.
pub const GFX_MEM_SIZE_LO: u32 = 0x0008;
/// Graphics memory size, high half.
pub const GFX_MEM_SIZE_HI: u32 = 0x000C;
/// BAR0 offset of GTT entry 0.
pub const GTT_OFFSET_REG: u32 = 0x0010;
/// Number of GTT entries.
pub const GTT_ENTRIES_REG: u32 = 0x0014;
/// Masked interrupt causes (1 = masked).
pub const INT_MASK: u32 = 0x0020;
/// Interrupt causes that happened (write 1 to clear).
pub const INT_IDENTITY: u32 = 0x0024;
/// Bit 0: interrupts enabled.
pub const INT_ENABLE: u32 = 0x0028;
/// One of `ERROR_*`.
pub const ERROR_STATUS: u32 = 0x0030;
/// Graphics address of the offending command, low half.
pub const ERROR_ADDR_LO: u32 = 0x0034;
/// High half.
pub const ERROR_ADDR_HI: u32 = 0x0038;
/// Header dword of the offending command.
pub const ERROR_HEADER: u32 = 0x003C;
/// Auditor reason code.
pub const ERROR_REASON: u32 = 0x0040;
/// `ENGINE_*` bits.
pub const ENGINE_STATUS: u32 = 0x0044;
/// Write 1 to reset the engine.
pub const RESET: u32 = 0x0048;
/// Ring tail (byte offset); writing it is the doorbell.
pub const RING_TAIL: u32 = 0x2030;
/// Ring head (byte offset), advanced by the engine.
pub const RING_HEAD: u32 = 0x2034;
/// Graphics address of the ring.
pub const RING_START: u32 = 0x2038;
/// Bit 0 enable; bits 20:12 ring pages minus one.
pub const RING_CTL: u32 = 0x203C;
/// Graphics address of the hardware status page.
pub const HWS_PGA: u32 = 0x2080;
/// First general-purpose register; GPR n is `GPR_BASE + 8 n` (low) and
/// `+ 4` (high), n in 0..16. The only registers commands may name.
pub const GPR_BASE: u32 = 0x2600;
/// Number of general-purpose registers.
pub const GPR_COUNT: u32 = 16;

/// Value of [`HAG_ID`].
pub const HAG_ID_VALUE: u32 = 0x4841_4753;
/// Value of [`HAG_REVISION`].
pub const HAG_REVISION_VALUE: u32 = 1;
/// BAR0 offset of the GTT.
pub const GTT_OFFSET: u32 = 0x10_0000;
/// Bytes per GTT entry.
pub const GTT_ENTRY_BYTES: u32 = 8;
/// GTT entry bit: present.
pub const GTT_PRESENT: u64 = 1;
/// GTT entry bits holding the guest physical address (38:12).
pub const GTT_ADDR_MASK: u64 = ((1 << 39) - 1) & !0xfff;

/// `RING_CTL` bit: ring enabled.
pub const RING_CTL_ENABLE: u32 = 1;
/// `RING_CTL` field: ring length in pages minus one, bits 20:12.
pub const RING_CTL_PAGES_SHIFT: u32 = 12;
/// Mask of that field after shifting.
pub const RING_CTL_PAGES_MASK: u32 = 0x1ff;

/// Interrupt cause: MI_USER_INTERRUPT or MI_FLUSH_DW notify.
pub const INT_USER: u32 = 1 << 0;
/// Interrupt cause: a submission was rejected.
pub const INT_COMMAND_ERROR: u32 = 1 << 1;
/// Interrupt cause: the vGPU hung.
pub const INT_HANG: u32 = 1 << 2;
/// Interrupt cause: DMA through an invalid GTT entry or outside guest RAM.
pub const INT_DMA_FAULT: u32 = 1 << 3;

/// `ERROR_STATUS`: no error.
pub const ERROR_NONE: u32 = 0;
/// `ERROR_STATUS`: a submission was rejected.
pub const ERROR_COMMAND_REJECTED: u32 = 1;
/// `ERROR_STATUS`: the vGPU hung.
pub const ERROR_HANG: u32 = 2;
/// `ERROR_STATUS`: a DMA fault.
pub const ERROR_DMA_FAULT: u32 = 3;

/// `ENGINE_STATUS` bit: no work pending.
pub const ENGINE_IDLE: u32 = 1 << 0;
/// `ENGINE_STATUS` bit: hung.
pub const ENGINE_HUNG: u32 = 1 << 1;
/// `ENGINE_STATUS` bit: stopped on an error until reset.
pub const ENGINE_STOPPED: u32 = 1 << 2;
/// `ENGINE_STATUS` bit: quiesced (submissions held).
pub const ENGINE_QUIESCED: u32 = 1 << 3;
