//! Command encodings: every opcode, length and field this crate decodes or
//! encodes, in one place.
//!
//! Values follow Intel's public programmer's reference manuals for Broadwell
//! (Gen8, "Volume 2a: Command Reference: Instructions") and Skylake (Gen9),
//! cross-checked against i915's `gt/intel_gpu_commands.h` and the GVT-g
//! command parser (`gvt/cmd_parser.c`). Each block names the PRM command.
//!
//! A command's first dword is its header. Bits 31:29 select the client:
//! 0 = MI (memory interface), 2 = 2D blitter, 3 = render (3D/PIPE_CONTROL).
//! "Length" fields hold the total dword count minus 2 ("bias 2").

/// Bits 31:29 of a header: the command client.
pub const CLIENT_SHIFT: u32 = 29;
/// Client of MI_* commands.
pub const CLIENT_MI: u32 = 0;
/// Client of the 2D blitter (XY_*_BLT) commands.
pub const CLIENT_2D: u32 = 2;
/// Client of render commands (PIPE_CONTROL).
pub const CLIENT_RENDER: u32 = 3;

/// MI commands: opcode in bits 28:23.
pub const MI_OPCODE_SHIFT: u32 = 23;
/// Mask of the MI opcode after shifting.
pub const MI_OPCODE_MASK: u32 = 0x3f;
/// 2D commands: opcode in bits 28:22.
pub const BLT_OPCODE_SHIFT: u32 = 22;
/// Mask of the 2D opcode after shifting.
pub const BLT_OPCODE_MASK: u32 = 0x7f;
/// Length (total dwords - 2) in bits 7:0, the usual place.
pub const LEN_MASK_8: u32 = 0xff;
/// MI_FLUSH_DW keeps its length in bits 5:0.
pub const LEN_MASK_6: u32 = 0x3f;
/// MI_STORE_DATA_IMM keeps its length in bits 9:0.
pub const LEN_MASK_10: u32 = 0x3ff;

/// Builds an MI header from its opcode (bits 28:23).
pub const fn mi(opcode: u32) -> u32 {
    (CLIENT_MI << CLIENT_SHIFT) | (opcode << MI_OPCODE_SHIFT)
}

/// Builds a 2D header from its opcode (bits 28:22).
pub const fn blt(opcode: u32) -> u32 {
    (CLIENT_2D << CLIENT_SHIFT) | (opcode << BLT_OPCODE_SHIFT)
}

// ---- MI_NOOP (PRM: MI_NOOP), 1 dword. Bit 22 writes bits 21:0 to the
// NOPID register; harmless, accepted.
/// MI_NOOP opcode.
pub const OP_MI_NOOP: u32 = 0x00;
/// MI_NOOP header bits the auditor accepts (NOP identification).
pub const MI_NOOP_ALLOWED: u32 = 0x007f_ffff;

// ---- MI_USER_INTERRUPT (PRM: MI_USER_INTERRUPT), 1 dword, no fields.
/// MI_USER_INTERRUPT opcode.
pub const OP_MI_USER_INTERRUPT: u32 = 0x02;

// ---- MI_ARB_CHECK (PRM: MI_ARB_CHECK), 1 dword, no fields: a preemption
// point (the engine may switch context here). Writes no memory.
/// MI_ARB_CHECK opcode.
pub const OP_MI_ARB_CHECK: u32 = 0x05;

// ---- MI_ARB_ON_OFF (PRM: MI_ARB_ON_OFF), 1 dword. Bit 0 enables (1) or
// disables (0) arbitration, i.e. whether MI_ARB_CHECK and batch boundaries
// may preempt. i915 frames every batch start with it. Writes no memory.
/// MI_ARB_ON_OFF opcode.
pub const OP_MI_ARB_ON_OFF: u32 = 0x08;
/// Bit 0: arbitration enable.
pub const MI_ARB_ENABLE: u32 = 1 << 0;

// ---- MI_BATCH_BUFFER_END (PRM: MI_BATCH_BUFFER_END), 1 dword.
/// MI_BATCH_BUFFER_END opcode.
pub const OP_MI_BATCH_BUFFER_END: u32 = 0x0a;

