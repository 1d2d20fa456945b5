//! The witness: a third host's vote on which side runs a protected VM
//! when its primary and its backup can no longer hear each other (issue
//! 21, item 1).
//!
//! Without a witness, silence is ambiguous: a backup that hears nothing
//! may be cut off from a primary that runs on, so the primary holds its
//! output for good, and a backup that loses the primary takes over on
//! silence alone. With one (`--witness ADDR` on both sides), each side
//! that wants to act on silence *claims* the VM instance from the witness
//! first, and only the first claim of a contest wins:
//!
//! - the backup takes over only with the witness's grant (after its VM is
//!   prepared, before the primary is fenced: [`crate::backup::take_over`]);
//!   denied, its checkpoint is void (the primary ran on past it) and is
//!   discarded;
//! - the primary, unprotected past the failover timeout, claims too:
//!   granted, no checkpoint of this generation can ever be resumed, so its
//!   held output goes out and the VM runs on, and its next pairing is one
//!   generation up; denied, the backup holds the grant and takes over, so
//!   its VM stops.
//!
//! A contest is one VM instance ([`Instance`], the VMM process) at one
//! generation. [`rule`] decides it: the first claim wins; the winner may
//! claim again (a retried takeover, a primary that loses its backup again);
//! an instance the backup took over is lost to its primary for good; a
//! primary that won may be protected again one generation up, where a new
//! contest starts. The witness stores each decision durably before it
//! answers ([`Book`]), so a restarted witness never grants the same
//! contest twice.
//!
//! The witness is reached over the pair's own authenticated channel
//! ([`crate::secure`], its handshake bound to this protocol): it holds the
//! key of every pair it serves (`--key`, repeatable) and keeps each pair's
//! contests apart, so a host holding one pair's key cannot claim another's
//! VM. A connection carries one request and its answer, each one JSON
//! object of at most [`MAX_MESSAGE`] bytes.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::admission::{self, Admission};
use crate::log::{info, warning};
use crate::secure::{self, Key, Protocol};
use crate::term::Instance;

/// Largest request or answer, in bytes (checked before it is read).
pub const MAX_MESSAGE: usize = 4096;
/// Contests remembered per pair (the oldest forgotten first): one per VM
/// instance that was ever contested, so thousands of restarts of a VM.
pub const REMEMBERED: usize = 4096;
/// How long one request may take in all, from connecting to the answer.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// Which side of a pair claims.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The primary, to run on unprotected.
    Primary,
    /// The backup, to take over.
    Backup,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Primary => "primary",
            Side::Backup => "backup",
        })
    }
}

/// What the witness decided about one VM instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ballot {
    /// The generation of the contest.
    pub generation: u64,
    /// Who won it.
    pub winner: Side,
}

/// What a claim comes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Granted: the ballot to store (and to answer with).
    Grant(Ballot),
    /// Refused, with why.
    Deny(String),
}

/// The contest rule: `side` claims a VM instance at `generation`, on
/// which the witness decided `recorded` (if anything).
pub fn rule(recorded: Option<Ballot>, side: Side, generation: u64) -> Decision {
    let Some(b) = recorded else {
        return Decision::Grant(Ballot {
            generation,
            winner: side,
        });
    };
    match (b.winner, side) {
        // Taken over: that instance never runs again, and its takeover
        // may be retried (a resume that failed) but not repeated.
        (Side::Backup, Side::Backup) if generation == b.generation => Decision::Grant(b),
        (Side::Backup, _) => Decision::Deny(format!(
            "the backup took this VM instance over at generation {}",
            b.generation
        )),
        // The primary kept it: no checkpoint up to that generation can be
        // resumed (its output since went out). It may win again at once
        // (its generation is the one it won at, or one it moved to
        // since); a backup only in a later pairing, a generation up.
        (Side::Primary, Side::Primary) => Decision::Grant(Ballot {
            generation: generation.max(b.generation),
            winner: Side::Primary,
        }),
        (Side::Primary, Side::Backup) if generation > b.generation => {
            Decision::Grant(Ballot { generation, winner: Side::Backup })
        }
        (Side::Primary, Side::Backup) => Decision::Deny(format!(
            "the primary kept this VM instance at generation {}: a checkpoint of generation {generation} can no longer be resumed",
            b.generation
        )),
    }
}

