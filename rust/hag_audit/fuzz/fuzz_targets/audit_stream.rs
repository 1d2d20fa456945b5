//! Fuzzes the auditor with arbitrary ring and batch contents, in both
//! address spaces.
//!
//! Input: byte 0 picks the split between ring and memory dwords, byte 1 the
//! depth limit, byte 2 the address spaces (bit 0: the configuration has a
//! PPGTT; bit 1: memory is mapped in the PPGTT, else the GGTT); the rest are
//! little-endian dwords. Memory is mapped at address 0 of its space; graphics
//! memory (GGTT) is 256 KiB, the PPGTT 512 KiB. The auditor must not panic,
//! every command it accepts must stay inside its address space, a PPGTT
//! operand needs a PPGTT in the configuration, and a PPGTT batch touches the
//! GGTT only through the status page.
#![no_main]

use hag_audit::audit::{
    audit, AddressSpace, AuditConfig, AuditSink, Blit, Command, SinkFull, SliceMemory,
    ValidatedCommand,
};
use libfuzzer_sys::fuzz_target;

const GFX: u64 = 0x4_0000;
const PPGTT: u64 = 0x8_0000;

struct Check<'c> {
    cfg: &'c AuditConfig<'c>,
}

impl AuditSink for Check<'_> {
    fn command(&mut self, cmd: &ValidatedCommand) -> Result<(), SinkFull> {
        let mut accesses: Vec<(AddressSpace, u64, u64)> =
            cmd.kind.write_set().ranges().map(|w| (w.space, w.gfx_addr, w.len)).collect();
        match cmd.kind {
            Command::CopyMemMem { src_space, src, .. } => accesses.push((src_space, src, 4)),
            Command::LoadRegisterMem { space, addr, .. }
            | Command::SemaphoreWait { space, addr, .. }
            | Command::BatchStart { space, addr, .. } => accesses.push((space, addr, 4)),
            Command::Blit(Blit { src: Some(s), bpp, width, height, .. }) => {
                if let Some(e) = s.rect(bpp, width, height).and_then(|r| r.extent()) {
                    accesses.push((e.space, e.gfx_addr, e.len));
                }
            }
            _ => {}
        }
        let status_page = matches!(
            cmd.kind,
            Command::StoreDataIndex { .. } | Command::FlushDw { .. } | Command::PipeControl { .. }
        );
        for (space, a, len) in accesses {
            let limit = self.cfg.space_size(space);
            assert!(limit > 0, "{cmd:?} uses a space the configuration refuses");
            assert!(a.checked_add(len).is_some_and(|e| e <= limit), "{cmd:?}");
            if cmd.space == AddressSpace::Ppgtt && space == AddressSpace::Ggtt {
                assert!(status_page, "{cmd:?}: a PPGTT batch touched the GGTT");
            }
        }
        if cmd.level == 0 {
            assert_eq!(cmd.space, AddressSpace::Ggtt, "{cmd:?}: the ring is GGTT");
        }
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let (split, depth, spaces, rest) = match data {
        [s, d, sp, rest @ ..] => (usize::from(*s), *d % 9, *sp, rest),
        _ => return,
    };
    let dwords: Vec<u32> = rest
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let split = split.min(dwords.len());
    let (ring, mem) = dwords.split_at(split);
    let cfg = AuditConfig {
        max_batch_depth: depth.max(1),
        max_commands: 10_000,
        ..AuditConfig::new(GFX, 0x1000)
            .with_registers(&[0x2600, 0x2604])
            .with_ppgtt(if spaces & 1 != 0 { PPGTT } else { 0 })
    };
    let space = if spaces & 2 != 0 { AddressSpace::Ppgtt } else { AddressSpace::Ggtt };
    let mut mem = SliceMemory { space, base: 0, dwords: mem };
    let _ = audit(ring, 0x8000, &cfg, &mut mem, &mut Check { cfg: &cfg });
});
