// SPDX-License-Identifier: GPL-2.0-only
//! The simulated vGPU's engine: executes a submission's validated commands
//! on guest memory, in bounded slices.
//!
//! It trusts the auditor (addresses in range, registers allowed, lengths
//! right) and checks nothing of the guest's again; what it must still
//! handle is what the guest can change after the audit: the GTT (a page no
//! longer mapped is a DMA fault) and memory contents (semaphores, blit
//! sources). Which command runs next is [`flow::Exec`]'s, the auditor's
//! own model of the walk, so the engine runs exactly the hardware's
//! sequence of audited commands (calls, chains, returns, batches started
//! again).
//!
//! Work is counted in operations: one per command and one per DMA call
//! (each page a transfer touches). A slice ends after [`SLICE_OPS`]
//! operations or [`SLICE_BYTES`] bytes, whichever comes first, or when a
//! semaphore is not yet satisfied; a blit is resumed at the chunk it
//! stopped at, and a blit whose rows all write the same bytes (pitch 0)
//! runs one row. A submission that has done [`SUBMISSION_OPS`] operations
//! is declared hung by the watchdog, whether or not its ring head moves
//! (fewer, and its slices spaced, after hangs in a row:
//! [`crate::backoff::HangBackoff`]).

use kernel::prelude::*;
use kernel::time::Ktime;

use super::Sim;
use crate::audit::flow::{Exec, FlowError};
use crate::audit::{Command, PostSync, ValidatedCommand, PAGE_SIZE};
use crate::glue::VgpuIo;
use crate::sim_regs as r;

/// Operations per slice: the vGPU's lock is held for one slice at most.
pub(crate) const SLICE_OPS: u32 = 1024;
/// Bytes moved per slice.
const SLICE_BYTES: u64 = 1 << 20;
/// Operations one submission may do before the watchdog calls it hung.
pub(crate) const SUBMISSION_OPS: u64 = 1 << 22;
/// Bytes of blit moved per DMA call at most.
const CHUNK: usize = 512;

/// Where the current blit is: its row, and bytes of that row done.
#[derive(Clone, Copy, Default)]
struct BlitAt {
    row: u64,
    done: u64,
}

/// A submission in flight: its validated commands and where execution is.
pub(crate) struct Submission {
    cmds: KVVec<ValidatedCommand>,
    exec: Exec,
    /// One bit per graphics page the submission may write.
    pub(super) pages: KVVec<u64>,
    blit: BlitAt,
    /// The ring tail this submission ends at.
    tail: u32,
    /// Operations done so far, for the watchdog.
    pub(super) work: u64,
}

impl Submission {
    pub(crate) fn new(cmds: KVVec<ValidatedCommand>, pages: KVVec<u64>, tail: u32) -> Self {
        let exec = Exec::new(&cmds);
        Self {
            cmds,
            exec,
            pages,
            blit: BlitAt::default(),
            tail,
            work: 0,
        }
    }
}

/// What one slice may still do.
struct Budget {
    ops: u32,
    bytes: u64,
}

impl Budget {
    fn spent(&self) -> bool {
        self.ops == 0 || self.bytes == 0
    }

    /// Charges a transfer of `len` bytes at `addr`: one operation per page.
    fn transfer(&mut self, addr: u64, len: usize) -> u32 {
        let len = len as u64;
        let pages = if len == 0 {
            0
        } else {
            let last = addr.saturating_add(len - 1) / PAGE_SIZE;
            (last - addr / PAGE_SIZE + 1).min(u64::from(u32::MAX)) as u32
        };
        self.ops = self.ops.saturating_sub(pages);
        self.bytes = self.bytes.saturating_sub(len);
        pages
    }
}

pub(super) enum Outcome {
    /// Every command ran.
    Finished,
    /// The slice ended with work left; `stalled` if waiting on memory.
    Progress { head_moved: bool, stalled: bool },
    /// Guest memory at this graphics address could not be reached.
    Fault(u64),
    /// The list does not walk as the auditor made it (a hag bug).
    Broken(FlowError),
}

enum Step {
    /// Done: on to the next command.
    Next,
    /// Not done, waiting on memory: run this command again later.
    Stall,
    /// Not done, the slice's budget is spent: go on next slice.
    Yield,
}