/// A request to the witness.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    /// What was decided about this instance (a primary asks before it
    /// pairs, to pair at a generation no stale checkpoint shares).
    Query {
        /// The VM instance.
        instance: InstanceId,
    },
    /// A claim.
    Claim {
        /// Who claims.
        side: Side,
        /// The VM instance.
        instance: InstanceId,
        /// At which generation.
        generation: u64,
        /// The VM's name, for the witness's log and records.
        vm: Option<String>,
    },
}

/// An [`Instance`] as the witness's messages and records carry it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct InstanceId {
    /// The boot id, 32 hex digits.
    #[serde(with = "hex_u128")]
    pub boot: u128,
    /// The VMM's pid.
    pub pid: u32,
    /// Its start time in clock ticks since boot.
    pub started: u64,
}

impl From<Instance> for InstanceId {
    fn from(i: Instance) -> Self {
        InstanceId {
            boot: i.boot,
            pid: i.pid,
            started: i.started,
        }
    }
}

impl From<InstanceId> for Instance {
    fn from(i: InstanceId) -> Self {
        Instance {
            boot: i.boot,
            pid: i.pid,
            started: i.started,
        }
    }
}

mod hex_u128 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u128, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:032x}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u128, D::Error> {
        let text = String::deserialize(d)?;
        u128::from_str_radix(&text, 16).map_err(serde::de::Error::custom)
    }
}

/// What the witness made of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The claim won.
    Granted,
    /// The claim lost: the other side won this contest.
    Refused,
    /// Nothing was decided (a query; or the witness could not store a
    /// decision): ask again.
    Undecided,
}

/// The witness's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    /// What it made of the request.
    pub verdict: Verdict,
    /// What is now decided about the instance, if anything.
    pub ballot: Option<Ballot>,
    /// Why, in words (for the logs).
    pub why: String,
}

/// One pair's decisions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Contest {
    instance: InstanceId,
    ballot: Ballot,
    vm: Option<String>,
}

/// Every decision, per pair (by its key's id), newest last; stored in
/// `witness.json` in the state directory, written, synced and renamed
/// into place before an answer goes out.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Book {
    pairs: BTreeMap<String, Vec<Contest>>,
}

impl Book {
    /// Answers `req` from the pair `pair`; returns the answer and whether
    /// the book changed (and must be stored before the answer goes out).
    pub fn answer(&mut self, pair: &str, req: &Request) -> (Answer, bool) {
        let contests = self.pairs.entry(pair.to_owned()).or_default();
        let (side, instance, generation, vm) = match req {
            Request::Query { instance } => {
                let ballot = contests
                    .iter()
                    .find(|c| c.instance == *instance)
                    .map(|c| c.ballot);
                let why = match ballot {
                    Some(b) => format!("generation {} went to the {}", b.generation, b.winner),
                    None => "nothing decided".into(),
                };
                return (
                    Answer {
                        verdict: Verdict::Undecided,
                        ballot,
                        why,
                    },
                    false,
                );
            }
            Request::Claim {
                side,
                instance,
                generation,
                vm,
            } => (*side, *instance, *generation, vm),
        };
        let at = contests.iter().position(|c| c.instance == instance);
        let recorded = at.map(|i| contests[i].ballot);
        match rule(recorded, side, generation) {
            Decision::Deny(why) => (
                Answer {
                    verdict: Verdict::Refused,
                    ballot: recorded,
                    why,
                },
                false,
            ),
            Decision::Grant(ballot) => {
                let changed = recorded != Some(ballot);
                if let Some(i) = at {
                    contests.remove(i);
                }
                contests.push(Contest {
                    instance,
                    ballot,
                    vm: vm.clone(),
                });
                if contests.len() > REMEMBERED {
                    contests.remove(0);
                }
                let why = format!("granted to the {side} at generation {}", ballot.generation);
                (
                    Answer {
                        verdict: Verdict::Granted,
                        ballot: Some(ballot),
                        why,
                    },
                    changed,
                )
            }
        }
    }

