//! The `hag` generic netlink family: find it, join its events group, and turn
//! what arrives into [`Event`]s.
//!
//! Bytes from the socket are parsed by hand ([`parse_datagram`],
//! [`parse_event`]) so that every way a message can be malformed has its own
//! [`ParseError`] naming the offset and the numbers involved, and no input
//! can make the parser panic. The nlctrl answer is parsed with the same
//! attribute walker, which skips attributes it does not know: newer kernels
//! add some.

use std::io;
use std::os::fd::AsFd;
use std::time::Duration;

use hag_abi::abi;
use netlink_packet_core::{NetlinkMessage, NLA_TYPE_MASK, NLMSG_ERROR, NLM_F_REQUEST};
use netlink_packet_generic::constants::{
    CTRL_ATTR_FAMILY_ID, CTRL_ATTR_MCAST_GROUPS, CTRL_ATTR_MCAST_GRP_ID, CTRL_ATTR_MCAST_GRP_NAME,
    CTRL_ATTR_VERSION, GENL_HDRLEN, GENL_ID_CTRL,
};
use netlink_packet_generic::ctrl::nlas::GenlCtrlAttrs;
use netlink_packet_generic::ctrl::{GenlCtrl, GenlCtrlCmd};
use netlink_packet_generic::GenlMessage;
use netlink_sys::{protocols::NETLINK_GENERIC, Socket};
use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use hag_dev::AbiMismatch;

/// One event from the module, as `hagctl events` prints it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// One of `abi::EVENT_*` (unknown values are kept, not refused).
    pub kind: u32,
    /// The vGPU the event is about.
    pub vgpu_id: Option<u32>,
    /// That vGPU's UUID.
    pub uuid: Option<[u8; 16]>,
    /// `ktime_get_ns()` in the kernel when it happened.
    pub timestamp_ns: Option<u64>,
    /// A human-readable detail.
    pub message: Option<String>,
}

/// What is wrong with bytes that claimed to be netlink messages.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    /// Fewer bytes left than a `nlmsghdr`.
    #[error("netlink message at byte {offset} is cut short: {remaining} bytes left, its header needs {NLMSG_HDRLEN}")]
    MessageHeaderTruncated {
        /// Where the message starts in the datagram.
        offset: usize,
        /// Bytes left from there.
        remaining: usize,
    },
    /// `nlmsg_len` is smaller than the header or runs past the datagram.
    #[error("netlink message at byte {offset} has length {len}, but {remaining} bytes are left and its header needs {NLMSG_HDRLEN}")]
    MessageLength {
        /// Where the message starts in the datagram.
        offset: usize,
        /// Its `nlmsg_len`.
        len: usize,
        /// Bytes left from there.
        remaining: usize,
    },
    /// Fewer bytes than a `genlmsghdr`.
    #[error("generic netlink payload is {len} bytes, shorter than its {GENL_HDRLEN}-byte header")]
    GenlHeaderTruncated {
        /// The payload's length.
        len: usize,
    },
    /// The genetlink command is not `CMD_EVENT`.
    #[error(
        "generic netlink command {cmd} is not an event (CMD_EVENT is {})",
        abi::CMD_EVENT
    )]
    WrongCommand {
        /// The command found.
        cmd: u8,
    },
    /// The genetlink header's version is not this build's.
    #[error(
        "generic netlink version {version} is not this hagctl's ({})",
        abi::GENL_VERSION
    )]
    WrongVersion {
        /// The version found.
        version: u8,
    },
    /// Fewer bytes left than an attribute header.
    #[error("attribute at byte {offset} is cut short: {remaining} bytes left, its header needs {NLA_HDRLEN}")]
    AttrHeaderTruncated {
        /// Where the attribute starts in the attribute area.
        offset: usize,
        /// Bytes left from there.
        remaining: usize,
    },
    /// `nla_len` is smaller than the attribute header.
    #[error("attribute {kind} at byte {offset} has length {len}, shorter than its {NLA_HDRLEN}-byte header")]
    AttrLengthTooSmall {
        /// Where the attribute starts.
        offset: usize,
        /// Its type.
        kind: u16,
        /// Its `nla_len`.
        len: usize,
    },
    /// `nla_len` runs past the end of the message.
    #[error("attribute {kind} at byte {offset} has length {len}, past the end of the message ({remaining} bytes left)")]
    AttrPastEnd {
        /// Where the attribute starts.
        offset: usize,
        /// Its type.
        kind: u16,
        /// Its `nla_len`.
        len: usize,
        /// Bytes left from its start.
        remaining: usize,
    },
    /// An attribute's value has the wrong size for its type.
    #[error("attribute {name} is {len} bytes, expected {expected}")]
    AttrSize {
        /// The attribute's name in the ABI.
        name: &'static str,
        /// Its value's length.
        len: usize,
        /// The length its type has.
        expected: usize,
    },
    /// An attribute that may appear once appeared again.
    #[error("attribute {name} appears twice")]
    AttrDuplicate {
        /// The attribute's name in the ABI.
        name: &'static str,
    },
    /// The event has no `ATTR_EVENT`, so there is nothing to report.
    #[error("event has no ATTR_EVENT attribute")]
    MissingKind,
}

