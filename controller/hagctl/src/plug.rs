//! The output gate: Linux's `sch_plug` qdisc on a network interface, driven
//! over rtnetlink, so that a protected VM's network output leaves only once
//! the epoch that produced it is acknowledged by the backup (Remus's output
//! commit).
//!
//! [`Plug::attach`] replaces the interface's root qdisc with a plug (handle
//! [`HANDLE`], `4847:`), which holds every packet from that moment.
//! [`Plug::buffer`] marks an epoch boundary: what was queued so far is the
//! epoch to release next. [`Plug::release_one`] lets that epoch out (when
//! its checkpoint is acknowledged). [`Plug::release_indefinite`] turns the
//! gate into a pass-through, [`Plug::detach`] deletes it (the kernel puts
//! the interface's default qdisc back). [`Plug::stats`] reads the qdisc's
//! counters (held packets and bytes, drops, what was sent).
//!
//! ```ignore
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let mut gate = Plug::attach("ifb0")?; // holds from here
//! // ... the VM runs epoch 1; pause it, take checkpoint 1, then:
//! gate.buffer()?; // epoch 1's packets are the ones to release next
//! // ... resume; epoch 2 runs while checkpoint 1 is sent; on its ack:
//! gate.release_one()?; // epoch 1's packets go out, epoch 2's stay
//! # Ok(()) }
//! ```
//!
//! # What the kernel does (net/sched/sch_plug.c)
//!
//! The qdisc is one FIFO and three counters of packets: `current` (queued
//! since the last `TCQ_PLUG_BUFFER`), `last` (the epoch closed by that
//! buffer) and `to_release` (packets at the head the dequeue may still let
//! out). Enqueue counts into `current`; dequeue hands out packets only while
//! `to_release` is non-zero.
//!
//! - Creation holds everything: a new plug is throttled and counts into
//!   `current`, so every packet from the moment [`Plug::attach`] returns is
//!   held, ARP and neighbour probes included (they leave by the same
//!   qdisc).
//! - `TCQ_PLUG_BUFFER` sets `last = current` and `current = 0`. It does not
//!   add: **only two epochs are counted**. Buffering a second time before
//!   the first buffered epoch is released overwrites its count; its packets
//!   stay at the head of the FIFO, and the next `TCQ_PLUG_RELEASE_ONE`
//!   releases the newer epoch's *count* of packets from the head, which is
//!   the older epoch's packets and, if the newer epoch was larger, some of
//!   the newer one's: output of an epoch not yet acknowledged could leave.
//!   [`Plug`] therefore refuses a [`Plug::buffer`] while an epoch is
//!   buffered and unreleased ([`PlugError::EpochPending`]) and sends
//!   nothing; a caller that must move on without an acknowledgement simply
//!   does not mark the boundary, so the next epoch's packets join the
//!   current one and leave with it, later but never early.
//! - `TCQ_PLUG_RELEASE_ONE` adds `last` to `to_release`, zeroes `last` and
//!   reschedules the queue; the packets leave asynchronously, soon after the
//!   call returns. With no buffered epoch it releases nothing.
//! - `TCQ_PLUG_RELEASE_INDEFINITE` zeroes all three counters and lets
//!   everything through, held packets and new ones alike, until the next
//!   `TCQ_PLUG_BUFFER`, which starts holding again (and closes no epoch:
//!   nothing was counted while it passed).
//! - The limit is in **bytes** of queued packets (`skb->len`), set at
//!   creation ([`DEFAULT_LIMIT`] unless [`Plug::attach_with_limit`]) or by
//!   `TCQ_PLUG_LIMIT` ([`Plug::set_limit`]); a packet that does not fit is
//!   dropped (counted in [`Stats::drops`]), as a full link drops it: TCP
//!   retransmits, a UDP datagram is lost. (The kernel's own default,
//!   `tx_queue_len * mtu`, is 0 on `lo`, so the limit is always given.)
//! - The qdisc has no dump of its own: the kernel does not tell the epoch
//!   counts, only the generic queue statistics.
//!
//! # Failure
//!
//! If hagctl dies, the qdisc stays on the interface and holds everything,
//! which is safe for output commit: nothing unacknowledged leaves. A later
//! [`Plug::attach`] on the same interface deletes such a leftover plug
//! first, which *drops* what it held (never releases it), then attaches a
//! fresh one. [`Plug::detach`] also drops what is still held; call
//! [`Plug::release_indefinite`] first to let it drain. Dropping a [`Plug`]
//! value does nothing to the qdisc.
//!
//! Every error names the interface, the step and, for a refusal, the
//! kernel's errno and its extended-ack message ("Specified qdisc kind is
//! unknown" when the kernel has no `sch_plug`, [`PlugError::Unsupported`]).
//!
//! # Where to put it
//!
//! A qdisc holds an interface's *egress*. On a VM's tap device, egress is
//! the direction towards the guest; what the guest sends arrives as the
//! tap's ingress. To hold a guest's output, plug the interface it leaves
//! the host by (a bridge's uplink that carries only VM traffic), or, as
//! Xen's Remus does, redirect the tap's ingress to an `ifb` device
//! (`tc filter ... action mirred egress redirect dev ifb0`) and plug that.
//! The boundary must be marked while the VM is paused, after its state for
//! the epoch is taken, so that the packets before it are exactly the
//! epoch's.