// ---- MI_SEMAPHORE_WAIT (PRM: MI_SEMAPHORE_WAIT, Gen8+), 4 dwords:
// DW1 semaphore data, DW2 address 31:2, DW3 address 47:32. Reads only.
/// MI_SEMAPHORE_WAIT opcode.
pub const OP_MI_SEMAPHORE_WAIT: u32 = 0x1c;
/// MI_SEMAPHORE_WAIT dwords.
pub const MI_SEMAPHORE_WAIT_DWORDS: u32 = 4;
/// Bit 22: the address is in the global GTT.
pub const MI_SEMAPHORE_GGTT: u32 = 1 << 22;
/// Bit 15: wait mode (1 = polling).
pub const MI_SEMAPHORE_POLL: u32 = 1 << 15;
/// Bits 14:12: compare operation.
pub const MI_SEMAPHORE_COMPARE_SHIFT: u32 = 12;
/// Header bits accepted besides opcode and length.
pub const MI_SEMAPHORE_ALLOWED: u32 = MI_SEMAPHORE_GGTT | MI_SEMAPHORE_POLL | (7 << 12);

// ---- MI_STORE_DATA_IMM (PRM: MI_STORE_DATA_IMM), Gen8: 4 dwords (dword
// store, length 2) or 5 dwords (bit 21 "Store Qword", length 3). DW1 address
// 31:2 (bit 0: core mode enable), DW2 address 47:32, DW3.. data.
/// MI_STORE_DATA_IMM opcode.
pub const OP_MI_STORE_DATA_IMM: u32 = 0x20;
/// Bit 22: "Use Global GTT".
pub const MI_SDI_GGTT: u32 = 1 << 22;
/// Bit 21: "Store Qword".
pub const MI_SDI_QWORD: u32 = 1 << 21;
/// DW1 bit 0: "Core Mode Enable" (address offset by core; refused).
pub const MI_SDI_CORE_MODE: u32 = 1 << 0;

// ---- MI_STORE_DATA_INDEX (PRM: MI_STORE_DATA_INDEX), Gen8: 3 dwords
// (length 1) or 4 dwords with bit 21 "Store Qword" (length 2). DW1 bits 11:2
// offset into the hardware status page.
/// MI_STORE_DATA_INDEX opcode.
pub const OP_MI_STORE_DATA_INDEX: u32 = 0x21;
/// Bit 22: "Use Per-Process Hardware Status Page" (refused).
pub const MI_SDX_PPHWSP: u32 = 1 << 22;
/// Bit 21: "Store Qword".
pub const MI_SDX_QWORD: u32 = 1 << 21;
/// DW1 bits that may hold the offset.
pub const MI_SDX_OFFSET_MASK: u32 = 0xffc;

// ---- MI_LOAD_REGISTER_IMM (PRM: MI_LOAD_REGISTER_IMM): length 2n-1 for n
// (register, value) pairs. Bits 11:8 byte write disables, bit 12 force
// posted. Register offset in bits 22:2 of each pair's first dword.
/// MI_LOAD_REGISTER_IMM opcode.
pub const OP_MI_LOAD_REGISTER_IMM: u32 = 0x22;
/// Bits 11:8: byte write disables.
pub const MI_LRI_BYTE_DISABLE_SHIFT: u32 = 8;
/// Header bits accepted besides opcode and length.
pub const MI_LRI_ALLOWED: u32 = (1 << 12) | (0xf << 8);

// ---- MI_STORE_REGISTER_MEM (PRM: MI_STORE_REGISTER_MEM), Gen8: 4 dwords.
// DW1 register, DW2 address 31:2, DW3 address 47:32. Writes 4 bytes.
/// MI_STORE_REGISTER_MEM opcode.
pub const OP_MI_STORE_REGISTER_MEM: u32 = 0x24;
/// MI_STORE_REGISTER_MEM dwords.
pub const MI_SRM_DWORDS: u32 = 4;
/// Bit 22: "Use Global GTT" (SRM and LRM).
pub const MI_SRM_LRM_GGTT: u32 = 1 << 22;
/// Bit 21: SRM predicate enable / LRM async mode.
pub const MI_SRM_LRM_BIT21: u32 = 1 << 21;

