//! Authenticated, encrypted connections between hosts: every connection
//! `hagctl` makes to another host (migration, checkpoint stream, control
//! and heartbeat paths) runs the Noise protocol `NNpsk0` (X25519,
//! ChaCha20-Poly1305, BLAKE2s; the `snow` crate) keyed by a 32-byte
//! pre-shared key that the operator provisions on both hosts as a file
//! (`--key FILE`; `hagctl keygen FILE` makes one). A peer without the key
//! completes no handshake: it gets nothing and changes nothing, and the
//! refusal is logged. Each connection has fresh ephemeral keys (forward
//! secrecy); a record that was altered, replayed, reordered or cut is an
//! error, never data. docs/ha.md says why this design.
//!
//! ```text
//! initiator                         responder
//!   len u16 | NNpsk0 msg 1 (psk, e) ──▶
//!                                 ◀── len u16 | msg 2 (e, ee)
//!   then records both ways: len u16 | ChaCha20-Poly1305(chunk ≤ 65519 bytes)
//! ```
//!
//! A connection splits into a [`Reader`] and a [`Writer`] with their own
//! nonce counters, so one thread may read while another writes. Reads may
//! carry a deadline for a whole message ([`Reader::set_deadline`]): a
//! peer that trickles bytes fails at the deadline, not never.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use snow::StatelessTransportState;

const PATTERN: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";
/// Bound into every handshake: keys for another protocol do not fit.
const PROLOGUE: &[u8] = b"hag host-to-host v2";
/// Largest Noise message.
const MAX_RECORD: usize = 65535;
/// AEAD tag bytes.
const TAG: usize = 16;
/// Plaintext bytes per record.
const CHUNK: usize = MAX_RECORD - TAG;
/// Longest wait for the next byte when no deadline is set.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a handshake may take in all (two small messages; generous
/// for a starved host, short for a peer that says nothing).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A pre-shared key (32 bytes).
#[derive(Clone)]
pub struct Key([u8; 32]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(…)")
    }
}

/// Why a key file was refused.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// Reading it.
    #[error("cannot read the key file {path}: {error}")]
    Read {
        /// The file.
        path: String,
        /// Why (in the message, not a source: printed once).
        error: io::Error,
    },
    /// Others may read it.
    #[error("the key file {path} is readable by others (mode {mode:o}): chmod 600 it")]
    Exposed {
        /// The file.
        path: String,
        /// Its mode.
        mode: u32,
    },
    /// Owned by another user, who could read or replace it.
    #[error(
        "the key file {path} belongs to uid {owner}, not to this user (uid {me}) or root: chown it"
    )]
    NotOwned {
        /// The file.
        path: String,
        /// Its owner.
        owner: u32,
        /// This process's effective uid.
        me: u32,
    },
    /// Not 64 hex digits.
    #[error(
        "the key file {path} does not hold a key: 64 hex digits expected (hagctl keygen makes one)"
    )]
    Format {
        /// The file.
        path: String,
    },
}

impl Key {
    /// Parses 64 hex digits (surrounding white space allowed).
    pub fn from_hex(text: &str) -> Option<Key> {
        let t = text.trim();
        if t.len() != 64 {
            return None;
        }
        let mut k = [0u8; 32];
        for (i, b) in k.iter_mut().enumerate() {
            *b = u8::from_str_radix(t.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Key(k))
    }

    /// The key as 64 hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// A fresh random key.
    pub fn generate() -> io::Result<Key> {
        let mut k = [0u8; 32];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut k)?;
        Ok(Key(k))
    }

    /// Reads a key file: only its owner may read it.
    pub fn load(path: &Path) -> Result<Key, KeyError> {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let name = path.display().to_string();
        let read = |error| KeyError::Read {
            path: name.clone(),
            error,
        };
        let meta = std::fs::metadata(path).map_err(read)?;
        let me = nix::unistd::geteuid().as_raw();
        if let Some(e) = key_file_problem(&name, meta.permissions().mode(), meta.uid(), me) {
            return Err(e);
        }
        let text = std::fs::read_to_string(path).map_err(read)?;
        Key::from_hex(&text).ok_or(KeyError::Format { path: name })
    }