// Until `hagctl checkpoint --qmp` drives it, only the tests and the
// `plug_gate` example use the gate, each a part of it.
#![allow(dead_code)]

#[path = "plug/selfcheck.rs"]
pub mod selfcheck;

use std::fmt;
use std::io;
use std::os::fd::AsFd;

use netlink_packet_core::{
    DefaultNla, NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_ECHO,
    NLM_F_REPLACE, NLM_F_REQUEST,
};
use netlink_packet_route::tc::{TcAttribute, TcHandle, TcHeader, TcMessage, TcStats2};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

/// The handle of hag's plug, `4847:` ("HG"), so that hag finds its own
/// gate again (a leftover of a hagctl that died) and never changes a qdisc
/// it did not make.
pub const HANDLE: u32 = 0x4847_0000;

/// Bytes of packets a plug holds before it drops (16 MiB: an epoch of 2 s
/// at 64 Mbit/s).
pub const DEFAULT_LIMIT: u32 = 16 << 20;

/// The qdisc's name in the kernel (`TCA_KIND`).
pub const KIND: &str = "plug";

/// `TCA_OPTIONS`: for sch_plug a bare `struct tc_plug_qopt`, not nested
/// attributes.
const TCA_OPTIONS: u16 = 2;

/// `NLMSGERR_ATTR_MSG`: the extended ack's message.
const NLMSGERR_ATTR_MSG: u16 = 1;

/// How long to wait for the kernel's answer (it answers within the send;
/// this only bounds a kernel that does not).
const ANSWER_TIMEOUT_MS: u16 = 5000;

/// `tc_plug_qopt.action` (include/uapi/linux/pkt_sched.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `TCQ_PLUG_BUFFER`: close the current epoch, start the next.
    Buffer = 0,
    /// `TCQ_PLUG_RELEASE_ONE`: release the closed epoch.
    ReleaseOne = 1,
    /// `TCQ_PLUG_RELEASE_INDEFINITE`: let everything through.
    ReleaseIndefinite = 2,
    /// `TCQ_PLUG_LIMIT`: set the limit in bytes.
    Limit = 3,
}

/// `struct tc_plug_qopt { int action; __u32 limit; }` in host byte order.
pub fn qopt(action: Action, limit: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&(action as i32).to_ne_bytes());
    b[4..].copy_from_slice(&limit.to_ne_bytes());
    b
}

/// What a plug operation was doing when it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Reading the root qdisc before replacing it.
    ReadRoot,
    /// Deleting a plug a previous hagctl left.
    RemoveLeftover,
    /// Replacing the root qdisc with a plug.
    Attach,
    /// `TCQ_PLUG_BUFFER`.
    Buffer,
    /// `TCQ_PLUG_RELEASE_ONE`.
    ReleaseOne,
    /// `TCQ_PLUG_RELEASE_INDEFINITE`.
    ReleaseIndefinite,
    /// `TCQ_PLUG_LIMIT`.
    SetLimit,
    /// Reading the plug's counters.
    Stats,
    /// Deleting the plug.
    Detach,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::ReadRoot => "reading the root qdisc",
            Step::RemoveLeftover => "deleting the plug a previous hagctl left",
            Step::Attach => "replacing the root qdisc with a plug",
            Step::Buffer => "marking an epoch boundary (TCQ_PLUG_BUFFER)",
            Step::ReleaseOne => "releasing the buffered epoch (TCQ_PLUG_RELEASE_ONE)",
            Step::ReleaseIndefinite => "releasing everything (TCQ_PLUG_RELEASE_INDEFINITE)",
            Step::SetLimit => "setting the plug's limit (TCQ_PLUG_LIMIT)",
            Step::Stats => "reading the plug's counters",
            Step::Detach => "deleting the plug",
        })
    }
}