// ---- MI_FLUSH_DW (PRM: MI_FLUSH_DW), Gen8: 4 dwords (length 2) or 5
// (length 3, qword data). Bits 15:14 post-sync operation, bit 21 store data
// index, DW1 bit 2 destination address type (1 = GGTT), DW1 31:3 address.
/// MI_FLUSH_DW opcode.
pub const OP_MI_FLUSH_DW: u32 = 0x26;
/// Bit 21: "Store Data Index" (address is an offset into the HWSP).
pub const MI_FLUSH_DW_STORE_INDEX: u32 = 1 << 21;
/// Bits 15:14: post-sync operation.
pub const MI_FLUSH_DW_OP_SHIFT: u32 = 14;
/// Bit 8: notify enable (interrupt).
pub const MI_FLUSH_DW_NOTIFY: u32 = 1 << 8;
/// DW1 bit 2: destination address type, 1 = GGTT.
pub const MI_FLUSH_DW_USE_GTT: u32 = 1 << 2;
/// Header bits accepted besides opcode and length: protected memory (22),
/// store index (21), TLB invalidate (18), flush CCS (16), post-sync op
/// (15:14), flush LLC (9), notify (8), invalidate BSD (7).
pub const MI_FLUSH_DW_ALLOWED: u32 =
    (1 << 22) | (1 << 21) | (1 << 18) | (1 << 16) | (3 << 14) | (1 << 9) | (1 << 8) | (1 << 7);

// ---- MI_LOAD_REGISTER_MEM (PRM: MI_LOAD_REGISTER_MEM), Gen8: 4 dwords.
/// MI_LOAD_REGISTER_MEM opcode.
pub const OP_MI_LOAD_REGISTER_MEM: u32 = 0x29;
/// MI_LOAD_REGISTER_MEM dwords.
pub const MI_LRM_DWORDS: u32 = 4;

// ---- MI_COPY_MEM_MEM (PRM: MI_COPY_MEM_MEM, Gen8+), 5 dwords: DW1-2
// destination, DW3-4 source. Bit 22 source in GGTT, bit 21 destination in
// GGTT. Copies one dword.
/// MI_COPY_MEM_MEM opcode.
pub const OP_MI_COPY_MEM_MEM: u32 = 0x2e;
/// MI_COPY_MEM_MEM dwords.
pub const MI_COPY_MEM_MEM_DWORDS: u32 = 5;
/// Bit 22: "Use Global GTT Source".
pub const MI_CMM_GGTT_SRC: u32 = 1 << 22;
/// Bit 21: "Use Global GTT Destination".
pub const MI_CMM_GGTT_DST: u32 = 1 << 21;

// ---- MI_ATOMIC (PRM: MI_ATOMIC, Gen8+): 3 dwords, or 11 with inline data
// (bit 18). Bit 22 memory type (1 = GGTT), 21 post-sync operation, 20:19
// data size (0 dword, 1 qword, 2 octword), 17 CS stall, 16 return data
// control, 15:8 atomic opcode. DW1 address 31:2, DW2 address 47:32.
/// MI_ATOMIC opcode.
pub const OP_MI_ATOMIC: u32 = 0x2f;
/// Bit 22: the address is in the global GTT.
pub const MI_ATOMIC_GGTT: u32 = 1 << 22;
/// Bit 21: post-sync operation.
pub const MI_ATOMIC_POST_SYNC: u32 = 1 << 21;
/// Bits 20:19: data size.
pub const MI_ATOMIC_SIZE_SHIFT: u32 = 19;
/// Bit 18: inline data (8 dwords follow the address).
pub const MI_ATOMIC_INLINE: u32 = 1 << 18;
/// Bit 17: CS stall.
pub const MI_ATOMIC_CS_STALL: u32 = 1 << 17;
/// Bit 16: return data control (pre-op value written back; refused).
pub const MI_ATOMIC_RETURN_DATA: u32 = 1 << 16;
/// Bits 15:8: atomic opcode.
pub const MI_ATOMIC_OPCODE_SHIFT: u32 = 8;
/// MI_ATOMIC dwords without inline data.
pub const MI_ATOMIC_DWORDS: u32 = 3;
/// MI_ATOMIC dwords with inline data.
pub const MI_ATOMIC_INLINE_DWORDS: u32 = 11;

