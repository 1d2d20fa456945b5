//! The hand-off: a workload GVT-g scanned and shadowed → audit → guest page
//! frames.
//!
//! [`hand_off`] audits one [`Workload`] with the vGPU's GGTT size and a full
//! 48-bit PPGTT, reading batch buffers only from GVT's shadow copies
//! ([`ShadowMemory`]). For every validated command it walks the write set
//! page by page, translates each graphics page to a guest frame through
//! [`Translate`] and gives the frame to the caller's sink, skipping repeats
//! of the page or frame just handled. The [`Outcome`] says whether that was
//! the whole write set ([`Outcome::Audited`]) or whether the caller must
//! mark everything ([`Outcome::Unmodelled`]); in the latter case the sink
//! may already have received some frames, which only adds dirty pages.
//!
//! This file is included as a module by the kernel (`#[path]`), so it uses
//! only `core`, carries no crate attributes, never panics on any input and
//! bounds every loop.

use core::fmt;

use crate::audit::{
    self, AddressSpace, AuditConfig, AuditError, AuditSink, GfxMemory, MemoryFault, SinkFull,
    ValidatedCommand, PAGE_SIZE,
};

/// Size of a context's PPGTT: GVT-g guests on Gen8/Gen9 use 4-level,
/// 48-bit page tables.
pub const PPGTT_SIZE: u64 = 1 << 48;

/// Most shadowed batch buffers a workload may come with; beyond it the
/// workload is unmodelled (it bounds the overlap check, which is quadratic).
pub const MAX_SHADOWS: usize = 256;

/// One batch buffer GVT shadowed for the workload: its guest graphics
/// address and GVT's copy of the bytes, up to and including its
/// `MI_BATCH_BUFFER_END` (or the chaining `MI_BATCH_BUFFER_START`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShadowBb<'a> {
    /// The address space `gma` is in.
    pub space: AddressSpace,
    /// Guest graphics address of `bytes[0]`.
    pub gma: u64,
    /// The shadow copy.
    pub bytes: &'a [u8],
}

impl ShadowBb<'_> {
    /// One past the last shadowed graphics address, or `None` if the copy
    /// would wrap around the address space.
    fn end(&self) -> Option<u64> {
        self.gma.checked_add(u64::try_from(self.bytes.len()).ok()?)
    }
}

/// Graphics memory made of a workload's shadowed batch buffers: a read
/// succeeds only if it lies wholly inside one shadow copy of the same
/// address space; anything else faults. It remembers which copies were
/// read.
#[derive(Clone, Copy, Debug)]
pub struct ShadowMemory<'a> {
    /// The shadow copies.
    pub bbs: &'a [ShadowBb<'a>],
    /// Bit i: `bbs[i]` was read (up to [`MAX_SHADOWS`]).
    read: [u64; MAX_SHADOWS / 64],
}

impl<'a> ShadowMemory<'a> {
    /// Memory made of `bbs`, none read yet.
    pub fn new(bbs: &'a [ShadowBb<'a>]) -> Self {
        ShadowMemory {
            bbs,
            read: [0; MAX_SHADOWS / 64],
        }
    }

    /// The first shadow copy no read touched, if any. GVT shadows a batch
    /// because its scan reached it, so the GPU may run it: one the audit
    /// never reached (a stream it was not handed) is not modelled.
    pub fn unread(&self) -> Option<&ShadowBb<'a>> {
        self.bbs.iter().enumerate().find_map(|(i, bb)| {
            let word = self.read.get(i / 64).copied().unwrap_or(0);
            (word & (1 << (i % 64)) == 0).then_some(bb)
        })
    }
}

impl ShadowMemory<'_> {
    /// The first two shadow copies in the same address space whose ranges
    /// overlap (or one that wraps around the address space), if any.
    ///
    /// Overlapping copies are two snapshots of the same guest bytes taken at
    /// different times: the GPU runs both, the auditor would read one, so a
    /// workload with them is not modelled.
    pub fn overlap(&self) -> Option<(usize, usize)> {
        for (i, a) in self.bbs.iter().enumerate() {
            let Some(a_end) = a.end() else {
                return Some((i, i));
            };
            for (j, b) in self.bbs.iter().enumerate().skip(i + 1) {
                let Some(b_end) = b.end() else {
                    return Some((j, j));
                };
                if a.space == b.space && a.gma < b_end && b.gma < a_end {
                    return Some((i, j));
                }
            }
        }
        None
    }
}