    /// Writes a new key file (mode 0600); refuses to overwrite one.
    pub fn write_new(&self, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        f.write_all((self.to_hex() + "\n").as_bytes())?;
        f.sync_all()
    }
}

/// What is wrong with a key file of `mode` owned by `owner`, read by uid
/// `me` (as ssh judges its keys): others may read it, or another user
/// owns it (and could read it, or replace it with a key of theirs).
fn key_file_problem(path: &str, mode: u32, owner: u32, me: u32) -> Option<KeyError> {
    let mode = mode & 0o777;
    if mode & 0o077 != 0 {
        return Some(KeyError::Exposed {
            path: path.to_owned(),
            mode,
        });
    }
    (owner != me && owner != 0).then(|| KeyError::NotOwned {
        path: path.to_owned(),
        owner,
        me,
    })
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The socket.
    #[error("handshake: {0}")]
    Io(#[from] io::Error),
    /// The peer does not hold the key (or is not hagctl).
    #[error("not authenticated: the peer does not hold this pair's key ({0})")]
    Refused(String),
    /// The handshake took too long.
    #[error("handshake not finished within {0:?}")]
    Timeout(Duration),
}

fn params() -> snow::params::NoiseParams {
    // A constant that parses: checked by the unit tests.
    PATTERN
        .parse()
        .unwrap_or_else(|_| unreachable!("{PATTERN} parses"))
}

fn read_record(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<bool> {
    let mut len = [0u8; 2];
    let mut have = 0;
    while have < 2 {
        match s.read(&mut len[have..]) {
            Ok(0) if have == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => have += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u16::from_le_bytes(len) as usize;
    buf.resize(len, 0);
    s.read_exact(buf)?;
    Ok(true)
}

/// Largest handshake message (NNpsk0's are 48 bytes): a peer speaking
/// anything else is refused before more than its length is read.
const MAX_HANDSHAKE: usize = 256;

/// A handshake record: its length is checked before the bytes are read
/// (an oversized one comes back as a buffer of that length, unread, for
/// the caller to refuse).
fn read_handshake_record(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<bool> {
    let mut len = [0u8; 2];
    if s.read(&mut len[..1])? == 0 {
        return Ok(false);
    }
    s.read_exact(&mut len[1..])?;
    let len = u16::from_le_bytes(len) as usize;
    buf.clear();
    if len > MAX_HANDSHAKE {
        buf.resize(len, 0);
        return Ok(true);
    }
    buf.resize(len, 0);
    s.read_exact(buf)?;
    Ok(true)
}

fn write_record(s: &mut TcpStream, rec: &[u8]) -> io::Result<()> {
    let mut out = Vec::with_capacity(2 + rec.len());
    out.extend_from_slice(&(rec.len() as u16).to_le_bytes());
    out.extend_from_slice(rec);
    s.write_all(&out)
}

fn deadline_io<T>(
    s: &mut TcpStream,
    deadline: Instant,
    limit: Duration,
    f: impl FnOnce(&mut TcpStream) -> io::Result<T>,
) -> Result<T, HandshakeError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(HandshakeError::Timeout(limit));
    }
    s.set_read_timeout(Some(left))?;
    s.set_write_timeout(Some(left))?;
    f(s).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => HandshakeError::Timeout(limit),
        _ => HandshakeError::Io(e),
    })
}

/// Runs the handshake on `stream` as the side that connected
/// (`initiator`) or accepted; returns the connection's two halves.
pub fn handshake(
    stream: TcpStream,
    key: &Key,
    initiator: bool,
) -> Result<(Reader, Writer), HandshakeError> {
    handshake_within(stream, key, initiator, HANDSHAKE_TIMEOUT)
}

/// [`handshake`], finished within `limit` (a listener gives an accepted
/// connection less than an initiator waits: see [`crate::admission`]).
pub fn handshake_within(
    stream: TcpStream,
    key: &Key,
    initiator: bool,
    limit: Duration,
) -> Result<(Reader, Writer), HandshakeError> {
    let proto = Protocol::HostToHost;
    if initiator {
        connect_as(stream, key, proto, limit)
    } else {
        accept_as(stream, std::slice::from_ref(key), proto, limit).map(|(_, r, w)| (r, w))
    }
}

/// What a connection is for, bound into its handshake: a key offered for
/// one protocol completes no handshake of the other, so a primary pointed
/// at a witness's port (or the reverse) is refused at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// Migration, the checkpoint stream, control and heartbeat paths.
    HostToHost,
    /// A primary's or a backup's claim to a witness ([`crate::witness`]).
    Witness,
}

