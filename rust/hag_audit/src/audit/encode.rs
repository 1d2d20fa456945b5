//! Builds the dwords of each supported command, for tests, a guest driver
//! and the kernel's own tests. Encoders never panic: fields wider than their
//! bits are masked, so feeding the result to [`audit`](super::audit) is the
//! check that the parameters were valid.
//!
//! Every address is a global-GTT address; every encoder sets the GGTT bits.
//! [`batch_buffer_start_ppgtt`] starts a PPGTT batch, and [`ppgtt`] turns a
//! command's memory operands into PPGTT ones (as a guest's user-mode driver
//! emits them).

use super::opcodes::*;

fn lo(addr: u64) -> u32 {
    addr as u32
}

fn hi(addr: u64) -> u32 {
    (addr >> 32) as u32
}

/// MI header with a length field for `dwords` total dwords.
const fn mi_len(opcode: u32, dwords: u32) -> u32 {
    mi(opcode) | (dwords - 2)
}

/// MI_NOOP.
pub const fn noop() -> [u32; 1] {
    [mi(OP_MI_NOOP)]
}

/// MI_USER_INTERRUPT.
pub const fn user_interrupt() -> [u32; 1] {
    [mi(OP_MI_USER_INTERRUPT)]
}

/// MI_ARB_CHECK.
pub const fn arb_check() -> [u32; 1] {
    [mi(OP_MI_ARB_CHECK)]
}

/// MI_ARB_ON_OFF: arbitration on (`enable`) or off.
pub const fn arb_on_off(enable: bool) -> [u32; 1] {
    [mi(OP_MI_ARB_ON_OFF) | if enable { MI_ARB_ENABLE } else { 0 }]
}

/// MI_BATCH_BUFFER_END.
pub const fn batch_buffer_end() -> [u32; 1] {
    [mi(OP_MI_BATCH_BUFFER_END)]
}

/// MI_BATCH_BUFFER_START of the batch at `addr` (GGTT); `second_level`
/// returns after the batch's MI_BATCH_BUFFER_END, otherwise it is a jump.
pub fn batch_buffer_start(addr: u64, second_level: bool) -> [u32; 3] {
    let level = if second_level { MI_BB_SECOND_LEVEL } else { 0 };
    [
        mi_len(OP_MI_BATCH_BUFFER_START, MI_BB_START_DWORDS) | level,
        lo(addr),
        hi(addr) & 0xffff,
    ]
}

/// MI_BATCH_BUFFER_START of the batch at `addr` in the PPGTT (address space
/// indicator set: the batch runs non-privileged), as i915 starts user
/// batches and user-mode drivers chain them.
pub fn batch_buffer_start_ppgtt(addr: u64, second_level: bool) -> [u32; 3] {
    let [h, lo, hi] = batch_buffer_start(addr, second_level);
    [h | MI_BB_PPGTT, lo, hi]
}

/// The same command with its "use global GTT" bits cleared, so that in the
/// ring or a GGTT batch its memory operands are PPGTT addresses. Commands
/// without such a bit (batch starts, status page forms, blits) come back
/// unchanged; so does anything too short to be the command it claims.
pub fn ppgtt<const N: usize>(mut cmd: [u32; N]) -> [u32; N] {
    let Some(&h) = cmd.first() else {
        return cmd;
    };
    let (dword, bits) = match Op::from_header(h) {
        Some(Op::StoreDataImm) => (0, MI_SDI_GGTT),
        Some(Op::StoreRegisterMem | Op::LoadRegisterMem) => (0, MI_SRM_LRM_GGTT),
        Some(Op::CopyMemMem) => (0, MI_CMM_GGTT_SRC | MI_CMM_GGTT_DST),
        Some(Op::Atomic) => (0, MI_ATOMIC_GGTT),
        Some(Op::SemaphoreWait) => (0, MI_SEMAPHORE_GGTT),
        Some(Op::FlushDw) if h & MI_FLUSH_DW_STORE_INDEX == 0 => (1, MI_FLUSH_DW_USE_GTT),
        Some(Op::PipeControl) => match cmd.get(1) {
            Some(f) if f & PC_STORE_DATA_INDEX == 0 => (1, PC_GLOBAL_GTT),
            _ => return cmd,
        },
        _ => return cmd,
    };
    if let Some(d) = cmd.get_mut(dword) {
        *d &= !bits;
    }
    cmd
}

