//! The gate checked on a real interface: `lo` of a fresh network namespace,
//! made on a thread of its own (so nothing else on the host is held), with
//! UDP datagrams to 127.0.0.1. Used by the plug's unit test and by the
//! `plug_gate` example (`plug_gate --selfcheck`, or `--selfcheck-here` on
//! the host's own `lo` where the kernel has no network namespaces, as the
//! test kernel), which runs it on a test host's kernel.
//!
//! The sequence: a datagram sent after attach is not received; a boundary
//! alone releases nothing; `release_one` lets out exactly the buffered
//! epoch; a second boundary before the release is refused; release
//! indefinite lets all through; a plug left by a dead owner keeps holding,
//! and the next attach drops what it held; detach restores the default.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_REQUEST,
};
use netlink_packet_route::link::{LinkFlags, LinkMessage};
use netlink_packet_route::RouteNetlinkMessage;

use super::{describe, encode, Plug, PlugError, Request, Rtnl, HANDLE};

/// How the check ended when it did not fail.
#[derive(Debug)]
pub enum Outcome {
    /// Every step held; one line per step, with the release latencies.
    Passed(Vec<String>),
    /// Not run here, and why (not root, no namespaces, no sch_plug).
    Skipped(String),
}

/// How long a datagram that must stay held is waited for.
const HELD_FOR: Duration = Duration::from_millis(300);
/// How long a released datagram may take: it only catches one that never
/// comes (milliseconds on loopback; seconds on a starved emulated host).
const RELEASED_WITHIN: Duration = Duration::from_secs(20);

/// Runs the check in a fresh network namespace on a new thread.
pub fn on_loopback() -> Result<Outcome, String> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(Outcome::Skipped(
            "not root (needs CAP_SYS_ADMIN for a network namespace and CAP_NET_ADMIN)".into(),
        ));
    }
    std::thread::spawn(|| {
        if let Err(e) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
            return Ok(Outcome::Skipped(format!(
                "cannot make a network namespace: {e}"
            )));
        }
        run()
    })
    .join()
    .map_err(|_| "the check's thread panicked".to_string())?
}

/// Runs the check on this thread's own network namespace: its `lo` is
/// plugged and unplugged, so only for a host that is there to be tested
/// (a test host whose kernel has no network namespaces).
pub fn on_loopback_here() -> Result<Outcome, String> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(Outcome::Skipped("not root (needs CAP_NET_ADMIN)".into()));
    }
    run()
}