// ---- MI_BATCH_BUFFER_START (PRM: MI_BATCH_BUFFER_START), Gen8: 3 dwords
// (length 1). Bit 22 second-level batch, bit 16 add offset enable, bit 15
// predication enable, bit 8 address space indicator (1 = PPGTT). DW1
// address 31:2, DW2 address 47:32.
/// MI_BATCH_BUFFER_START opcode.
pub const OP_MI_BATCH_BUFFER_START: u32 = 0x31;
/// MI_BATCH_BUFFER_START dwords on Gen8+.
pub const MI_BB_START_DWORDS: u32 = 3;
/// Bit 22: second-level batch (returns on MI_BATCH_BUFFER_END).
pub const MI_BB_SECOND_LEVEL: u32 = 1 << 22;
/// Bit 16: add offset enable (refused).
pub const MI_BB_ADD_OFFSET: u32 = 1 << 16;
/// Bit 15: predication enable (refused).
pub const MI_BB_PREDICATE: u32 = 1 << 15;
/// Bit 8: address space indicator, 1 = PPGTT (refused).
pub const MI_BB_PPGTT: u32 = 1 << 8;

// ---- PIPE_CONTROL (PRM: PIPE_CONTROL), Gen8/9: 6 dwords. Header type 3,
// subtype 3, opcode 2, sub-opcode 0. DW1 flags: 24 destination address type
// (1 = GGTT), 23 LRI post-sync operation, 21 store data index, 15:14
// post-sync operation (1 write immediate, 2 write PS depth count, 3 write
// timestamp; each writes a qword), 8 notify. DW2 address 31:2, DW3 address
// 47:32, DW4-5 immediate data.
/// PIPE_CONTROL header without length.
pub const PIPE_CONTROL: u32 = (3 << 29) | (3 << 27) | (2 << 24);
/// Bits 31:16 that identify PIPE_CONTROL.
pub const PIPE_CONTROL_ID_MASK: u32 = 0xffff_0000;
/// PIPE_CONTROL dwords on Gen8/9.
pub const PIPE_CONTROL_DWORDS: u32 = 6;
/// DW1 bit 24: destination address type, 1 = GGTT.
pub const PC_GLOBAL_GTT: u32 = 1 << 24;
/// DW1 bit 23: LRI post-sync operation (writes a register; refused).
pub const PC_LRI_POST_SYNC: u32 = 1 << 23;
/// DW1 bit 21: store data index (address is an offset into the HWSP).
pub const PC_STORE_DATA_INDEX: u32 = 1 << 21;
/// DW1 bit 20: CS stall.
pub const PC_CS_STALL: u32 = 1 << 20;
/// DW1 bits 15:14: post-sync operation.
pub const PC_POST_SYNC_SHIFT: u32 = 14;
/// DW1 bit 8: notify enable.
pub const PC_NOTIFY: u32 = 1 << 8;

// ---- Post-sync operation values (MI_FLUSH_DW and PIPE_CONTROL bits 15:14).
/// No write.
pub const POST_SYNC_NONE: u32 = 0;
/// Write the immediate data.
pub const POST_SYNC_WRITE_IMM: u32 = 1;
/// PIPE_CONTROL: write the PS depth count (reserved on MI_FLUSH_DW).
pub const POST_SYNC_DEPTH_COUNT: u32 = 2;
/// Write the timestamp.
pub const POST_SYNC_TIMESTAMP: u32 = 3;

// ---- 2D blitter. XY_COLOR_BLT (PRM: XY_COLOR_BLT), Gen8: 7 dwords. DW0
// bit 11 tiling enable, bits 21:20 32bpp byte mask. DW1 bit 30 clipping,
// 25:24 color depth, 23:16 ROP, 15:0 pitch. DW2 Y1:X1, DW3 Y2:X2 (exclusive),
// DW4-5 destination base, DW6 color.
/// XY_COLOR_BLT opcode.
pub const OP_XY_COLOR_BLT: u32 = 0x50;
/// XY_COLOR_BLT dwords on Gen8+.
pub const XY_COLOR_BLT_DWORDS: u32 = 7;

