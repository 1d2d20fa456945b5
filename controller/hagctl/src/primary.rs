//! The primary's decisions in continuous checkpointing, without I/O.
//!
//! [`Policy`] takes what `hagctl checkpoint` observes (an epoch
//! acknowledged, the backup heard or lost, a hang, a signal, the VM gone)
//! and answers with what to do ([`Action`]); threads and sockets only feed
//! it and carry its actions out. The output rule it enforces
//! (docs/ha.md):
//!
//! - Output of epoch `e` is released only once the backup acknowledged
//!   `e` ([`Action::Release`]), or all of it once the backup confirmed
//!   that protection ended and it discarded its checkpoint
//!   ([`Action::ReleaseAll`]). Never on silence: a backup the primary
//!   cannot hear may still hear the primary, or may take over from its
//!   last checkpoint, and released output would then be contradicted.
//! - A backup that shows a newer generation took over: the VM is stopped
//!   before anything else, and is never resumed; if stopping fails, output
//!   stays held and stopping is retried. At pairing the backup judges this
//!   primary's term (`term`): a VM instance it took over from is stopped
//!   so; any other adopts the backup's generation if newer (a new start of
//!   the VM after a takeover of an older one).
//! - A hang stops the VM first, then tells the backup (HANG). A VM that
//!   crashed (its VMM gone without shutting it down) is handed over the
//!   same way, with nothing to stop.
//! - A signal (SIGTERM, SIGINT) ends protection: ABORT on every connection
//!   of the session; confirmed, output is released and the VM runs on
//!   unprotected; unconfirmed within the failover timeout, the backup may
//!   take over, so the VM is stopped.
//! - The VM finishing ends protection the same way (ABORT, then the
//!   confirmation), never by just closing the connections: the backup
//!   would take the silence for a lost host and resume a finished VM.
//! - An operator's confirmation that the backup is down (fenced, its host
//!   off) while it is unheard ends protection too: its checkpoint can no
//!   longer be resumed, so the held output goes out and the VM runs on.
//! - A witness's grant, claimed while the backup is unheard
//!   ([`crate::witness`]), means the same for the checkpoints of this
//!   generation: the held output goes out and the VM runs on, but
//!   protection does not end: the next pairing (the backup back, or
//!   another) is one generation up, where no stale checkpoint lives. The
//!   witness's refusal means the backup holds the grant and takes over:
//!   the VM stops, as at a fence. A grant recorded earlier (read from the
//!   witness, not won now) only moves the generation up: output held now
//!   may be newer than a checkpoint of a later pairing.
//!
//! The policy works for any VMM driver: it speaks of epochs and output,
//! not of how an epoch is captured.

use std::time::Duration;

/// Where the primary stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Connecting or running the first checkpoint of a pairing.
    Syncing,
    /// The last epoch was acknowledged.
    Protected,
    /// The link to the backup failed; retrying. Output stays held.
    Unprotected(String),
    /// Protection is ending (ABORT sent), waiting for the backup to say so.
    Ending {
        /// Why (a signal, or the VM finished).
        why: String,
        /// The VM finished by itself: there is nothing to stop.
        vm_finished: bool,
    },
    /// A newer generation runs the VM elsewhere.
    Fenced(u64),
    /// The vGPU hung: the VM is stopped, the backup told to take over.
    HandedOver(String),
    /// Finished: nothing more to do.
    Done,
}

impl std::fmt::Display for State {
    /// As an operator reads it (`confirm-backup-down`'s refusal says it).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            State::Syncing => f.write_str("synchronising with the backup"),
            State::Protected => f.write_str("protected"),
            State::Unprotected(why) => write!(f, "unprotected ({why})"),
            State::Ending { why, .. } => write!(f, "ending protection ({why})"),
            State::Fenced(g) => write!(f, "fenced by generation {g}"),
            State::HandedOver(why) => write!(f, "handed over to the backup ({why})"),
            State::Done => f.write_str("done"),
        }
    }
}

