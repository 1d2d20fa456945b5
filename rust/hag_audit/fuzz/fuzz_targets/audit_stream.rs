//! Fuzzes the auditor with arbitrary ring and batch contents, in both
//! address spaces.
//!
//! Input: byte 0 picks the split between ring and memory dwords, byte 1 the
//! depth limit, byte 2 the address spaces (bit 0: the configuration has a
//! PPGTT; bit 1: memory is mapped in the PPGTT, else the GGTT) and the mode
//! (bit 2: the rest builds valid-but-expensive streams, see [`expensive`];
//! else the rest are little-endian dwords). Memory is mapped at address 0
//! of its space; graphics memory (GGTT) is 256 KiB, the PPGTT 512 KiB. The
//! auditor must not panic, every command it accepts must stay inside its
//! address space, a PPGTT operand needs a PPGTT in the configuration, and a
//! PPGTT batch touches the GGTT only through the status page. Every
//! accepted list must walk ([`flow::Exec`]) without an error, and each
//! command's bounded page runs must cover its pages.
#![no_main]

use hag_audit::audit::flow::Exec;
use hag_audit::audit::{
    audit, encode, AddressSpace, AuditConfig, AuditSink, Blit, Command, SinkFull, SliceMemory,
    ValidatedCommand,
};
use libfuzzer_sys::fuzz_target;

const GFX: u64 = 0x4_0000;
const PPGTT: u64 = 0x8_0000;

struct Check<'c> {
    cfg: &'c AuditConfig<'c>,
    cmds: Vec<ValidatedCommand>,
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
        // Bounded page runs never miss a page (checked where cheap).
        let set = cmd.kind.write_set();
        if set.ranges().take(4097).count() <= 4096 {
            let runs: Vec<_> = set.page_runs(16).collect();
            for page in set.pages() {
                assert!(runs.iter().any(|r| r.first <= page && page <= r.last), "{cmd:?}");
            }
        }
        self.cmds.push(*cmd);
        Ok(())
    }
}

/// Valid-but-expensive streams: each input byte picks a piece (a register
/// load of many pairs, a blit of one-byte rows at pitch 0 or 1, a start of
/// one of eight batch slots, called or chained, so that batches already
/// audited are started again, a store, an end); the next byte its operand.
/// Batch slot k is at 0x1000 * (k + 1); the ring is the first pieces up to
/// a start-less end.
fn expensive(bytes: &[u8]) -> Vec<u32> {
    let mut out = Vec::new();
    let mut it = bytes.chunks_exact(2);
    for pair in &mut it {
        let (kind, arg) = (pair[0], pair[1]);
        let slot = u64::from(arg % 8 + 1) * 0x1000;
        match kind % 8 {
            0 => {
                let pairs = arg.max(1).min(128);
                out.push(encode::load_register_imm_header(pairs));
                for i in 0..u32::from(pairs) {
                    out.extend([0x2600 + 4 * (i % 2), i]);
                }
            }
            1 => {
                let dst = encode::BlitRect { base: 0x3_0000, pitch: 0, x: 0, y: 0 };
                let src = encode::BlitRect { base: 0x2_0000, pitch: u16::from(arg % 2), x: 0, y: 0 };
                out.extend(encode::xy_src_copy_blt(dst, src, 1, 1, 0x7fff));
            }
            2 => {
                let dst = encode::BlitRect { base: 0x3_0000, pitch: u16::from(arg % 3), x: 0, y: 0 };
                out.extend(encode::xy_color_blt(dst, 1, 1, 0x7fff, 0));
            }
            3 | 4 => out.extend(encode::batch_buffer_start(slot, kind % 8 == 4)),
            5 => out.extend(encode::store_data_imm(0x3_8000 + u64::from(arg) * 8, 1)),
            6 => out.extend(encode::batch_buffer_end()),
            _ => out.extend(encode::noop()),
        }
    }
    out
}

/// The expensive mode's memory: batch slot k holds the pieces of the input
/// after its k-th separator (0xff), ending in an end.
fn expensive_memory(rest: &[u8]) -> Vec<u32> {
    let mut mem = vec![0u32; (GFX / 4) as usize];
    for (k, part) in rest.split(|&b| b == 0xff).skip(1).take(8).enumerate() {
        let mut dw = expensive(part);
        dw.extend(encode::batch_buffer_end());
        let at = ((k as u64 + 1) * 0x1000 / 4) as usize;
        for (i, d) in dw.into_iter().take(0x400).enumerate() {
            mem[at + i] = d;
        }
    }
    mem
}

fuzz_target!(|data: &[u8]| {
    let (split, depth, spaces, rest) = match data {
        [s, d, sp, rest @ ..] => (usize::from(*s), *d % 9, *sp, rest),
        _ => return,
    };
    if spaces & 4 != 0 {
        let ring_part = rest.split(|&b| b == 0xff).next().unwrap_or(&[]);
        let mut ring = expensive(ring_part);
        if ring.len() % 2 == 1 {
            ring.push(0);
        }
        let mem = expensive_memory(rest);
        let cfg = AuditConfig { max_batch_depth: depth.max(1), ..AuditConfig::new(GFX, 0x1000).with_registers(&[0x2600, 0x2604]) };
        let mut memory = SliceMemory { space: AddressSpace::Ggtt, base: 0, dwords: &mem };
        let mut check = Check { cfg: &cfg, cmds: Vec::new() };
        if audit(&ring, 0x3_c000, &cfg, &mut memory, &mut check).is_ok() {
            walk(&check.cmds);
        }
        return;
    }
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
    let mut check = Check { cfg: &cfg, cmds: Vec::new() };
    if audit(ring, 0x8000, &cfg, &mut mem, &mut check).is_ok() {
        walk(&check.cmds);
    }
});

/// An accepted list walks: every step is a command of the list, at the
/// walk's level, and never an error (a bounded number of steps: loops run
/// on).
fn walk(cmds: &[ValidatedCommand]) {
    let mut exec = Exec::new(cmds);
    for _ in 0..20_000 {
        match exec.current(cmds) {
            Ok(Some(i)) => assert_eq!(cmds[i].level, exec.level(), "{:?}", cmds[i]),
            Ok(None) => return,
            Err(e) => panic!("the auditor's list does not walk: {e:?}"),
        }
        exec.advance(cmds).unwrap_or_else(|e| panic!("the auditor's list does not walk: {e:?}"));
    }
}