impl GfxMemory for ShadowMemory<'_> {
    fn read_dwords(
        &mut self,
        space: AddressSpace,
        gfx_addr: u64,
        out: &mut [u32],
    ) -> Result<(), MemoryFault> {
        let fault = MemoryFault { gfx_addr };
        let want = out.len().checked_mul(4).ok_or(fault)?;
        for (i, bb) in self.bbs.iter().enumerate() {
            if bb.space != space {
                continue;
            }
            let Some(off) = gfx_addr.checked_sub(bb.gma) else {
                continue;
            };
            let Ok(start) = usize::try_from(off) else {
                continue;
            };
            let Some(src) = start
                .checked_add(want)
                .and_then(|end| bb.bytes.get(start..end))
            else {
                continue;
            };
            let mut at = 0;
            for o in out.iter_mut() {
                let bytes = src
                    .get(at..at + 4)
                    .and_then(|b| <[u8; 4]>::try_from(b).ok());
                *o = u32::from_le_bytes(bytes.ok_or(fault)?);
                at += 4;
            }
            if let Some(word) = self.read.get_mut(i / 64) {
                *word |= 1 << (i % 64);
            }
            return Ok(());
        }
        Err(fault)
    }
}

/// A graphics address GVT could not translate (not mapped, or not guest
/// RAM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TranslateFault;

/// How graphics addresses become guest page frames: the kernel asks GVT
/// (`intel_gvt_audit_gma_to_gfn`), tests use a table.
pub trait Translate {
    /// The guest page frame number holding graphics address `gma` of
    /// `space` (the workload's GGTT or its context's PPGTT).
    fn gma_to_gfn(&mut self, space: AddressSpace, gma: u64) -> Result<u64, TranslateFault>;
}

/// One workload as GVT handed it over.
#[derive(Clone, Copy, Debug)]
pub struct Workload<'a> {
    /// GVT's scanned copy of the ring slice `[head, tail)`, a wrap already
    /// joined.
    pub ring: &'a [u32],
    /// GGTT address of the first ring dword.
    pub ring_gma: u64,
    /// GGTT address of the engine's hardware status page as the guest
    /// programmed it (GVT's `hws_pga`). "Store data index" writes are
    /// audited there: GVT rewrites the GGTT forms of `PIPE_CONTROL` and
    /// `MI_FLUSH_DW` to that page. The forms it leaves alone (i915's
    /// flushes: `LRC_PPHWSP_SCRATCH_ADDR` without the GGTT bit) are, by
    /// i915's naming, writes to the per-process status page of the running
    /// context, i.e. page 0 of GVT's shadow context, which
    /// `update_guest_context` does not copy back (it copies pages from 2
    /// on); counting them here then only adds a page.
    pub hwsp_gma: u64,
    /// The batch buffers GVT shadowed.
    pub bbs: &'a [ShadowBb<'a>],
    /// Bytes of graphics address space the vGPU's GGTT spans.
    pub ggtt_size: u64,
    /// The context's indirect context buffer (RCS only), as GVT scanned
    /// and shadowed it: the GPU runs it at every restore of the context,
    /// before the ring, so its writes are the workload's too.
    pub indirect_ctx: Option<IndirectCtx<'a>>,
}

/// A context's indirect context buffer ("wa_ctx"): a command stream of its
/// own, in the GGTT, that the GPU runs whenever it restores the context.
#[derive(Clone, Copy, Debug)]
pub struct IndirectCtx<'a> {
    /// GGTT address of `dwords[0]`.
    pub gma: u64,
    /// GVT's shadow of the buffer: the bytes the guest's context names.
    pub dwords: &'a [u32],
}

/// Registers an indirect context buffer may name. i915 (6.12,
/// `gen9_init_indirectctx_bb` and `gen8_emit_flush_coherentl3_wa`) saves,
/// sets and restores `GEN8_L3SQCREG4` around a flush, and sets three
/// chicken registers; none of them moves where the GPU writes. Anything
/// else in an indirect context is not modelled.
pub const INDIRECT_CTX_REGISTERS: [u32; 4] = [
    0xb118, // GEN8_L3SQCREG4
    0x7014, // COMMON_SLICE_CHICKEN2
    0x2088, // FF_SLICE_CHICKEN
    0x2090, // _3D_CHICKEN3
];