/// What the primary observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The backup accepted the pairing (HELLO_OK): its generation,
    /// failover timeout and verdict on this primary's term.
    Paired {
        /// The backup's generation.
        generation: u64,
        /// The backup's failover timeout.
        timeout: Duration,
        /// Whether it took over from this VM instance (`None`: a backup
        /// before terms, which judges by generation alone).
        superseded: Option<bool>,
    },
    /// The backup answered a control connection's JOIN (HELLO_OK).
    Joined {
        /// The backup's generation.
        generation: u64,
        /// Its verdict on this primary's term, as in `Paired`.
        superseded: Option<bool>,
    },
    /// EPOCH_ACK.
    Acked {
        /// The epoch.
        epoch: u64,
        /// The backup's generation in it.
        generation: u64,
    },
    /// A heartbeat (or any message) of the session from the backup.
    Heard {
        /// Its generation.
        generation: u64,
    },
    /// The data link or its control connection failed, or the backup was
    /// silent past the timeout.
    LinkLost(String),
    /// Our vGPU hung.
    Hung(String),
    /// The VM died without being shut down (its VMM killed or crashed):
    /// nothing to stop, the backup takes over as after a hang.
    Crashed(String),
    /// SIGTERM or SIGINT.
    Signal(String),
    /// The backup acknowledged the end of protection (it discarded its
    /// checkpoint and will not take over).
    EndConfirmed,
    /// No confirmation of the end within the failover timeout.
    EndUnconfirmed,
    /// The VM finished and its last epoch was acknowledged.
    Finished,
    /// The VM is gone or failed by itself.
    VmGone(String),
    /// The operator confirmed that the backup cannot take over (its host
    /// is down or fenced: `hagctl confirm-backup-down`), as `pcs stonith
    /// confirm` does for a cluster node.
    BackupDown(String),
    /// The witness granted this primary the VM at this generation (it
    /// was claimed while the backup was unheard): no checkpoint of it
    /// will be resumed.
    WitnessGranted(u64),
    /// The witness gave the VM to the backup, which takes it over from
    /// this generation (why, in the witness's words).
    WitnessDenied(u64, String),
    /// The witness's book says this primary won a contest at this
    /// generation (read, not claimed now).
    WitnessRecord(u64),
    /// Stopping the VM failed.
    StopFailed(String),
    /// The VM is stopped.
    Stopped,
}

/// What to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Release the output held for epochs up to and including this one.
    Release(u64),
    /// Release all held output and stop holding (protection ended, the
    /// backup confirmed it will not take over).
    ReleaseAll,
    /// Stop the VM (this reason).
    StopVm(String),
    /// Tell the backup to take over now, on every connection.
    SendHang(String),
    /// End protection, on every connection.
    SendAbort(String),
    /// Close the session's connections (a later sync opens new ones).
    Cut,
    /// Finish with this outcome and detail.
    Exit(&'static str, String),
}

/// The primary's policy.
#[derive(Clone, Debug)]
pub struct Policy {
    generation: u64,
    timeout: Duration,
    acked: u64,
    released: u64,
    /// The last epoch number spent (its EPOCH_END may have gone out).
    sent: u64,
    vm_stopped: bool,
    /// The VM is known stopped (its stop succeeded, or it crashed).
    stop_confirmed: bool,
    stop_failures: u32,
    /// Where it stands.
    pub state: State,
}

/// Stopping the VM is tried this often before the primary gives up (and
/// exits with the output still held).
pub const STOP_ATTEMPTS: u32 = 5;

impl Policy {
    /// A primary at `generation`, with `timeout` until the backup tells
    /// its own.
    pub fn new(generation: u64, timeout: Duration) -> Self {
        Policy {
            generation,
            timeout,
            acked: 0,
            released: 0,
            sent: 0,
            vm_stopped: false,
            stop_confirmed: false,
            stop_failures: 0,
            state: State::Syncing,
        }
    }

    /// This primary's generation (its backup's, if newer, once paired).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The failover timeout in force (the backup's, once paired).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The last acknowledged epoch.
    pub fn acked(&self) -> u64 {
        self.acked
    }

    /// The number the next epoch will carry.
    pub fn next_epoch(&self) -> u64 {
        self.sent.max(self.acked) + 1
    }

