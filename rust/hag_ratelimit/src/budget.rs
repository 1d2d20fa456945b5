//! [`LogBudget`] and [`AtomicLogBudget`]: at most [`BURST`] lines per
//! [`INTERVAL_NS`], the rest counted.

use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Lines printed per interval at most (the kernel's
/// `DEFAULT_RATELIMIT_BURST`).
pub const BURST: u32 = 10;
/// The interval, in nanoseconds (the kernel's `DEFAULT_RATELIMIT_INTERVAL`,
/// 5 s).
pub const INTERVAL_NS: u64 = 5_000_000_000;

/// Whether to print a line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Print it; `suppressed` lines were left out since the last one
    /// printed (say so, if not 0).
    Print {
        /// Lines left out before this one.
        suppressed: u64,
    },
    /// Leave it out (it is counted).
    Suppress,
}

/// What a printed line appends about the lines left out before it:
/// nothing, or ` (N more left out)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeftOut(pub u64);

impl core::fmt::Display for LeftOut {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.0 {
            0 => Ok(()),
            n => write!(
                f,
                " ({n} more left out: at most {BURST} lines per {} s)",
                INTERVAL_NS / 1_000_000_000
            ),
        }
    }
}

/// A budget for one source of lines, under its owner's lock.
#[derive(Clone, Debug, Default)]
pub struct LogBudget {
    /// When the current interval began (ns, monotonic); `None` before the
    /// first line.
    start: Option<u64>,
    printed: u32,
    suppressed: u64,
}

impl LogBudget {
    /// A budget with nothing printed yet.
    pub const fn new() -> LogBudget {
        LogBudget {
            start: None,
            printed: 0,
            suppressed: 0,
        }
    }

    /// Whether a line at `now_ns` (a monotonic clock) may be printed.
    pub fn check(&mut self, now_ns: u64) -> Verdict {
        let new_interval = match self.start {
            None => true,
            // A clock that went back (it should not) starts one too.
            Some(start) => now_ns.checked_sub(start).is_none_or(|d| d >= INTERVAL_NS),
        };
        if new_interval {
            self.start = Some(now_ns);
            self.printed = 0;
        }
        if self.printed < BURST {
            self.printed += 1;
            Verdict::Print {
                suppressed: core::mem::take(&mut self.suppressed),
            }
        } else {
            self.suppressed = self.suppressed.saturating_add(1);
            Verdict::Suppress
        }
    }
}

/// The same budget for callers without a lock: shared by every context
/// (a `static`). Concurrent callers at an interval's start may print a
/// few lines more than [`BURST`]; never unboundedly many.
#[derive(Debug, Default)]
pub struct AtomicLogBudget {
    /// The interval's start + 1 (0: nothing printed yet).
    start: AtomicU64,
    printed: AtomicU32,
    suppressed: AtomicU64,
}

impl AtomicLogBudget {
    /// A budget with nothing printed yet.
    pub const fn new() -> AtomicLogBudget {
        AtomicLogBudget {
            start: AtomicU64::new(0),
            printed: AtomicU32::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Whether a line at `now_ns` (a monotonic clock) may be printed.
    pub fn check(&self, now_ns: u64) -> Verdict {
        let stamp = now_ns.saturating_add(1);
        let start = self.start.load(Ordering::Acquire);
        let expired = start == 0 || stamp.checked_sub(start).is_none_or(|d| d >= INTERVAL_NS);
        // One caller wins the new interval and resets the count.
        if expired
            && self
                .start
                .compare_exchange(start, stamp, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.printed.store(0, Ordering::Release);
        }
        if self.printed.fetch_add(1, Ordering::AcqRel) < BURST {
            Verdict::Print {
                suppressed: self.suppressed.swap(0, Ordering::AcqRel),
            }
        } else {
            // Saturates only after 2^64 lines.
            self.suppressed.fetch_add(1, Ordering::AcqRel);
            Verdict::Suppress
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `count` lines, one every `step_ns` from `t0`; returns the
    /// verdicts.
    fn run(check: &mut dyn FnMut(u64) -> Verdict, t0: u64, step_ns: u64, count: u64) -> [u64; 2] {
        let (mut printed, mut reported) = (0, 0);
        for i in 0..count {
            if let Verdict::Print { suppressed } = check(t0 + i * step_ns) {
                printed += 1;
                reported += suppressed;
            }
        }
        [printed, reported]
    }

    #[test]
    fn a_flood_prints_a_burst_per_interval_and_reports_the_rest() {
        for atomic in [false, true] {
            let mut plain = LogBudget::new();
            let shared = AtomicLogBudget::new();
            let mut check = |t| {
                if atomic {
                    shared.check(t)
                } else {
                    plain.check(t)
                }
            };
            // 10 000 lines over 10 s (one per ms) from t = 0: three
            // intervals begin (0, 5 s, 10 s is past the end), 20 lines.
            let [printed, reported] = run(&mut check, 0, 1_000_000, 10_000);
            assert_eq!(printed, 2 * u64::from(BURST), "atomic {atomic}");
            // The second interval's first line reports the first's rest.
            assert_eq!(reported, 5_000 - u64::from(BURST), "atomic {atomic}");
            // A quiet source prints every line, and the next line reports
            // what the flood's last interval left out.
            match check(60_000_000_000) {
                Verdict::Print { suppressed } => {
                    assert_eq!(suppressed, 5_000 - u64::from(BURST))
                }
                v => panic!("{v:?}"),
            }
            let [printed, _] = run(&mut check, 70_000_000_000, INTERVAL_NS, 5);
            assert_eq!(printed, 5, "atomic {atomic}");
        }
    }

    #[test]
    fn a_line_says_how_many_were_left_out() {
        extern crate std;
        use std::string::ToString;
        assert_eq!(LeftOut(0).to_string(), "");
        assert_eq!(
            LeftOut(4990).to_string(),
            " (4990 more left out: at most 10 lines per 5 s)"
        );
    }

    #[test]
    fn a_clock_that_goes_back_starts_an_interval_rather_than_blocking() {
        let mut b = LogBudget::new();
        let [printed, _] = run(&mut |t| b.check(t), 10 * INTERVAL_NS, 1, 50);
        assert_eq!(printed, u64::from(BURST));
        assert_eq!(b.check(0), Verdict::Print { suppressed: 40 });
        let a = AtomicLogBudget::new();
        let [printed, _] = run(&mut |t| a.check(t), 10 * INTERVAL_NS, 1, 50);
        assert_eq!(printed, u64::from(BURST));
        assert_eq!(a.check(0), Verdict::Print { suppressed: 40 });
    }
}