/// What went wrong talking to rtnetlink.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// The kernel refused the request.
    #[error("the kernel refused: {}{}", io::Error::from_raw_os_error(*.errno), match .message { Some(m) => format!(": {m}"), None => String::new() })]
    Refused {
        /// The errno (positive).
        errno: i32,
        /// The extended ack's message, if the kernel gave one.
        message: Option<String>,
    },
    /// Sending or receiving failed.
    #[error("rtnetlink I/O")]
    Io(#[source] io::Error),
    /// No answer within the timeout.
    #[error("no answer from the kernel within {ANSWER_TIMEOUT_MS} ms")]
    NoAnswer,
    /// The answer could not be read.
    #[error("malformed answer: {0}")]
    Malformed(String),
}

/// A plug operation's failure; each names the interface.
#[derive(Debug, thiserror::Error)]
pub enum PlugError {
    /// The interface does not exist.
    #[error("no network interface '{ifname}'")]
    NoInterface {
        /// The name asked for.
        ifname: String,
        /// `if_nametoindex`'s error.
        #[source]
        source: nix::Error,
    },
    /// An rtnetlink socket could not be opened.
    #[error("{ifname}: cannot open an rtnetlink socket")]
    Socket {
        /// The interface.
        ifname: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The kernel has no `plug` qdisc.
    #[error("{ifname}: {step}: the kernel has no plug qdisc (sch_plug, CONFIG_NET_SCH_PLUG){}", match .message { Some(m) => format!(": {m}"), None => String::new() })]
    Unsupported {
        /// The interface.
        ifname: String,
        /// The step ([`Step::Attach`]).
        step: Step,
        /// The kernel's extended-ack message.
        message: Option<String>,
    },
    /// An epoch is buffered and not released: a second buffer would
    /// overwrite its count (see the module docs); nothing was sent.
    #[error("{ifname}: an epoch is already buffered and not released; sch_plug counts only one, so a second boundary would let unacknowledged packets out with its release (release it first, or leave this boundary unmarked)")]
    EpochPending {
        /// The interface.
        ifname: String,
    },
    /// A request failed.
    #[error("{ifname}: {step}")]
    Netlink {
        /// The interface.
        ifname: String,
        /// What was being done.
        step: Step,
        /// What went wrong.
        #[source]
        source: NetlinkError,
    },
}

/// `e` and its causes on one line, `: `-separated.
pub fn describe(e: &PlugError) -> String {
    let mut s = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// A plug's counters (the kernel's generic qdisc statistics).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stats {
    /// The root qdisc's kind (`plug` for hag's).
    pub kind: String,
    /// Its handle.
    pub handle: u32,
    /// Packets queued (held, or released and not yet sent).
    pub backlog_packets: u32,
    /// Bytes queued.
    pub backlog_bytes: u32,
    /// Packets dropped (the limit was reached).
    pub drops: u32,
    /// Bytes the qdisc has let out since it was attached.
    pub sent_bytes: u64,
    /// Packets the qdisc has let out since it was attached.
    pub sent_packets: u32,
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "backlog={}p/{}b drops={} sent={}p/{}b",
            self.backlog_packets,
            self.backlog_bytes,
            self.drops,
            self.sent_packets,
            self.sent_bytes
        )
    }
}

/// Where the gate is in sch_plug's model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Holding; `pending`: an epoch is buffered and not yet released.
    Holding {
        /// A `TCQ_PLUG_BUFFER` was sent with no `TCQ_PLUG_RELEASE_ONE` since.
        pending: bool,
    },
    /// Letting everything through (after `release_indefinite`).
    PassThrough,
}