impl Protocol {
    fn prologue(self) -> &'static [u8] {
        match self {
            Protocol::HostToHost => PROLOGUE,
            Protocol::Witness => b"hag witness v1",
        }
    }
}

fn builder(key: &Key, proto: Protocol) -> Result<snow::Builder<'_>, HandshakeError> {
    let refused = |e: snow::Error| HandshakeError::Refused(e.to_string());
    snow::Builder::new(params())
        .prologue(proto.prologue())
        .map_err(refused)?
        .psk(0, &key.0)
        .map_err(refused)
}

/// The initiator's side of the handshake for `proto`, within `limit`.
pub fn connect_as(
    mut stream: TcpStream,
    key: &Key,
    proto: Protocol,
    limit: Duration,
) -> Result<(Reader, Writer), HandshakeError> {
    let deadline = Instant::now() + limit;
    let refused = |e: snow::Error| HandshakeError::Refused(e.to_string());
    let mut hs = builder(key, proto)?.build_initiator().map_err(refused)?;
    let mut msg = vec![0u8; MAX_HANDSHAKE];
    let n = hs.write_message(&[], &mut msg).map_err(refused)?;
    deadline_io(&mut stream, deadline, limit, |s| write_record(s, &msg[..n]))?;
    let rec = read_peer_handshake(&mut stream, deadline, limit)?;
    hs.read_message(&rec, &mut msg).map_err(refused)?;
    transport(stream, hs)
}

/// The responder's side of the handshake for `proto`, within `limit`,
/// for a peer holding any of `keys` (a witness serves several pairs, each
/// with its own key): which one it holds is found by trying each on its
/// first message (no Diffie-Hellman is spent on a wrong one). Returns the
/// index of the key it holds.
pub fn accept_as(
    mut stream: TcpStream,
    keys: &[Key],
    proto: Protocol,
    limit: Duration,
) -> Result<(usize, Reader, Writer), HandshakeError> {
    let deadline = Instant::now() + limit;
    let refused = |e: snow::Error| HandshakeError::Refused(e.to_string());
    let rec = read_peer_handshake(&mut stream, deadline, limit)?;
    let mut msg = vec![0u8; MAX_HANDSHAKE];
    let mut last = HandshakeError::Refused("no key to try".into());
    for (index, key) in keys.iter().enumerate() {
        let mut hs = builder(key, proto)?.build_responder().map_err(refused)?;
        if let Err(e) = hs.read_message(&rec, &mut msg) {
            last = refused(e);
            continue;
        }
        let n = hs.write_message(&[], &mut msg).map_err(refused)?;
        deadline_io(&mut stream, deadline, limit, |s| write_record(s, &msg[..n]))?;
        let (r, w) = transport(stream, hs)?;
        return Ok((index, r, w));
    }
    Err(last)
}

/// The peer's handshake message, its size checked before it is read.
fn read_peer_handshake(
    stream: &mut TcpStream,
    deadline: Instant,
    limit: Duration,
) -> Result<Vec<u8>, HandshakeError> {
    let mut rec = Vec::new();
    let got = deadline_io(stream, deadline, limit, |s| {
        read_handshake_record(s, &mut rec)
    })?;
    if !got {
        return Err(HandshakeError::Refused(
            "the peer closed the connection".into(),
        ));
    }
    if rec.len() > MAX_HANDSHAKE {
        return Err(HandshakeError::Refused(format!(
            "a first record of {} bytes is no hag handshake",
            rec.len()
        )));
    }
    Ok(rec)
}

/// The connection's two halves once the handshake `hs` is done.
fn transport(
    stream: TcpStream,
    hs: snow::HandshakeState,
) -> Result<(Reader, Writer), HandshakeError> {
    let refused = |e: snow::Error| HandshakeError::Refused(e.to_string());
    let t = Arc::new(hs.into_stateless_transport_mode().map_err(refused)?);
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    let w = stream.try_clone()?;
    Ok((
        Reader {
            stream,
            t: t.clone(),
            nonce: 0,
            plain: Vec::new(),
            pos: 0,
            deadline: None,
            // As TCP connections here always had: a peer silent this long
            // is gone (a deadline, when set, is shorter).
            idle: Some(IDLE_TIMEOUT),
        },
        Writer {
            stream: w,
            t,
            nonce: 0,
            sealed: Vec::new(),
            seal_time: Duration::ZERO,
            sealers: sealers(),
        },
    ))
}

