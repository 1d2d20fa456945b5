// SPDX-License-Identifier: GPL-2.0-only
//! The simulated vGPU's engine: executes a submission's validated commands
//! on guest memory, in bounded slices.
//!
//! It trusts the auditor (addresses in range, registers allowed, lengths
//! right) and checks nothing of the guest's again; what it must still
//! handle is what the guest can change after the audit: the GTT (a page no
//! longer mapped is a DMA fault) and memory contents (semaphores, blit
//! sources). A slice ends after [`SLICE_COMMANDS`] commands or
//! [`SLICE_BYTES`] bytes of blit, or when a semaphore is not yet satisfied.

use kernel::prelude::*;
use kernel::time::Ktime;

use super::Sim;
use crate::sim_regs as r;
use crate::audit::{BlitKind, Command, PostSync, ValidatedCommand};
use crate::glue::VgpuHandle;

/// Commands per slice.
const SLICE_COMMANDS: u32 = 256;
/// Blit bytes per slice.
const SLICE_BYTES: u64 = 1 << 20;
/// Deepest call stack (the auditor allows at most 8 levels).
const MAX_FRAMES: usize = 8;

/// Where a batch's `MI_BATCH_BUFFER_END` continues.
#[derive(Clone, Copy)]
enum Frame {
    /// With the next command in the list (the batch was listed inline).
    Inline,
    /// At this index (the batch was re-run from where it was listed).
    Resume(usize),
}

/// A submission in flight: its validated commands and where execution is.
pub(crate) struct Submission {
    cmds: KVec<ValidatedCommand>,
    pc: usize,
    frames: [Frame; MAX_FRAMES],
    depth: usize,
    /// Rows of the current blit already done.
    blit_row: u64,
    /// The ring tail this submission ends at.
    tail: u32,
}

impl Submission {
    pub(crate) fn new(cmds: KVec<ValidatedCommand>, tail: u32) -> Self {
        Self {
            cmds,
            pc: 0,
            frames: [Frame::Inline; MAX_FRAMES],
            depth: 0,
            blit_row: 0,
            tail,
        }
    }

    pub(crate) fn commands(&self) -> &[ValidatedCommand] {
        &self.cmds
    }

    fn push(&mut self, frame: Frame) -> bool {
        let Some(slot) = self.frames.get_mut(self.depth) else { return false };
        *slot = frame;
        self.depth += 1;
        true
    }

    fn pop(&mut self) -> Option<Frame> {
        self.depth = self.depth.checked_sub(1)?;
        self.frames.get(self.depth).copied()
    }
}

pub(super) enum Outcome {
    /// Every command ran.
    Finished,
    /// The slice ended with work left; `stalled` if waiting on memory.
    Progress { head_moved: bool, stalled: bool },
    /// Guest memory at this graphics address could not be reached.
    Fault(u64),
}

enum Step {
    Next,
    Jump(usize),
    /// Not done: run this command again next slice.
    Stall,
}

pub(super) fn run_slice(sim: &mut Sim, handle: &VgpuHandle) -> Outcome {
    let Some(mut run) = sim.run.take() else { return Outcome::Finished };
    let head_before = sim.regs.ring_head;
    let mut budget = SLICE_BYTES;
    let mut outcome = Outcome::Progress { head_moved: false, stalled: false };
    let mut stalled = false;
    for _ in 0..SLICE_COMMANDS {
        let Some(cmd) = run.cmds.get(run.pc).copied() else {
            outcome = Outcome::Finished;
            break;
        };
        if cmd.level == 0 {
            // The guest may move RING_START meanwhile: wrap, never panic.
            sim.regs.ring_head = cmd.gfx_addr.wrapping_sub(u64::from(sim.regs.ring_start)) as u32;
        }
        match execute(sim, handle, &mut run, &cmd, &mut budget) {
            Ok(Step::Next) => {
                run.pc += 1;
                sim.stats.commands += 1;
            }
            Ok(Step::Jump(to)) => {
                run.pc = to;
                sim.stats.commands += 1;
            }
            Ok(Step::Stall) => {
                stalled = true;
                break;
            }
            Err(gfx) => {
                outcome = Outcome::Fault(gfx);
                break;
            }
        }
    }
    if matches!(outcome, Outcome::Progress { .. }) {
        outcome = Outcome::Progress { head_moved: sim.regs.ring_head != head_before, stalled };
    }
    if let Outcome::Finished = outcome {
        sim.regs.ring_head = run.tail;
    }
    sim.run = Some(run);
    outcome
}

