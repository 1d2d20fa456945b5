//! The hand-off on real command streams: batches Mesa 22.3.6's own Intel
//! drivers (iris for GLES, anv for Vulkan) built for a Skylake GPU with no
//! GPU present (drm-shim), captured per execbuffer with every object's
//! softpin address (`scripts/mesa/regen-corpus.sh` records
//! `tests/mesa/*.bin`; the format is in `scripts/mesa/extract.py`).
//!
//! Each workload is framed as i915 6.12 frames a user batch in a GVT-g
//! guest's ring and handed off with a PPGTT that maps every object of the
//! execbuffer. The hand-off must never panic and never meet anything but a
//! command it does not model (no address, length or batch error: that
//! would be a bug in the auditor or in the framing); what it audits must
//! lie in the objects; what it cannot model takes the bounded fallback,
//! the objects' pages. `cargo test -p hag_gvt --test mesa -- --nocapture`
//! prints the table docs/gvt-g.md shows.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use hag_gvt::audit::{AddressSpace, Reason};
use hag_gvt::handoff::{
    hand_off, Limits, Outcome, ShadowBb, Translate, TranslateFault, Unmodelled, Workload,
};

mod common;
use common::i915::*;

/// The guest these workloads are modelled in: 1 GiB of RAM, the pages a
/// dirty log of it covers (what "mark the whole log" marked before).
const GUEST_PAGES: u64 = (1 << 30) / 4096;
const GGTT_SIZE: u64 = 256 << 20;
const RING: u64 = 0x10_0000;

/// One captured execbuffer.
struct Capture {
    name: String,
    engine: u32,
    /// (address, size) of every exec object.
    objects: Vec<(u64, u64)>,
    /// (address, bytes) of every batch segment; the first is the start.
    batches: Vec<(u64, Vec<u8>)>,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn parse(path: &Path) -> Capture {
    let b = fs::read(path).unwrap();
    assert_eq!(&b[..8], b"HAGMESA1", "{}", path.display());
    let engine = u32_at(&b, 8);
    let (nobj, nbb) = (u32_at(&b, 12) as usize, u32_at(&b, 16) as usize);
    let mut at = 24;
    let objects = (0..nobj)
        .map(|_| {
            let o = (u64_at(&b, at), u64_at(&b, at + 8));
            at += 16;
            o
        })
        .collect();
    let batches = (0..nbb)
        .map(|_| {
            let (gma, len) = (u64_at(&b, at), u32_at(&b, at + 8) as usize);
            at += 16;
            let bytes = b[at..at + len].to_vec();
            at += len;
            (gma, bytes)
        })
        .collect();
    assert_eq!(at, b.len(), "{}: trailing bytes", path.display());
    Capture {
        name: path.file_stem().unwrap().to_string_lossy().into_owned(),
        engine,
        objects,
        batches,
    }
}

fn corpus() -> Vec<Capture> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/mesa");
    let mut files: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "bin"))
        .collect();
    files.sort();
    files.iter().map(|p| parse(p)).collect()
}

/// The guest's GTTs: each object page maps to a guest frame of its own,
/// the ring's timeline and status page to theirs; nothing else is mapped.
struct Gtt<'a> {
    objects: &'a [(u64, u64)],
}

const OBJ_GFN_BASE: u64 = 0x1_0000;

impl Gtt<'_> {
    /// The reachable set: every page of every object, as guest frames.
    fn reachable(&self) -> BTreeSet<u64> {
        let mut pages = BTreeSet::new();
        for &(addr, size) in self.objects {
            for page in addr / 4096..(addr + size).div_ceil(4096) {
                pages.insert(OBJ_GFN_BASE + page);
            }
        }
        pages
    }
}

impl Translate for Gtt<'_> {
    fn gma_to_gfn(&mut self, space: AddressSpace, gma: u64) -> Result<u64, TranslateFault> {
        match space {
            AddressSpace::Ggtt if gma == SEQNO & !0xfff => Ok(SEQNO_GFN),
            AddressSpace::Ggtt if gma == HWSP => Ok(HWSP_GFN),
            AddressSpace::Ggtt => Err(TranslateFault),
            AddressSpace::Ppgtt => self
                .objects
                .iter()
                .any(|&(addr, size)| addr <= gma && gma < addr + size)
                .then_some(OBJ_GFN_BASE + gma / 4096)
                .ok_or(TranslateFault),
        }
    }
}

/// What one workload came to.
struct Row {
    name: String,
    commands: usize,
    batches: usize,
    outcome: Outcome,
    /// Frames the precise write set named.
    precise: usize,
    /// Pages the fallback marks (the reachable set).
    reachable: usize,
}