impl State {
    /// The state after `action`, or `None` if the action must not be sent
    /// (a second buffer while one is pending).
    pub fn after(self, action: Action) -> Option<State> {
        match (self, action) {
            (State::Holding { pending: true }, Action::Buffer) => None,
            (_, Action::Buffer) => Some(State::Holding {
                pending: self != State::PassThrough,
            }),
            (State::Holding { .. }, Action::ReleaseOne) => Some(State::Holding { pending: false }),
            (State::PassThrough, Action::ReleaseOne) => Some(State::PassThrough),
            (_, Action::ReleaseIndefinite) => Some(State::PassThrough),
            (s, Action::Limit) => Some(s),
        }
    }
}

/// hag's plug on one interface. Not `Clone`: one owner marks the epochs.
pub struct Plug {
    ifname: String,
    ifindex: u32,
    rtnl: Rtnl,
    state: State,
}

impl fmt::Debug for Plug {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plug")
            .field("ifname", &self.ifname)
            .field("ifindex", &self.ifindex)
            .field("state", &self.state)
            .finish()
    }
}

impl Plug {
    /// Replaces `ifname`'s root qdisc with a plug holding up to
    /// [`DEFAULT_LIMIT`] bytes; everything sent from now on is held.
    pub fn attach(ifname: &str) -> Result<Plug, PlugError> {
        Self::attach_with_limit(ifname, DEFAULT_LIMIT)
    }

    /// [`Plug::attach`] with a limit of `limit` bytes. A plug of hag's that
    /// is already there (a hagctl that died) is deleted first: what it held
    /// is dropped, not released.
    pub fn attach_with_limit(ifname: &str, limit: u32) -> Result<Plug, PlugError> {
        let ifindex =
            nix::net::if_::if_nametoindex(ifname).map_err(|source| PlugError::NoInterface {
                ifname: ifname.to_string(),
                source,
            })?;
        let rtnl = Rtnl::open().map_err(|source| PlugError::Socket {
            ifname: ifname.to_string(),
            source,
        })?;
        let mut plug = Plug {
            ifname: ifname.to_string(),
            ifindex,
            rtnl,
            state: State::Holding { pending: false },
        };
        let root = plug.root(0, Step::ReadRoot)?;
        if root.as_ref().is_some_and(|s| s.handle == HANDLE) {
            plug.request(Request::Delete { only_plug: false }, Step::RemoveLeftover)?;
        }
        match plug.request(Request::Create { limit }, Step::Attach) {
            Err(PlugError::Netlink {
                source:
                    NetlinkError::Refused {
                        errno: libc_enoent,
                        message,
                    },
                ..
            }) if libc_enoent == nix::libc::ENOENT => Err(PlugError::Unsupported {
                ifname: ifname.to_string(),
                step: Step::Attach,
                message,
            }),
            Err(e) => Err(e),
            Ok(_) => Ok(plug),
        }
    }

    /// The interface's name.
    pub fn ifname(&self) -> &str {
        &self.ifname
    }

    /// Where the gate is.
    pub fn state(&self) -> State {
        self.state
    }

    /// An epoch is buffered and not yet released.
    pub fn pending(&self) -> bool {
        self.state == State::Holding { pending: true }
    }

    /// An epoch boundary (`TCQ_PLUG_BUFFER`): what was queued since the
    /// last boundary (or since attach) is the epoch [`Plug::release_one`]
    /// releases. Refused with [`PlugError::EpochPending`], sending nothing,
    /// while a buffered epoch is not yet released. After
    /// [`Plug::release_indefinite`] it starts holding again.
    pub fn buffer(&mut self) -> Result<(), PlugError> {
        self.act(Action::Buffer, Step::Buffer)
    }

    /// `TCQ_PLUG_RELEASE_ONE`: the buffered epoch's packets leave (soon
    /// after this returns); the current epoch's stay. With no buffered
    /// epoch it releases nothing.
    pub fn release_one(&mut self) -> Result<(), PlugError> {
        self.act(Action::ReleaseOne, Step::ReleaseOne)
    }

    /// `TCQ_PLUG_RELEASE_INDEFINITE`: everything held leaves and the gate
    /// lets everything through until the next [`Plug::buffer`].
    pub fn release_indefinite(&mut self) -> Result<(), PlugError> {
        self.act(Action::ReleaseIndefinite, Step::ReleaseIndefinite)
    }