fn run() -> Result<Outcome, String> {
    lo_up()?;
    let rx = UdpSocket::bind("127.0.0.1:0").map_err(|e| format!("binding the receiver: {e}"))?;
    let to = rx.local_addr().map_err(|e| e.to_string())?;
    let tx = UdpSocket::bind("127.0.0.1:0").map_err(|e| format!("binding the sender: {e}"))?;
    let send = |what: &str| {
        tx.send_to(what.as_bytes(), to)
            .map(|_| ())
            .map_err(|e| format!("sending {what:?}: {e}"))
    };
    let mut lines = Vec::new();

    let mut plug = match Plug::attach_with_limit("lo", 1 << 20) {
        Ok(p) => p,
        Err(e @ PlugError::Unsupported { .. }) => return Ok(Outcome::Skipped(describe(&e))),
        Err(e) => return Err(describe(&e)),
    };
    let e = |e: PlugError| describe(&e);
    send("1")?;
    held(&rx, "after attach")?;
    let s = plug.stats().map_err(e)?;
    if s.kind != "plug" || s.handle != HANDLE || s.backlog_packets != 1 {
        return Err(format!(
            "after attach and one datagram: root qdisc {} {:#x}, {s}; expected hag's plug holding 1 packet",
            s.kind, s.handle
        ));
    }
    lines.push(format!("attached; one datagram held ({s})"));
    plug.buffer().map_err(e)?;
    held(&rx, "after buffer alone")?;
    send("2")?;
    let t = Instant::now();
    plug.release_one().map_err(e)?;
    let call = t.elapsed();
    arrives(&rx, "1", "after release_one")?;
    let total = t.elapsed();
    held(&rx, "the next epoch, after release_one")?;
    lines.push(format!(
        "buffer + release_one let out exactly epoch 1 (the call {} us, received {} us after it began)",
        call.as_micros(),
        total.as_micros()
    ));
    plug.buffer().map_err(e)?;
    match plug.buffer() {
        Err(PlugError::EpochPending { .. }) => {}
        other => return Err(format!("a second boundary while one is pending: {other:?}")),
    }
    lines.push("a second boundary before the release is refused".into());
    send("3")?;
    plug.release_one().map_err(e)?;
    arrives(&rx, "2", "after the second release_one")?;
    held(&rx, "epoch 3, after the second release_one")?;
    plug.release_indefinite().map_err(e)?;
    arrives(&rx, "3", "after release_indefinite")?;
    send("4")?;
    arrives(&rx, "4", "sent while passing through")?;
    lines.push("release_indefinite lets the held and the new through".into());
    plug.buffer().map_err(e)?;
    send("5")?;
    held(&rx, "after buffer following release_indefinite")?;

    // The owner goes away: the qdisc stays and holds.
    drop(plug);
    held(&rx, "after its owner went away")?;
    let mut rtnl = Rtnl::open().map_err(|e| format!("rtnetlink: {e}"))?;
    let lo = nix::net::if_::if_nametoindex("lo").map_err(|e| e.to_string())?;
    let replies = rtnl
        .exchange(|seq| encode(Request::Get { handle: HANDLE }, lo, seq))
        .map_err(|e| format!("reading the leftover plug: {e}"))?;
    if !replies
        .iter()
        .any(|r| matches!(r, RouteNetlinkMessage::NewQueueDiscipline(_)))
    {
        return Err("the plug went away with its owner".into());
    }
    let mut plug = Plug::attach_with_limit("lo", 1 << 20).map_err(e)?;
    plug.release_indefinite().map_err(e)?;
    held(&rx, "what a leftover plug held, after a new attach")?;
    lines.push("a plug whose owner went away keeps holding; the next attach drops it".into());
    plug.detach().map_err(e)?;
    let replies = rtnl
        .exchange(|seq| encode(Request::Get { handle: 0 }, lo, seq))
        .map_err(|e| format!("reading the root qdisc after detach: {e}"))?;
    // lo's default is noqueue, which a kernel may or may not report.
    for r in &replies {
        if let RouteNetlinkMessage::NewQueueDiscipline(q) = r {
            let s = super::stats_of(q);
            if s.kind == super::KIND || s.handle == HANDLE {
                return Err(format!(
                    "after detach the root qdisc is {} {:#x}",
                    s.kind, s.handle
                ));
            }
        }
    }
    send("6")?;
    arrives(&rx, "6", "after detach")?;
    lines.push("detach restores lo's default".into());
    Ok(Outcome::Passed(lines))
}

/// `ip link set lo up`.
fn lo_up() -> Result<(), String> {
    let lo = nix::net::if_::if_nametoindex("lo").map_err(|e| format!("no lo: {e}"))?;
    let mut rtnl = Rtnl::open().map_err(|e| format!("rtnetlink: {e}"))?;
    rtnl.exchange(|seq| {
        let mut link = LinkMessage::default();
        link.header.index = lo;
        link.header.flags = LinkFlags::Up;
        link.header.change_mask = LinkFlags::Up;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK;
        header.sequence_number = seq;
        let mut msg = NetlinkMessage::new(
            header,
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)),
        );
        msg.finalize();
        let mut bytes = vec![0; msg.buffer_len()];
        msg.serialize(&mut bytes);
        bytes
    })
    .map(|_| ())
    .map_err(|e| format!("bringing lo up: {e}"))
}

/// Nothing arrives within [`HELD_FOR`].
fn held(rx: &UdpSocket, when: &str) -> Result<(), String> {
    rx.set_read_timeout(Some(HELD_FOR))
        .map_err(|e| e.to_string())?;
    let mut buf = [0u8; 64];
    match rx.recv(&mut buf) {
        Ok(n) => Err(format!(
            "{when}: datagram {:?} arrived; it should have been held",
            String::from_utf8_lossy(&buf[..n])
        )),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(format!("{when}: receiving: {e}")),
    }
}

/// `what` arrives within [`RELEASED_WITHIN`].
fn arrives(rx: &UdpSocket, what: &str, when: &str) -> Result<(), String> {
    rx.set_read_timeout(Some(RELEASED_WITHIN))
        .map_err(|e| e.to_string())?;
    let mut buf = [0u8; 64];
    match rx.recv(&mut buf) {
        Ok(n) if &buf[..n] == what.as_bytes() => Ok(()),
        Ok(n) => Err(format!(
            "{when}: datagram {:?} arrived, expected {what:?}",
            String::from_utf8_lossy(&buf[..n])
        )),
        Err(e) => Err(format!(
            "{when}: datagram {what:?} did not arrive within {} ms: {e}",
            RELEASED_WITHIN.as_millis()
        )),
    }
}