/// The receiving half of a connection.
pub struct Reader {
    stream: TcpStream,
    t: Arc<StatelessTransportState>,
    nonce: u64,
    plain: Vec<u8>,
    pos: usize,
    deadline: Option<Instant>,
    idle: Option<Duration>,
}

impl Reader {
    /// Reads must finish by `deadline` (`None`: only the idle timeout).
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }

    /// Longest wait for the next byte when there is no deadline.
    pub fn set_idle_timeout(&mut self, idle: Option<Duration>) {
        self.idle = idle;
    }

    /// The TCP connection (to shut it down from elsewhere).
    pub fn socket(&self) -> io::Result<TcpStream> {
        self.stream.try_clone()
    }

    fn fill(&mut self) -> io::Result<bool> {
        let timeout = match self.deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the message did not arrive whole by its deadline",
                    ));
                }
                Some(self.idle.map_or(left, |i| i.min(left)))
            }
            None => self.idle,
        };
        self.stream.set_read_timeout(timeout)?;
        let mut rec = Vec::new();
        if !read_record(&mut self.stream, &mut rec)? {
            return Ok(false);
        }
        self.plain.resize(rec.len(), 0);
        let n = self
            .t
            .read_message(self.nonce, &rec, &mut self.plain)
            .map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("a record failed authentication ({e}): altered, replayed or not from the peer"),
                )
            })?;
        self.nonce += 1;
        self.plain.truncate(n);
        self.pos = 0;
        Ok(true)
    }
}

impl Read for Reader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.plain.len() {
            if !self.fill()? {
                return Ok(0);
            }
        }
        let n = buf.len().min(self.plain.len() - self.pos);
        buf[..n].copy_from_slice(&self.plain[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Records sealed per write: a PAGES frame (256 pages, about 1 MiB) goes
/// in one or two batches.
const BATCH_RECORDS: usize = 16;

/// Threads that seal a batch's records, at most (records of a connection
/// are independent: each has its own nonce, the counter).
const MAX_SEALERS: usize = 4;

/// How many threads seal: the CPUs this process may run on, up to
/// [`MAX_SEALERS`] (one where it has one CPU, as a test host whose other
/// CPU is isolated for the VM).
fn sealers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_SEALERS))
}

/// The sending half of a connection.
pub struct Writer {
    stream: TcpStream,
    t: Arc<StatelessTransportState>,
    nonce: u64,
    /// The batch being written, as records on the wire (`len u16 | record`
    /// each), reused from write to write.
    sealed: Vec<u8>,
    /// Time spent encrypting, in all.
    seal_time: Duration,
    sealers: usize,
}

impl Writer {
    /// Closes the connection both ways (the reader sees the end).
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// Closes the sending direction only (the peer reads the end).
    pub fn shutdown_write(&self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }

    /// A bound on each blocking write.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.stream.set_write_timeout(t)
    }

    /// Time spent encrypting since the connection was made (the rest of a
    /// write's time is the socket's).
    pub fn seal_time(&self) -> Duration {
        self.seal_time
    }

    /// Seals `plain` (at most [`BATCH_RECORDS`] records) into
    /// `self.sealed` as records on the wire, the records split among the
    /// sealing threads.
    fn seal_batch(&mut self, plain: &[u8]) -> io::Result<()> {
        let records = plain.len().div_ceil(CHUNK);
        self.sealed.resize(plain.len() + records * (2 + TAG), 0);
        let mut slots: Vec<(u64, &[u8], &mut [u8])> = plain
            .chunks(CHUNK)
            .zip(self.sealed.chunks_mut(2 + CHUNK + TAG))
            .zip(self.nonce..)
            .map(|((p, out), nonce)| (nonce, p, &mut out[..2 + p.len() + TAG]))
            .collect();
        let t = &*self.t;
        let seal = |slots: &mut [(u64, &[u8], &mut [u8])]| -> io::Result<()> {
            for (nonce, p, out) in slots {
                let n = t
                    .write_message(*nonce, p, &mut out[2..])
                    .map_err(|e| io::Error::other(format!("encrypting: {e}")))?;
                debug_assert_eq!(n + 2, out.len());
                out[..2].copy_from_slice(&(n as u16).to_le_bytes());
            }
            Ok(())
        };
        let per_thread = records.div_ceil(self.sealers.min(records));
        if per_thread == records {
            seal(&mut slots)?;
        } else {
            std::thread::scope(|s| {
                let mut parts = slots.chunks_mut(per_thread);
                let first = parts.next().unwrap_or_default();
                let others: Vec<_> = parts.map(|part| s.spawn(move || seal(part))).collect();
                let mut result = seal(first);
                for h in others {
                    let r = h
                        .join()
                        .unwrap_or_else(|_| Err(io::Error::other("a sealing thread panicked")));
                    result = result.and(r);
                }
                result
            })?;
        }
        self.nonce += records as u64;
        Ok(())
    }
}

impl Write for Writer {
    /// Seals and writes up to [`BATCH_RECORDS`] records of `buf` at once.
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(CHUNK * BATCH_RECORDS);
        let t = Instant::now();
        self.seal_batch(&buf[..n])?;
        self.seal_time += t.elapsed();
        self.stream.write_all(&self.sealed)?;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Both halves, for a connection one thread uses alone.
pub struct Conn {
    /// Reading.
    pub r: Reader,
    /// Writing.
    pub w: Writer,
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.r.read(buf)
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.w.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A connection's sending half run by a thread of its own behind a short
/// queue, so that no one ever blocks writing to a peer while holding
/// shared state: heartbeats and fences are posted ([`Outbox::post`]) and
/// dropped, with the connection closed, when the peer does not take them.
#[derive(Clone)]
pub struct Outbox {
    tx: std::sync::mpsc::SyncSender<Out>,
    sock: Arc<TcpStream>,
}

/// What the writing thread is given.
enum Out {
    /// A frame to write.
    Frame(Vec<u8>),
    /// Answer once every frame queued before this one is written.
    Flushed(std::sync::mpsc::SyncSender<()>),
}

/// Frames an outbox holds before it counts its peer as stuck.
const OUTBOX_FRAMES: usize = 16;
/// How long one write to a peer may block.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

impl Outbox {
    /// Starts the writing thread for `w`.
    pub fn spawn(mut w: Writer) -> io::Result<Outbox> {
        let sock = Arc::new(w.stream.try_clone()?);
        w.set_write_timeout(Some(WRITE_TIMEOUT))?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Out>(OUTBOX_FRAMES);
        std::thread::Builder::new()
            .name("outbox".into())
            .spawn(move || {
                for out in rx {
                    match out {
                        Out::Frame(frame) => {
                            if w.write_all(&frame).is_err() {
                                w.shutdown();
                                return;
                            }
                        }
                        Out::Flushed(done) => {
                            let _ = done.try_send(());
                        }
                    }
                }
            })?;
        Ok(Outbox { tx, sock })
    }

    /// Queues `msg` without waiting; false (and the connection closed) if
    /// the peer is not taking what was sent before.
    pub fn post(&self, msg: &crate::wire::Msg) -> bool {
        let ok = self
            .tx
            .try_send(Out::Frame(crate::wire::encode_frame(msg)))
            .is_ok();
        if !ok {
            self.close();
        }
        ok
    }

    /// Queues `msg`, waiting for room (for the one thread that owns the
    /// conversation, never under a shared lock).
    pub fn send(&self, msg: &crate::wire::Msg) -> bool {
        self.tx
            .send(Out::Frame(crate::wire::encode_frame(msg)))
            .is_ok()
    }

    /// Waits (up to `timeout`) until everything queued so far is written:
    /// before a process exits, so that its last words (an OK ENDED) are
    /// not lost with its threads. False if that did not happen in time.
    pub fn flush(&self, timeout: Duration) -> bool {
        let (done, flushed) = std::sync::mpsc::sync_channel(1);
        if self.tx.try_send(Out::Flushed(done)).is_err() {
            return false;
        }
        flushed.recv_timeout(timeout).is_ok()
    }

