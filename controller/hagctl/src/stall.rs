//! A side's own stall must never count as its peer's silence. A process
//! that was stopped (SIGSTOP, a host that froze, a long page-in) wakes
//! with its peer's heartbeats of that time still queued in its sockets,
//! unread: judged at once, the peer looks silent for the whole stall. The
//! backup (before it decides to take over) and the primary (before it
//! declares its backup lost) ask a [`StallGuard`] first, which holds any
//! verdict until the readers had time to drain what arrived meanwhile.

use std::time::{Duration, Instant};

use crate::backup::HEARTBEAT;

/// A loop turn this much later than the last means this process stalled.
const STALL: Duration = Duration::from_millis(500);

/// Watches a loop's turns for the process's own stalls.
#[derive(Clone, Debug)]
pub struct StallGuard {
    last: Instant,
    quiet_until: Instant,
}

impl StallGuard {
    /// A guard whose loop starts at `now`.
    pub fn new(now: Instant) -> StallGuard {
        StallGuard {
            last: now,
            quiet_until: now,
        }
    }

    /// Called every turn of the loop (more often than [`STALL`]): whether
    /// it may judge the peer's silence at `now`.
    pub fn may_decide(&mut self, now: Instant) -> bool {
        if now.saturating_duration_since(self.last) > STALL {
            self.quiet_until = now + STALL.max(2 * HEARTBEAT);
        }
        self.last = now;
        now >= self.quiet_until
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 20, item 5: after its own stall a side waits for its readers
    /// before it judges anything.
    #[test]
    fn a_stalled_side_judges_nothing_until_its_readers_drained() {
        let t0 = Instant::now();
        let mut g = StallGuard::new(t0);
        let ms = Duration::from_millis;
        assert!(g.may_decide(t0 + ms(200)));
        assert!(g.may_decide(t0 + ms(400)));
        // Stopped for 4 s: the heartbeats of that time are still unread.
        let woke = t0 + ms(4400);
        assert!(!g.may_decide(woke));
        assert!(!g.may_decide(woke + ms(200)));
        assert!(g.may_decide(woke + ms(600)));
    }
}