    /// Spends the next epoch number: called before its EPOCH_END goes
    /// out. A number is never used twice, acknowledged or not: a backup
    /// that applied an epoch whose ack was lost holds it and refuses it
    /// again.
    pub fn spend_epoch(&mut self) -> u64 {
        self.sent = self.next_epoch();
        self.sent
    }

    /// Output released up to this epoch.
    #[cfg(test)]
    pub fn released(&self) -> u64 {
        self.released
    }

    /// The VM may run (no fence, no hang, not ended unconfirmed).
    #[cfg(test)]
    pub fn vm_may_run(&self) -> bool {
        !self.vm_stopped
            && !matches!(
                self.state,
                State::Fenced(_) | State::HandedOver(_) | State::Done
            )
    }

    /// Whether what the output gates still hold may be dropped at exit:
    /// the VM was stopped for good (fenced, handed over, crashed, ended
    /// unconfirmed, gone while unprotected) and no stop failed. Output of a VM that may still run
    /// stays held.
    pub fn held_output_void(&self) -> bool {
        self.stop_confirmed && self.stop_failures == 0
    }

    /// Protection is over and nothing can contradict the output: release
    /// it, close the connections and exit.
    fn release_and_exit(&mut self, outcome: &'static str, detail: String) -> Vec<Action> {
        self.state = State::Done;
        vec![
            Action::ReleaseAll,
            Action::Cut,
            Action::Exit(outcome, detail),
        ]
    }

    /// The stop asked for succeeded.
    fn stopped(&mut self) -> Vec<Action> {
        self.stop_confirmed = self.vm_stopped;
        vec![]
    }

    fn stop(&mut self, why: String) -> Action {
        self.vm_stopped = true;
        Action::StopVm(why)
    }

    fn final_state(&self) -> bool {
        matches!(
            self.state,
            State::Fenced(_) | State::HandedOver(_) | State::Done
        )
    }