// XY_SRC_COPY_BLT (PRM: XY_SRC_COPY_BLT), Gen8: 10 dwords. DW0 bit 15 source
// tiled, bit 11 destination tiled, 21:20 byte mask. DW1 as XY_COLOR_BLT.
// DW2 dst Y1:X1, DW3 dst Y2:X2, DW4-5 dst base, DW6 src Y1:X1, DW7 src
// pitch 15:0, DW8-9 src base.
/// XY_SRC_COPY_BLT opcode.
pub const OP_XY_SRC_COPY_BLT: u32 = 0x53;
/// XY_SRC_COPY_BLT dwords on Gen8+.
pub const XY_SRC_COPY_BLT_DWORDS: u32 = 10;
/// XY_SRC_COPY_BLT DW0 bit 15: source tiled.
pub const XY_SRC_TILED: u32 = 1 << 15;
/// XY_COLOR_BLT / XY_SRC_COPY_BLT DW0 bit 11: destination tiled.
pub const XY_DST_TILED: u32 = 1 << 11;
/// DW0 bits 21:20: 32bpp write enables (alpha, RGB).
pub const XY_WRITE_RGBA: u32 = 3 << 20;
/// DW1 bits 25:24: color depth of the legacy XY blits.
pub const XY_DEPTH_SHIFT: u32 = 24;
/// Legacy depth values: 8 bpp.
pub const XY_DEPTH_8: u32 = 0;
/// Legacy depth values: 16 bpp 565.
pub const XY_DEPTH_16_565: u32 = 1;
/// Legacy depth values: 16 bpp 1555.
pub const XY_DEPTH_16_1555: u32 = 2;
/// Legacy depth values: 32 bpp.
pub const XY_DEPTH_32: u32 = 3;
/// DW1 bits 23:16: raster operation.
pub const XY_ROP_SHIFT: u32 = 16;
/// DW1 bit 30: clipping enable (only narrows the write).
pub const XY_CLIP_ENABLE: u32 = 1 << 30;

// XY_FAST_COPY_BLT (PRM: XY_FAST_COPY_BLT, Gen9+), 10 dwords. DW0 bits 21:20
// source tiling, 14:13 destination tiling (0 = linear). DW1 bits 26:24 color
// depth (0 8 bpp, 1 16, 3 32, 4 64, 5 128), 15:0 destination pitch. Other
// dwords as XY_SRC_COPY_BLT.
/// XY_FAST_COPY_BLT opcode.
pub const OP_XY_FAST_COPY_BLT: u32 = 0x42;
/// XY_FAST_COPY_BLT dwords.
pub const XY_FAST_COPY_BLT_DWORDS: u32 = 10;
/// DW0 bits 21:20: source tiling.
pub const XY_FAST_SRC_TILING: u32 = 3 << 20;
/// DW0 bits 14:13: destination tiling.
pub const XY_FAST_DST_TILING: u32 = 3 << 13;
/// DW1 bits 26:24: fast-copy color depth.
pub const XY_FAST_DEPTH_MASK: u32 = 7 << 24;

/// Bytes per pixel of a legacy XY blit depth code (DW1 bits 25:24).
pub const fn xy_bpp(depth: u32) -> u8 {
    match depth & 3 {
        XY_DEPTH_8 => 1,
        XY_DEPTH_16_565 | XY_DEPTH_16_1555 => 2,
        _ => 4,
    }
}

/// Bytes per pixel of an XY_FAST_COPY_BLT depth code (DW1 bits 26:24), or
/// `None` for a reserved code.
pub const fn fast_bpp(depth: u32) -> Option<u8> {
    match depth {
        0 => Some(1),
        1 => Some(2),
        3 => Some(4),
        4 => Some(8),
        5 => Some(16),
        _ => None,
    }
}

/// The XY_FAST_COPY_BLT depth code for `bpp` bytes per pixel.
pub const fn fast_depth(bpp: u8) -> Option<u32> {
    match bpp {
        1 => Some(0),
        2 => Some(1),
        4 => Some(3),
        8 => Some(4),
        16 => Some(5),
        _ => None,
    }
}

/// The commands this auditor knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// MI_NOOP
    Noop,
    /// MI_USER_INTERRUPT
    UserInterrupt,
    /// MI_ARB_CHECK
    ArbCheck,
    /// MI_ARB_ON_OFF
    ArbOnOff,
    /// MI_BATCH_BUFFER_END
    BatchEnd,
    /// MI_BATCH_BUFFER_START
    BatchStart,
    /// MI_SEMAPHORE_WAIT
    SemaphoreWait,
    /// MI_STORE_DATA_IMM
    StoreDataImm,
    /// MI_STORE_DATA_INDEX
    StoreDataIndex,
    /// MI_LOAD_REGISTER_IMM
    LoadRegisterImm,
    /// MI_STORE_REGISTER_MEM
    StoreRegisterMem,
    /// MI_FLUSH_DW
    FlushDw,
    /// MI_LOAD_REGISTER_MEM
    LoadRegisterMem,
    /// MI_COPY_MEM_MEM
    CopyMemMem,
    /// MI_ATOMIC
    Atomic,
    /// PIPE_CONTROL
    PipeControl,
    /// XY_COLOR_BLT
    XyColorBlt,
    /// XY_SRC_COPY_BLT
    XySrcCopyBlt,
    /// XY_FAST_COPY_BLT
    XyFastCopyBlt,
}

