//! The GVT-g hand-off of hag, the part that needs no i915.
//!
//! On a GVT-g host, i915's GVT scans and shadows every workload a guest
//! submits (its ring slice and the batch buffers it starts) and then calls
//! hag. [`handoff::hand_off`] runs hag's auditor over exactly what GVT
//! shadowed ([`handoff::ShadowMemory`]), turns the write set of every
//! validated command into guest page frame numbers through a
//! [`handoff::Translate`] (the kernel asks GVT's GTT), and hands each frame
//! to a sink (the kernel sets dirty bits).
//!
//! # Promises
//!
//! - **Never fails a workload it cannot model.** GVT's own scanner is the
//!   security gate and has already accepted the workload. Whatever hag
//!   cannot model (a command the auditor refuses, an address GVT cannot
//!   translate, more pages than the limit) yields
//!   [`Outcome::Unmodelled`](handoff::Outcome::Unmodelled): the caller
//!   then marks every page it logs dirty, so no write is ever missed.
//! - **What is audited is what GVT shadowed.** Batch buffers are read from
//!   GVT's shadow copies only; a read outside them faults (and the workload
//!   is unmodelled), never falls back to guest memory.
//! - **Never panics, bounded work, no allocation.** Work is bounded by the
//!   auditor's limits and by [`handoff::Limits`].
//!
//! [`track`] keeps what each workload in flight may still write until GVT
//! says it is done, so that a read of the dirty log while the GPU runs it
//! does not lose its writes.
//!
//! `no_std`, `core` only, no `unsafe`: the kernel module includes
//! [`handoff`] and [`track`] as modules of their own (`#[path]`), next to the auditor,
//! which it reaches as `crate::audit` in both builds.
//!
//! # Example
//!
//! ```
//! use hag_gvt::audit::{encode, AddressSpace};
//! use hag_gvt::handoff::{hand_off, Limits, Outcome, ShadowBb, TranslateFault, Translate, Workload};
//!
//! /// The guest's GGTT maps graphics page n to guest frame 0x1000 + n.
//! struct Linear;
//! impl Translate for Linear {
//!     fn gma_to_gfn(&mut self, _: AddressSpace, gma: u64) -> Result<u64, TranslateFault> {
//!         Ok(0x1000 + gma / 4096)
//!     }
//! }
//!
//! let ring = encode::store_data_imm(0x2_0004, 7);
//! let wl = Workload { ring: &ring, ring_gma: 0x1000, hwsp_gma: 0, bbs: &[], ggtt_size: 16 << 20, indirect_ctx: None };
//! let mut gfns = Vec::new();
//! let outcome = hand_off(&wl, &Limits::DEFAULT, &mut Linear, &mut |gfn| gfns.push(gfn));
//! assert_eq!(outcome, Outcome::Audited { pages: 1, commands: 1 });
//! assert_eq!(gfns, [0x1020]);
//! # let _: &[ShadowBb] = &[];
//! ```
#![no_std]

pub use hag_audit::audit;

pub mod handoff;
pub mod track;