    /// Closes the connection.
    pub fn close(&self) {
        let _ = self.sock.shutdown(Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair(a: Key, b: Key) -> (Result<Conn, String>, Result<Conn, String>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            handshake(s, &b, false)
                .map(|(r, w)| Conn { r, w })
                .map_err(|e| e.to_string())
        });
        let c = TcpStream::connect(addr).unwrap();
        let client = handshake(c, &a, true)
            .map(|(r, w)| Conn { r, w })
            .map_err(|e| e.to_string());
        (client, t.join().unwrap())
    }

    #[test]
    fn a_key_file_must_be_private_and_ours() {
        assert!(key_file_problem("k", 0o100600, 1000, 1000).is_none());
        // Root's own file, read by a service user: root may own it.
        assert!(key_file_problem("k", 0o400, 0, 1000).is_none());
        let e = key_file_problem("k", 0o640, 1000, 1000)
            .unwrap()
            .to_string();
        assert!(e.contains("readable by others (mode 640)"), "{e}");
        let e = key_file_problem("/etc/hag/pair.key", 0o600, 1001, 0)
            .unwrap()
            .to_string();
        assert!(
            e.contains("/etc/hag/pair.key belongs to uid 1001, not to this user (uid 0)"),
            "{e}"
        );
    }

    #[test]
    fn the_pattern_parses_and_keys_round_trip() {
        let _ = params();
        let k = Key::generate().unwrap();
        assert_eq!(Key::from_hex(&k.to_hex()).unwrap().0, k.0);
        assert!(Key::from_hex("00").is_none());
        assert!(Key::from_hex(&"zz".repeat(32)).is_none());
    }

    #[test]
    fn same_key_talks_both_ways_large_messages_included() {
        let k = Key::generate().unwrap();
        let (c, s) = pair(k.clone(), k);
        let (mut c, mut s) = (c.unwrap(), s.unwrap());
        // More than a batch of records, sealed by three threads, and a
        // write after it continues the nonces.
        let big: Vec<u8> = (0..(CHUNK * BATCH_RECORDS + 200_000) as u32)
            .map(|i| (i * 7) as u8)
            .collect();
        c.w.sealers = 3;
        let t = {
            let big = big.clone();
            std::thread::spawn(move || {
                c.write_all(&big[..10]).unwrap();
                c.write_all(&big[10..]).unwrap();
                let mut back = [0u8; 5];
                c.read_exact(&mut back).unwrap();
                back
            })
        };
        let mut got = vec![0u8; big.len()];
        s.read_exact(&mut got).unwrap();
        assert_eq!(got, big);
        s.write_all(b"hello").unwrap();
        assert_eq!(&t.join().unwrap(), b"hello");
    }

    #[test]
    fn a_peer_without_the_key_is_refused_on_both_sides() {
        let (c, s) = pair(Key::generate().unwrap(), Key::generate().unwrap());
        assert!(s.err().unwrap().contains("not authenticated"));
        assert!(c.is_err());
    }

    #[test]
    fn a_plain_tcp_peer_gets_nothing_and_a_silent_one_times_out() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let k = Key::generate().unwrap();
        let t = std::thread::spawn(move || {
            let mut out = Vec::new();
            for _ in 0..3 {
                let (s, _) = l.accept().unwrap();
                out.push(handshake(s, &k, false).err().unwrap().to_string());
            }
            out
        });
        // An old (unencrypted) hagctl's HELLO frame.
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(&crate::wire::encode_frame(&crate::wire::Msg::Commit))
            .unwrap();
        // A port scanner's HTTP request: refused on its length alone.
        let mut h = TcpStream::connect(addr).unwrap();
        h.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        // A peer that connects and says nothing.
        let start = Instant::now();
        let _silent = TcpStream::connect(addr).unwrap();
        let errs = t.join().unwrap();
        assert!(errs[0].contains("not authenticated"), "{}", errs[0]);
        assert!(errs[1].contains("is no hag handshake"), "{}", errs[1]);
        assert!(errs[2].contains("not finished within"), "{}", errs[2]);
        assert!(start.elapsed() >= HANDSHAKE_TIMEOUT);
    }