/// Why joining the module's event stream failed.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    /// The socket could not be created or bound.
    #[error("cannot open a generic netlink socket")]
    Socket(#[source] io::Error),
    /// The kernel does not know the family: the module is not loaded.
    #[error("the generic netlink family '{}' is not registered: the hag_mdev module is not loaded (insmod hag_mdev.ko)", abi::GENL_NAME)]
    FamilyNotRegistered,
    /// Sending the nlctrl request or reading its answer failed.
    #[error(
        "cannot ask nlctrl about the generic netlink family '{}'",
        abi::GENL_NAME
    )]
    Exchange(#[source] io::Error),
    /// nlctrl answered with an error other than "no such family".
    #[error(
        "nlctrl refused to describe the generic netlink family '{}'",
        abi::GENL_NAME
    )]
    Refused(#[source] io::Error),
    /// nlctrl's answer could not be parsed.
    #[error(
        "nlctrl's answer about the generic netlink family '{}' is malformed",
        abi::GENL_NAME
    )]
    Malformed(#[source] ParseError),
    /// nlctrl's answer lacks something every family has.
    #[error(
        "nlctrl's answer about the generic netlink family '{}' has no {what}",
        abi::GENL_NAME
    )]
    Missing {
        /// What was missing.
        what: &'static str,
    },
    /// The family is of another ABI version.
    #[error(transparent)]
    Abi(AbiMismatch),
    /// The family exists but without the events group.
    #[error("the generic netlink family '{}' has no multicast group '{}': hag_mdev was built from another ABI", abi::GENL_NAME, abi::GENL_MCGRP_EVENTS)]
    NoEventsGroup,
    /// `NETLINK_ADD_MEMBERSHIP` failed.
    #[error(
        "cannot join the multicast group '{}' (id {id})",
        abi::GENL_MCGRP_EVENTS
    )]
    Join {
        /// The group's id.
        id: u32,
        /// The failure.
        #[source]
        source: io::Error,
    },
}

/// Why waiting for events failed.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    /// `poll(2)` or `recv(2)` failed.
    #[error("cannot receive from the generic netlink socket")]
    Io(#[source] io::Error),
    /// The kernel dropped events because hagctl read too slowly.
    #[error("the socket's receive buffer overflowed: some hag events were lost")]
    Lost,
    /// A datagram was larger than the receive buffer.
    #[error("a netlink datagram of {len} bytes did not fit the {RECV_BUFFER}-byte receive buffer")]
    Truncated {
        /// The datagram's length.
        len: usize,
    },
    /// A message in the datagram is malformed.
    #[error("malformed hag event")]
    Malformed(#[source] ParseError),
}

const NLMSG_HDRLEN: usize = 16;
const NLA_HDRLEN: usize = 4;
/// The kernel builds multicast messages of at most `NLMSG_GOODSIZE` (about
/// 8 KiB; an event is a few dozen bytes), so a datagram always fits.
const RECV_BUFFER: usize = 32 * 1024;
/// Sequence number of our nlctrl request, to tell its answer apart.
const CTRL_SEQ: u32 = 1;
/// How many unrelated datagrams to skip while waiting for nlctrl's answer.
const CTRL_MAX_DATAGRAMS: usize = 16;

const fn align4(len: usize) -> usize {
    (len + 3) & !3
}

/// One netlink message inside a datagram.
#[derive(Debug, PartialEq, Eq)]
pub struct RawMessage<'a> {
    /// `nlmsg_type`: a family id or `NLMSG_*`.
    pub message_type: u16,
    /// `nlmsg_seq`.
    pub sequence: u32,
    /// The bytes after the `nlmsghdr`.
    pub payload: &'a [u8],
}