fn execute(
    sim: &mut Sim,
    handle: &VgpuHandle,
    run: &mut Submission,
    cmd: &ValidatedCommand,
    budget: &mut u64,
) -> core::result::Result<Step, u64> {
    match cmd.kind {
        // Arbitration only decides where the real engine may preempt; the
        // simulated engine never preempts a submission.
        Command::Noop | Command::ArbCheck | Command::ArbOnOff { .. } => {}
        Command::UserInterrupt => sim.raise(r::INT_USER),
        Command::BatchStart { addr, second_level, level, already_audited, .. } => {
            let call = cmd.level == 0 || second_level;
            if !already_audited {
                if call && !run.push(Frame::Inline) {
                    return Err(addr);
                }
                return Ok(Step::Next);
            }
            // Run the batch again from where the auditor listed it.
            let start = run
                .cmds
                .iter()
                .position(|c| c.gfx_addr == addr && c.level == level)
                .ok_or(addr)?;
            if call && !run.push(Frame::Resume(run.pc + 1)) {
                return Err(addr);
            }
            return Ok(Step::Jump(start));
        }
        Command::BatchEnd => match run.pop() {
            Some(Frame::Resume(to)) => return Ok(Step::Jump(to)),
            Some(Frame::Inline) => {}
            // The auditor refuses MI_BATCH_BUFFER_END in the ring.
            None => return Err(cmd.gfx_addr),
        },
        Command::SemaphoreWait { addr, data, compare, .. } => {
            let value = read_u32(sim, handle, addr)?;
            let holds = match compare {
                0 => value > data,
                1 => value >= data,
                2 => value < data,
                3 => value <= data,
                4 => value == data,
                _ => value != data,
            };
            if !holds {
                return Ok(Step::Stall);
            }
        }
        Command::StoreDataImm { addr, data, qword, .. } | Command::StoreDataIndex { addr, data, qword, .. } => {
            write_data(sim, handle, addr, data, qword)?;
        }
        Command::LoadRegisterImm { reg, value, .. } => set_gpr(sim, reg, value),
        Command::StoreRegisterMem { reg, addr, .. } => {
            let value = gpr(sim, reg);
            write_bytes(sim, handle, addr, &value.to_le_bytes())?;
        }
        Command::LoadRegisterMem { reg, addr, .. } => {
            let value = read_u32(sim, handle, addr)?;
            set_gpr(sim, reg, value);
        }
        Command::CopyMemMem { dst, src, .. } => {
            let value = read_u32(sim, handle, src)?;
            write_bytes(sim, handle, dst, &value.to_le_bytes())?;
        }
        Command::Atomic { addr, len, opcode, inline_data, .. } => {
            atomic(sim, handle, addr, len, opcode, inline_data.map_or([0, 0], |d| [d[0], d[1]]))?;
        }
        Command::FlushDw { post_sync, notify } => {
            post_sync_write(sim, handle, post_sync, false)?;
            if notify {
                sim.raise(r::INT_USER);
            }
        }
        Command::PipeControl { post_sync, .. } => post_sync_write(sim, handle, post_sync, true)?,
        Command::Blit(blit) => {
            let Some(dst) = blit.dst.rect(blit.bpp, blit.width, blit.height) else {
                return Err(blit.dst.base);
            };
            let src = blit.src.and_then(|s| s.rect(blit.bpp, blit.width, blit.height));
            let mut row_buf = [0u8; 512];
            while run.blit_row < dst.rows {
                let row = run.blit_row;
                let dst_row = dst.base + row * dst.pitch;
                let mut done = 0u64;
                while done < dst.row_bytes {
                    let n = (dst.row_bytes - done).min(row_buf.len() as u64) as usize;
                    let buf = &mut row_buf[..n];
                    match (blit.kind, src) {
                        (BlitKind::Color, _) | (_, None) => {
                            let color = blit.color.to_le_bytes();
                            let bpp = usize::from(blit.bpp).max(1);
                            for (i, b) in buf.iter_mut().enumerate() {
                                *b = color[((done as usize + i) % bpp) % 4];
                            }
                        }
                        (_, Some(src)) => {
                            let from = src.base + row * src.pitch + done;
                            sim.gfx_access(handle, from, buf, false)?;
                        }
                    }
                    write_gfx(sim, handle, dst_row + done, buf)?;
                    done += n as u64;
                }
                run.blit_row += 1;
                *budget = budget.saturating_sub(dst.row_bytes.max(1));
                if *budget == 0 && run.blit_row < dst.rows {
                    return Ok(Step::Stall);
                }
            }
            run.blit_row = 0;
        }
    }
    Ok(Step::Next)
}

