//! When `hagctl checkpoint`'s epochs start: every `--interval`, counted
//! from when the previous epoch was due, not from when it was acknowledged
//! (as Remus does). An epoch still running when the next is due (a slow
//! link or backup) makes the next start at once, late; the lateness is
//! reported with that epoch ([`Start::late`]), and the period
//! is measured from there, so a slow backup shows up as overruns and a
//! longer actual period, never as a silently longer interval.
//!
//! Pure: the caller reads the clock and sleeps.

use std::time::{Duration, Instant};

/// The epoch schedule.
#[derive(Clone, Debug)]
pub struct Schedule {
    interval: Duration,
    /// When the epoch now running (or last run) was due.
    due: Instant,
    /// When it actually started (`None`: no epoch started yet).
    started: Option<Instant>,
}

/// When the next epoch starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Start {
    /// Its start.
    pub at: Instant,
    /// How far past its due time it starts (the previous epoch overran).
    pub late: Option<Duration>,
}

impl Schedule {
    /// The schedule of epochs every `interval`, the first starting at
    /// `now`.
    pub fn new(interval: Duration, now: Instant) -> Schedule {
        Schedule {
            interval,
            due: now,
            started: None,
        }
    }

    /// The epoch that started at `now` (it was due at [`Schedule::next`]'s
    /// answer): returns the time since the previous one started, the
    /// actual period (`None` for the schedule's first epoch).
    pub fn started(&mut self, now: Instant) -> Option<Duration> {
        let period = self.started.map(|s| now.saturating_duration_since(s));
        self.started = Some(now);
        period
    }

    /// An epoch was given up (its VM paused for as long as that took):
    /// the next comes a whole interval after `now`, so that the VM runs
    /// between two pauses however long a failing capture takes.
    pub fn skipped(&mut self, now: Instant) {
        self.due = now;
    }

    /// The next epoch's start, asked at `now` once the current one is
    /// done: an interval after the current one was due, or at once if that
    /// has passed (then late, and the schedule continues
    /// from `now`).
    pub fn next(&mut self, now: Instant) -> Start {
        let due = self.due + self.interval;
        if now <= due {
            self.due = due;
            return Start {
                at: due,
                late: None,
            };
        }
        self.due = now;
        Start {
            at: now,
            late: Some(now - due),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn an_epoch_shorter_than_the_interval_does_not_stretch_the_period() {
        let t0 = Instant::now();
        let mut s = Schedule::new(2 * S, t0);
        assert_eq!(s.started(t0), None);
        // The epoch (pause, send, ack) took 1.5 s: the next still starts
        // 2 s after this one did, not 2 s after its ack (3.5 s).
        let next = s.next(t0 + S * 3 / 2);
        assert_eq!(
            next,
            Start {
                at: t0 + 2 * S,
                late: None
            }
        );
        assert_eq!(s.started(next.at), Some(2 * S));
        let next = s.next(t0 + 3 * S);
        assert_eq!(next.at, t0 + 4 * S);
    }

    #[test]
    fn an_overrun_starts_the_next_epoch_at_once_and_late() {
        let t0 = Instant::now();
        let mut s = Schedule::new(2 * S, t0);
        s.started(t0);
        // A slow backup: acknowledged 5 s after the start.
        let next = s.next(t0 + 5 * S);
        assert_eq!(
            next,
            Start {
                at: t0 + 5 * S,
                late: Some(3 * S)
            }
        );
        assert_eq!(s.started(next.at), Some(5 * S));
        // Back to speed: the period is kept from the late start.
        let next = s.next(t0 + 6 * S);
        assert_eq!(
            next,
            Start {
                at: t0 + 7 * S,
                late: None
            }
        );
    }

    #[test]
    fn a_skipped_epoch_leaves_the_vm_a_whole_interval() {
        let t0 = Instant::now();
        let mut s = Schedule::new(2 * S, t0);
        s.started(t0);
        // The capture failed after 30 s (a stuck save).
        s.skipped(t0 + 30 * S);
        assert_eq!(
            s.next(t0 + 30 * S),
            Start {
                at: t0 + 32 * S,
                late: None
            }
        );
    }

    #[test]
    fn the_schedule_does_not_drift_with_the_callers_wake_ups() {
        let t0 = Instant::now();
        let mut s = Schedule::new(S, t0);
        // Each epoch starts a little after it was due (a sleep's
        // granularity) and ends within the interval.
        let mut at = t0;
        for k in 1..=100u32 {
            let next = s.next(at + S / 2);
            assert_eq!(next.at, t0 + S * k);
            at = next.at + Duration::from_millis(9);
            s.started(at);
        }
    }
}