/// Splits a datagram into its netlink messages.
pub fn parse_datagram(buf: &[u8]) -> Result<Vec<RawMessage<'_>>, ParseError> {
    let mut messages = Vec::new();
    let mut offset = 0;
    while offset < buf.len() {
        let rest = &buf[offset..];
        let Some(header) = rest.first_chunk::<NLMSG_HDRLEN>() else {
            return Err(ParseError::MessageHeaderTruncated {
                offset,
                remaining: rest.len(),
            });
        };
        let len = u32::from_ne_bytes([header[0], header[1], header[2], header[3]]) as usize;
        if len < NLMSG_HDRLEN || len > rest.len() {
            return Err(ParseError::MessageLength {
                offset,
                len,
                remaining: rest.len(),
            });
        }
        messages.push(RawMessage {
            message_type: u16::from_ne_bytes([header[4], header[5]]),
            sequence: u32::from_ne_bytes([header[8], header[9], header[10], header[11]]),
            payload: &rest[NLMSG_HDRLEN..len],
        });
        // The last message may omit its alignment padding.
        offset += align4(len).min(rest.len());
    }
    Ok(messages)
}

/// One attribute: its type (flag bits masked off) and value.
struct Attr<'a> {
    kind: u16,
    value: &'a [u8],
}

/// Walks a netlink attribute area; yields an error once and then stops.
struct Attrs<'a> {
    buf: &'a [u8],
    offset: usize,
    failed: bool,
}

fn attrs(buf: &[u8]) -> Attrs<'_> {
    Attrs {
        buf,
        offset: 0,
        failed: false,
    }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = Result<Attr<'a>, ParseError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.offset >= self.buf.len() {
            return None;
        }
        let offset = self.offset;
        let rest = &self.buf[offset..];
        let result = match rest.first_chunk::<NLA_HDRLEN>() {
            None => Err(ParseError::AttrHeaderTruncated {
                offset,
                remaining: rest.len(),
            }),
            Some(header) => {
                let len = usize::from(u16::from_ne_bytes([header[0], header[1]]));
                let kind = u16::from_ne_bytes([header[2], header[3]]) & NLA_TYPE_MASK;
                if len < NLA_HDRLEN {
                    Err(ParseError::AttrLengthTooSmall { offset, kind, len })
                } else if len > rest.len() {
                    Err(ParseError::AttrPastEnd {
                        offset,
                        kind,
                        len,
                        remaining: rest.len(),
                    })
                } else {
                    self.offset += align4(len).min(rest.len());
                    Ok(Attr {
                        kind,
                        value: &rest[NLA_HDRLEN..len],
                    })
                }
            }
        };
        self.failed = result.is_err();
        Some(result)
    }
}

fn fixed<const N: usize>(name: &'static str, value: &[u8]) -> Result<[u8; N], ParseError> {
    value.try_into().map_err(|_| ParseError::AttrSize {
        name,
        len: value.len(),
        expected: N,
    })
}

fn set_once<T>(slot: &mut Option<T>, name: &'static str, value: T) -> Result<(), ParseError> {
    if slot.replace(value).is_some() {
        return Err(ParseError::AttrDuplicate { name });
    }
    Ok(())
}