    /// Takes an event; returns the actions, in order.
    pub fn on(&mut self, ev: Event) -> Vec<Action> {
        use Action::*;
        if let Event::Paired {
            generation,
            superseded,
            ..
        }
        | Event::Joined {
            generation,
            superseded,
        } = ev
        {
            if let Some(fence) = self.judged(generation, superseded) {
                return fence;
            }
        }
        match ev {
            Event::Heard { generation } if generation > self.generation => self.fenced(generation),
            Event::Acked { generation, .. } if generation > self.generation => {
                self.fenced(generation)
            }
            _ if matches!(self.state, State::Fenced(_) | State::Done) => {
                // Only stopping matters now.
                match ev {
                    Event::StopFailed(why) => self.stop_failed(why),
                    Event::Stopped => self.stopped(),
                    _ => vec![],
                }
            }
            Event::Paired { timeout, .. } => {
                if !timeout.is_zero() {
                    self.timeout = timeout;
                }
                vec![]
            }
            Event::Heard { .. } | Event::Joined { .. } => vec![],
            Event::Acked { epoch, .. } => {
                if matches!(self.state, State::HandedOver(_) | State::Ending { .. }) {
                    return vec![];
                }
                if epoch <= self.acked {
                    return vec![];
                }
                self.acked = epoch;
                self.released = epoch;
                self.state = State::Protected;
                vec![Release(epoch)]
            }
            Event::LinkLost(why) => match self.state {
                State::Syncing | State::Protected | State::Unprotected(_) => {
                    self.state = State::Unprotected(why);
                    vec![Cut]
                }
                _ => vec![],
            },
            Event::Hung(why) => {
                if matches!(self.state, State::HandedOver(_)) {
                    return vec![];
                }
                self.state = State::HandedOver(why.clone());
                vec![
                    self.stop(format!("its vGPU hung: {why}")),
                    SendHang(format!("vGPU hang: {why}")),
                ]
            }
            Event::Crashed(why) => {
                if matches!(self.state, State::HandedOver(_)) || self.final_state() {
                    return vec![];
                }
                // Gone already: there is nothing to stop, and its output
                // since the last acknowledged epoch never goes out.
                let why = format!("the VM crashed: {why}");
                self.vm_stopped = true;
                self.stop_confirmed = true;
                self.state = State::HandedOver(why.clone());
                vec![SendHang(why)]
            }
            Event::Signal(why) => match self.state {
                State::Ending { .. } | State::HandedOver(_) => vec![],
                _ => {
                    self.state = State::Ending {
                        why: why.clone(),
                        vm_finished: false,
                    };
                    vec![SendAbort(format!("protection ends: {why}"))]
                }
            },
            Event::EndConfirmed => match &self.state {
                State::Ending {
                    vm_finished: true, ..
                } => self.release_and_exit(
                    "finished",
                    "the VM finished; its last epoch was acknowledged and its output released; the backup discarded its checkpoint".into(),
                ),
                State::Ending { why, .. } => {
                    let detail = format!("{why}; the backup discarded its checkpoint, output released, the VM runs on unprotected");
                    self.release_and_exit("ended", detail)
                }
                _ => vec![],
            },
            Event::EndUnconfirmed => match &self.state {
                State::Ending {
                    vm_finished: true, ..
                } => {
                    let detail = format!("the VM finished and its output was released, but the backup did not confirm the end within the failover timeout: it may resume epoch {} (the finished VM's last) unless it is stopped", self.acked);
                    self.release_and_exit("finished-unconfirmed", detail)
                }
                State::Ending { why, .. } => {
                    let why = why.clone();
                    self.state = State::Done;
                    vec![
                        self.stop(format!(
                            "{why}, but the backup did not confirm: it may take over from epoch {}",
                            self.acked
                        )),
                        Cut,
                        Exit(
                            "vm-stopped",
                            format!("{why}; the backup did not confirm the end, so it may take over from epoch {}: this VM was stopped, its unacknowledged output never released", self.acked),
                        ),
                    ]
                }
                _ => vec![],
            },
            // The backup must hear the end before the connections close,
            // or it takes the silence for a lost host and resumes a VM that
            // finished: ABORT, then wait for its confirmation as at a signal.
            Event::Finished => match self.state {
                State::Ending { .. } | State::HandedOver(_) | State::Done => vec![],
                _ => {
                    self.state = State::Ending {
                        why: "the VM finished".into(),
                        vm_finished: true,
                    };
                    vec![SendAbort("protection ends: finished".into())]
                }
            },
            Event::VmGone(why) => {
                if self.final_state() {
                    return vec![];
                }
                // Its output since the last ack never goes out (the backup
                // may still resume from that epoch); with the VM gone for
                // good it is dropped, and the gate with it.
                self.state = State::Done;
                self.vm_stopped = true;
                self.stop_confirmed = true;
                vec![Exit("vm-stopped", why)]
            }
            // Nothing can contradict the held output any more: it goes
            // out, and the VM runs on unprotected. Only while the backup
            // is unheard: one that acknowledges epochs is not down.
            Event::BackupDown(who) => match self.state {
                State::Syncing | State::Unprotected(_) => self.release_and_exit(
                    "ended",
                    format!("{who}: the backup cannot take over; output released, the VM runs on unprotected"),
                ),
                _ => vec![],
            },
            // Output goes out only while nothing else can release it or
            // contradict it: unheard, unpaired. Any later pairing is a
            // generation up, whatever the state now.
            Event::WitnessGranted(generation) => {
                self.generation = self.generation.max(generation.saturating_add(1));
                match self.state {
                    State::Unprotected(_) => {
                        self.state = State::Unprotected(format!(
                            "the witness granted this primary the VM at generation {generation}; output released, the VM runs on until the backup is back"
                        ));
                        vec![ReleaseAll]
                    }
                    _ => vec![],
                }
            }
            Event::WitnessRecord(generation) => {
                self.generation = self.generation.max(generation.saturating_add(1));
                vec![]
            }
            Event::WitnessDenied(generation, why) => {
                let mut actions = self.fenced(generation.saturating_add(1));
                if let Some(Exit(_, detail)) = actions.last_mut() {
                    *detail = format!("the witness refused this primary ({why}): the backup takes the VM over; this VM is stopped so it never runs twice");
                }
                actions
            }
            Event::StopFailed(why) => self.stop_failed(why),
            Event::Stopped => self.stopped(),
        }
    }