fn run(c: &Capture) -> Row {
    // I915_EXEC_BLT is 3; everything else these drivers submit is render.
    let ring = if c.engine == 3 {
        blitter_request(c.batches[0].0, 42, false)
    } else {
        render_request(c.batches[0].0, 42, false)
    };
    let bbs: Vec<ShadowBb<'_>> = c
        .batches
        .iter()
        .map(|(gma, bytes)| ShadowBb {
            space: AddressSpace::Ppgtt,
            gma: *gma,
            bytes,
        })
        .collect();
    let wl = Workload {
        ring: &ring,
        ring_gma: RING,
        hwsp_gma: HWSP,
        bbs: &bbs,
        ggtt_size: GGTT_SIZE,
        indirect_ctx: None,
    };
    let mut gtt = Gtt {
        objects: &c.objects,
    };
    let mut gfns = Vec::new();
    let outcome = hand_off(&wl, &Limits::DEFAULT, &mut gtt, &mut |g| gfns.push(g));
    let reachable = gtt.reachable();
    if let Outcome::Audited { .. } = outcome {
        for g in &gfns {
            assert!(
                reachable.contains(g) || *g == SEQNO_GFN || *g == HWSP_GFN,
                "{}: frame {g:#x} outside the workload's objects",
                c.name
            );
        }
    }
    Row {
        name: c.name.clone(),
        commands: c.batches.iter().map(|(_, b)| count_commands(b)).sum(),
        batches: c.batches.len(),
        outcome,
        precise: gfns.iter().collect::<BTreeSet<_>>().len(),
        reachable: reachable.len(),
    }
}

/// Commands in a batch segment, by the GEN length rules.
fn count_commands(b: &[u8]) -> usize {
    let mut at = 0;
    let mut n = 0;
    while at + 4 <= b.len() {
        let dw = u32_at(b, at);
        let len = match dw >> 29 {
            0 if (dw >> 23) & 0x3f < 0x10 => 1,
            0 | 2 | 3 => {
                // PIPELINE_SELECT and 3DSTATE_VF_STATISTICS: one dword.
                if dw >> 29 == 3 && matches!(dw >> 16, 0x6904 | 0x680b) {
                    1
                } else {
                    (dw & 0xff) as usize + 2
                }
            }
            _ => 1,
        };
        at += len * 4;
        n += 1;
    }
    n
}

/// Names of the render-engine commands the corpus stops at (PRM vol. 2a).
fn render_name(header: u32) -> Option<&'static str> {
    Some(match header >> 16 {
        0x6101 => "STATE_BASE_ADDRESS",
        0x6904 => "PIPELINE_SELECT",
        0x7808 => "3DSTATE_VERTEX_BUFFERS",
        0x780e => "3DSTATE_CC_STATE_POINTERS",
        0x7105 => "GPGPU_WALKER",
        0x7b00 => "3DPRIMITIVE",
        _ => return None,
    })
}

/// Why a workload was not modelled, for the table.
fn why(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Audited { .. } => "-".into(),
        Outcome::Unmodelled {
            reason: Unmodelled::Refused(e),
        } => match e.header {
            Some(h) => {
                let name = render_name(h).unwrap_or_else(|| e.command_name());
                match e.reason {
                    Reason::RegisterNotAllowed { reg } => format!("{name} of register {reg:#x}"),
                    _ => format!("{name} ({h:#010x})"),
                }
            }
            None => format!("{e}"),
        },
        Outcome::Unmodelled { reason } => format!("{reason}"),
    }
}

#[test]
fn mesa_corpus() {
    let corpus = corpus();
    assert!(corpus.len() >= 8, "the corpus is in tests/mesa/");
    let rows: Vec<Row> = corpus.iter().map(run).collect();
    println!(
        "| workload | batches | commands | outcome | pages marked | first command not modelled |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        let (kind, pages) = match r.outcome {
            Outcome::Audited { .. } => ("precise", r.precise),
            Outcome::Unmodelled { .. } => ("fallback", r.reachable),
        };
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            r.name,
            r.batches,
            r.commands,
            kind,
            pages,
            why(&r.outcome)
        );
    }
    let precise = rows
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Audited { .. }))
        .count();
    let fallback_pages: usize = rows
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Unmodelled { .. }))
        .map(|r| r.reachable)
        .sum();
    let fallback = rows.len() - precise;
    println!(
        "\n{} workloads: {precise} precise, {fallback} fallback; the fallback marked {fallback_pages} pages in all, \
         where marking the whole log of a 1 GiB guest marked {}",
        rows.len(),
        fallback as u64 * GUEST_PAGES
    );
    for r in &rows {
        if let Outcome::Unmodelled { reason } = r.outcome {
            // GVT accepted these: the only acceptable reason is a command
            // the auditor does not model, never an address or batch error.
            let ok = match reason {
                Unmodelled::Refused(e) => {
                    matches!(
                        e.reason,
                        Reason::UnknownOpcode
                            | Reason::Unsupported { .. }
                            | Reason::RegisterNotAllowed { .. }
                    )
                }
                _ => false,
            };
            assert!(ok, "{}: {reason}", r.name);
            assert!(
                r.reachable as u64 <= GUEST_PAGES / 64,
                "{}: a fallback bigger than the objects",
                r.name
            );
        }
    }
}