/// Parses the payload of one `hag` family message (genetlink header and
/// attributes) into an [`Event`].
pub fn parse_event(payload: &[u8]) -> Result<Event, ParseError> {
    let Some((header, attr_area)) = payload.split_first_chunk::<GENL_HDRLEN>() else {
        return Err(ParseError::GenlHeaderTruncated { len: payload.len() });
    };
    let (cmd, version) = (header[0], header[1]);
    if cmd != abi::CMD_EVENT {
        return Err(ParseError::WrongCommand { cmd });
    }
    if version != abi::GENL_VERSION {
        return Err(ParseError::WrongVersion { version });
    }

    let (mut kind, mut vgpu_id, mut uuid, mut timestamp_ns, mut message) =
        (None, None, None, None, None);
    for attr in attrs(attr_area) {
        let Attr {
            kind: attr_kind,
            value,
        } = attr?;
        match attr_kind {
            abi::ATTR_EVENT => set_once(
                &mut kind,
                "ATTR_EVENT",
                u32::from_ne_bytes(fixed("ATTR_EVENT", value)?),
            )?,
            abi::ATTR_VGPU_ID => set_once(
                &mut vgpu_id,
                "ATTR_VGPU_ID",
                u32::from_ne_bytes(fixed("ATTR_VGPU_ID", value)?),
            )?,
            abi::ATTR_VGPU_UUID => {
                set_once(&mut uuid, "ATTR_VGPU_UUID", fixed("ATTR_VGPU_UUID", value)?)?
            }
            abi::ATTR_TIMESTAMP_NS => set_once(
                &mut timestamp_ns,
                "ATTR_TIMESTAMP_NS",
                u64::from_ne_bytes(fixed("ATTR_TIMESTAMP_NS", value)?),
            )?,
            // The text is only shown, so a missing NUL or bad UTF-8 costs a
            // replacement character, not the event.
            abi::ATTR_MESSAGE => {
                let text = value.split(|&b| b == 0).next().unwrap_or_default();
                set_once(
                    &mut message,
                    "ATTR_MESSAGE",
                    String::from_utf8_lossy(text).into_owned(),
                )?
            }
            // ATTR_PAD only aligns the u64 after it; anything else is from a
            // newer module of the same ABI, which may add attributes.
            _ => {}
        }
    }
    Ok(Event {
        kind: kind.ok_or(ParseError::MissingKind)?,
        vgpu_id,
        uuid,
        timestamp_ns,
        message,
    })
}

/// What nlctrl told about the `hag` family.
#[derive(Debug, PartialEq, Eq)]
pub struct FamilyInfo {
    /// The family's dynamically assigned id (`nlmsg_type` of its messages).
    pub id: u16,
    /// The family's version.
    pub version: u32,
    /// The id of [`abi::GENL_MCGRP_EVENTS`], if the family has it.
    pub events_group: Option<u32>,
}