    /// The backup's verdict at pairing: superseded (or, from a backup
    /// before terms, a newer generation) fences; current adopts the
    /// backup's generation if newer.
    fn judged(&mut self, generation: u64, superseded: Option<bool>) -> Option<Vec<Action>> {
        match superseded {
            Some(true) => Some(self.fenced(generation)),
            None if generation > self.generation => Some(self.fenced(generation)),
            Some(false) if !self.final_state() => {
                self.generation = self.generation.max(generation);
                None
            }
            _ => None,
        }
    }

    fn fenced(&mut self, generation: u64) -> Vec<Action> {
        if let State::Fenced(g) = self.state {
            if g >= generation {
                return vec![];
            }
        }
        let was_handed_over = matches!(self.state, State::HandedOver(_));
        self.state = State::Fenced(generation);
        let mut out = Vec::new();
        if !self.vm_stopped {
            out.push(self.stop(format!(
                "the backup took over at generation {generation} (this primary: {}): only one copy may run",
                self.generation
            )));
        }
        out.push(Action::Cut);
        out.push(Action::Exit(
            if was_handed_over { "handed-over" } else { "fenced" },
            format!(
                "the backup runs the VM at generation {generation}, newer than this primary's {}; this VM is stopped so it never runs twice",
                self.generation
            ),
        ));
        out
    }