    /// The book stored in `dir` (`None` if there is none).
    pub fn load(dir: &Path) -> Result<Option<Book>, String> {
        let path = dir.join("witness.json");
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text).map(Some).map_err(|e| {
                format!(
                    "{} cannot be read as the witness's book: {e}",
                    path.display()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }

    /// Stores the book in `dir` durably: a new file, synced, renamed over
    /// the old one, the directory synced.
    pub fn store(&self, dir: &Path) -> Result<(), String> {
        let path = dir.join("witness.json");
        let tmp = dir.join("witness.json.new");
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            std::fs::File::open(dir)?.sync_all()
        };
        write().map_err(|e| format!("cannot store {}: {e}", path.display()))
    }
}

/// A pair's id in the book: a hash of its key (the key itself is never
/// written down).
pub fn pair_id(key: &Key) -> String {
    use blake2::Digest;
    let mut h = blake2::Blake2s256::new();
    h.update(b"hag witness pair id");
    h.update(key.to_hex().as_bytes());
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Sends one length-prefixed JSON message.
fn send<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<(), String> {
    let body = serde_json::to_vec(msg).map_err(|e| e.to_string())?;
    if body.len() > MAX_MESSAGE {
        return Err(format!(
            "a message of {} bytes (at most {MAX_MESSAGE})",
            body.len()
        ));
    }
    let mut frame = (body.len() as u16).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    w.write_all(&frame).map_err(|e| e.to_string())
}

/// Reads one length-prefixed JSON message, its length capped before the
/// body is read.
fn receive<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> Result<T, String> {
    let mut len = [0u8; 2];
    r.read_exact(&mut len).map_err(|e| e.to_string())?;
    let len = u16::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(format!("a message of {len} bytes (at most {MAX_MESSAGE})"));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(|e| e.to_string())?;
    serde_json::from_slice(&body).map_err(|e| format!("not a witness message: {e}"))
}

/// Where a primary or a backup finds its witness.
#[derive(Clone, Debug)]
pub struct WitnessAt {
    /// `HOST:PORT`.
    pub addr: String,
    /// The pair's key (the witness holds it too).
    pub key: Key,
}

impl WitnessAt {
    /// This witness as both sides of a pair must name it: its address as
    /// given and the key it is reached with, hashed. A backup tells it in
    /// HELLO_OK; a primary claims only from the witness its backup takes
    /// over with.
    pub fn id(&self) -> u64 {
        use blake2::Digest;
        let mut h = blake2::Blake2s256::new();
        h.update(b"hag witness id");
        h.update(pair_id(&self.key).as_bytes());
        h.update(self.addr.as_bytes());
        let d = h.finalize();
        u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
    }

    /// Asks the witness `req`, within [`ASK_TIMEOUT`] (each of its
    /// addresses in turn, until one connects).
    pub fn ask(&self, req: &Request) -> Result<Answer, String> {
        let deadline = Instant::now() + ASK_TIMEOUT;
        let fail = |e: String| format!("witness {}: {e}", self.addr);
        let mut last = "no address".to_owned();
        let mut stream = None;
        for addr in self
            .addr
            .to_socket_addrs()
            .map_err(|e| fail(e.to_string()))?
        {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(&addr, left) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e.to_string(),
            }
        }
        let stream = stream.ok_or_else(|| fail(last))?;
        let left = deadline.saturating_duration_since(Instant::now());
        let (mut r, mut w) = secure::connect_as(stream, &self.key, Protocol::Witness, left)
            .map_err(|e| fail(e.to_string()))?;
        r.set_deadline(Some(deadline));
        send(&mut w, req).map_err(fail)?;
        receive(&mut r).map_err(fail)
    }
}

/// How soon a request that failed (the witness unreachable) is tried
/// again.
pub const RETRY: Duration = Duration::from_secs(1);

/// What a request was, for its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asked {
    /// A query.
    Query,
    /// A claim.
    Claim,
}

/// A side's requests, each asked on a thread of its own: the loop that
/// starts them and polls for the answer never waits on the witness (nor on
/// resolving its name).
pub struct Asker {
    at: WitnessAt,
    pending: Option<(Asked, std::sync::mpsc::Receiver<Result<Answer, String>>)>,
    not_before: Instant,
}

impl Asker {
    /// Requests to the witness at `at`.
    pub fn new(at: WitnessAt) -> Self {
        Asker {
            at,
            pending: None,
            not_before: Instant::now(),
        }
    }

    /// The witness's id ([`WitnessAt::id`]).
    pub fn id(&self) -> u64 {
        self.at.id()
    }

