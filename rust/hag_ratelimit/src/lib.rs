//! What a guest can make the host's kernel log print, bounded.
//!
//! A guest decides how often its vGPU rejects a submission or hangs, and a
//! slow `hagctl events` listener how often an event is not delivered: one
//! line each would let either flood the host's log. hag_mdev prints such
//! lines through a [`LogBudget`] (one per vGPU) or an [`AtomicLogBudget`]
//! (one per module, for callers with no lock of their own): at most
//! [`BURST`] lines per [`INTERVAL_NS`], as the kernel's own printk rate
//! limit allows, and the first line of the next interval says how many
//! were left out. The counters themselves (`IOC_VGPU_STATS`) are never
//! limited.
//!
//! And what engine time a guest that keeps hanging its vGPU gets
//! ([`HangBackoff`]): a submission is bounded, but a loop of hangs and
//! resets would otherwise keep a kernel worker busy for ever.
//!
//! The kernel module includes these files by path (`rust/hag_mdev/hag.rs`);
//! the host tests here run the same code.
#![no_std]

mod backoff;
mod budget;

pub use backoff::*;
pub use budget::*;