/// Work limits of one hand-off, on top of the auditor's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most graphics pages translated per workload.
    pub max_pages: u32,
    /// Most write ranges (a blit counts one per row) walked per workload.
    pub max_ranges: u32,
}

impl Limits {
    /// 4096 pages (16 MiB of writes) and 65536 ranges: far above what a
    /// guest driver's ring and batch post-sync writes need, small enough
    /// that a hand-off stays a fraction of GVT's own scan.
    pub const DEFAULT: Limits = Limits {
        max_pages: 4096,
        max_ranges: 65536,
    };
}

/// Why a workload was not modelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unmodelled {
    /// The auditor refused it (a command it does not model, a batch not
    /// shadowed, a bad configuration…).
    Refused(AuditError),
    /// The auditor refused the context's indirect context buffer.
    IndirectCtxRefused(AuditError),
    /// GVT could not translate a written page.
    Untranslatable {
        /// The page's address space.
        space: AddressSpace,
        /// Its graphics address.
        gma: u64,
    },
    /// The write set spans more pages than [`Limits::max_pages`].
    TooManyPages {
        /// The limit.
        limit: u32,
    },
    /// The write set has more ranges than [`Limits::max_ranges`].
    TooManyRanges {
        /// The limit.
        limit: u32,
    },
    /// GVT shadowed a batch buffer that neither the ring nor the indirect
    /// context led the audit to (the GPU may run it all the same).
    UnreachedShadow {
        /// Its address space.
        space: AddressSpace,
        /// Its graphics address.
        gma: u64,
    },
    /// More shadowed batch buffers than [`MAX_SHADOWS`].
    TooManyShadows {
        /// How many there were.
        count: usize,
    },
    /// Two shadow copies overlap (see [`ShadowMemory::overlap`]), or one
    /// wraps around the address space.
    OverlappingShadows {
        /// Graphics address of the first.
        first: u64,
        /// Graphics address of the second.
        second: u64,
    },
}

impl fmt::Display for Unmodelled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Unmodelled::Refused(e) => write!(f, "audit refused it: {e}"),
            Unmodelled::IndirectCtxRefused(e) => {
                write!(f, "audit refused its indirect context: {e}")
            }
            Unmodelled::Untranslatable { space, gma } => {
                write!(
                    f,
                    "{} address {gma:#x} has no guest page",
                    space_name(space)
                )
            }
            Unmodelled::TooManyPages { limit } => {
                write!(f, "writes more than {limit} pages")
            }
            Unmodelled::TooManyRanges { limit } => {
                write!(f, "writes more than {limit} ranges")
            }
            Unmodelled::UnreachedShadow { space, gma } => write!(
                f,
                "a batch buffer GVT shadowed at {} {gma:#x} was not reached",
                space_name(space)
            ),
            Unmodelled::TooManyShadows { count } => {
                write!(f, "{count} shadowed batch buffers, more than {MAX_SHADOWS}")
            }
            Unmodelled::OverlappingShadows { first, second } => write!(
                f,
                "shadowed batch buffers at {first:#x} and {second:#x} overlap"
            ),
        }
    }
}

/// The name of an address space in messages.
pub const fn space_name(space: AddressSpace) -> &'static str {
    match space {
        AddressSpace::Ggtt => "GGTT",
        AddressSpace::Ppgtt => "PPGTT",
    }
}

/// What a hand-off found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The whole write set was translated: the sink received every guest
    /// frame the workload may write.
    Audited {
        /// Frames given to the sink.
        pages: u32,
        /// Commands the auditor validated.
        commands: u32,
    },
    /// Not modelled: the caller must treat every page it logs as written.
    Unmodelled {
        /// Why.
        reason: Unmodelled,
    },
}

/// The audit sink: walks each command's write set as it is validated.
struct Mapper<'t, T: Translate, F: FnMut(u64)> {
    translate: &'t mut T,
    sink: &'t mut F,
    limits: Limits,
    /// The graphics page translated last, to skip it when the next range
    /// starts on it.
    last_page: Option<(AddressSpace, u64)>,
    /// The frame given to the sink last.
    last_gfn: Option<u64>,
    pages: u32,
    translations: u32,
    ranges: u32,
    failure: Option<Unmodelled>,
}