    /// Asks `req`, unless a request is under way or the last one failed
    /// less than [`RETRY`] ago.
    pub fn start(&mut self, req: Request) {
        if self.pending.is_some() || Instant::now() < self.not_before {
            return;
        }
        let asked = match req {
            Request::Query { .. } => Asked::Query,
            Request::Claim { .. } => Asked::Claim,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let at = self.at.clone();
        std::thread::spawn(move || {
            let _ = tx.send(at.ask(&req));
        });
        self.pending = Some((asked, rx));
    }

    /// Forgets the request under way: its answer, when it comes, is of a
    /// moment that has passed (a pairing since).
    pub fn forget(&mut self) {
        self.pending = None;
    }

    /// The answer to the request under way, once it came (or failed), and
    /// what the request was. A failure, or an undecided claim, holds the
    /// next request back for [`RETRY`].
    pub fn answer(&mut self) -> Option<(Asked, Result<Answer, String>)> {
        let (asked, rx) = self.pending.as_ref()?;
        let asked = *asked;
        let got = match rx.try_recv() {
            Ok(got) => got,
            Err(std::sync::mpsc::TryRecvError::Empty) => return None,
            Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                Err("the request's thread ended".into())
            }
        };
        self.pending = None;
        let again = match &got {
            Err(_) => true,
            Ok(a) => asked == Asked::Claim && a.verdict == Verdict::Undecided,
        };
        if again {
            self.not_before = Instant::now() + RETRY;
        }
        Some((asked, got))
    }
}

/// `--witness` and `--witness-key` of `hagctl checkpoint` and `hagctl
/// backup`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct WitnessArgs {
    /// A third host's `hagctl witness` (HOST:PORT): a takeover needs its
    /// grant, and a primary that lost its backup claims the VM from it to
    /// release its held output and run on (give it on both hosts)
    #[arg(long, value_name = "HOST:PORT")]
    pub witness: Option<String>,
    /// The key the witness holds for this pair [default: --key]
    #[arg(long, value_name = "FILE", requires = "witness")]
    pub witness_key: Option<PathBuf>,
}

impl WitnessArgs {
    /// The witness's address and key file, if one was given.
    pub fn get(self) -> Option<(String, Option<PathBuf>)> {
        Some((self.witness?, self.witness_key))
    }
}

/// The witness configured (`(address, key file)`, the key file defaulting
/// to the pair's key `pair`), loaded.
pub fn configured(
    witness: &Option<(String, Option<PathBuf>)>,
    pair: &Key,
) -> Result<Option<WitnessAt>, secure::KeyError> {
    let Some((addr, key_file)) = witness else {
        return Ok(None);
    };
    let key = match key_file {
        Some(path) => Key::load(path)?,
        None => pair.clone(),
    };
    Ok(Some(WitnessAt {
        addr: addr.clone(),
        key,
    }))
}

/// Options of `hagctl witness`.
#[derive(Clone, Debug)]
pub struct WitnessOptions {
    /// `ADDR:PORT` to listen on.
    pub listen: String,
    /// The key of each pair it serves.
    pub keys: Vec<PathBuf>,
    /// Where its book is kept.
    pub state_dir: PathBuf,
    /// Start a new, empty book if there is none.
    pub new: bool,
}

struct Served {
    keys: Vec<Key>,
    ids: Vec<String>,
    book: Mutex<Book>,
    dir: PathBuf,
    admission: Arc<Admission>,
}

/// `hagctl witness`: answers claims until killed.
pub fn serve(opts: &WitnessOptions, ready: impl FnOnce(&str)) -> anyhow::Result<()> {
    let keys = opts
        .keys
        .iter()
        .map(|p| Key::load(p))
        .collect::<Result<Vec<_>, _>>()?;
    std::fs::create_dir_all(&opts.state_dir)
        .map_err(|e| anyhow::anyhow!("{}: {e}", opts.state_dir.display()))?;
    // A witness that lost its book could decide a contest twice: an empty
    // one is only ever started on purpose.
    let book = match Book::load(&opts.state_dir).map_err(anyhow::Error::msg)? {
        Some(book) => book,
        None if opts.new => {
            let book = Book::default();
            book.store(&opts.state_dir).map_err(anyhow::Error::msg)?;
            book
        }
        None => anyhow::bail!(
            "{} has no witness.json: a witness that lost its decisions could decide a contest twice; give --new only to start a new witness",
            opts.state_dir.display()
        ),
    };
    let listener = TcpListener::bind(&opts.listen)
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", opts.listen))?;
    let ids: Vec<String> = keys.iter().map(pair_id).collect();
    info!(
        "witness on {} for {} pair(s) ({}), its decisions in {}",
        opts.listen,
        keys.len(),
        ids.join(", "),
        opts.state_dir.join("witness.json").display()
    );
    let served = Arc::new(Served {
        keys,
        ids,
        book: Mutex::new(book),
        dir: opts.state_dir.clone(),
        admission: Admission::new(
            admission::MAX_HANDSHAKES,
            admission::MAX_HANDSHAKES_PER_SOURCE,
            64,
        ),
    });
    ready(&opts.listen);
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        let Ok(peer) = stream.peer_addr() else {
            continue;
        };
        let handshake = match served.admission.handshake(peer.ip()) {
            Ok(h) => h,
            Err(e) => {
                info!("refused a connection from {peer}: {e}");
                continue;
            }
        };
        let served = served.clone();
        std::thread::spawn(move || {
            let from = peer.to_string();
            let (pair, mut r, mut w) = match secure::accept_as(
                stream,
                &served.keys,
                Protocol::Witness,
                admission::ACCEPT_HANDSHAKE,
            ) {
                Ok(c) => c,
                Err(e) => {
                    info!("refused a connection from {from}: {e}");
                    return;
                }
            };
            let Ok(_slot) = handshake.authenticated() else {
                return;
            };
            r.set_deadline(Some(Instant::now() + ASK_TIMEOUT));
            let req: Request = match receive(&mut r) {
                Ok(req) => req,
                Err(e) => {
                    info!("{from}: {e}");
                    return;
                }
            };
            let answer = served.decide(&served.ids[pair], &req, &from);
            if let Err(e) = send(&mut w, &answer) {
                info!("{from}: the answer was not sent: {e}");
            }
        });
    }
    Ok(())
}