    /// `TCQ_PLUG_LIMIT`: hold up to `limit` bytes from now on.
    pub fn set_limit(&mut self, limit: u32) -> Result<(), PlugError> {
        self.request(Request::Change(Action::Limit, limit), Step::SetLimit)?;
        Ok(())
    }

    /// The plug's counters.
    pub fn stats(&mut self) -> Result<Stats, PlugError> {
        match self.root(HANDLE, Step::Stats)? {
            Some(s) => Ok(s),
            None => Err(self.err(
                Step::Stats,
                NetlinkError::Malformed("the kernel sent no qdisc".to_string()),
            )),
        }
    }

    /// Deletes the plug; the kernel puts the interface's default qdisc
    /// back. What is still held is dropped.
    pub fn detach(mut self) -> Result<(), PlugError> {
        self.request(Request::Delete { only_plug: true }, Step::Detach)?;
        Ok(())
    }

    fn act(&mut self, action: Action, step: Step) -> Result<(), PlugError> {
        let Some(next) = self.state.after(action) else {
            return Err(PlugError::EpochPending {
                ifname: self.ifname.clone(),
            });
        };
        self.request(Request::Change(action, 0), step)?;
        self.state = next;
        Ok(())
    }

    /// The root qdisc (`handle` 0: whatever it is; else only if it has that
    /// handle); `None` if the kernel reports none (a built-in `noqueue`
    /// may go unreported).
    fn root(&mut self, handle: u32, step: Step) -> Result<Option<Stats>, PlugError> {
        let replies = self.request(Request::Get { handle }, step)?;
        for reply in replies {
            if let RouteNetlinkMessage::NewQueueDiscipline(msg) = reply {
                return Ok(Some(stats_of(&msg)));
            }
        }
        Ok(None)
    }

    fn request(
        &mut self,
        request: Request,
        step: Step,
    ) -> Result<Vec<RouteNetlinkMessage>, PlugError> {
        let ifindex = self.ifindex;
        self.rtnl
            .exchange(|seq| encode(request, ifindex, seq))
            .map_err(|e| self.err(step, e))
    }

    fn err(&self, step: Step, source: NetlinkError) -> PlugError {
        PlugError::Netlink {
            ifname: self.ifname.clone(),
            step,
            source,
        }
    }
}

/// One rtnetlink request about the root qdisc of an interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// `RTM_NEWQDISC`, create and replace: a plug holding `limit` bytes.
    Create {
        /// Bytes.
        limit: u32,
    },
    /// `RTM_NEWQDISC` without create: change hag's plug.
    Change(Action, u32),
    /// `RTM_GETQDISC` of the root (handle 0: whichever), with `NLM_F_ECHO`:
    /// without it a kernel sends the answer only to the `RTNLGRP_TC`
    /// group, not back to the asker.
    Get {
        /// The handle it must have, or 0.
        handle: u32,
    },
    /// `RTM_DELQDISC` of the root with hag's handle; `only_plug`: only if
    /// it is a plug (a leftover is deleted whatever its kind).
    Delete {
        /// Name the kind, so the kernel refuses another.
        only_plug: bool,
    },
}

/// The netlink message for `request` on interface `ifindex`, sequence `seq`.
pub fn encode(request: Request, ifindex: u32, seq: u32) -> Vec<u8> {
    let header = TcHeader {
        index: ifindex as i32,
        handle: match request {
            Request::Get { handle } => handle.into(),
            _ => HANDLE.into(),
        },
        parent: TcHandle::ROOT,
        ..Default::default()
    };
    let kind = TcAttribute::Kind(KIND.to_string());
    let options = |action, limit| {
        TcAttribute::Other(DefaultNla::new(TCA_OPTIONS, qopt(action, limit).to_vec()))
    };
    let (payload, flags) = match request {
        Request::Create { limit } => (
            RouteNetlinkMessage::NewQueueDiscipline(TcMessage::from_parts(
                header,
                vec![kind, options(Action::Limit, limit)],
            )),
            NLM_F_CREATE | NLM_F_REPLACE,
        ),
        Request::Change(action, limit) => (
            RouteNetlinkMessage::NewQueueDiscipline(TcMessage::from_parts(
                header,
                vec![kind, options(action, limit)],
            )),
            0,
        ),
        Request::Get { .. } => (
            RouteNetlinkMessage::GetQueueDiscipline(TcMessage::from_parts(header, vec![])),
            NLM_F_ECHO,
        ),
        Request::Delete { only_plug } => (
            RouteNetlinkMessage::DelQueueDiscipline(TcMessage::from_parts(
                header,
                if only_plug { vec![kind] } else { vec![] },
            )),
            0,
        ),
    };
    let mut nl_header = NetlinkHeader::default();
    nl_header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
    nl_header.sequence_number = seq;
    let mut msg = NetlinkMessage::new(nl_header, NetlinkPayload::InnerMessage(payload));
    msg.finalize();
    let mut bytes = vec![0; msg.buffer_len()];
    msg.serialize(&mut bytes);
    bytes
}