    fn stop_failed(&mut self, why: String) -> Vec<Action> {
        self.stop_failures += 1;
        if self.stop_failures < STOP_ATTEMPTS {
            return vec![Action::StopVm(format!("retrying after: {why}"))];
        }
        vec![Action::Exit(
            "stop-failed",
            format!("the VM must stop but could not be stopped ({why}); its output stays held: stop it by hand"),
        )]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::*;

    fn protected() -> Policy {
        let mut p = Policy::new(0, Duration::from_secs(9));
        p.on(Event::Paired {
            generation: 0,
            timeout: Duration::from_secs(3),
            superseded: Some(false),
        });
        assert_eq!(
            p.on(Event::Acked {
                epoch: 1,
                generation: 0
            }),
            vec![Release(1)]
        );
        p
    }

    fn releases(actions: &[Action]) -> bool {
        actions.iter().any(|a| matches!(a, Release(_) | ReleaseAll))
    }

    /// Item 3: the backup-to-primary direction is lost (or the backup is
    /// silent for any reason): the primary calls itself unprotected and
    /// releases nothing; the next acknowledged epoch releases.
    #[test]
    fn silence_releases_nothing() {
        let mut p = protected();
        let a = p.on(Event::LinkLost(
            "no heartbeat from the backup for 3.2 s".into(),
        ));
        assert_eq!(a, vec![Cut]);
        assert!(matches!(p.state, State::Unprotected(_)));
        assert_eq!(p.released(), 1);
        // Retries failing do not release either.
        assert!(!releases(
            &p.on(Event::LinkLost("connection refused".into()))
        ));
        // A resync's epoch does.
        assert_eq!(
            p.on(Event::Acked {
                epoch: 5,
                generation: 0
            }),
            vec![Release(5)]
        );
        assert_eq!(p.state, State::Protected);
    }

    /// Issue 21, item 1: the witness's grant releases what was held while
    /// the backup was unheard and sends the next pairing a generation up;
    /// while paired it releases nothing; a refusal stops the VM.
    #[test]
    fn the_witness_grants_or_fences() {
        let mut p = protected();
        assert!(
            !releases(&p.on(Event::WitnessGranted(0))),
            "while protected"
        );
        assert_eq!(p.generation(), 1, "the next pairing is a generation up");
        let mut fresh = Policy::new(0, Duration::from_secs(3));
        assert!(
            !releases(&fresh.on(Event::WitnessGranted(4))),
            "before any pairing"
        );
        p.on(Event::LinkLost("silent".into()));
        assert!(
            !releases(&p.on(Event::WitnessRecord(5))),
            "a record is no grant"
        );
        assert_eq!(p.generation(), 6);
        assert_eq!(p.on(Event::WitnessGranted(6)), vec![ReleaseAll]);
        assert_eq!(p.generation(), 7);
        assert!(
            matches!(p.state, State::Unprotected(_)),
            "protection goes on"
        );
        assert!(p.vm_may_run());
        // The backup back: pairs a generation up, epochs release again.
        p.on(Event::Paired {
            generation: 1,
            timeout: Duration::from_secs(3),
            superseded: Some(false),
        });
        assert_eq!(p.generation(), 7);
        assert_eq!(
            p.on(Event::Acked {
                epoch: 9,
                generation: 7
            }),
            vec![Release(9)]
        );

        let mut p = protected();
        p.on(Event::LinkLost("silent".into()));
        let a = p.on(Event::WitnessDenied(0, "the backup took it over".into()));
        assert!(matches!(a[0], StopVm(_)), "{a:?}");
        assert!(!releases(&a));
        assert!(matches!(a.last(), Some(Exit("fenced", d)) if d.contains("witness refused")));
        assert_eq!(p.state, State::Fenced(1));
        assert!(!p.vm_may_run());
    }

    /// Issue 21, item 2: the operator's word that the backup is down
    /// releases the held output and ends protection, the VM running on;
    /// but only while the backup is unheard, and never after a fence or
    /// a handover.
    #[test]
    fn a_backup_confirmed_down_releases_only_while_unheard() {
        let who = || "the operator confirmed the backup down".to_owned();
        let mut p = protected();
        assert!(
            p.on(Event::BackupDown(who())).is_empty(),
            "released while protected"
        );
        assert_eq!(p.state, State::Protected);
        p.on(Event::LinkLost(
            "no heartbeat from the backup for 3.2 s".into(),
        ));
        let a = p.on(Event::BackupDown(who()));
        assert_eq!(a[..2], [ReleaseAll, Cut]);
        assert!(
            matches!(&a[2], Exit("ended", d) if d.contains("the VM runs on unprotected")),
            "{a:?}"
        );
        assert!(!a.iter().any(|x| matches!(x, StopVm(_))), "{a:?}");
        // A fenced or handed-over primary's output stays held.
        for ev in [
            Event::Heard { generation: 1 },
            Event::Hung("ring 0 timed out".into()),
        ] {
            let mut p = protected();
            p.on(Event::LinkLost("silent".into()));
            p.on(ev);
            assert!(!releases(&p.on(Event::BackupDown(who()))));
        }
    }

    /// Item 3: a primary that stalled (SIGSTOP) past the timeout finds a
    /// newer generation: it stops the VM before anything, never releases.
    #[test]
    fn a_newer_generation_stops_the_vm_first_and_releases_nothing() {
        let mut p = protected();
        p.on(Event::LinkLost("silent".into()));
        let a = p.on(Event::Heard { generation: 1 });
        assert!(
            matches!(&a[0], StopVm(why) if why.contains("generation 1")),
            "{a:?}"
        );
        assert!(matches!(a.last(), Some(Exit("fenced", _))), "{a:?}");
        assert!(!releases(&a));
        assert!(!p.vm_may_run());
        // An ack arriving late (it was in the socket) releases nothing now.
        assert!(p
            .on(Event::Acked {
                epoch: 2,
                generation: 0
            })
            .is_empty());
        // A newer generation in an ack or a HELLO_OK fences too.
        let mut q = protected();
        assert!(matches!(
            q.on(Event::Acked {
                epoch: 2,
                generation: 4
            })[0],
            StopVm(_)
        ));
        let mut r = Policy::new(0, Duration::from_secs(3));
        assert!(matches!(
            r.on(Event::Paired {
                generation: 2,
                timeout: Duration::from_secs(3),
                superseded: None,
            })[0],
            StopVm(_)
        ));
    }

    /// Issue 20, item 3: at pairing the backup judges the VM instance, not
    /// the generation alone. One it took over from stops, whatever its
    /// generation; any other (the VM started afresh after a takeover)
    /// adopts the backup's newer generation and runs on.
    #[test]
    fn the_backups_verdict_decides_at_pairing_not_the_generation() {
        let mut fresh = Policy::new(0, Duration::from_secs(3));
        let a = fresh.on(Event::Joined {
            generation: 3,
            superseded: Some(false),
        });
        assert!(a.is_empty(), "{a:?}");
        assert_eq!(fresh.generation(), 3);
        assert!(fresh
            .on(Event::Paired {
                generation: 3,
                timeout: Duration::from_secs(3),
                superseded: Some(false),
            })
            .is_empty());
        assert_eq!(
            fresh.on(Event::Acked {
                epoch: 1,
                generation: 3
            }),
            vec![Release(1)]
        );
        // A later raise is a takeover: fenced as always.
        assert!(matches!(
            fresh.on(Event::Heard { generation: 4 })[0],
            StopVm(_)
        ));

        let mut old = Policy::new(5, Duration::from_secs(3));
        let a = old.on(Event::Joined {
            generation: 2,
            superseded: Some(true),
        });
        assert!(matches!(&a[0], StopVm(_)), "{a:?}");
        assert!(matches!(a.last(), Some(Exit("fenced", _))), "{a:?}");
        assert!(!old.vm_may_run());
        // A backup before terms: a newer generation fences, as before.
        let mut legacy = Policy::new(0, Duration::from_secs(3));
        assert!(matches!(
            legacy.on(Event::Joined {
                generation: 1,
                superseded: None,
            })[0],
            StopVm(_)
        ));
    }

    /// Item 3: the two sides judge silence by the same timeout: the
    /// backup's, adopted at pairing.
    #[test]
    fn the_backups_timeout_is_adopted_at_pairing() {
        let mut p = Policy::new(0, Duration::from_secs(9));
        p.on(Event::Paired {
            generation: 0,
            timeout: Duration::from_millis(2500),
            superseded: Some(false),
        });
        assert_eq!(p.timeout(), Duration::from_millis(2500));
    }

    /// Item 3: SIGTERM (the libvirt hook) ends protection: ABORT, then
    /// release only when the backup confirmed; unconfirmed, stop the VM
    /// (the backup may take over), release nothing.
    #[test]
    fn a_signal_ends_protection_only_when_the_backup_confirms() {
        let mut p = protected();
        let a = p.on(Event::Signal("SIGTERM".into()));
        assert_eq!(a, vec![SendAbort("protection ends: SIGTERM".into())]);
        assert!(!releases(&a));
        let a = p.on(Event::EndConfirmed);
        assert_eq!(a[0], ReleaseAll);
        assert!(matches!(a.last(), Some(Exit("ended", _))));
        assert!(p.vm_may_run() || p.state == State::Done);

        let mut p = protected();
        p.on(Event::Signal("SIGTERM".into()));
        let a = p.on(Event::EndUnconfirmed);
        assert!(
            matches!(&a[0], StopVm(why) if why.contains("epoch 1")),
            "{a:?}"
        );
        assert!(!releases(&a));
        assert!(matches!(a.last(), Some(Exit("vm-stopped", _))));
    }

    /// Item 3: a failed stop after a fence is retried, and the output
    /// stays held; after the last attempt the primary says so and exits.
    #[test]
    fn a_failed_stop_is_retried_and_never_releases() {
        let mut p = protected();
        p.on(Event::Heard { generation: 1 });
        for _ in 1..STOP_ATTEMPTS {
            let a = p.on(Event::StopFailed("control socket gone".into()));
            assert!(matches!(&a[..], [StopVm(_)]), "{a:?}");
        }
        let a = p.on(Event::StopFailed("control socket gone".into()));
        assert!(
            matches!(&a[..], [Exit("stop-failed", why)] if why.contains("output stays held")),
            "{a:?}"
        );
        // The VM may still run: what the gates hold is never dropped.
        assert!(!p.held_output_void());
    }

    /// Held output is dropped at exit only once the VM is stopped for
    /// good; released or still running, it is not the policy's to drop.
    #[test]
    fn held_output_is_void_only_behind_a_stopped_vm() {
        let mut p = protected();
        assert!(!p.held_output_void());
        p.on(Event::Heard { generation: 1 });
        assert!(!p.held_output_void(), "fenced, its stop not yet done");
        p.on(Event::Stopped);
        assert!(p.held_output_void(), "fenced and stopped");

        let mut p = protected();
        p.on(Event::Crashed("SIGKILL".into()));
        assert!(p.held_output_void(), "crashed: nothing runs");

        let mut p = protected();
        p.on(Event::Signal("SIGTERM".into()));
        p.on(Event::EndConfirmed);
        assert!(!p.held_output_void(), "released, the VM runs on");

        let mut p = protected();
        p.on(Event::Signal("SIGTERM".into()));
        p.on(Event::EndUnconfirmed);
        p.on(Event::Stopped);
        assert!(p.held_output_void(), "ended unconfirmed: stopped");
    }

    /// A crashed VM is handed over at once, with nothing to stop and
    /// nothing released; the fence then confirms the handover.
    #[test]
    fn a_crash_hands_over_without_a_stop() {
        let mut p = protected();
        let a = p.on(Event::Crashed("QEMU exited with no SHUTDOWN event".into()));
        assert!(
            matches!(&a[..], [SendHang(why)] if why.starts_with("the VM crashed: ")),
            "{a:?}"
        );
        assert!(p.on(Event::Hung("after the crash".into())).is_empty());
        let a = p.on(Event::Heard { generation: 1 });
        assert!(matches!(&a[..], [Cut, Exit("handed-over", _)]), "{a:?}");
        assert!(!releases(&a));
    }

    /// A hang stops the VM before telling the backup; a later fence
    /// confirms the handover and does not stop twice.
    #[test]
    fn a_hang_stops_then_hands_over() {
        let mut p = protected();
        let a = p.on(Event::Hung("vgpu-hung vgpu=1".into()));
        assert!(matches!(&a[..], [StopVm(_), SendHang(_)]), "{a:?}");
        assert!(p
            .on(Event::Acked {
                epoch: 2,
                generation: 0
            })
            .is_empty());
        assert!(p.on(Event::Hung("again".into())).is_empty());
        assert!(p.on(Event::Crashed("and crashed".into())).is_empty());
        let a = p.on(Event::Heard { generation: 1 });
        assert!(matches!(&a[..], [Cut, Exit("handed-over", _)]), "{a:?}");
    }

    /// Found by qemu-tests/chaos (drop-acks): an epoch whose ack was lost
    /// keeps its number; the next capture carries a new one, and its ack
    /// releases the output of both.
    #[test]
    fn an_epoch_number_is_spent_even_when_its_ack_is_lost() {
        let mut p = protected();
        assert_eq!(p.spend_epoch(), 2);
        p.on(Event::LinkLost("no EPOCH_ACK 2 within 9 s".into()));
        assert_eq!(p.next_epoch(), 3);
        assert_eq!(p.spend_epoch(), 3);
        assert_eq!(
            p.on(Event::Acked {
                epoch: 3,
                generation: 0
            }),
            vec![Release(3)]
        );
        assert_eq!(p.next_epoch(), 4);
    }

    /// An old acknowledgement never moves the release point back or
    /// releases twice; the VM finishing ends protection with ABORT.
    #[test]
    fn acks_only_move_forward_and_finishing_ends() {
        let mut p = protected();
        p.on(Event::Acked {
            epoch: 3,
            generation: 0,
        });
        assert!(p
            .on(Event::Acked {
                epoch: 2,
                generation: 0
            })
            .is_empty());
        assert_eq!(p.released(), 3);
        // Finishing says ABORT and waits: closing at once would leave the
        // backup to take the silence for a lost host and resume the VM.
        let a = p.on(Event::Finished);
        assert_eq!(a, vec![SendAbort("protection ends: finished".into())]);
        let a = p.clone().on(Event::EndConfirmed);
        assert!(matches!(a.last(), Some(Exit("finished", _))));
        let a = p.on(Event::EndUnconfirmed);
        assert!(!a.iter().any(|x| matches!(x, StopVm(_))));
        assert!(matches!(a.last(), Some(Exit("finished-unconfirmed", _))));
        // A VM gone by itself, unprotected: its held output is never
        // released, but dropped (no gate is left holding it).
        let mut q = protected();
        q.on(Event::LinkLost("x".into()));
        let a = q.on(Event::VmGone("the VM is gone".into()));
        assert!(!releases(&a));
        assert!(q.held_output_void());
    }
}