fn gpr(sim: &Sim, reg: u32) -> u32 {
    let index = (reg.wrapping_sub(r::GPR_BASE) / 4) as usize;
    sim.regs.gpr.get(index).copied().unwrap_or(0)
}

fn set_gpr(sim: &mut Sim, reg: u32, value: u32) {
    let index = (reg.wrapping_sub(r::GPR_BASE) / 4) as usize;
    if let Some(slot) = sim.regs.gpr.get_mut(index) {
        *slot = value;
    }
}

fn read_u32(sim: &Sim, handle: &VgpuHandle, addr: u64) -> core::result::Result<u32, u64> {
    let mut b = [0u8; 4];
    sim.gfx_access(handle, addr, &mut b, false)?;
    Ok(u32::from_le_bytes(b))
}

/// Every engine write to guest memory goes through here, so the
/// `bytes_written` counter is what the GPU really wrote: the measure the
/// audit's (page-granular, superset) write sets are compared with.
fn write_gfx(sim: &mut Sim, handle: &VgpuHandle, addr: u64, buf: &mut [u8]) -> core::result::Result<(), u64> {
    sim.gfx_access(handle, addr, buf, true)?;
    sim.stats.bytes_written = sim.stats.bytes_written.wrapping_add(buf.len() as u64);
    Ok(())
}

fn write_bytes(sim: &mut Sim, handle: &VgpuHandle, addr: u64, bytes: &[u8]) -> core::result::Result<(), u64> {
    let mut buf = [0u8; 8];
    let buf = &mut buf[..bytes.len()];
    buf.copy_from_slice(bytes);
    write_gfx(sim, handle, addr, buf)
}

fn write_data(sim: &mut Sim, handle: &VgpuHandle, addr: u64, data: [u32; 2], qword: bool) -> core::result::Result<(), u64> {
    let value = u64::from(data[0]) | (u64::from(data[1]) << 32);
    let bytes = value.to_le_bytes();
    write_bytes(sim, handle, addr, if qword { &bytes } else { &bytes[..4] })
}

fn post_sync_write(sim: &mut Sim, handle: &VgpuHandle, post_sync: PostSync, qword: bool) -> core::result::Result<(), u64> {
    match post_sync {
        PostSync::None => Ok(()),
        // MI_FLUSH_DW's short form stores a dword; both forms carry the
        // high dword as 0 then, so a non-zero high dword means a qword.
        PostSync::WriteImm { addr, data, .. } => write_data(sim, handle, addr, data, qword || data[1] != 0),
        PostSync::DepthCount { addr, .. } => write_data(sim, handle, addr, [0, 0], true),
        PostSync::Timestamp { addr, .. } => {
            let now = Ktime::ktime_get().to_ns() as u64;
            write_data(sim, handle, addr, [now as u32, (now >> 32) as u32], true)
        }
    }
}

/// MI_ATOMIC on a dword or qword: AND, OR, XOR, MOVE, INC, DEC, ADD, SUB
/// (the low nibble of the opcode); other operations leave memory as it is
/// (the audit still counted the bytes as written).
fn atomic(sim: &mut Sim, handle: &VgpuHandle, addr: u64, len: u8, opcode: u8, operand: [u32; 2]) -> core::result::Result<(), u64> {
    let width = if len >= 8 { 8 } else { 4 };
    let mut b = [0u8; 8];
    sim.gfx_access(handle, addr, &mut b[..width], false)?;
    let old = u64::from_le_bytes(b);
    let arg = u64::from(operand[0]) | (u64::from(operand[1]) << 32);
    let new = match opcode & 0x0f {
        0x1 => old & arg,
        0x2 => old | arg,
        0x3 => old ^ arg,
        0x4 => arg,
        0x5 => old.wrapping_add(1),
        0x6 => old.wrapping_sub(1),
        0x7 => old.wrapping_add(arg),
        0x8 => old.wrapping_sub(arg),
        _ => return Ok(()),
    };
    write_bytes(sim, handle, addr, &new.to_le_bytes()[..width])
}