pub(super) fn run_slice(sim: &mut Sim, handle: &VgpuIo<'_>) -> Outcome {
    let Some(mut run) = sim.run.take() else { return Outcome::Finished };
    let head_before = sim.regs.ring_head;
    let mut budget = Budget { ops: SLICE_OPS, bytes: SLICE_BYTES };
    let mut stalled = false;
    let outcome = loop {
        if budget.spent() {
            break None;
        }
        let index = match run.exec.current(&run.cmds) {
            Ok(Some(i)) => i,
            Ok(None) => break Some(Outcome::Finished),
            Err(e) => break Some(Outcome::Broken(e)),
        };
        let Some(cmd) = run.cmds.get(index).copied() else {
            break Some(Outcome::Broken(FlowError::BadNesting { index }));
        };
        if cmd.level == 0 {
            // The qword holding the command (tails are qword aligned, and
            // a snapshot taken after a fault or hang must restore). The
            // guest may move RING_START meanwhile: wrap, never panic.
            sim.regs.ring_head = (cmd.gfx_addr.wrapping_sub(u64::from(sim.regs.ring_start)) as u32) & !7;
        }
        let ops_before = budget.ops;
        budget.ops = budget.ops.saturating_sub(1);
        let step = execute(sim, handle, &mut run.blit, &cmd, &mut budget);
        run.work = run.work.saturating_add(u64::from(ops_before - budget.ops));
        match step {
            Ok(Step::Next) => {
                sim.stats.commands += 1;
                if let Err(e) = run.exec.advance(&run.cmds) {
                    break Some(Outcome::Broken(e));
                }
            }
            Ok(Step::Yield) => break None,
            Ok(Step::Stall) => {
                stalled = true;
                break None;
            }
            Err(gfx) => break Some(Outcome::Fault(gfx)),
        }
    };
    let outcome = outcome.unwrap_or(Outcome::Progress { head_moved: sim.regs.ring_head != head_before, stalled });
    if let Outcome::Finished = outcome {
        sim.regs.ring_head = run.tail;
    }
    sim.run = Some(run);
    outcome
}