/// The counters in a qdisc message.
fn stats_of(msg: &TcMessage) -> Stats {
    let mut s = Stats {
        handle: msg.header.handle.into(),
        ..Default::default()
    };
    for attr in &msg.attributes {
        match attr {
            TcAttribute::Kind(k) => s.kind = k.clone(),
            TcAttribute::Stats2(v) => {
                for st in v {
                    match st {
                        TcStats2::Queue(q) => {
                            s.backlog_packets = q.qlen;
                            s.backlog_bytes = q.backlog;
                            s.drops = q.drops;
                        }
                        TcStats2::Basic(b) => {
                            s.sent_bytes = b.bytes;
                            s.sent_packets = b.packets;
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    s
}

/// The extended ack's message in an `NLMSG_ERROR` payload after the errno,
/// with `NETLINK_CAP_ACK` on (the request echoed as its 16-byte header
/// only, then attributes).
pub fn ext_ack_message(after_errno: &[u8]) -> Option<String> {
    let mut rest = after_errno.get(16..)?;
    while let Some(h) = rest.first_chunk::<4>() {
        let len = usize::from(u16::from_ne_bytes([h[0], h[1]]));
        let kind = u16::from_ne_bytes([h[2], h[3]]) & 0x3fff;
        if len < 4 || len > rest.len() {
            return None;
        }
        if kind == NLMSGERR_ATTR_MSG {
            let value = &rest[4..len];
            let end = value.iter().position(|&b| b == 0).unwrap_or(value.len());
            return Some(String::from_utf8_lossy(&value[..end]).into_owned());
        }
        rest = rest.get((len + 3) & !3..).unwrap_or_default();
    }
    None
}

/// An rtnetlink socket that asks and waits for the answer.
pub struct Rtnl {
    socket: Socket,
    seq: u32,
}

impl Rtnl {
    /// Opens a socket with extended acks and capped echoes.
    pub fn open() -> io::Result<Rtnl> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.set_ext_ack(true)?;
        socket.set_cap_ack(true)?;
        Ok(Rtnl { socket, seq: 0 })
    }

    /// Sends the message `encode(seq)` makes and collects the replies of
    /// that sequence until its ack.
    pub fn exchange(
        &mut self,
        encode: impl FnOnce(u32) -> Vec<u8>,
    ) -> Result<Vec<RouteNetlinkMessage>, NetlinkError> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let bytes = encode(seq);
        self.socket
            .send_to(&bytes, &SocketAddr::new(0, 0), 0)
            .map_err(NetlinkError::Io)?;
        let mut replies = Vec::new();
        loop {
            let mut fds = [PollFd::new(self.socket.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::from(ANSWER_TIMEOUT_MS)) {
                Ok(0) => return Err(NetlinkError::NoAnswer),
                Ok(_) => {}
                Err(nix::Error::EINTR) => continue,
                Err(e) => return Err(NetlinkError::Io(e.into())),
            }
            let (datagram, _) = self.socket.recv_from_full().map_err(NetlinkError::Io)?;
            let mut offset = 0;
            while offset < datagram.len() {
                let rest = &datagram[offset..];
                let len = rest
                    .first_chunk::<4>()
                    .map(|h| u32::from_ne_bytes(*h) as usize)
                    .filter(|&l| l >= 16 && l <= rest.len())
                    .ok_or_else(|| {
                        NetlinkError::Malformed(format!(
                            "message at byte {offset} of a {}-byte datagram has a bad length",
                            datagram.len()
                        ))
                    })?;
                offset += (len + 3) & !3;
                let one = &rest[..len];
                let message_seq = u32::from_ne_bytes([one[8], one[9], one[10], one[11]]);
                if message_seq != seq {
                    continue;
                }
                let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(one)
                    .map_err(|e| NetlinkError::Malformed(e.to_string()))?;
                match msg.payload {
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(replies),
                            Some(code) => Err(NetlinkError::Refused {
                                errno: code.get().saturating_neg(),
                                message: ext_ack_message(&e.header),
                            }),
                        };
                    }
                    NetlinkPayload::Done(_) => return Ok(replies),
                    NetlinkPayload::InnerMessage(m) => replies.push(m),
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_route::tc::{TcStatsBasic, TcStatsQueue};

    #[test]
    fn qopt_is_action_then_limit() {
        assert_eq!(qopt(Action::Buffer, 0), [0; 8]);
        let b = qopt(Action::Limit, 0x0102_0304);
        assert_eq!(i32::from_ne_bytes(b[..4].try_into().unwrap()), 3);
        assert_eq!(u32::from_ne_bytes(b[4..].try_into().unwrap()), 0x0102_0304);
        assert_eq!(Action::ReleaseOne as i32, 1);
        assert_eq!(Action::ReleaseIndefinite as i32, 2);
    }

    /// The create request byte for byte: nlmsghdr, tcmsg, TCA_KIND
    /// "plug\0" padded, TCA_OPTIONS with a bare tc_plug_qopt.
    #[test]
    fn create_request_bytes() {
        let b = encode(Request::Create { limit: 65536 }, 7, 42);
        let u16_at = |o: usize| u16::from_ne_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().unwrap());
        assert_eq!(b.len(), 16 + 20 + 12 + 12);
        assert_eq!(u32_at(0) as usize, b.len());
        assert_eq!(u16_at(4), 36, "RTM_NEWQDISC");
        assert_eq!(
            u16_at(6),
            0x1 | 0x4 | 0x400 | 0x100,
            "REQUEST|ACK|CREATE|REPLACE"
        );
        assert_eq!(u32_at(8), 42);
        // tcmsg: family, pad, ifindex, handle, parent, info.
        assert_eq!(&b[16..20], &[0, 0, 0, 0]);
        assert_eq!(u32_at(20), 7);
        assert_eq!(u32_at(24), 0x4847_0000);
        assert_eq!(u32_at(28), 0xffff_ffff, "TC_H_ROOT");
        assert_eq!(u32_at(32), 0);
        // TCA_KIND (1), length 4 + 5, padded to 12.
        assert_eq!((u16_at(36), u16_at(38)), (9, 1));
        assert_eq!(&b[40..48], b"plug\0\0\0\0");
        // TCA_OPTIONS (2), length 4 + 8.
        assert_eq!((u16_at(48), u16_at(50)), (12, 2));
        assert_eq!(&b[52..60], &qopt(Action::Limit, 65536));
    }

    #[test]
    fn change_get_and_delete_requests() {
        let b = encode(Request::Change(Action::ReleaseOne, 0), 3, 1);
        assert_eq!(u16::from_ne_bytes([b[4], b[5]]), 36);
        assert_eq!(u16::from_ne_bytes([b[6], b[7]]), 0x5, "no CREATE: a change");
        assert_eq!(&b[52..60], &qopt(Action::ReleaseOne, 0));
        let g = encode(Request::Get { handle: 0 }, 3, 2);
        assert_eq!(g.len(), 36);
        assert_eq!(u16::from_ne_bytes([g[4], g[5]]), 38, "RTM_GETQDISC");
        assert_eq!(u32::from_ne_bytes(g[24..28].try_into().unwrap()), 0);
        let d = encode(Request::Delete { only_plug: true }, 3, 3);
        assert_eq!(u16::from_ne_bytes([d[4], d[5]]), 37, "RTM_DELQDISC");
        assert_eq!(u32::from_ne_bytes(d[24..28].try_into().unwrap()), HANDLE);
        assert_eq!(&d[40..44], b"plug", "only hag's plug is deleted");
        let leftover = encode(Request::Delete { only_plug: false }, 3, 4);
        assert_eq!(
            leftover.len(),
            36,
            "a leftover is deleted whatever its kind"
        );
        assert_eq!(
            u16::from_ne_bytes([g[6], g[7]]),
            0x1 | 0x4 | 0x8,
            "GET asks for an echo, or the answer goes only to RTNLGRP_TC"
        );
    }

    #[test]
    fn a_second_boundary_before_the_release_is_refused() {
        let s = State::Holding { pending: false };
        let s = s.after(Action::Buffer).unwrap();
        assert_eq!(s, State::Holding { pending: true });
        assert_eq!(s.after(Action::Buffer), None);
        assert_eq!(s.after(Action::Limit), Some(s));
        let s = s.after(Action::ReleaseOne).unwrap();
        assert_eq!(s, State::Holding { pending: false });
        assert_eq!(s.after(Action::ReleaseOne), Some(s), "nothing to release");
        let p = s.after(Action::ReleaseIndefinite).unwrap();
        assert_eq!(p, State::PassThrough);
        // After pass-through a boundary starts holding and closes nothing.
        assert_eq!(
            p.after(Action::Buffer),
            Some(State::Holding { pending: false })
        );
        assert_eq!(
            State::Holding { pending: true }.after(Action::ReleaseIndefinite),
            Some(State::PassThrough)
        );
    }

    #[test]
    fn the_extended_ack_message_is_read() {
        let mut p = vec![0u8; 16]; // the echoed request header
        let msg = b"Specified qdisc kind is unknown\0";
        p.extend_from_slice(&((4 + msg.len()) as u16).to_ne_bytes());
        p.extend_from_slice(&1u16.to_ne_bytes());
        p.extend_from_slice(msg);
        p.resize((p.len() + 3) & !3, 0);
        assert_eq!(
            ext_ack_message(&p).as_deref(),
            Some("Specified qdisc kind is unknown")
        );
        assert_eq!(ext_ack_message(&p[..16]), None);
        assert_eq!(ext_ack_message(&p[..10]), None);
        let mut bad = p.clone();
        bad[16] = 0xff; // length past the end
        assert_eq!(ext_ack_message(&bad), None);
    }

    #[test]
    fn counters_come_from_stats2() {
        let mut basic = TcStatsBasic::default();
        (basic.bytes, basic.packets) = (1234, 5);
        let mut queue = TcStatsQueue::default();
        (queue.qlen, queue.backlog, queue.drops) = (3, 300, 1);
        let msg = TcMessage::from_parts(
            TcHeader {
                handle: HANDLE.into(),
                ..Default::default()
            },
            vec![
                TcAttribute::Kind("plug".into()),
                TcAttribute::Stats2(vec![TcStats2::Basic(basic), TcStats2::Queue(queue)]),
            ],
        );
        let s = stats_of(&msg);
        assert_eq!(
            s,
            Stats {
                kind: "plug".into(),
                handle: HANDLE,
                backlog_packets: 3,
                backlog_bytes: 300,
                drops: 1,
                sent_bytes: 1234,
                sent_packets: 5,
            }
        );
        assert_eq!(s.to_string(), "backlog=3p/300b drops=1 sent=5p/1234b");
    }

    #[test]
    fn errors_name_the_interface_and_the_kernel_message() {
        let e = PlugError::Netlink {
            ifname: "eth0".into(),
            step: Step::ReleaseOne,
            source: NetlinkError::Refused {
                errno: 22,
                message: Some("Invalid handle".into()),
            },
        };
        let chain = format!("{e}: {}", std::error::Error::source(&e).unwrap());
        assert_eq!(
            chain,
            "eth0: releasing the buffered epoch (TCQ_PLUG_RELEASE_ONE): the kernel refused: \
             Invalid argument (os error 22): Invalid handle"
        );
        assert!(PlugError::EpochPending {
            ifname: "tap0".into()
        }
        .to_string()
        .starts_with("tap0: an epoch is already buffered"));
        let e = Plug::attach("no-such-if0").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("no network interface 'no-such-if0'"),
            "{e}"
        );
    }

    /// The gate on a real interface: `lo` of a fresh network namespace
    /// (root only; skipped where the kernel has no sch_plug).
    #[test]
    fn plug_holds_loopback_until_released() {
        match selfcheck::on_loopback() {
            Ok(selfcheck::Outcome::Passed(lines)) => {
                for l in lines {
                    eprintln!("plug selfcheck: {l}");
                }
            }
            Ok(selfcheck::Outcome::Skipped(why)) => eprintln!("SKIPPED plug on loopback: {why}"),
            Err(e) => panic!("plug on loopback: {e}"),
        }
    }
}
