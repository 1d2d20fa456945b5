// SPDX-License-Identifier: GPL-2.0-only
//! Context snapshots of a `hag-sim` vGPU, in `hag_abi::snapshot`'s format.
//!
//! A snapshot holds everything a guest can observe or the engine needs to go
//! on: config space, the register file, the GTT and the engine's halt state.
//! It is taken only while quiesced with no submission in flight, so there is
//! no half-run command list to carry. Restore checks the snapshot (magic,
//! version, checksum, lengths), that it comes from a vGPU of the same type
//! and graphics memory size, and every value it loads, before it changes
//! anything.

use kernel::prelude::*;

use super::{Halt, Regs, Sim, GTT_ENTRIES};
use crate::abi;
use crate::sim_regs as r;
use crate::snapshot::{self as fmt, Snapshot, SnapshotError, Writer};

const CONFIG_BYTES: usize = r::CONFIG_SIZE as usize;
const REGS_BYTES: usize = fmt::REGS_WORDS * 4;
const GTT_BYTES: usize = GTT_ENTRIES * 8;
const ENGINE_BYTES: usize = 16;
const NO_TAIL: u32 = u32::MAX;

/// Bytes of a snapshot of a `hag-sim` vGPU.
pub(crate) const SNAPSHOT_BYTES: usize =
    fmt::HEADER_BYTES + 4 * 8 + CONFIG_BYTES + REGS_BYTES + GTT_BYTES + ENGINE_BYTES;

fn put(out: &mut [u8], index: usize, value: u32) {
    if let Some(slot) = out.get_mut(index * 4..index * 4 + 4) {
        slot.copy_from_slice(&value.to_le_bytes());
    }
}

fn get(bytes: &[u8], index: usize) -> u32 {
    match bytes.get(index * 4..index * 4 + 4) {
        Some(&[a, b, c, d]) => u32::from_le_bytes([a, b, c, d]),
        _ => 0,
    }
}

impl Regs {
    /// The register words of the snapshot, in this order.
    fn save(&self, out: &mut [u8]) {
        let words = [
            self.int_mask,
            self.int_identity,
            self.int_enable,
            self.error_status,
            self.error_addr as u32,
            (self.error_addr >> 32) as u32,
            self.error_header,
            self.error_reason,
            self.ring_tail,
            self.ring_head,
            self.ring_start,
            self.ring_ctl,
            self.hws_pga,
        ];
        for (i, w) in words.iter().enumerate() {
            put(out, i, *w);
        }
        for (i, w) in self.gpr.iter().enumerate() {
            put(out, 16 + i, *w);
        }
    }

    fn load(bytes: &[u8]) -> Self {
        let mut gpr = [0; 2 * r::GPR_COUNT as usize];
        for (i, w) in gpr.iter_mut().enumerate() {
            *w = get(bytes, 16 + i);
        }
        Self {
            int_mask: get(bytes, 0),
            int_identity: get(bytes, 1),
            int_enable: get(bytes, 2) & 1,
            error_status: get(bytes, 3),
            error_addr: u64::from(get(bytes, 4)) | (u64::from(get(bytes, 5)) << 32),
            error_header: get(bytes, 6),
            error_reason: get(bytes, 7),
            ring_tail: get(bytes, 8),
            ring_head: get(bytes, 9),
            ring_start: get(bytes, 10),
            ring_ctl: get(bytes, 11),
            hws_pga: get(bytes, 12),
            gpr,
        }
    }
}

/// Maps a snapshot format error to the errno the ioctl returns.
pub(crate) fn errno(e: SnapshotError) -> Error {
    match e {
        SnapshotError::UnknownVersion(_) => crate::errno(kernel::bindings::EPROTO),
        SnapshotError::NoSpace { .. } => ENOSPC,
        _ => EINVAL,
    }
}

impl Sim {
    /// Writes the snapshot into `out` (at least [`SNAPSHOT_BYTES`]).
    pub(crate) fn save(&self, out: &mut [u8]) -> Result<usize> {
        if !self.quiesced || self.run.is_some() {
            return Err(EBUSY);
        }
        let mut w = Writer::new(out, abi::VGPU_SOURCE_SIM as u16, abi::SIM_GFX_MEM_SIZE).map_err(errno)?;
        w.section(fmt::TAG_CONFIG, CONFIG_BYTES, |b| b.copy_from_slice(&self.config)).map_err(errno)?;
        w.section(fmt::TAG_REGS, REGS_BYTES, |b| self.regs.save(b)).map_err(errno)?;
        w.section(fmt::TAG_GTT, GTT_BYTES, |b| {
            for (i, pte) in self.gtt.iter().enumerate() {
                if let Some(slot) = b.get_mut(i * 8..i * 8 + 8) {
                    slot.copy_from_slice(&pte.to_le_bytes());
                }
            }
        })
        .map_err(errno)?;
        w.section(fmt::TAG_ENGINE, ENGINE_BYTES, |b| {
            let halt = match self.halt {
                Halt::Idle => 0,
                Halt::Stopped => 1,
                Halt::Hung => 2,
            };
            put(b, 0, halt);
            put(b, 1, self.queued_tail.unwrap_or(NO_TAIL));
            put(b, 2, self.watchdog_ms);
        })
        .map_err(errno)?;
        Ok(w.finish())
    }

