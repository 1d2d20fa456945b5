//! Fuzzes the auditor with arbitrary ring and batch contents.
//!
//! Input: byte 0 picks the split between ring and memory dwords, byte 1 the
//! depth limit; the rest are little-endian dwords. Memory is mapped at
//! graphics address 0 in a 256 KiB graphics memory. The auditor must not
//! panic, and every command it accepts must stay inside graphics memory.
#![no_main]

use hag_audit::audit::{
    audit, AuditConfig, AuditSink, Blit, Command, SinkFull, SliceMemory, ValidatedCommand,
};
use libfuzzer_sys::fuzz_target;

const GFX: u64 = 0x4_0000;

struct Check;

impl AuditSink for Check {
    fn command(&mut self, cmd: &ValidatedCommand) -> Result<(), SinkFull> {
        for w in cmd.kind.write_set().ranges() {
            assert!(w.gfx_addr.checked_add(w.len).is_some_and(|e| e <= GFX), "{cmd:?}");
        }
        let read = match cmd.kind {
            Command::CopyMemMem { src, .. } => Some((src, 4)),
            Command::LoadRegisterMem { addr, .. } | Command::SemaphoreWait { addr, .. } => Some((addr, 4)),
            Command::Blit(Blit { src: Some(s), bpp, width, height, .. }) => {
                s.rect(bpp, width, height).and_then(|r| r.extent()).map(|e| (e.gfx_addr, e.len))
            }
            _ => None,
        };
        if let Some((a, len)) = read {
            assert!(a.checked_add(len).is_some_and(|e| e <= GFX), "{cmd:?}");
        }
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let (split, depth, rest) = match data {
        [s, d, rest @ ..] => (usize::from(*s), *d % 9, rest),
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
        ..AuditConfig::new(GFX, 0x1000).with_registers(&[0x2600, 0x2604])
    };
    let mut mem = SliceMemory { base: 0, dwords: mem };
    let _ = audit(ring, 0x8000, &cfg, &mut mem, &mut Check);
});