impl Served {
    /// Answers `req` of `pair`, storing a new decision before it is told:
    /// one that cannot be stored is not granted.
    fn decide(&self, pair: &str, req: &Request, from: &str) -> Answer {
        let mut book = self.book.lock().unwrap_or_else(|p| p.into_inner());
        let before = book.clone();
        let (answer, changed) = book.answer(pair, req);
        if changed {
            if let Err(e) = book.store(&self.dir) {
                *book = before;
                warning!("{e}: the claim of {from} is refused");
                return Answer {
                    verdict: Verdict::Undecided,
                    ballot: None,
                    why: format!("the witness cannot store its decision: {e}"),
                };
            }
        }
        if let Request::Claim {
            side,
            instance,
            generation,
            vm,
        } = req
        {
            info!(
                "pair {pair}: {from} claimed {} ({}) for the {side} at generation {generation}: {}",
                vm.as_deref().unwrap_or("a VM"),
                Instance::from(*instance),
                answer.why
            );
        }
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Side = Side::Primary;
    const B: Side = Side::Backup;

    fn granted(d: Decision) -> Ballot {
        match d {
            Decision::Grant(b) => b,
            Decision::Deny(why) => panic!("denied: {why}"),
        }
    }

    fn denied(d: Decision) -> bool {
        matches!(d, Decision::Deny(_))
    }

    #[test]
    fn the_first_claim_of_a_contest_wins() {
        let b = granted(rule(None, B, 3));
        assert_eq!(
            b,
            Ballot {
                generation: 3,
                winner: B
            }
        );
        assert!(
            denied(rule(Some(b), P, 3)),
            "the primary, after the backup won"
        );
        assert!(
            denied(rule(Some(b), P, 9)),
            "a taken-over instance at any generation"
        );
        let p = granted(rule(None, P, 3));
        assert!(
            denied(rule(Some(p), B, 3)),
            "the backup, after the primary won"
        );
        assert!(denied(rule(Some(p), B, 2)), "an older checkpoint");
    }

    #[test]
    fn a_winner_may_claim_again() {
        let b = Ballot {
            generation: 3,
            winner: B,
        };
        assert_eq!(granted(rule(Some(b), B, 3)), b, "a retried takeover");
        assert!(
            denied(rule(Some(b), B, 4)),
            "a second takeover of one instance"
        );
        let p = Ballot {
            generation: 3,
            winner: P,
        };
        assert_eq!(granted(rule(Some(p), P, 3)), p);
        assert_eq!(
            granted(rule(Some(p), P, 4)).generation,
            4,
            "after it moved up"
        );
        assert_eq!(
            granted(rule(Some(p), P, 1)).generation,
            3,
            "a restarted primary that did not ask first"
        );
    }

    #[test]
    fn a_primary_that_kept_its_vm_is_protected_again_a_generation_up() {
        let p = Ballot {
            generation: 3,
            winner: P,
        };
        assert_eq!(
            granted(rule(Some(p), B, 4)),
            Ballot {
                generation: 4,
                winner: B
            }
        );
    }

    fn inst(pid: u32) -> InstanceId {
        InstanceId {
            boot: 0xabc,
            pid,
            started: 7,
        }
    }

    fn claim(side: Side, pid: u32, generation: u64) -> Request {
        Request::Claim {
            side,
            instance: inst(pid),
            generation,
            vm: Some("vm1".into()),
        }
    }

    #[test]
    fn the_book_keeps_pairs_and_instances_apart() {
        let mut book = Book::default();
        let (a, changed) = book.answer("pair1", &claim(B, 10, 0));
        assert!(a.verdict == Verdict::Granted && changed);
        let (a, changed) = book.answer("pair1", &claim(P, 10, 0));
        assert!(a.verdict == Verdict::Refused && !changed, "{a:?}");
        assert!(a.why.contains("took this VM instance over"), "{}", a.why);
        assert!(
            book.answer("pair2", &claim(P, 10, 0)).0.verdict == Verdict::Granted,
            "another pair's contest"
        );
        assert!(
            book.answer("pair1", &claim(P, 11, 1)).0.verdict == Verdict::Granted,
            "another instance"
        );
        let (q, changed) = book.answer("pair1", &Request::Query { instance: inst(10) });
        assert!(q.verdict == Verdict::Undecided && !changed);
        assert_eq!(
            q.ballot,
            Some(Ballot {
                generation: 0,
                winner: B
            })
        );
        let (again, changed) = book.answer("pair1", &claim(B, 10, 0));
        assert!(
            again.verdict == Verdict::Granted && !changed,
            "the same grant again stores nothing"
        );
    }

    #[test]
    fn the_book_forgets_the_oldest_contests_first() {
        let mut book = Book::default();
        for pid in 0..=REMEMBERED as u32 {
            book.answer("p", &claim(B, pid, 0));
        }
        assert_eq!(book.pairs["p"].len(), REMEMBERED);
        assert!(book
            .answer("p", &Request::Query { instance: inst(0) })
            .0
            .ballot
            .is_none());
        assert!(book
            .answer("p", &Request::Query { instance: inst(1) })
            .0
            .ballot
            .is_some());
    }

    #[test]
    fn the_book_is_stored_and_read_back() {
        let dir = std::env::temp_dir().join(format!("hag-witness-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(Book::load(&dir).unwrap(), None);
        let mut book = Book::default();
        book.answer("p", &claim(P, 5, 2));
        book.store(&dir).unwrap();
        assert_eq!(Book::load(&dir).unwrap(), Some(book));
        std::fs::write(dir.join("witness.json"), "{").unwrap();
        assert!(
            Book::load(&dir).is_err(),
            "a damaged book is an error, never an empty one"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn messages_are_capped_before_they_are_read() {
        let mut big = (MAX_MESSAGE as u16 + 1).to_le_bytes().to_vec();
        big.extend(vec![b' '; MAX_MESSAGE + 1]);
        let r: Result<Request, String> = receive(&mut &big[..]);
        assert!(r.unwrap_err().contains("at most"));
        let mut buf = Vec::new();
        send(&mut buf, &claim(B, 1, 2)).unwrap();
        let back: Request = receive(&mut &buf[..]).unwrap();
        assert_eq!(back, claim(B, 1, 2));
    }

    #[test]
    fn a_claim_crosses_a_real_connection_and_only_with_the_pairs_key() {
        let dir = std::env::temp_dir().join(format!("hag-witness-net-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key_path = dir.join("pair.key");
        let key = Key::generate().unwrap();
        key.write_new(&key_path).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let mut opts = WitnessOptions {
            listen: addr.clone(),
            keys: vec![key_path],
            state_dir: dir.join("state"),
            new: false,
        };
        let refused = serve(&opts, |_| {}).unwrap_err().to_string();
        assert!(refused.contains("has no witness.json"), "{refused}");
        opts.new = true;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            serve(&opts, |_| tx.send(()).unwrap()).unwrap();
        });
        rx.recv().unwrap();
        let w = WitnessAt {
            addr: addr.clone(),
            key,
        };
        assert_eq!(w.ask(&claim(B, 1, 0)).unwrap().verdict, Verdict::Granted);
        assert_eq!(w.ask(&claim(P, 1, 0)).unwrap().verdict, Verdict::Refused);
        let stranger = WitnessAt {
            addr,
            key: Key::generate().unwrap(),
        };
        assert!(
            stranger.ask(&claim(P, 2, 0)).is_err(),
            "another key is refused"
        );
        let stored = Book::load(&dir.join("state")).unwrap().unwrap();
        assert_eq!(stored.pairs.values().next().unwrap().len(), 1);
        std::fs::remove_dir_all(&dir).ok();
    }
}
