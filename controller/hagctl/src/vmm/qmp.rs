//! A QMP client: QEMU's machine protocol on a unix socket.
//!
//! QMP sends one JSON object per line (ending in `\r\n` or `\n`): first a
//! greeting (`{"QMP": {"version": …, "capabilities": […]}}`), then, after
//! the client's `qmp_capabilities`, a reply to each command
//! (`{"return": …, "id": …}` or `{"error": {"class": …, "desc": …}, "id":
//! …}`) and, at any time in between, asynchronous events (`{"event": NAME,
//! "data": …, "timestamp": {"seconds": …, "microseconds": …}}`).
//!
//! What [`Qmp`] promises:
//! - every command carries an `id`, and only the reply with that id answers
//!   it: a late reply to a command that timed out is dropped, never taken
//!   for the answer to the next one;
//! - events that arrive while waiting for a reply are kept, in order, for
//!   [`Qmp::take_events`] and [`Qmp::wait_event`] (at most [`MAX_EVENTS`];
//!   past that the oldest are dropped and counted);
//! - a command's whole reply must arrive within its deadline (not each
//!   read), else [`QmpError::Timeout`];
//! - no message may be longer than [`MAX_MESSAGE`] bytes, and QEMU's
//!   refusal is [`QmpError::Command`] with QMP's error `class` and `desc`;
//! - after a transport error (the socket failed, closed, or sent something
//!   that is not QMP) the client is broken and every later call says so.

use std::collections::VecDeque;
use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Longest message (one line) accepted from QEMU. `query-qmp-schema`, the
/// largest reply QEMU has, is well under a megabyte.
pub const MAX_MESSAGE: usize = 4 << 20;

/// Events kept while nobody takes them.
pub const MAX_EVENTS: usize = 4096;

/// Default deadline of a command's whole reply (and of the greeting).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// QEMU's version, from the greeting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct QemuVersion {
    /// Major.
    pub major: u64,
    /// Minor.
    pub minor: u64,
    /// Micro.
    pub micro: u64,
}

impl std::fmt::Display for QemuVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.micro)
    }
}

/// The greeting QEMU sends on connect.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Greeting {
    /// QEMU's version.
    pub version: QemuVersion,
    /// The distribution's package string (may be empty).
    pub package: String,
    /// Protocol capabilities offered (`oob`); hagctl enables none.
    pub capabilities: Vec<String>,
}

/// How long [`Qmp::end_seen`] reads what a closing QEMU left.
const END_READ: Duration = Duration::from_millis(500);

/// An asynchronous event.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// `MIGRATION`, `STOP`, `RESUME`, `SHUTDOWN`, …
    pub name: String,
    /// Its `data` (`Null` if it has none).
    pub data: Value,
    /// QEMU's host clock when it happened: seconds and microseconds.
    pub timestamp: Option<(i64, i64)>,
}

/// One QMP message, parsed.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    /// The greeting.
    Greeting(Greeting),
    /// A command's success.
    Return {
        /// The command's id, as sent.
        id: Option<Value>,
        /// What it returned.
        value: Value,
    },
    /// A command's failure.
    Error {
        /// The command's id, as sent.
        id: Option<Value>,
        /// QMP's error class (`GenericError`, `CommandNotFound`, …).
        class: String,
        /// QEMU's description.
        desc: String,
    },
    /// An event.
    Event(Event),
}

/// Parses one line from QEMU.
pub fn parse_message(line: &[u8]) -> Result<Message, String> {
    let value: Value =
        serde_json::from_slice(line).map_err(|e| format!("not a JSON message: {e}"))?;
    let Value::Object(mut obj) = value else {
        return Err("a message that is not a JSON object".into());
    };
    let id = obj.remove("id");
    if let Some(greeting) = obj.remove("QMP") {
        return parse_greeting(&greeting).map(Message::Greeting);
    }
    if let Some(value) = obj.remove("return") {
        return Ok(Message::Return { id, value });
    }
    if let Some(error) = obj.remove("error") {
        let text = |field: &str| {
            error
                .get(field)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| format!("an error reply without '{field}'"))
        };
        return Ok(Message::Error {
            id,
            class: text("class")?,
            desc: text("desc")?,
        });
    }
    if let Some(name) = obj.remove("event") {
        let name = name
            .as_str()
            .ok_or("an event whose name is not a string")?
            .to_owned();
        let timestamp = obj.get("timestamp").and_then(|t| {
            Some((
                t.get("seconds")?.as_i64()?,
                t.get("microseconds")?.as_i64()?,
            ))
        });
        return Ok(Message::Event(Event {
            name,
            data: obj.remove("data").unwrap_or(Value::Null),
            timestamp,
        }));
    }
    let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    Err(format!(
        "a message with none of QMP, return, error, event (keys: {})",
        keys.join(", ")
    ))
}