/// MI_STORE_DATA_IMM writing the dword `value` at `addr`.
pub fn store_data_imm(addr: u64, value: u32) -> [u32; 4] {
    [
        mi_len(OP_MI_STORE_DATA_IMM, 4) | MI_SDI_GGTT,
        lo(addr),
        hi(addr) & 0xffff,
        value,
    ]
}

/// MI_STORE_DATA_IMM writing the qword `value` at `addr` (8-byte aligned).
pub fn store_qword_imm(addr: u64, value: u64) -> [u32; 5] {
    [
        mi_len(OP_MI_STORE_DATA_IMM, 5) | MI_SDI_GGTT | MI_SDI_QWORD,
        lo(addr),
        hi(addr) & 0xffff,
        lo(value),
        hi(value),
    ]
}

/// MI_STORE_DATA_INDEX writing the dword `value` at `offset` in the status
/// page.
pub fn store_data_index(offset: u16, value: u32) -> [u32; 3] {
    [
        mi_len(OP_MI_STORE_DATA_INDEX, 3),
        u32::from(offset) & MI_SDX_OFFSET_MASK,
        value,
    ]
}

/// MI_STORE_DATA_INDEX writing the qword `value` at `offset` in the status
/// page.
pub fn store_qword_index(offset: u16, value: u64) -> [u32; 4] {
    [
        mi_len(OP_MI_STORE_DATA_INDEX, 4) | MI_SDX_QWORD,
        u32::from(offset) & MI_SDX_OFFSET_MASK,
        lo(value),
        hi(value),
    ]
}

/// MI_LOAD_REGISTER_IMM header for `pairs` (1 to 128) register/value pairs
/// that follow it.
pub fn load_register_imm_header(pairs: u8) -> u32 {
    let pairs = u32::from(pairs.clamp(1, 128));
    mi(OP_MI_LOAD_REGISTER_IMM) | (2 * pairs - 1)
}

/// MI_LOAD_REGISTER_IMM of one register.
pub fn load_register_imm(reg: u32, value: u32) -> [u32; 3] {
    [load_register_imm_header(1), reg, value]
}

/// MI_STORE_REGISTER_MEM: stores register `reg` at `addr`.
pub fn store_register_mem(reg: u32, addr: u64) -> [u32; 4] {
    [
        mi_len(OP_MI_STORE_REGISTER_MEM, MI_SRM_DWORDS) | MI_SRM_LRM_GGTT,
        reg,
        lo(addr),
        hi(addr) & 0xffff,
    ]
}

/// MI_LOAD_REGISTER_MEM: loads register `reg` from `addr`.
pub fn load_register_mem(reg: u32, addr: u64) -> [u32; 4] {
    [
        mi_len(OP_MI_LOAD_REGISTER_MEM, MI_LRM_DWORDS) | MI_SRM_LRM_GGTT,
        reg,
        lo(addr),
        hi(addr) & 0xffff,
    ]
}

/// MI_COPY_MEM_MEM: copies the dword at `src` to `dst`.
pub fn copy_mem_mem(dst: u64, src: u64) -> [u32; 5] {
    [
        mi_len(OP_MI_COPY_MEM_MEM, MI_COPY_MEM_MEM_DWORDS) | MI_CMM_GGTT_SRC | MI_CMM_GGTT_DST,
        lo(dst),
        hi(dst) & 0xffff,
        lo(src),
        hi(src) & 0xffff,
    ]
}

/// MI_ATOMIC header bits for `opcode` and data size `size` (0 dword, 1
/// qword, 2 octword).
fn atomic_header(opcode: u8, size: u8, dwords: u32) -> u32 {
    mi_len(OP_MI_ATOMIC, dwords)
        | MI_ATOMIC_GGTT
        | ((u32::from(size) & 3) << MI_ATOMIC_SIZE_SHIFT)
        | (u32::from(opcode) << MI_ATOMIC_OPCODE_SHIFT)
}

/// MI_ATOMIC `opcode` on the `size`-coded operand at `addr`, operands from
/// the command streamer's registers.
pub fn atomic(addr: u64, opcode: u8, size: u8) -> [u32; 3] {
    [
        atomic_header(opcode, size, MI_ATOMIC_DWORDS),
        lo(addr),
        hi(addr) & 0xffff,
    ]
}