impl<T: Translate, F: FnMut(u64)> Mapper<'_, T, F> {
    fn fail(&mut self, why: Unmodelled) -> Result<(), SinkFull> {
        self.failure = Some(why);
        Err(SinkFull)
    }

    fn page(&mut self, space: AddressSpace, page: u64) -> Result<(), SinkFull> {
        if self.last_page == Some((space, page)) {
            return Ok(());
        }
        if self.translations >= self.limits.max_pages {
            let limit = self.limits.max_pages;
            return self.fail(Unmodelled::TooManyPages { limit });
        }
        self.translations += 1;
        // page = address / 4096, so this cannot overflow; saturate anyway.
        let gma = page.saturating_mul(PAGE_SIZE);
        let gfn = match self.translate.gma_to_gfn(space, gma) {
            Ok(gfn) => gfn,
            Err(TranslateFault) => return self.fail(Unmodelled::Untranslatable { space, gma }),
        };
        self.last_page = Some((space, page));
        if self.last_gfn != Some(gfn) {
            (self.sink)(gfn);
            self.last_gfn = Some(gfn);
            self.pages = self.pages.saturating_add(1);
        }
        Ok(())
    }
}

impl<T: Translate, F: FnMut(u64)> AuditSink for Mapper<'_, T, F> {
    fn command(&mut self, cmd: &ValidatedCommand) -> Result<(), SinkFull> {
        // Each turn of the inner loop translates a page (bounded by
        // max_pages) or skips the one repeat a range can start with, so the
        // work is bounded by max_pages + max_ranges.
        for range in cmd.kind.write_set().ranges() {
            if self.ranges >= self.limits.max_ranges {
                let limit = self.limits.max_ranges;
                return self.fail(Unmodelled::TooManyRanges { limit });
            }
            self.ranges += 1;
            for page in audit::pages_of(range) {
                self.page(range.space, page)?;
            }
        }
        Ok(())
    }
}

/// Audits `wl` and gives `sink` the guest frame of every page its validated
/// commands may write; see the module docs.
pub fn hand_off<T: Translate, F: FnMut(u64)>(
    wl: &Workload<'_>,
    limits: &Limits,
    translate: &mut T,
    sink: &mut F,
) -> Outcome {
    let unmodelled = |reason| Outcome::Unmodelled { reason };
    if wl.bbs.len() > MAX_SHADOWS {
        return unmodelled(Unmodelled::TooManyShadows {
            count: wl.bbs.len(),
        });
    }
    let mut mem = ShadowMemory::new(wl.bbs);
    if let Some((i, j)) = mem.overlap() {
        let gma = |k: usize| wl.bbs.get(k).map_or(0, |bb| bb.gma);
        return unmodelled(Unmodelled::OverlappingShadows {
            first: gma(i),
            second: gma(j),
        });
    }
    // No register is allowed: the only MI_LOAD_REGISTER_IMM i915 (6.12)
    // puts in a Gen8/Gen9 execlists ring is `emit_pdps`, which loads the
    // PPGTT page-directory pointers (3-level PPGTTs only). Those redirect
    // every later PPGTT write, and the write set could not follow them, so
    // such a workload stays unmodelled.
    let cfg = AuditConfig::new(wl.ggtt_size, wl.hwsp_gma).with_ppgtt(PPGTT_SIZE);
    let mut mapper = Mapper {
        translate,
        sink,
        limits: *limits,
        last_page: None,
        last_gfn: None,
        pages: 0,
        translations: 0,
        ranges: 0,
        failure: None,
    };
    let mut commands = 0u32;
    if let Some(ictx) = wl.indirect_ctx {
        let ictx_cfg = cfg.with_registers(&INDIRECT_CTX_REGISTERS);
        match audit::audit(ictx.dwords, ictx.gma, &ictx_cfg, &mut mem, &mut mapper) {
            Ok(summary) => commands = summary.commands,
            Err(e) => {
                return unmodelled(mapper.failure.unwrap_or(Unmodelled::IndirectCtxRefused(e)))
            }
        }
    }
    match audit::audit(wl.ring, wl.ring_gma, &cfg, &mut mem, &mut mapper) {
        Ok(_) if mem.unread().is_some() => unmodelled(Unmodelled::UnreachedShadow {
            space: mem.unread().map_or(AddressSpace::Ggtt, |bb| bb.space),
            gma: mem.unread().map_or(0, |bb| bb.gma),
        }),
        Ok(summary) => Outcome::Audited {
            pages: mapper.pages,
            commands: commands.saturating_add(summary.commands),
        },
        Err(e) => unmodelled(mapper.failure.unwrap_or(Unmodelled::Refused(e))),
    }
}