fn parse_greeting(g: &Value) -> Result<Greeting, String> {
    let version = g.get("version").ok_or("a greeting without 'version'")?;
    let qemu = version
        .get("qemu")
        .ok_or("a greeting without 'version.qemu'")?;
    let part = |name: &str| {
        qemu.get(name)
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("a greeting without 'version.qemu.{name}'"))
    };
    Ok(Greeting {
        version: QemuVersion {
            major: part("major")?,
            minor: part("minor")?,
            micro: part("micro")?,
        },
        package: version
            .get("package")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .trim()
            .to_owned(),
        capabilities: g
            .get("capabilities")
            .and_then(Value::as_array)
            .map(|caps| {
                caps.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default(),
    })
}

/// Why a QMP call failed.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// Nothing listens at the socket.
    #[error("cannot connect to the QMP socket {path}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// What connect said.
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing failed.
    #[error("QMP socket {path}: {what}: {error}")]
    Io {
        /// The socket.
        path: PathBuf,
        /// What was being done.
        what: String,
        /// The error (in the message, not a source: the message is what
        /// a skipped epoch reports, and it must say why).
        error: std::io::Error,
    },
    /// No (whole) reply within the deadline.
    #[error("QMP socket {path}: no reply to '{command}' within {}", fmt_duration(*.timeout))]
    Timeout {
        /// The socket.
        path: PathBuf,
        /// The command (or `greeting`).
        command: String,
        /// The deadline.
        timeout: Duration,
    },
    /// QEMU closed the connection (it quit, or was killed).
    #[error("QMP socket {path}: QEMU closed the connection ({during})")]
    Closed {
        /// The socket.
        path: PathBuf,
        /// What was being waited for.
        during: String,
    },
    /// A message longer than [`MAX_MESSAGE`].
    #[error("QMP socket {path}: a message longer than {limit} bytes")]
    TooLong {
        /// The socket.
        path: PathBuf,
        /// The limit.
        limit: usize,
    },
    /// Something that is not QMP.
    #[error("QMP socket {path}: {what}")]
    Protocol {
        /// The socket.
        path: PathBuf,
        /// What was wrong.
        what: String,
    },
    /// QEMU refused the command.
    #[error("QEMU refused '{command}': {desc} ({class})")]
    Command {
        /// The command.
        command: String,
        /// QMP's error class.
        class: String,
        /// QEMU's description.
        desc: String,
    },
    /// An earlier transport error broke this connection.
    #[error("QMP socket {path}: the connection is unusable after an earlier error ({why})")]
    Broken {
        /// The socket.
        path: PathBuf,
        /// The earlier error.
        why: String,
    },
}

impl QmpError {
    /// QEMU's description, if QEMU refused the command.
    pub fn desc(&self) -> Option<&str> {
        match self {
            QmpError::Command { desc, .. } => Some(desc),
            _ => None,
        }
    }

    /// QMP's error class, if QEMU refused the command.
    pub fn class(&self) -> Option<&str> {
        match self {
            QmpError::Command { class, .. } => Some(class),
            _ => None,
        }
    }

    /// QEMU is gone (closed the socket).
    pub fn is_closed(&self) -> bool {
        matches!(self, QmpError::Closed { .. })
    }
}