impl Op {
    /// Identifies the command a header starts, or `None` if it is unknown.
    pub const fn from_header(header: u32) -> Option<Op> {
        match header >> CLIENT_SHIFT {
            CLIENT_MI => match (header >> MI_OPCODE_SHIFT) & MI_OPCODE_MASK {
                OP_MI_NOOP => Some(Op::Noop),
                OP_MI_USER_INTERRUPT => Some(Op::UserInterrupt),
                OP_MI_ARB_CHECK => Some(Op::ArbCheck),
                OP_MI_ARB_ON_OFF => Some(Op::ArbOnOff),
                OP_MI_BATCH_BUFFER_END => Some(Op::BatchEnd),
                OP_MI_SEMAPHORE_WAIT => Some(Op::SemaphoreWait),
                OP_MI_STORE_DATA_IMM => Some(Op::StoreDataImm),
                OP_MI_STORE_DATA_INDEX => Some(Op::StoreDataIndex),
                OP_MI_LOAD_REGISTER_IMM => Some(Op::LoadRegisterImm),
                OP_MI_STORE_REGISTER_MEM => Some(Op::StoreRegisterMem),
                OP_MI_FLUSH_DW => Some(Op::FlushDw),
                OP_MI_LOAD_REGISTER_MEM => Some(Op::LoadRegisterMem),
                OP_MI_COPY_MEM_MEM => Some(Op::CopyMemMem),
                OP_MI_ATOMIC => Some(Op::Atomic),
                OP_MI_BATCH_BUFFER_START => Some(Op::BatchStart),
                _ => None,
            },
            CLIENT_2D => match (header >> BLT_OPCODE_SHIFT) & BLT_OPCODE_MASK {
                OP_XY_COLOR_BLT => Some(Op::XyColorBlt),
                OP_XY_SRC_COPY_BLT => Some(Op::XySrcCopyBlt),
                OP_XY_FAST_COPY_BLT => Some(Op::XyFastCopyBlt),
                _ => None,
            },
            CLIENT_RENDER if header & PIPE_CONTROL_ID_MASK == PIPE_CONTROL => Some(Op::PipeControl),
            _ => None,
        }
    }

    /// The PRM name of the command.
    pub const fn name(self) -> &'static str {
        match self {
            Op::Noop => "MI_NOOP",
            Op::UserInterrupt => "MI_USER_INTERRUPT",
            Op::ArbCheck => "MI_ARB_CHECK",
            Op::ArbOnOff => "MI_ARB_ON_OFF",
            Op::BatchEnd => "MI_BATCH_BUFFER_END",
            Op::BatchStart => "MI_BATCH_BUFFER_START",
            Op::SemaphoreWait => "MI_SEMAPHORE_WAIT",
            Op::StoreDataImm => "MI_STORE_DATA_IMM",
            Op::StoreDataIndex => "MI_STORE_DATA_INDEX",
            Op::LoadRegisterImm => "MI_LOAD_REGISTER_IMM",
            Op::StoreRegisterMem => "MI_STORE_REGISTER_MEM",
            Op::FlushDw => "MI_FLUSH_DW",
            Op::LoadRegisterMem => "MI_LOAD_REGISTER_MEM",
            Op::CopyMemMem => "MI_COPY_MEM_MEM",
            Op::Atomic => "MI_ATOMIC",
            Op::PipeControl => "PIPE_CONTROL",
            Op::XyColorBlt => "XY_COLOR_BLT",
            Op::XySrcCopyBlt => "XY_SRC_COPY_BLT",
            Op::XyFastCopyBlt => "XY_FAST_COPY_BLT",
        }
    }
}

/// The PRM name of the command a header starts ("unknown command" if none).
pub const fn command_name(header: u32) -> &'static str {
    match Op::from_header(header) {
        Some(op) => op.name(),
        None => "unknown command",
    }
}