    /// Parses a snapshot and checks that it is of a vGPU like this one
    /// (its version, checksum and layout, its source and graphics memory).
    pub(crate) fn parse_compatible<'a>(&self, bytes: &'a [u8]) -> Result<Snapshot<'a>> {
        let snap = Snapshot::parse(bytes).map_err(|e| {
            pr_info!("vGPU {}: restore refused: {}\n", self.id, e);
            errno(e)
        })?;
        if u32::from(snap.source) != abi::VGPU_SOURCE_SIM || snap.gfx_mem_size != abi::SIM_GFX_MEM_SIZE {
            pr_info!(
                "vGPU {}: restore refused: snapshot of a {} vGPU with {} bytes of graphics memory, this is a sim vGPU with {}\n",
                self.id,
                abi::source_name(u32::from(snap.source)),
                snap.gfx_mem_size,
                abi::SIM_GFX_MEM_SIZE
            );
            return Err(EXDEV);
        }
        Ok(snap)
    }

    /// Loads a snapshot. Everything is checked before anything changes; the
    /// vGPU is left quiesced (`IOC_RESUME` lets it run).
    pub(crate) fn restore(&mut self, bytes: &[u8]) -> Result {
        if self.run.is_some() {
            return Err(EBUSY);
        }
        let snap = self.parse_compatible(bytes)?;
        let config = snap.section(fmt::TAG_CONFIG, CONFIG_BYTES).map_err(errno)?;
        let regs = Regs::load(snap.section(fmt::TAG_REGS, REGS_BYTES).map_err(errno)?);
        let gtt = snap.section(fmt::TAG_GTT, GTT_BYTES).map_err(errno)?;
        let engine = snap.section(fmt::TAG_ENGINE, ENGINE_BYTES).map_err(errno)?;
        let halt = match get(engine, 0) {
            0 => Halt::Idle,
            1 => Halt::Stopped,
            2 => Halt::Hung,
            _ => return Err(EINVAL),
        };
        let queued_tail = match get(engine, 1) {
            NO_TAIL => None,
            tail => Some(tail),
        };
        let watchdog_ms = get(engine, 2);
        // The same checks a guest's register writes get. Ring offsets are
        // qword aligned and inside the largest ring: a guest may shrink
        // its ring under them (the next doorbell then refuses), and such a
        // vGPU must still migrate.
        let max_ring = (r::RING_CTL_PAGES_MASK + 1) * 4096;
        let in_ring = |off: u32| off < max_ring && off % 8 == 0;
        if regs.ring_start % 4096 != 0
            || !super::hws_pga_valid(regs.hws_pga)
            || regs.ring_ctl & !((r::RING_CTL_PAGES_MASK << r::RING_CTL_PAGES_SHIFT) | r::RING_CTL_ENABLE) != 0
            || !in_ring(regs.ring_head)
            || !in_ring(regs.ring_tail)
            || !queued_tail.map_or(true, in_ring)
            || !(abi::WATCHDOG_MIN_MS..=abi::WATCHDOG_MAX_MS).contains(&watchdog_ms)
        {
            pr_info!("vGPU {}: restore refused: register values out of range\n", self.id);
            return Err(EINVAL);
        }
        // Config space goes through the guest's write path: only what a
        // guest may write is taken, and a snapshot that differs from this
        // vGPU anywhere else (ids, class, capabilities) is damaged or not
        // this kind of device's.
        if let Some(at) = (0..CONFIG_BYTES).find(|&at| !Self::config_writable(at) && config[at] != self.config[at]) {
            pr_info!("vGPU {}: restore refused: config space byte {:#x} is read-only and differs\n", self.id, at);
            return Err(EINVAL);
        }

        self.config_write(0, config)?;
        self.regs = regs;
        for (i, pte) in self.gtt.iter_mut().enumerate() {
            *pte = gtt.get(i * 8..i * 8 + 8).map_or(0, |b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]));
        }
        self.halt = halt;
        self.queued_tail = queued_tail;
        self.watchdog_ms = watchdog_ms;
        self.quiesced = true;
        Ok(())
    }
}