fn fmt_duration(d: Duration) -> String {
    if d.as_millis() < 1000 {
        format!("{} ms", d.as_millis())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// A connection to one QEMU's QMP socket, in command mode.
pub struct Qmp {
    stream: UnixStream,
    path: PathBuf,
    pending: Vec<u8>,
    next_id: u64,
    events: VecDeque<Event>,
    dropped_events: u64,
    /// `RESUME` events read (taken or not), plus one per reconnection.
    resumes: u64,
    greeting: Greeting,
    timeout: Duration,
    broken: Option<String>,
}

impl Qmp {
    /// Connects to the socket at `path`, reads the greeting and enters
    /// command mode (`qmp_capabilities`), each within `timeout`.
    ///
    /// QEMU serves one client per QMP socket at a time: while another
    /// client (libvirt, another hagctl) is connected, the greeting does
    /// not come and this fails with a timeout that says so.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let stream = UnixStream::connect(path).map_err(|source| QmpError::Connect {
            path: path.to_owned(),
            source,
        })?;
        let mut qmp = Qmp::from_stream(stream, path, timeout);
        let deadline = Instant::now() + timeout;
        let greeting = loop {
            match qmp.read_message(deadline, "the greeting") {
                Ok(Message::Greeting(g)) => break g,
                Ok(Message::Event(e)) => qmp.push_event(e),
                Ok(other) => {
                    return Err(qmp.fail(QmpError::Protocol {
                        path: path.to_owned(),
                        what: format!("expected the QMP greeting, got {other:?}"),
                    }))
                }
                Err(QmpError::Timeout { .. }) => {
                    return Err(QmpError::Timeout {
                        path: path.to_owned(),
                        command: "the greeting (is another client connected? QEMU serves one \
                                  client per QMP socket)"
                            .into(),
                        timeout,
                    })
                }
                Err(e) => return Err(e),
            }
        };
        qmp.greeting = greeting;
        qmp.execute("qmp_capabilities", None)?;
        Ok(qmp)
    }

    /// Whether a transport error broke this connection.
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    /// After a transport error that did not close QEMU's end (a reply
    /// that never came, a write that timed out): the broken connection
    /// closed (QEMU serves one client per socket) and a new one in its
    /// place, its events after the old one's.
    pub fn reconnect(&mut self) -> Result<(), QmpError> {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let mut fresh = Qmp::connect(&self.path, self.timeout)?;
        let mut events = std::mem::take(&mut self.events);
        events.extend(fresh.events.drain(..));
        fresh.events = events;
        fresh.dropped_events += self.dropped_events;
        // Whatever QEMU said while nobody listened is lost: it may have
        // been a RESUME.
        fresh.resumes += self.resumes + 1;
        fresh.next_id = self.next_id;
        *self = fresh;
        Ok(())
    }

    /// A client on an already connected stream (the greeting not yet read).
    fn from_stream(stream: UnixStream, path: &Path, timeout: Duration) -> Qmp {
        Qmp {
            stream,
            path: path.to_owned(),
            pending: Vec::new(),
            next_id: 1,
            events: VecDeque::new(),
            dropped_events: 0,
            resumes: 0,
            greeting: Greeting::default(),
            timeout,
            broken: None,
        }
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pid of the QEMU at the other end (`SO_PEERCRED`: the process
    /// that made the listening socket).
    pub fn peer_pid(&self) -> Result<i32, QmpError> {
        nix::sys::socket::getsockopt(&self.stream, nix::sys::socket::sockopt::PeerCredentials)
            .map(|c| c.pid())
            .map_err(|e| QmpError::Protocol {
                path: self.path.clone(),
                what: format!("cannot tell QEMU's pid (SO_PEERCRED): {e}"),
            })
    }

    /// What QEMU said on connect.
    pub fn greeting(&self) -> &Greeting {
        &self.greeting
    }

    /// Runs `command` with `arguments` (an object, or `None`) and returns
    /// what it returned, within the default deadline.
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        self.execute_within(command, arguments, self.timeout)
    }

    /// [`Qmp::execute`] with its own deadline.
    pub fn execute_within(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        self.call(command, arguments, None, timeout)
    }

    /// Runs `command` with `fd` passed along as `SCM_RIGHTS` (for `getfd`
    /// and `add-fd`).
    pub fn execute_with_fd(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        fd: BorrowedFd<'_>,
    ) -> Result<Value, QmpError> {
        self.call(command, arguments, Some(fd), self.timeout)
    }

    fn call(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        fd: Option<BorrowedFd<'_>>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        self.usable()?;
        let id = self.next_id;
        self.next_id += 1;
        let mut request = serde_json::json!({ "execute": command, "id": id });
        if let Some(args) = arguments {
            request["arguments"] = args;
        }
        let mut line = serde_json::to_vec(&request).map_err(|e| QmpError::Protocol {
            path: self.path.clone(),
            what: format!("cannot encode '{command}': {e}"),
        })?;
        line.push(b'\n');
        let deadline = Instant::now() + timeout;
        self.send(&line, fd, command, timeout)?;
        let during = format!("waiting for the reply to '{command}'");
        loop {
            match self.read_message(deadline, &during) {
                Ok(Message::Event(e)) => self.push_event(e),
                Ok(Message::Return { id: rid, value }) if id_matches(rid.as_ref(), id) => {
                    return Ok(value)
                }
                Ok(Message::Error {
                    id: rid,
                    class,
                    desc,
                }) if id_matches(rid.as_ref(), id) => {
                    return Err(QmpError::Command {
                        command: command.to_owned(),
                        class,
                        desc,
                    })
                }
                // A late reply to an earlier command that timed out.
                Ok(Message::Return { .. } | Message::Error { .. }) => {}
                Ok(Message::Greeting(_)) => {
                    return Err(self.fail(QmpError::Protocol {
                        path: self.path.clone(),
                        what: format!("a second greeting while {during}"),
                    }))
                }
                Err(QmpError::Timeout { .. }) => {
                    return Err(QmpError::Timeout {
                        path: self.path.clone(),
                        command: command.to_owned(),
                        timeout,
                    })
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes every event received so far, oldest first.
    pub fn take_events(&mut self) -> Vec<Event> {
        self.events.drain(..).collect()
    }

    /// Drops the buffered events called `name`.
    pub fn discard_events(&mut self, name: &str) {
        self.events.retain(|e| e.name != name);
    }

    /// The first buffered event called `name`, left in the buffer.
    pub fn find_event(&self, name: &str) -> Option<&Event> {
        self.events.iter().find(|e| e.name == name)
    }

    /// After a failed call: whether QEMU is gone (its end of the socket
    /// closed) and, if so, whether a `SHUTDOWN` event came first. What QEMU
    /// sent before it closed is read first (a write to the closed socket
    /// can fail before the events waiting to be read are seen). `None`:
    /// the connection is not known to be closed (a timeout, a protocol
    /// error): QEMU may still be running.
    pub fn end_seen(&mut self) -> Option<bool> {
        let deadline = Instant::now() + END_READ;
        loop {
            match self.read_message(deadline, "reading what QEMU sent before it closed") {
                Ok(Message::Event(e)) => self.push_event(e),
                Ok(_) => {}
                Err(QmpError::Closed { .. }) => break,
                Err(QmpError::Io { error, .. })
                    if matches!(
                        error.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                    ) =>
                {
                    break
                }
                Err(_) => return None,
            }
        }
        Some(self.find_event("SHUTDOWN").is_some())
    }

    /// Events dropped because nobody took them (more than [`MAX_EVENTS`]).
    pub fn dropped_events(&self) -> u64 {
        self.dropped_events
    }

    /// How many `RESUME` events this connection has read (each time
    /// anyone ran the VM: this client, another one, or QEMU itself),
    /// counting a reconnection as one: unchanged between two calls means
    /// nothing read in between says the VM ran.
    pub fn resumes_seen(&self) -> u64 {
        self.resumes
    }

    /// Reads what QEMU sends for up to `timeout` (at least one read
    /// attempt), buffering events; returns how many events are buffered.
    pub fn poll_events(&mut self, timeout: Duration) -> Result<usize, QmpError> {
        self.usable()?;
        let deadline = Instant::now() + timeout;
        loop {
            match self.read_message(deadline, "waiting for events") {
                Ok(Message::Event(e)) => self.push_event(e),
                Ok(_) => {} // a late reply
                Err(QmpError::Timeout { .. }) => return Ok(self.events.len()),
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes the first buffered or arriving event for which `wanted` is
    /// true (leaving the others buffered), waiting up to `timeout`.
    pub fn wait_event(
        &mut self,
        wanted: impl Fn(&Event) -> bool,
        timeout: Duration,
    ) -> Result<Option<Event>, QmpError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.events.iter().position(&wanted) {
                return Ok(self.events.remove(i));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            self.usable()?;
            match self.read_message(deadline, "waiting for an event") {
                Ok(Message::Event(e)) => self.push_event(e),
                Ok(_) => {}
                Err(QmpError::Timeout { .. }) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
    }

    fn push_event(&mut self, e: Event) {
        if e.name == "RESUME" {
            self.resumes += 1;
        }
        if self.events.len() >= MAX_EVENTS {
            self.events.pop_front();
            self.dropped_events += 1;
        }
        self.events.push_back(e);
    }

    fn usable(&self) -> Result<(), QmpError> {
        match &self.broken {
            Some(why) => Err(QmpError::Broken {
                path: self.path.clone(),
                why: why.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Marks the connection broken by `e` and returns it.
    fn fail(&mut self, e: QmpError) -> QmpError {
        if self.broken.is_none() {
            self.broken = Some(e.to_string());
        }
        e
    }

    fn send(
        &mut self,
        line: &[u8],
        fd: Option<BorrowedFd<'_>>,
        command: &str,
        timeout: Duration,
    ) -> Result<(), QmpError> {
        let _ = self.stream.set_write_timeout(Some(timeout));
        let result = match fd {
            Some(fd) => {
                use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
                let fds = [fd.as_raw_fd()];
                let cmsg = [ControlMessage::ScmRights(&fds)];
                let iov = [IoSlice::new(line)];
                sendmsg::<()>(
                    self.stream.as_raw_fd(),
                    &iov,
                    &cmsg,
                    MsgFlags::empty(),
                    None,
                )
                .map_err(std::io::Error::from)
                // The fd went with the first bytes; the rest goes plainly.
                .and_then(|sent| self.stream.write_all(&line[sent..]))
            }
            None => self.stream.write_all(line),
        };
        result.map_err(|error| {
            let e = QmpError::Io {
                path: self.path.clone(),
                what: format!("sending '{command}'"),
                error,
            };
            self.fail(e)
        })
    }

    /// The next message, whole, by `deadline`.
    fn read_message(&mut self, deadline: Instant, during: &str) -> Result<Message, QmpError> {
        let line = self.read_line(deadline, during)?;
        parse_message(&line).map_err(|what| {
            let e = QmpError::Protocol {
                path: self.path.clone(),
                what: format!("{what} while {during}"),
            };
            self.fail(e)
        })
    }

    fn read_line(&mut self, deadline: Instant, during: &str) -> Result<Vec<u8>, QmpError> {
        let mut buf = [0u8; 64 << 10];
        loop {
            if let Some(nl) = self.pending.iter().position(|&b| b == b'\n') {
                let rest = self.pending.split_off(nl + 1);
                let mut line = std::mem::replace(&mut self.pending, rest);
                while line.last().is_some_and(|b| b.is_ascii_whitespace()) {
                    line.pop();
                }
                if line.is_empty() {
                    continue;
                }
                if line.len() > MAX_MESSAGE {
                    let e = QmpError::TooLong {
                        path: self.path.clone(),
                        limit: MAX_MESSAGE,
                    };
                    return Err(self.fail(e));
                }
                return Ok(line);
            }
            if self.pending.len() > MAX_MESSAGE {
                let e = QmpError::TooLong {
                    path: self.path.clone(),
                    limit: MAX_MESSAGE,
                };
                return Err(self.fail(e));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(QmpError::Timeout {
                    path: self.path.clone(),
                    command: during.to_owned(),
                    timeout: Duration::ZERO,
                });
            }
            // Never zero: that would mean "no timeout".
            let _ = self
                .stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))));
            // Read no further than the cap allows.
            let room = (MAX_MESSAGE + 2 - self.pending.len()).min(buf.len());
            match self.stream.read(&mut buf[..room]) {
                Ok(0) => {
                    let e = QmpError::Closed {
                        path: self.path.clone(),
                        during: during.to_owned(),
                    };
                    return Err(self.fail(e));
                }
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(error) => {
                    let e = QmpError::Io {
                        path: self.path.clone(),
                        what: during.to_owned(),
                        error,
                    };
                    return Err(self.fail(e));
                }
            }
        }
    }
}

/// A reply answers command `id` if it carries that id, or no id at all
/// (QEMU answers a request it could not parse without one).
fn id_matches(reply: Option<&Value>, id: u64) -> bool {
    match reply {
        None => true,
        Some(v) => v.as_u64() == Some(id),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::BufRead;
    use std::os::unix::net::UnixListener;

    pub(crate) const GREETING: &str = r#"{"QMP": {"version": {"qemu": {"micro": 2, "minor": 0, "major": 10}, "package": "Debian 1:10.0.2+ds-2+deb13u1~bpo12+1"}, "capabilities": ["oob"]}}"#;

    #[test]
    fn greeting_parses() {
        let Message::Greeting(g) = parse_message(GREETING.as_bytes()).unwrap() else {
            panic!("not a greeting");
        };
        assert_eq!(
            g.version,
            QemuVersion {
                major: 10,
                minor: 0,
                micro: 2
            }
        );
        assert_eq!(g.version.to_string(), "10.0.2");
        assert_eq!(g.package, "Debian 1:10.0.2+ds-2+deb13u1~bpo12+1");
        assert_eq!(g.capabilities, ["oob"]);
        assert!(parse_message(br#"{"QMP": {"version": {"qemu": {"major": 10}}}}"#).is_err());
        assert!(
            QemuVersion {
                major: 10,
                minor: 0,
                micro: 0
            } > QemuVersion {
                major: 9,
                minor: 2,
                micro: 3
            }
        );
    }

    #[test]
    fn replies_and_errors_parse() {
        assert_eq!(
            parse_message(br#"{"return": {"status": "running", "running": true}, "id": 3}"#)
                .unwrap(),
            Message::Return {
                id: Some(3.into()),
                value: serde_json::json!({"status": "running", "running": true})
            }
        );
        assert_eq!(
            parse_message(br#"{"id": "bogus", "error": {"class": "CommandNotFound", "desc": "The command bogus has not been found"}}"#)
                .unwrap(),
            Message::Error {
                id: Some("bogus".into()),
                class: "CommandNotFound".into(),
                desc: "The command bogus has not been found".into()
            }
        );
        assert!(parse_message(br#"{"error": {"class": "GenericError"}}"#).is_err());
        assert!(parse_message(br#"{"something": 1}"#).is_err());
        assert!(parse_message(b"[1, 2]").is_err());
        assert!(parse_message(b"{\"return\": ").is_err());
    }

    #[test]
    fn events_parse() {
        let Message::Event(e) = parse_message(br#"{"timestamp": {"seconds": 1796115811, "microseconds": 248934}, "event": "MIGRATION", "data": {"status": "setup"}}"#).unwrap() else {
            panic!("not an event");
        };
        assert_eq!(e.name, "MIGRATION");
        assert_eq!(e.data["status"], "setup");
        assert_eq!(e.timestamp, Some((1796115811, 248934)));
        let Message::Event(e) = parse_message(br#"{"event": "STOP"}"#).unwrap() else {
            panic!("not an event");
        };
        assert_eq!((e.data, e.timestamp), (Value::Null, None));
    }

    #[test]
    fn ids_match_only_their_command() {
        assert!(id_matches(Some(&7.into()), 7));
        assert!(!id_matches(Some(&6.into()), 7));
        assert!(!id_matches(Some(&"7".into()), 7));
        assert!(id_matches(None, 7));
    }

    /// A fake QEMU on a socket pair: it sends the greeting, then answers
    /// each request line with what `answer` says (lines, each sent with
    /// `\r\n`), and ends when `answer` returns `None`.
    pub(crate) fn fake_qemu(
        answer: impl Fn(&Value) -> Option<Vec<String>> + Send + 'static,
    ) -> (Qmp, std::thread::JoinHandle<Vec<Value>>) {
        let (a, b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            let mut seen = Vec::new();
            let mut w = b.try_clone().unwrap();
            writeln!(w, "{GREETING}\r").unwrap();
            for line in std::io::BufReader::new(b).lines() {
                let Ok(line) = line else { break };
                let req: Value = serde_json::from_str(&line).unwrap();
                let Some(out) = answer(&req) else {
                    seen.push(req);
                    break;
                };
                seen.push(req);
                for l in out {
                    if w.write_all(format!("{l}\r\n").as_bytes()).is_err() {
                        break;
                    }
                }
            }
            seen
        });
        let mut qmp = Qmp::from_stream(a, Path::new("fake.sock"), Duration::from_secs(5));
        let deadline = Instant::now() + Duration::from_secs(5);
        let Message::Greeting(g) = qmp.read_message(deadline, "greeting").unwrap() else {
            panic!("no greeting");
        };
        qmp.greeting = g;
        qmp.execute("qmp_capabilities", None).unwrap();
        (qmp, server)
    }

    /// `{"return": R, "id": ID}` for request `req`.
    pub(crate) fn ret(req: &Value, r: Value) -> String {
        serde_json::json!({"return": r, "id": req["id"]}).to_string()
    }

    #[test]
    fn commands_events_and_errors_over_a_socket() {
        let (mut qmp, server) = fake_qemu(|req| {
            let cmd = req["execute"].as_str().unwrap_or_default();
            Some(match cmd {
                "qmp_capabilities" => vec![ret(req, serde_json::json!({}))],
                "stop" => vec![
                    // An event before the reply, and a stale reply.
                    r#"{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "STOP"}"#.into(),
                    r#"{"return": {}, "id": 999}"#.into(),
                    ret(req, serde_json::json!({})),
                ],
                "query-status" => vec![ret(
                    req,
                    serde_json::json!({"status": "paused", "running": false}),
                )],
                "quit" => return None,
                _ => vec![serde_json::json!({"id": req["id"], "error": {"class": "CommandNotFound", "desc": format!("The command {cmd} has not been found")}}).to_string()],
            })
        });
        assert_eq!(qmp.greeting().version.major, 10);
        assert_eq!(qmp.execute("stop", None).unwrap(), serde_json::json!({}));
        let status = qmp.execute("query-status", None).unwrap();
        assert_eq!(status["status"], "paused");
        let err = qmp
            .execute("bogus", Some(serde_json::json!({"x": 1})))
            .unwrap_err();
        assert_eq!(err.class(), Some("CommandNotFound"));
        assert_eq!(err.desc(), Some("The command bogus has not been found"));
        assert_eq!(
            err.to_string(),
            "QEMU refused 'bogus': The command bogus has not been found (CommandNotFound)"
        );
        let events = qmp.take_events();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].name, "STOP");
        assert!(qmp.take_events().is_empty());
        // The fake closes on quit: the client sees QEMU go.
        let err = qmp.execute("quit", None).unwrap_err();
        assert!(err.is_closed(), "{err}");
        assert!(matches!(
            qmp.execute("query-status", None),
            Err(QmpError::Broken { .. })
        ));
        let seen = server.join().unwrap();
        let ids: Vec<u64> = seen.iter().map(|r| r["id"].as_u64().unwrap()).collect();
        assert_eq!(ids, [1, 2, 3, 4, 5]);
        assert_eq!(seen[3]["arguments"]["x"], 1);
        assert!(seen[1].get("arguments").is_none());
    }

    #[test]
    fn a_reply_must_come_whole_within_the_deadline() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut qmp = Qmp::from_stream(a, Path::new("slow.sock"), Duration::from_millis(300));
        let writer = std::thread::spawn(move || {
            let mut b = b;
            // A reply trickling in, a byte every 50 ms: each read is quick,
            // the whole is not.
            for byte in br#"{"return": {}, "id": 1}"# {
                if b.write_all(&[*byte]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            b
        });
        let t = Instant::now();
        let err = qmp.execute("query-status", None).unwrap_err();
        assert!(matches!(err, QmpError::Timeout { .. }), "{err}");
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert!(err
            .to_string()
            .contains("no reply to 'query-status' within 300 ms"));
        drop(writer.join());
    }

    #[test]
    fn an_endless_line_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut qmp = Qmp::from_stream(a, Path::new("big.sock"), Duration::from_secs(20));
        let writer = std::thread::spawn(move || {
            let mut b = b;
            let chunk = vec![b' '; 1 << 20];
            for _ in 0..(MAX_MESSAGE >> 20) + 4 {
                if b.write_all(&chunk).is_err() {
                    break;
                }
            }
        });
        let err = qmp.poll_events(Duration::from_secs(20)).unwrap_err();
        assert!(matches!(err, QmpError::TooLong { .. }), "{err}");
        drop(qmp);
        writer.join().unwrap();
    }

    /// A QEMU that quit says SHUTDOWN before it closes; one that was
    /// killed just closes; one that is only slow is not taken for gone.
    #[test]
    fn how_qemu_ended_is_read_to_the_end() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut qmp = Qmp::from_stream(a, Path::new("end.sock"), Duration::from_secs(5));
        writeln!(
            b,
            r#"{{"event": "SHUTDOWN", "data": {{"guest": false, "reason": "host-signal"}}}}"#
        )
        .unwrap();
        drop(b);
        // The failed call that noticed (a write to the closed socket).
        assert!(qmp.execute("query-status", None).is_err());
        assert_eq!(qmp.end_seen(), Some(true));

        let (a, b) = UnixStream::pair().unwrap();
        let mut qmp = Qmp::from_stream(a, Path::new("killed.sock"), Duration::from_secs(5));
        drop(b);
        assert_eq!(qmp.end_seen(), Some(false));

        let (a, _b) = UnixStream::pair().unwrap();
        let mut qmp = Qmp::from_stream(a, Path::new("slow.sock"), Duration::from_secs(5));
        assert_eq!(qmp.end_seen(), None);
    }

    #[test]
    fn events_are_kept_for_wait_event() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut qmp = Qmp::from_stream(a, Path::new("ev.sock"), Duration::from_secs(5));
        let mut w = b;
        for status in ["setup", "active", "completed"] {
            writeln!(
                w,
                r#"{{"event": "MIGRATION", "data": {{"status": "{status}"}}}}"#
            )
            .unwrap();
        }
        writeln!(w, r#"{{"event": "RESUME"}}"#).unwrap();
        let e = qmp
            .wait_event(|e| e.name == "RESUME", Duration::from_secs(2))
            .unwrap()
            .unwrap();
        assert_eq!(e.name, "RESUME");
        let e = qmp
            .wait_event(
                |e| e.name == "MIGRATION" && e.data["status"] == "completed",
                Duration::from_secs(2),
            )
            .unwrap()
            .unwrap();
        assert_eq!(e.data["status"], "completed");
        assert_eq!(qmp.take_events().len(), 2);
        assert!(qmp
            .wait_event(|_| true, Duration::from_millis(50))
            .unwrap()
            .is_none());
        drop(w);
    }

    #[test]
    fn old_events_are_dropped_past_the_cap() {
        let (a, _b) = UnixStream::pair().unwrap();
        let mut qmp = Qmp::from_stream(a, Path::new("ev.sock"), Duration::from_secs(5));
        for i in 0..MAX_EVENTS + 3 {
            qmp.push_event(Event {
                name: format!("E{i}"),
                data: Value::Null,
                timestamp: None,
            });
        }
        assert_eq!(qmp.dropped_events(), 3);
        let events = qmp.take_events();
        assert_eq!(events.len(), MAX_EVENTS);
        assert_eq!(events[0].name, "E3");
    }

    #[test]
    fn no_greeting_says_why() {
        let dir = std::env::temp_dir().join(format!("hagctl-qmp-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("silent.sock");
        let _ = std::fs::remove_file(&path);
        let _listener = UnixListener::bind(&path).unwrap();
        let err = match Qmp::connect(&path, Duration::from_millis(200)) {
            Err(e) => e,
            Ok(_) => panic!("connected to a silent socket"),
        };
        assert!(err.to_string().contains("another client"), "{err}");
        let _ = std::fs::remove_file(&path);
        assert!(matches!(
            Qmp::connect(&path, Duration::from_millis(200)),
            Err(QmpError::Connect { .. })
        ));
        let _ = std::fs::remove_dir(&dir);
    }

    #[test]
    fn a_broken_connection_is_replaced() {
        let dir = std::env::temp_dir().join(format!("hagctl-qmp-reconnect-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vm.qmp");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        // One client at a time, as QEMU: the first connection answers
        // query-status with something that is not QMP; the second, taken
        // only once the first is closed, answers it.
        let server = std::thread::spawn(move || {
            for garbled in [true, false] {
                let (conn, _) = listener.accept().unwrap();
                let mut w = conn.try_clone().unwrap();
                writeln!(w, "{GREETING}\r").unwrap();
                for line in std::io::BufReader::new(conn).lines() {
                    let Ok(line) = line else { break };
                    let req: Value = serde_json::from_str(&line).unwrap();
                    let out = match (req["execute"].as_str(), garbled) {
                        (Some("query-status"), true) => "not json".to_owned(),
                        (Some("query-status"), false) => ret(
                            &req,
                            serde_json::json!({"status": "running", "running": true}),
                        ),
                        _ => ret(&req, serde_json::json!({})),
                    };
                    writeln!(w, "{out}\r").unwrap();
                }
            }
        });
        let mut qmp = Qmp::connect(&path, Duration::from_secs(5)).unwrap();
        let err = qmp.execute("query-status", None).unwrap_err();
        assert!(matches!(err, QmpError::Protocol { .. }), "{err}");
        assert!(qmp.is_broken());
        assert!(matches!(
            qmp.execute("query-status", None),
            Err(QmpError::Broken { .. })
        ));
        qmp.reconnect().unwrap();
        assert!(!qmp.is_broken());
        let status = qmp.execute("query-status", None).unwrap();
        assert_eq!(status["status"], "running");
        drop(qmp);
        server.join().unwrap();
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_dir(&dir);
    }
}