/// Parses the payload of nlctrl's `CTRL_CMD_NEWFAMILY` answer.
pub fn parse_family(payload: &[u8]) -> Result<FamilyInfo, SubscribeError> {
    let malformed = SubscribeError::Malformed;
    let attr_area =
        payload
            .get(GENL_HDRLEN..)
            .ok_or(malformed(ParseError::GenlHeaderTruncated {
                len: payload.len(),
            }))?;
    let (mut id, mut version, mut events_group) = (None, None, None);
    for attr in attrs(attr_area) {
        let attr = attr.map_err(malformed)?;
        match attr.kind {
            CTRL_ATTR_FAMILY_ID => {
                id = Some(u16::from_ne_bytes(
                    fixed("CTRL_ATTR_FAMILY_ID", attr.value).map_err(malformed)?,
                ))
            }
            CTRL_ATTR_VERSION => {
                version = Some(u32::from_ne_bytes(
                    fixed("CTRL_ATTR_VERSION", attr.value).map_err(malformed)?,
                ))
            }
            CTRL_ATTR_MCAST_GROUPS => {
                for group in attrs(attr.value) {
                    let group = group.map_err(malformed)?;
                    let (mut name, mut group_id) = (None, None);
                    for field in attrs(group.value) {
                        let field = field.map_err(malformed)?;
                        match field.kind {
                            CTRL_ATTR_MCAST_GRP_NAME => name = Some(field.value),
                            CTRL_ATTR_MCAST_GRP_ID => {
                                group_id = Some(u32::from_ne_bytes(
                                    fixed("CTRL_ATTR_MCAST_GRP_ID", field.value)
                                        .map_err(malformed)?,
                                ))
                            }
                            _ => {}
                        }
                    }
                    if name == Some(abi::GENL_MCGRP_EVENTS_C) {
                        events_group = group_id;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(FamilyInfo {
        id: id.ok_or(SubscribeError::Missing { what: "family id" })?,
        version: version.ok_or(SubscribeError::Missing { what: "version" })?,
        events_group,
    })
}

/// Accepts the family only if it speaks this build's ABI and has the events
/// group; returns the group's id.
pub fn check_family(family: &FamilyInfo) -> Result<u32, SubscribeError> {
    if family.version != u32::from(abi::GENL_VERSION) {
        return Err(SubscribeError::Abi(AbiMismatch {
            module: family.version,
        }));
    }
    family.events_group.ok_or(SubscribeError::NoEventsGroup)
}

/// A netlink socket that has joined the `hag` events group.
pub struct EventSocket {
    socket: Socket,
    family_id: u16,
    buf: Vec<u8>,
}

impl EventSocket {
    /// Resolves the family through nlctrl, checks its version and joins its
    /// events group.
    pub fn subscribe() -> Result<Self, SubscribeError> {
        let mut socket = Socket::new(NETLINK_GENERIC).map_err(SubscribeError::Socket)?;
        socket.bind_auto().map_err(SubscribeError::Socket)?;
        let family = resolve_family(&socket, abi::GENL_NAME)?;
        let group = check_family(&family)?;
        socket
            .add_membership(group)
            .map_err(|source| SubscribeError::Join { id: group, source })?;
        Ok(Self {
            socket,
            family_id: family.id,
            buf: Vec::with_capacity(RECV_BUFFER),
        })
    }

    /// Waits up to `timeout` (forever if `None`) for a datagram and returns
    /// the events in it, or `None` if the time ran out.
    pub fn receive(
        &mut self,
        timeout: Option<Duration>,
    ) -> Result<Option<Vec<Event>>, ReceiveError> {
        if !wait_readable(&self.socket, timeout).map_err(ReceiveError::Io)? {
            return Ok(None);
        }
        self.buf.clear();
        let len = match self.socket.recv(
            &mut self.buf,
            nix::libc::MSG_DONTWAIT | nix::libc::MSG_TRUNC,
        ) {
            Ok(len) => len,
            // poll can wake without data (e.g. a spurious wakeup).
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(Some(Vec::new())),
            Err(err) if err.raw_os_error() == Some(Errno::ENOBUFS as i32) => {
                return Err(ReceiveError::Lost)
            }
            Err(err) => return Err(ReceiveError::Io(err)),
        };
        if len > self.buf.len() {
            return Err(ReceiveError::Truncated { len });
        }
        events_in(&self.buf, self.family_id).map(Some)
    }
}

/// The events among a datagram's messages; other message types (there
/// should be none once subscribed) are skipped.
pub fn events_in(datagram: &[u8], family_id: u16) -> Result<Vec<Event>, ReceiveError> {
    parse_datagram(datagram)
        .and_then(|messages| {
            messages
                .iter()
                .filter(|m| m.message_type == family_id)
                .map(|m| parse_event(m.payload))
                .collect()
        })
        .map_err(ReceiveError::Malformed)
}

/// Asks nlctrl about the family `name` (always [`abi::GENL_NAME`] but in
/// tests, which ask about nlctrl itself to check against a real answer).
fn resolve_family(socket: &Socket, name: &str) -> Result<FamilyInfo, SubscribeError> {
    let mut request = NetlinkMessage::from(GenlMessage::from_payload(GenlCtrl {
        cmd: GenlCtrlCmd::GetFamily,
        nlas: vec![GenlCtrlAttrs::FamilyName(name.to_owned())],
    }));
    request.header.flags = NLM_F_REQUEST;
    request.header.sequence_number = CTRL_SEQ;
    request.finalize();
    let mut bytes = vec![0; request.buffer_len()];
    request.serialize(&mut bytes);
    socket
        .send_to(&bytes, &netlink_sys::SocketAddr::new(0, 0), 0)
        .map_err(SubscribeError::Exchange)?;

    // The kernel answers inside sendmsg, so the reply is already queued.
    for _ in 0..CTRL_MAX_DATAGRAMS {
        let (datagram, _) = socket.recv_from_full().map_err(SubscribeError::Exchange)?;
        let messages = parse_datagram(&datagram).map_err(SubscribeError::Malformed)?;
        for message in messages.iter().filter(|m| m.sequence == CTRL_SEQ) {
            match message.message_type {
                GENL_ID_CTRL => return parse_family(message.payload),
                NLMSG_ERROR => return Err(nlmsg_error(message.payload)),
                _ => {}
            }
        }
    }
    Err(SubscribeError::Exchange(io::Error::new(
        io::ErrorKind::TimedOut,
        "no answer from nlctrl",
    )))
}

fn nlmsg_error(payload: &[u8]) -> SubscribeError {
    let Some(code) = payload.first_chunk::<4>().map(|c| i32::from_ne_bytes(*c)) else {
        return SubscribeError::Malformed(ParseError::GenlHeaderTruncated { len: payload.len() });
    };
    match Errno::from_raw(code.saturating_neg()) {
        Errno::ENOENT => SubscribeError::FamilyNotRegistered,
        errno => SubscribeError::Refused(io::Error::from(errno)),
    }
}

/// Waits until the socket is readable; `false` if `timeout` passed first.
fn wait_readable(socket: &Socket, timeout: Option<Duration>) -> io::Result<bool> {
    let timeout = match timeout {
        None => PollTimeout::NONE,
        // Round up: a timeout rounded down to 0 ms would spin until it ends.
        Some(t) => PollTimeout::try_from(t.as_micros().div_ceil(1000)).unwrap_or(PollTimeout::MAX),
    };
    let mut fds = [PollFd::new(socket.as_fd(), PollFlags::POLLIN)];
    loop {
        match poll(&mut fds, timeout) {
            Ok(0) => return Ok(false),
            Ok(_) => return Ok(true),
            Err(Errno::EINTR) => continue,
            Err(errno) => return Err(errno.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_generic::constants::{CTRL_ATTR_FAMILY_NAME, CTRL_CMD_NEWFAMILY};

    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let len = u16::try_from(NLA_HDRLEN + value.len()).unwrap();
        let mut out = Vec::new();
        out.extend_from_slice(&len.to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(value);
        out.resize(align4(out.len()), 0);
        out
    }

    fn genl(cmd: u8, attrs: &[Vec<u8>]) -> Vec<u8> {
        let mut out = vec![cmd, abi::GENL_VERSION, 0, 0];
        for a in attrs {
            out.extend_from_slice(a);
        }
        out
    }

    fn nlmsg(message_type: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(NLMSG_HDRLEN + payload.len()).unwrap();
        let mut out = Vec::new();
        out.extend_from_slice(&len.to_ne_bytes());
        out.extend_from_slice(&message_type.to_ne_bytes());
        out.extend_from_slice(&0u16.to_ne_bytes());
        out.extend_from_slice(&seq.to_ne_bytes());
        out.extend_from_slice(&0u32.to_ne_bytes());
        out.extend_from_slice(payload);
        out.resize(align4(out.len()), 0);
        out
    }

    const UUID: [u8; 16] = [
        0x83, 0xb8, 0xf4, 0xf2, 0x50, 0x9f, 0x38, 0x2f, 0x3c, 0x1e, 0xe6, 0xbf, 0xe0, 0xfa, 0x10,
        0x01,
    ];

    /// Laid out as the kernel does it: a pad before the u64 timestamp.
    fn full_event() -> Vec<u8> {
        genl(
            abi::CMD_EVENT,
            &[
                attr(abi::ATTR_EVENT, &abi::EVENT_VGPU_CREATED.to_ne_bytes()),
                attr(abi::ATTR_VGPU_ID, &1u32.to_ne_bytes()),
                attr(abi::ATTR_VGPU_UUID, &UUID),
                attr(abi::ATTR_PAD, &[]),
                attr(abi::ATTR_TIMESTAMP_NS, &123_456_789u64.to_ne_bytes()),
                attr(abi::ATTR_MESSAGE, b"created by test\0"),
            ],
        )
    }

    #[test]
    fn valid_event_parses_every_field() {
        assert_eq!(
            parse_event(&full_event()),
            Ok(Event {
                kind: abi::EVENT_VGPU_CREATED,
                vgpu_id: Some(1),
                uuid: Some(UUID),
                timestamp_ns: Some(123_456_789),
                message: Some("created by test".into()),
            })
        );
    }

    #[test]
    fn event_with_only_a_kind_is_valid() {
        let msg = genl(
            abi::CMD_EVENT,
            &[attr(abi::ATTR_EVENT, &abi::EVENT_VGPU_HUNG.to_ne_bytes())],
        );
        let event = parse_event(&msg).unwrap();
        assert_eq!(event.kind, abi::EVENT_VGPU_HUNG);
        assert_eq!(event.vgpu_id, None);
        assert_eq!(event.message, None);
    }

    #[test]
    fn unknown_attribute_and_pad_are_skipped() {
        let msg = genl(
            abi::CMD_EVENT,
            &[
                attr(abi::ATTR_MAX + 1, b"from the future"),
                attr(abi::ATTR_PAD, &[0; 4]),
                attr(abi::ATTR_EVENT, &abi::EVENT_VGPU_REMOVED.to_ne_bytes()),
            ],
        );
        assert_eq!(parse_event(&msg).unwrap().kind, abi::EVENT_VGPU_REMOVED);
    }

    #[test]
    fn truncated_attribute_header_is_refused() {
        let mut msg = genl(
            abi::CMD_EVENT,
            &[attr(
                abi::ATTR_EVENT,
                &abi::EVENT_VGPU_CREATED.to_ne_bytes(),
            )],
        );
        msg.extend_from_slice(&[8, 0]);
        assert_eq!(
            parse_event(&msg),
            Err(ParseError::AttrHeaderTruncated {
                offset: 8,
                remaining: 2
            })
        );
    }

    #[test]
    fn attribute_length_past_the_end_is_refused() {
        let mut msg = genl(abi::CMD_EVENT, &[attr(abi::ATTR_MESSAGE, b"abcdefgh")]);
        msg.truncate(msg.len() - 4);
        let err = parse_event(&msg).unwrap_err();
        assert_eq!(
            err,
            ParseError::AttrPastEnd {
                offset: 0,
                kind: abi::ATTR_MESSAGE,
                len: 12,
                remaining: 8
            }
        );
        assert!(err.to_string().contains("past the end"), "{err}");
    }

    #[test]
    fn attribute_length_below_its_header_is_refused() {
        let mut msg = genl(abi::CMD_EVENT, &[]);
        msg.extend_from_slice(&2u16.to_ne_bytes());
        msg.extend_from_slice(&abi::ATTR_EVENT.to_ne_bytes());
        assert_eq!(
            parse_event(&msg),
            Err(ParseError::AttrLengthTooSmall {
                offset: 0,
                kind: abi::ATTR_EVENT,
                len: 2
            })
        );
    }

    #[test]
    fn wrong_value_size_is_refused() {
        let msg = genl(abi::CMD_EVENT, &[attr(abi::ATTR_VGPU_UUID, &[0; 15])]);
        assert_eq!(
            parse_event(&msg),
            Err(ParseError::AttrSize {
                name: "ATTR_VGPU_UUID",
                len: 15,
                expected: 16
            })
        );
    }

    #[test]
    fn duplicate_attribute_is_refused() {
        let kind = attr(abi::ATTR_EVENT, &abi::EVENT_VGPU_CREATED.to_ne_bytes());
        let msg = genl(abi::CMD_EVENT, &[kind.clone(), kind]);
        assert_eq!(
            parse_event(&msg),
            Err(ParseError::AttrDuplicate { name: "ATTR_EVENT" })
        );
    }

    #[test]
    fn wrong_genl_command_is_refused() {
        let mut msg = full_event();
        msg[0] = abi::CMD_UNSPEC;
        assert_eq!(
            parse_event(&msg),
            Err(ParseError::WrongCommand {
                cmd: abi::CMD_UNSPEC
            })
        );
    }

    #[test]
    fn wrong_genl_version_is_refused() {
        let mut msg = full_event();
        msg[1] = abi::GENL_VERSION + 1;
        assert_eq!(
            parse_event(&msg),
            Err(ParseError::WrongVersion {
                version: abi::GENL_VERSION + 1
            })
        );
    }

    #[test]
    fn short_genl_header_and_missing_kind_are_refused() {
        assert_eq!(
            parse_event(&[abi::CMD_EVENT, 1]),
            Err(ParseError::GenlHeaderTruncated { len: 2 })
        );
        let msg = genl(
            abi::CMD_EVENT,
            &[attr(abi::ATTR_VGPU_ID, &1u32.to_ne_bytes())],
        );
        assert_eq!(parse_event(&msg), Err(ParseError::MissingKind));
    }

    #[test]
    fn message_without_nul_or_utf8_is_kept() {
        let msg = genl(
            abi::CMD_EVENT,
            &[
                attr(abi::ATTR_EVENT, &abi::EVENT_COMMAND_REJECTED.to_ne_bytes()),
                attr(abi::ATTR_MESSAGE, b"bad \xff"),
            ],
        );
        assert_eq!(
            parse_event(&msg).unwrap().message.as_deref(),
            Some("bad \u{fffd}")
        );
    }

    #[test]
    fn no_prefix_of_a_valid_event_panics() {
        let msg = full_event();
        for len in 0..msg.len() {
            let _ = parse_event(&msg[..len]);
            let _ = events_in(&msg[..len], 0x20);
        }
    }

    #[test]
    fn datagram_keeps_only_the_family_messages() {
        let mut datagram = nlmsg(0x20, 0, &full_event());
        datagram.extend(nlmsg(0x21, 0, b"other"));
        datagram.extend(nlmsg(0x20, 0, &full_event()));
        let events = events_in(&datagram, 0x20).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].vgpu_id, Some(1));
    }

    #[test]
    fn datagram_with_bad_lengths_is_refused() {
        let msg = nlmsg(0x20, 0, &full_event());
        assert_eq!(
            parse_datagram(&msg[..10]),
            Err(ParseError::MessageHeaderTruncated {
                offset: 0,
                remaining: 10
            })
        );
        assert_eq!(
            parse_datagram(&msg[..20]),
            Err(ParseError::MessageLength {
                offset: 0,
                len: msg.len(),
                remaining: 20
            })
        );
        let mut short = msg.clone();
        short[..4].copy_from_slice(&4u32.to_ne_bytes());
        assert!(matches!(
            parse_datagram(&short),
            Err(ParseError::MessageLength { len: 4, .. })
        ));
    }

    fn family_answer(version: u32, groups: &[(&[u8], u32)]) -> Vec<u8> {
        let mut nested = Vec::new();
        for (i, (name, id)) in groups.iter().enumerate() {
            let mut fields = attr(CTRL_ATTR_MCAST_GRP_NAME, name);
            fields.extend(attr(CTRL_ATTR_MCAST_GRP_ID, &id.to_ne_bytes()));
            nested.extend(attr(u16::try_from(i + 1).unwrap(), &fields));
        }
        genl(
            CTRL_CMD_NEWFAMILY,
            &[
                attr(CTRL_ATTR_FAMILY_ID, &0x1du16.to_ne_bytes()),
                attr(CTRL_ATTR_FAMILY_NAME, abi::GENL_NAME_C),
                attr(CTRL_ATTR_VERSION, &version.to_ne_bytes()),
                attr(99, b"a newer nlctrl attribute"),
                attr(CTRL_ATTR_MCAST_GROUPS, &nested),
            ],
        )
    }

    #[test]
    fn family_answer_gives_id_version_and_events_group() {
        let answer = family_answer(
            u32::from(abi::GENL_VERSION),
            &[(b"other\0", 7), (abi::GENL_MCGRP_EVENTS_C, 9)],
        );
        let family = parse_family(&answer).unwrap();
        assert_eq!(
            family,
            FamilyInfo {
                id: 0x1d,
                version: u32::from(abi::GENL_VERSION),
                events_group: Some(9)
            }
        );
        assert_eq!(check_family(&family).unwrap(), 9);
    }

    #[test]
    fn family_of_another_version_or_without_group_is_refused() {
        let newer = u32::from(abi::GENL_VERSION) + 1;
        let other = parse_family(&family_answer(newer, &[(abi::GENL_MCGRP_EVENTS_C, 9)])).unwrap();
        let err = check_family(&other).unwrap_err();
        assert!(matches!(
            err,
            SubscribeError::Abi(AbiMismatch { module }) if module == newer
        ));
        assert!(
            err.to_string()
                .starts_with(&format!("hag_mdev speaks ABI {newer}")),
            "{err}"
        );

        let no_group = parse_family(&family_answer(u32::from(abi::GENL_VERSION), &[])).unwrap();
        assert!(matches!(
            check_family(&no_group),
            Err(SubscribeError::NoEventsGroup)
        ));
    }

    /// Needs only a kernel with generic netlink, not hag_mdev: checks the
    /// request and the parser against what a real nlctrl sends.
    #[test]
    fn real_nlctrl_describes_itself() {
        let mut socket = Socket::new(NETLINK_GENERIC).unwrap();
        socket.bind_auto().unwrap();
        let family = resolve_family(&socket, "nlctrl").unwrap();
        assert_eq!(family.id, GENL_ID_CTRL);
        assert_eq!(family.events_group, None);
        assert!(matches!(
            resolve_family(&socket, "hagctl-nothing"),
            Err(SubscribeError::FamilyNotRegistered)
        ));
    }

    #[test]
    fn missing_family_is_reported_as_module_not_loaded() {
        let err = nlmsg_error(&(-(Errno::ENOENT as i32)).to_ne_bytes());
        assert!(matches!(err, SubscribeError::FamilyNotRegistered));
        assert_eq!(
            err.to_string(),
            "the generic netlink family 'hag' is not registered: the hag_mdev module is not loaded (insmod hag_mdev.ko)"
        );
    }
}
