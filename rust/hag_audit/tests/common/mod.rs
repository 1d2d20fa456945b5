//! Test helpers: a sparse graphics memory, a collecting sink, a config.
#![allow(dead_code)]

use std::collections::BTreeMap;

use hag_audit::audit::{
    audit, AddressSpace, AuditConfig, AuditError, AuditSink, AuditSummary, GfxMemory, MemoryFault,
    SinkFull, ValidatedCommand,
};

/// 64 MiB of graphics memory.
pub const GFX: u64 = 0x400_0000;
/// The hardware status page.
pub const HWSP: u64 = 0x3000;
/// Where test rings claim to live.
pub const RING: u64 = 0x1000;
/// Registers the tests allow.
pub const REGS: &[u32] = &[0x2600, 0x2604, 0x20d8];

/// The test PPGTT: 4 GiB (a 32-bit PPGTT), smaller than 2^48 so its limit
/// shows in errors.
pub const PPGTT: u64 = 1 << 32;

pub fn cfg() -> AuditConfig<'static> {
    AuditConfig::new(GFX, HWSP).with_registers(REGS)
}

/// The test config with the test PPGTT.
pub fn ppgtt_cfg() -> AuditConfig<'static> {
    cfg().with_ppgtt(PPGTT)
}

/// Sparse dword memory in both address spaces; unwritten dwords fault.
#[derive(Default, Clone, Debug)]
pub struct Mem {
    /// GGTT contents.
    pub dwords: BTreeMap<u64, u32>,
    /// PPGTT contents.
    pub ppgtt: BTreeMap<u64, u32>,
    pub reads: usize,
}

impl Mem {
    pub fn new() -> Self {
        Self::default()
    }

    /// Places `dw` at GGTT address `addr`.
    pub fn put(&mut self, addr: u64, dw: &[u32]) -> &mut Self {
        self.put_in(AddressSpace::Ggtt, addr, dw)
    }

    /// Places `dw` at PPGTT address `addr`.
    pub fn put_ppgtt(&mut self, addr: u64, dw: &[u32]) -> &mut Self {
        self.put_in(AddressSpace::Ppgtt, addr, dw)
    }

    /// Places `dw` at `addr` in `space`.
    pub fn put_in(&mut self, space: AddressSpace, addr: u64, dw: &[u32]) -> &mut Self {
        let map = match space {
            AddressSpace::Ggtt => &mut self.dwords,
            AddressSpace::Ppgtt => &mut self.ppgtt,
        };
        for (i, d) in dw.iter().enumerate() {
            map.insert(addr + 4 * i as u64, *d);
        }
        self
    }
}

impl GfxMemory for Mem {
    fn read_dwords(
        &mut self,
        space: AddressSpace,
        gfx_addr: u64,
        out: &mut [u32],
    ) -> Result<(), MemoryFault> {
        self.reads += 1;
        let map = match space {
            AddressSpace::Ggtt => &self.dwords,
            AddressSpace::Ppgtt => &self.ppgtt,
        };
        for (i, o) in out.iter_mut().enumerate() {
            let a = gfx_addr + 4 * i as u64;
            *o = *map.get(&a).ok_or(MemoryFault { gfx_addr: a })?;
        }
        Ok(())
    }
}

/// Collects commands, up to `cap`.
#[derive(Default, Debug)]
pub struct Sink {
    pub cmds: Vec<ValidatedCommand>,
    pub cap: Option<usize>,
}

impl AuditSink for Sink {
    fn command(&mut self, cmd: &ValidatedCommand) -> Result<(), SinkFull> {
        if self.cap.is_some_and(|c| self.cmds.len() >= c) {
            return Err(SinkFull);
        }
        self.cmds.push(*cmd);
        Ok(())
    }
}

pub fn run_with(
    ring: &[u32],
    cfg: &AuditConfig<'_>,
    mem: &mut Mem,
) -> (Result<AuditSummary, AuditError>, Vec<ValidatedCommand>) {
    let mut sink = Sink::default();
    let r = audit(ring, RING, cfg, mem, &mut sink);
    (r, sink.cmds)
}

/// Audits `ring` alone with the test config.
pub fn run(ring: &[u32]) -> (Result<AuditSummary, AuditError>, Vec<ValidatedCommand>) {
    run_with(ring, &cfg(), &mut Mem::new())
}

/// Concatenates command arrays.
pub fn cat(parts: &[&[u32]]) -> Vec<u32> {
    parts.iter().flat_map(|p| p.iter().copied()).collect()
}