/// MI_ATOMIC with inline operands.
pub fn atomic_inline(addr: u64, opcode: u8, size: u8, data: [u32; 8]) -> [u32; 11] {
    let [d0, d1, d2, d3, d4, d5, d6, d7] = data;
    [
        atomic_header(opcode, size, MI_ATOMIC_INLINE_DWORDS) | MI_ATOMIC_INLINE,
        lo(addr),
        hi(addr) & 0xffff,
        d0,
        d1,
        d2,
        d3,
        d4,
        d5,
        d6,
        d7,
    ]
}

/// MI_FLUSH_DW without a post-sync write.
pub const fn flush_dw() -> [u32; 4] {
    [mi_len(OP_MI_FLUSH_DW, 4), 0, 0, 0]
}

/// MI_FLUSH_DW writing the dword `value` at `addr` (8-byte aligned) after
/// the flush.
pub fn flush_dw_store(addr: u64, value: u32) -> [u32; 4] {
    [
        mi_len(OP_MI_FLUSH_DW, 4) | (POST_SYNC_WRITE_IMM << MI_FLUSH_DW_OP_SHIFT),
        lo(addr) | MI_FLUSH_DW_USE_GTT,
        hi(addr) & 0xffff,
        value,
    ]
}

/// MI_FLUSH_DW writing the qword `value` at `addr` (8-byte aligned).
pub fn flush_dw_store_qword(addr: u64, value: u64) -> [u32; 5] {
    [
        mi_len(OP_MI_FLUSH_DW, 5) | (POST_SYNC_WRITE_IMM << MI_FLUSH_DW_OP_SHIFT),
        lo(addr) | MI_FLUSH_DW_USE_GTT,
        hi(addr) & 0xffff,
        lo(value),
        hi(value),
    ]
}

/// MI_FLUSH_DW writing the dword `value` at `offset` in the status page
/// (store data index), raising an interrupt if `notify`.
pub fn flush_dw_store_index(offset: u16, value: u32, notify: bool) -> [u32; 4] {
    let notify = if notify { MI_FLUSH_DW_NOTIFY } else { 0 };
    [
        mi_len(OP_MI_FLUSH_DW, 4)
            | MI_FLUSH_DW_STORE_INDEX
            | (POST_SYNC_WRITE_IMM << MI_FLUSH_DW_OP_SHIFT)
            | notify,
        (u32::from(offset) & 0xff8) | MI_FLUSH_DW_USE_GTT,
        0,
        value,
    ]
}

/// MI_FLUSH_DW writing the timestamp at `addr` (8-byte aligned).
pub fn flush_dw_timestamp(addr: u64) -> [u32; 4] {
    [
        mi_len(OP_MI_FLUSH_DW, 4) | (POST_SYNC_TIMESTAMP << MI_FLUSH_DW_OP_SHIFT),
        lo(addr) | MI_FLUSH_DW_USE_GTT,
        hi(addr) & 0xffff,
        0,
    ]
}

/// PIPE_CONTROL with DW1 `flags` and no post-sync write (post-sync bits of
/// `flags` are cleared).
pub fn pipe_control(flags: u32) -> [u32; 6] {
    [
        PIPE_CONTROL | (PIPE_CONTROL_DWORDS - 2),
        flags & !(3 << PC_POST_SYNC_SHIFT) & !PC_LRI_POST_SYNC,
        0,
        0,
        0,
        0,
    ]
}

/// PIPE_CONTROL writing the qword `value` at `addr` (8-byte aligned, GGTT)
/// after the flushes in `flags`.
pub fn pipe_control_write_imm(flags: u32, addr: u64, value: u64) -> [u32; 6] {
    let [h, f, ..] = pipe_control(flags);
    [
        h,
        f | PC_GLOBAL_GTT | (POST_SYNC_WRITE_IMM << PC_POST_SYNC_SHIFT),
        lo(addr),
        hi(addr) & 0xffff,
        lo(value),
        hi(value),
    ]
}

/// PIPE_CONTROL writing the timestamp at `addr` (8-byte aligned, GGTT).
pub fn pipe_control_timestamp(flags: u32, addr: u64) -> [u32; 6] {
    let [h, f, ..] = pipe_control(flags);
    [
        h,
        f | PC_GLOBAL_GTT | (POST_SYNC_TIMESTAMP << PC_POST_SYNC_SHIFT),
        lo(addr),
        hi(addr) & 0xffff,
        0,
        0,
    ]
}