    /// Accepts one connection, authenticates it with `key` and hands its
    /// reading half to `f` in a thread.
    fn accept_one<T: Send + 'static>(
        key: Key,
        f: impl FnOnce(Reader) -> T + Send + 'static,
    ) -> (std::net::SocketAddr, std::thread::JoinHandle<T>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let (r, _w) = handshake(s, &key, false).unwrap();
            f(r)
        });
        (addr, t)
    }

    #[test]
    fn an_altered_record_is_an_error_and_a_deadline_ends_a_trickle() {
        let k = Key::generate().unwrap();
        let (addr, t) = accept_one(k.clone(), |mut r| {
            let mut b = [0u8; 4];
            r.read_exact(&mut b).map_err(|e| e.to_string())
        });
        let c = TcpStream::connect(addr).unwrap();
        let (_r, w) = handshake(c, &k, true).unwrap();
        // A record with a flipped bit, written under the encryption.
        let mut raw = w.stream.try_clone().unwrap();
        let mut rec = vec![0u8; 4 + TAG];
        let n = w.t.write_message(0, b"abcd", &mut rec).unwrap();
        rec[3] ^= 1;
        write_record(&mut raw, &rec[..n]).unwrap();
        let err = t.join().unwrap().unwrap_err();
        assert!(err.contains("failed authentication"), "{err}");

        // A deadline: half a record, then nothing.
        let (addr, t) = accept_one(k.clone(), |mut r| {
            r.set_deadline(Some(Instant::now() + Duration::from_millis(300)));
            let mut b = [0u8; 4];
            r.read_exact(&mut b).map_err(|e| e.kind())
        });
        let c = TcpStream::connect(addr).unwrap();
        let (_r, w) = handshake(c, &k, true).unwrap();
        let mut raw = w.stream.try_clone().unwrap();
        raw.write_all(&[20, 0, 1]).unwrap();
        let kind = t.join().unwrap().unwrap_err();
        assert!(
            matches!(kind, io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock),
            "{kind:?}"
        );
    }

    /// Where a sender's time goes per epoch-sized batch of pages (run by
    /// hand, natively or under qemu-x86_64 to see a test host's TCG):
    /// cargo test --release -p hagctl pipeline_cost -- --ignored --nocapture
    #[test]
    #[ignore]
    fn pipeline_cost() {
        let (c, s) = pair(Key([3; 32]), Key([3; 32]));
        let (c, _s) = (c.unwrap(), s.unwrap());
        let n = 2560usize;
        let mut raw = vec![0u8; n * crate::wire::PAGE];
        let mut x = 0x9e3779b97f4a7c15u64;
        for (i, page) in raw.chunks_exact_mut(crate::wire::PAGE).enumerate() {
            match i % 5 {
                0 | 1 => page.iter_mut().for_each(|b| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    *b = x as u8
                }),
                2 | 3 => page
                    .chunks_exact_mut(4)
                    .enumerate()
                    .for_each(|(j, w)| w.copy_from_slice(&((j / 8) as u32).to_le_bytes())),
                _ => {}
            }
        }
        let pages: Vec<u64> = (0..n as u64).collect();
        let (mut out, mut scratch) = (Vec::new(), crate::wire::PageScratch::default());
        for compress in [true, false] {
            let t = Instant::now();
            let mut bytes = 0;
            for (p, r) in pages.chunks(256).zip(raw.chunks(256 * crate::wire::PAGE)) {
                crate::wire::encode_pages_frame(1, p, r, compress, None, &mut out, &mut scratch);
                bytes += out.len();
            }
            eprintln!(
                "encode compress={compress}: {:?} for {bytes} bytes",
                t.elapsed()
            );
        }
        let t = Instant::now();
        let mut h = crc32fast::Hasher::new();
        h.update(&raw);
        eprintln!(
            "crc32 of {} bytes: {:?} ({})",
            raw.len(),
            t.elapsed(),
            h.finalize()
        );
        let t = Instant::now();
        let mut sealed = vec![0u8; CHUNK + TAG];
        for (i, chunk) in raw.chunks(CHUNK).enumerate() {
            c.w.t.write_message(i as u64, chunk, &mut sealed).unwrap();
        }
        eprintln!("seal of {} bytes: {:?}", raw.len(), t.elapsed());
    }
}