fn execute(
    sim: &mut Sim,
    handle: &VgpuIo<'_>,
    at: &mut BlitAt,
    cmd: &ValidatedCommand,
    budget: &mut Budget,
) -> core::result::Result<Step, u64> {
    match cmd.kind {
        // Arbitration only decides where the real engine may preempt; the
        // simulated engine never preempts a submission. Batch starts and
        // ends are the walk's ([`Exec`]).
        Command::Noop
        | Command::ArbCheck
        | Command::ArbOnOff { .. }
        | Command::BatchStart { .. }
        | Command::BatchEnd => {}
        Command::UserInterrupt => sim.raise(r::INT_USER),
        Command::SemaphoreWait { addr, data, compare, .. } => {
            let value = read_u32(sim, handle, budget, addr)?;
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
            write_data(sim, handle, budget, addr, data, qword)?;
        }
        Command::LoadRegisterImm { reg, value, .. } => set_gpr(sim, reg, value),
        Command::StoreRegisterMem { reg, addr, .. } => {
            let value = gpr(sim, reg);
            write_bytes(sim, handle, budget, addr, &value.to_le_bytes())?;
        }
        Command::LoadRegisterMem { reg, addr, .. } => {
            let value = read_u32(sim, handle, budget, addr)?;
            set_gpr(sim, reg, value);
        }
        Command::CopyMemMem { dst, src, .. } => {
            let value = read_u32(sim, handle, budget, src)?;
            write_bytes(sim, handle, budget, dst, &value.to_le_bytes())?;
        }
        Command::Atomic { addr, len, opcode, inline_data, .. } => {
            atomic(sim, handle, budget, addr, len, opcode, inline_data.map_or([0, 0], |d| [d[0], d[1]]))?;
        }
        Command::FlushDw { post_sync, notify } => {
            post_sync_write(sim, handle, budget, post_sync, false)?;
            if notify {
                sim.raise(r::INT_USER);
            }
        }
        Command::PipeControl { post_sync, .. } => post_sync_write(sim, handle, budget, post_sync, true)?,
        Command::Blit(blit) => {
            let Some(dst) = blit.dst.rect(blit.bpp, blit.width, blit.height) else {
                return Err(blit.dst.base);
            };
            let src = blit.src.and_then(|s| s.rect(blit.bpp, blit.width, blit.height));
            let fill = !blit.copies();
            let rows = if blit.rows_repeat() { dst.rows.min(1) } else { dst.rows };
            let mut buf = [0u8; CHUNK];
            while at.row < rows {
                let row = at.row;
                let dst_row = dst.base + row * dst.pitch;
                while at.done < dst.row_bytes {
                    // Resumed here next slice, at this chunk.
                    if budget.spent() {
                        return Ok(Step::Yield);
                    }
                    let done = at.done;
                    let n = (dst.row_bytes - done).min(CHUNK as u64) as usize;
                    let part = &mut buf[..n];
                    match src {
                        Some(src) if !fill => {
                            let from = src.base + row * src.pitch + done;
                            budget.transfer(from, n);
                            sim.gfx_access(handle, from, part, false)?;
                        }
                        _ => {
                            let color = blit.color.to_le_bytes();
                            let bpp = usize::from(blit.bpp).max(1);
                            for (i, b) in part.iter_mut().enumerate() {
                                *b = color[((done as usize + i) % bpp) % 4];
                            }
                        }
                    }
                    write_gfx(sim, handle, budget, dst_row + done, part)?;
                    at.done += n as u64;
                }
                at.done = 0;
                at.row += 1;
            }
            *at = BlitAt::default();
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

fn read_u32(sim: &Sim, handle: &VgpuIo<'_>, budget: &mut Budget, addr: u64) -> core::result::Result<u32, u64> {
    let mut b = [0u8; 4];
    budget.transfer(addr, b.len());
    sim.gfx_access(handle, addr, &mut b, false)?;
    Ok(u32::from_le_bytes(b))
}

/// Every engine write to guest memory goes through here, so the
/// `bytes_written` counter is what the GPU really wrote: the measure the
/// audit's (page-granular, superset) write sets are compared with.
fn write_gfx(sim: &mut Sim, handle: &VgpuIo<'_>, budget: &mut Budget, addr: u64, buf: &mut [u8]) -> core::result::Result<(), u64> {
    budget.transfer(addr, buf.len());
    sim.gfx_access(handle, addr, buf, true)?;
    sim.stats.bytes_written = sim.stats.bytes_written.wrapping_add(buf.len() as u64);
    Ok(())
}

fn write_bytes(sim: &mut Sim, handle: &VgpuIo<'_>, budget: &mut Budget, addr: u64, bytes: &[u8]) -> core::result::Result<(), u64> {
    let mut buf = [0u8; 8];
    let buf = &mut buf[..bytes.len()];
    buf.copy_from_slice(bytes);
    write_gfx(sim, handle, budget, addr, buf)
}

fn write_data(sim: &mut Sim, handle: &VgpuIo<'_>, budget: &mut Budget, addr: u64, data: [u32; 2], qword: bool) -> core::result::Result<(), u64> {
    let value = u64::from(data[0]) | (u64::from(data[1]) << 32);
    let bytes = value.to_le_bytes();
    write_bytes(sim, handle, budget, addr, if qword { &bytes } else { &bytes[..4] })
}

fn post_sync_write(sim: &mut Sim, handle: &VgpuIo<'_>, budget: &mut Budget, post_sync: PostSync, qword: bool) -> core::result::Result<(), u64> {
    match post_sync {
        PostSync::None => Ok(()),
        // MI_FLUSH_DW's short form stores a dword; both forms carry the
        // high dword as 0 then, so a non-zero high dword means a qword.
        PostSync::WriteImm { addr, data, .. } => write_data(sim, handle, budget, addr, data, qword || data[1] != 0),
        PostSync::DepthCount { addr, .. } => write_data(sim, handle, budget, addr, [0, 0], true),
        PostSync::Timestamp { addr, .. } => {
            let now = Ktime::ktime_get().to_ns() as u64;
            write_data(sim, handle, budget, addr, [now as u32, (now >> 32) as u32], true)
        }
    }
}

/// MI_ATOMIC on a dword or qword: AND, OR, XOR, MOVE, INC, DEC, ADD, SUB
/// (the low nibble of the opcode); other operations leave memory as it is
/// (the audit still counted the bytes as written).
fn atomic(sim: &mut Sim, handle: &VgpuIo<'_>, budget: &mut Budget, addr: u64, len: u8, opcode: u8, operand: [u32; 2]) -> core::result::Result<(), u64> {
    let width = if len >= 8 { 8 } else { 4 };
    let mut b = [0u8; 8];
    budget.transfer(addr, width);
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
    write_bytes(sim, handle, budget, addr, &new.to_le_bytes()[..width])
}