/// MI_SEMAPHORE_WAIT polling `addr` until compare operation `compare`
/// (bits 14:12) holds against `data`.
pub fn semaphore_wait(addr: u64, data: u32, compare: u8) -> [u32; 4] {
    [
        mi_len(OP_MI_SEMAPHORE_WAIT, MI_SEMAPHORE_WAIT_DWORDS)
            | MI_SEMAPHORE_GGTT
            | MI_SEMAPHORE_POLL
            | ((u32::from(compare) & 7) << MI_SEMAPHORE_COMPARE_SHIFT),
        data,
        lo(addr),
        hi(addr) & 0xffff,
    ]
}

/// A linear rectangle for the blit encoders: `width` × `height` pixels at
/// (`x`, `y`) of a surface at `base` with `pitch` bytes per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlitRect {
    /// Surface base address.
    pub base: u64,
    /// Bytes per row.
    pub pitch: u16,
    /// Left edge.
    pub x: u16,
    /// Top edge.
    pub y: u16,
}

fn yx(y: u16, x: u16) -> u32 {
    (u32::from(y) << 16) | u32::from(x)
}

/// The legacy XY depth code for `bpp` bytes per pixel (1, 2 as 565, else 4).
fn legacy_depth(bpp: u8) -> u32 {
    match bpp {
        1 => XY_DEPTH_8,
        2 => XY_DEPTH_16_565,
        _ => XY_DEPTH_32,
    }
}

/// XY_COLOR_BLT filling `width` × `height` pixels of `dst` with `color`
/// (ROP 0xF0, pattern copy).
pub fn xy_color_blt(dst: BlitRect, bpp: u8, width: u16, height: u16, color: u32) -> [u32; 7] {
    [
        blt(OP_XY_COLOR_BLT) | XY_WRITE_RGBA | (XY_COLOR_BLT_DWORDS - 2),
        (legacy_depth(bpp) << XY_DEPTH_SHIFT) | (0xf0 << XY_ROP_SHIFT) | u32::from(dst.pitch),
        yx(dst.y, dst.x),
        yx(dst.y.wrapping_add(height), dst.x.wrapping_add(width)),
        lo(dst.base),
        hi(dst.base) & 0xffff,
        color,
    ]
}

/// XY_SRC_COPY_BLT copying `width` × `height` pixels from `src` to `dst`
/// (ROP 0xCC, source copy).
pub fn xy_src_copy_blt(
    dst: BlitRect,
    src: BlitRect,
    bpp: u8,
    width: u16,
    height: u16,
) -> [u32; 10] {
    [
        blt(OP_XY_SRC_COPY_BLT) | XY_WRITE_RGBA | (XY_SRC_COPY_BLT_DWORDS - 2),
        (legacy_depth(bpp) << XY_DEPTH_SHIFT) | (0xcc << XY_ROP_SHIFT) | u32::from(dst.pitch),
        yx(dst.y, dst.x),
        yx(dst.y.wrapping_add(height), dst.x.wrapping_add(width)),
        lo(dst.base),
        hi(dst.base) & 0xffff,
        yx(src.y, src.x),
        u32::from(src.pitch),
        lo(src.base),
        hi(src.base) & 0xffff,
    ]
}

/// XY_FAST_COPY_BLT (linear to linear) copying `width` × `height` pixels of
/// `bpp` bytes (1, 2, 4, 8 or 16; others encode as 4) from `src` to `dst`.
pub fn xy_fast_copy_blt(
    dst: BlitRect,
    src: BlitRect,
    bpp: u8,
    width: u16,
    height: u16,
) -> [u32; 10] {
    let depth = fast_depth(bpp).unwrap_or(3);
    [
        blt(OP_XY_FAST_COPY_BLT) | (XY_FAST_COPY_BLT_DWORDS - 2),
        (depth << 24) | u32::from(dst.pitch),
        yx(dst.y, dst.x),
        yx(dst.y.wrapping_add(height), dst.x.wrapping_add(width)),
        lo(dst.base),
        hi(dst.base) & 0xffff,
        yx(src.y, src.x),
        u32::from(src.pitch),
        lo(src.base),
        hi(src.base) & 0xffff,
    ]
}
