// SPDX-License-Identifier: GPL-2.0-only
//! How much engine time a guest that keeps hanging its vGPU gets.
//!
//! A submission is bounded (the watchdog ends it after a fixed amount of
//! work), but a guest can submit a self-chaining loop, let it hang, reset
//! the vGPU and submit it again, for ever: a kernel worker busy without
//! end, charged to no VM. As a GPU driver stops trusting a context that
//! keeps hanging, a [`HangBackoff`] counts the hangs in a row (since the
//! last submission that finished) and, for each, halves the work the next
//! submission may do before it is called hung and doubles the pause
//! between its slices, down to one slice and up to [`MAX_GAP_MS`]. So the
//! engine time such a guest gets falls with every hang, to at most one
//! slice per [`MAX_GAP_MS`]; the first submission that finishes restores
//! the full allowance. A single hang costs a well-behaved guest nothing
//! (its next submission is only slowed until it finishes).
//!
//! Pure arithmetic, no clock: the kernel module's engine asks it at each
//! slice (`rust/hag_mdev/sim.rs`), and the host tests below run the same
//! code.

/// The longest pause between two slices of a submission after hangs, ms.
pub const MAX_GAP_MS: u32 = 16;

/// Hangs in a row after which the allowance stops falling.
const MAX_STREAK: u32 = 12;

/// Hangs in a row, and what they leave the next submission.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HangBackoff {
    streak: u32,
}

impl HangBackoff {
    /// A submission was declared hung.
    pub fn hung(&mut self) {
        self.streak = (self.streak + 1).min(MAX_STREAK);
    }

    /// A submission finished: the guest's work is trusted again.
    pub fn finished(&mut self) {
        self.streak = 0;
    }

    /// Hangs since the last submission that finished (capped).
    pub fn streak(&self) -> u32 {
        self.streak
    }

    /// The work a submission may do before it is called hung: `full`
    /// halved for each hang in a row, never below `floor` (one slice).
    pub fn work_limit(&self, full: u64, floor: u64) -> u64 {
        (full >> self.streak).max(floor)
    }

    /// The pause after each slice of a submission, ms: none without a
    /// hang, then 1, 2, 4 … [`MAX_GAP_MS`].
    pub fn slice_gap_ms(&self) -> u32 {
        match self.streak {
            0 => 0,
            n => (1u32 << (n - 1).min(MAX_GAP_MS.trailing_zeros())).min(MAX_GAP_MS),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: u64 = 1 << 22;
    const SLICE: u64 = 1024;

    #[test]
    fn a_trusted_guest_gets_everything() {
        let b = HangBackoff::default();
        assert_eq!(b.work_limit(FULL, SLICE), FULL);
        assert_eq!(b.slice_gap_ms(), 0);
    }

    #[test]
    fn each_hang_in_a_row_halves_the_work_and_doubles_the_gap() {
        let mut b = HangBackoff::default();
        let mut seen = [(0, 0); 6];
        for s in &mut seen {
            b.hung();
            *s = (b.work_limit(FULL, SLICE), b.slice_gap_ms());
        }
        assert_eq!(
            seen,
            [
                (FULL / 2, 1),
                (FULL / 4, 2),
                (FULL / 8, 4),
                (FULL / 16, 8),
                (FULL / 32, 16),
                (FULL / 64, 16)
            ]
        );
    }

    #[test]
    fn a_guest_that_never_stops_hanging_gets_one_slice_per_gap() {
        let mut b = HangBackoff::default();
        for _ in 0..1000 {
            b.hung();
        }
        assert_eq!(b.streak(), MAX_STREAK);
        assert_eq!(b.work_limit(FULL, SLICE), SLICE);
        assert_eq!(b.slice_gap_ms(), MAX_GAP_MS);
        // Engine time over time: at most one slice of work per gap.
        assert!(b.work_limit(FULL, SLICE) / u64::from(b.slice_gap_ms()) <= SLICE);
    }

    #[test]
    fn a_finished_submission_restores_the_allowance() {
        let mut b = HangBackoff::default();
        b.hung();
        b.hung();
        b.finished();
        assert_eq!(b, HangBackoff::default());
        assert_eq!(b.work_limit(FULL, SLICE), FULL);
    }
}
