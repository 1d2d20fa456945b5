//! Who may take a listening `hagctl backup`'s resources, and when.
//!
//! A connection first runs the key handshake ([`crate::secure`]); only an
//! authenticated peer may then hold a session slot (`--max-connections`).
//! Handshakes have a pool of their own, capped in all and per source
//! address, and the responder gives each one [`ACCEPT_HANDSHAKE`]: so
//! peers without the key, however many connections they open and however
//! slowly they speak, never hold a session slot and never keep the pairing,
//! a resynchronisation or a fenced primary's JOIN from getting in.
//!
//! [`Admission`] only counts; the tickets it hands out give their place
//! back when dropped, so a thread that ends for any reason frees it.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// How long an accepted connection has to complete the handshake (two
/// small messages: milliseconds natively, well under this on a starved
/// emulated host; an initiator refused for being slow simply retries).
pub const ACCEPT_HANDSHAKE: Duration = Duration::from_secs(2);
/// Handshakes under way at once, in all.
pub const MAX_HANDSHAKES: usize = 32;
/// Handshakes under way at once from one address.
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 4;

/// Why a connection was not admitted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Too many handshakes under way.
    #[error("{0} handshakes under way already (the limit)")]
    Handshakes(usize),
    /// Too many handshakes under way from this address.
    #[error("{limit} handshakes from {addr} under way already (the limit per address)")]
    FromSource {
        /// The address.
        addr: IpAddr,
        /// The limit.
        limit: usize,
    },
    /// Every session slot is held by authenticated connections.
    #[error("{0} authenticated connections open already (--max-connections)")]
    Sessions(usize),
}

#[derive(Debug, Default)]
struct Counts {
    handshakes: usize,
    by_source: BTreeMap<IpAddr, usize>,
    sessions: usize,
}

/// The counts, and their limits.
#[derive(Debug)]
pub struct Admission {
    counts: Mutex<Counts>,
    max_handshakes: usize,
    max_per_source: usize,
    max_sessions: usize,
}

impl Admission {
    /// Limits: handshakes in all and per source, and session slots.
    pub fn new(max_handshakes: usize, max_per_source: usize, max_sessions: usize) -> Arc<Self> {
        Arc::new(Admission {
            counts: Mutex::new(Counts::default()),
            max_handshakes,
            max_per_source,
            max_sessions,
        })
    }

    fn counts(&self) -> MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A connection from `addr` wants to run the handshake.
    pub fn handshake(self: &Arc<Self>, addr: IpAddr) -> Result<Handshake, Refusal> {
        let mut c = self.counts();
        if c.handshakes >= self.max_handshakes {
            return Err(Refusal::Handshakes(self.max_handshakes));
        }
        let from = c.by_source.entry(addr).or_insert(0);
        if *from >= self.max_per_source {
            return Err(Refusal::FromSource {
                addr,
                limit: self.max_per_source,
            });
        }
        *from += 1;
        c.handshakes += 1;
        Ok(Handshake {
            admission: self.clone(),
            addr,
        })
    }

    /// Session slots held now.
    #[cfg(test)]
    pub fn sessions(&self) -> usize {
        self.counts().sessions
    }
}

/// A handshake's place in the pool; given back when dropped.
#[derive(Debug)]
pub struct Handshake {
    admission: Arc<Admission>,
    addr: IpAddr,
}

impl Handshake {
    /// The peer proved the key: its handshake place becomes a session
    /// slot, if one is free.
    pub fn authenticated(self) -> Result<Session, Refusal> {
        let a = self.admission.clone();
        drop(self);
        let mut c = a.counts();
        if c.sessions >= a.max_sessions {
            return Err(Refusal::Sessions(a.max_sessions));
        }
        c.sessions += 1;
        drop(c);
        Ok(Session { admission: a })
    }
}

impl Drop for Handshake {
    fn drop(&mut self) {
        let mut c = self.admission.counts();
        c.handshakes -= 1;
        if let Some(n) = c.by_source.get_mut(&self.addr) {
            *n -= 1;
            if *n == 0 {
                c.by_source.remove(&self.addr);
            }
        }
    }
}

/// An authenticated connection's session slot; given back when dropped.
#[derive(Debug)]
pub struct Session {
    admission: Arc<Admission>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.admission.counts().sessions -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([192, 0, 2, last])
    }

    #[test]
    fn unauthenticated_peers_never_hold_a_session_slot() {
        // Issue 20, item 4: 16 idle connections used to take all 16 slots.
        let a = Admission::new(8, 4, 2);
        let idle: Vec<_> = (0..4).map(|_| a.handshake(ip(1)).unwrap()).collect();
        assert_eq!(
            a.handshake(ip(1)).unwrap_err(),
            Refusal::FromSource {
                addr: ip(1),
                limit: 4
            }
        );
        // Another address still gets in, and once authenticated holds a
        // session slot although the idle ones are still there.
        let s1 = a.handshake(ip(2)).unwrap().authenticated().unwrap();
        let s2 = a.handshake(ip(3)).unwrap().authenticated().unwrap();
        assert_eq!(a.sessions(), 2);
        assert_eq!(
            a.handshake(ip(4)).unwrap().authenticated().unwrap_err(),
            Refusal::Sessions(2)
        );
        drop(s1);
        let _s3 = a.handshake(ip(4)).unwrap().authenticated().unwrap();
        drop(s2);
        drop(idle);
        assert!(a.handshake(ip(1)).is_ok(), "places given back on drop");
    }

    #[test]
    fn the_handshake_pool_is_capped_in_all() {
        let a = Admission::new(3, 2, 16);
        let _h: Vec<_> = [1, 1, 2]
            .iter()
            .map(|&n| a.handshake(ip(n)).unwrap())
            .collect();
        assert_eq!(a.handshake(ip(9)).unwrap_err(), Refusal::Handshakes(3));
        assert_eq!(a.sessions(), 0);
    }
}
