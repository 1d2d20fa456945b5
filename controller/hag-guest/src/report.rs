//! The guest's output on the network, and the client that receives it.
//!
//! With `--report HOST:PORT`, every progress line and the final
//! `HAG-GUEST-RESULT` line also leave as one UDP datagram each:
//!
//! ```text
//! HAG-GUEST seq=3 ns=41234567890 hag-guest: iteration 1234, 6.0 s
//! HAG-GUEST seq=9 ns=57234567890 HAG-GUEST-RESULT PASS iterations=4567 seconds=30.0
//! ```
//!
//! `seq` counts the datagrams from 1; `ns` is the guest's CLOCK_MONOTONIC
//! when it was sent, so a guest that re-executes from an earlier state (a
//! takeover from a checkpoint) and sends the same `seq` again sends other
//! bytes: a client that saw both was shown output that was then undone.
//! Each datagram is sent before its line is printed, so a line on the
//! console is already in the network stack.
//!
//! `hag-guest listen --port P` is that client: it appends each datagram to
//! stdout as one line, `<arrival> <from> <payload>`, arrival being the
//! receiving host's wall clock (seconds.microseconds) and the payload with
//! bytes other than printable ASCII written as `\xNN` (and `\` as `\\`).
//! With `--query-port Q` it also answers every TCP connection on Q with
//! the number of datagrams logged so far (`N\n`), so a test can ask what
//! the client has seen. `qemu-tests/guest/client_check.py` judges such a
//! log. With `--finish-file F` it answers every datagram with
//! `HAG-GUEST-FINISH` once F exists: the guest then ends its run at its
//! next progress line, verified as at its end (as SIGTERM ends it), so a
//! test that has seen what it waited for (a takeover and some progress
//! after it) need not wait out the run's --seconds.

use std::fmt::Write as _;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use nix::time::{clock_gettime, ClockId};

/// The largest datagram the listener takes whole.
const MAX_DATAGRAM: usize = 65536;

/// The listener's answer that ends the guest's run.
pub const FINISH: &[u8] = b"HAG-GUEST-FINISH";

/// The console, and with `--report` the network.
pub struct Reporter {
    target: Option<(UdpSocket, SocketAddr)>,
    seq: u64,
    failures: u64,
    /// The listener answered [`FINISH`].
    finish: bool,
}

impl Reporter {
    /// A reporter that prints, and sends to `to` if given.
    pub fn new(to: Option<SocketAddr>) -> io::Result<Reporter> {
        let target = match to {
            None => None,
            Some(addr) => {
                let any: SocketAddr = if addr.is_ipv4() {
                    "0.0.0.0:0".parse().expect("a literal address")
                } else {
                    "[::]:0".parse().expect("a literal address")
                };
                let socket = UdpSocket::bind(any)?;
                socket.set_nonblocking(true)?;
                Some((socket, addr))
            }
        };
        Ok(Reporter {
            target,
            seq: 0,
            failures: 0,
            finish: false,
        })
    }

    /// Whether the listener has answered [`FINISH`] (from the report
    /// address; anything else is ignored).
    pub fn finish_asked(&mut self) -> bool {
        if let Some((socket, addr)) = &self.target {
            let mut buf = [0u8; 64];
            while let Ok((n, from)) = socket.recv_from(&mut buf) {
                self.finish |= from == *addr && &buf[..n] == FINISH;
            }
        }
        self.finish
    }

    /// Sends `line` as the next datagram (if reporting), then prints it.
    /// A failed send is said on the console the first time only; the run
    /// goes on.
    pub fn line(&mut self, line: &str) {
        if let Some((socket, addr)) = &self.target {
            self.seq += 1;
            let datagram = datagram(self.seq, monotonic_ns(), line);
            if let Err(e) = socket.send_to(datagram.as_bytes(), addr) {
                self.failures += 1;
                if self.failures == 1 {
                    print_line(&format!(
                        "hag-guest: report seq={} to {addr} not sent: {e} (later failures are not shown)",
                        self.seq
                    ));
                }
            }
        }
        print_line(line);
    }
}

/// Prints one line on stdout and flushes it.
fn print_line(line: &str) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// CLOCK_MONOTONIC in nanoseconds.
fn monotonic_ns() -> u128 {
    clock_gettime(ClockId::CLOCK_MONOTONIC)
        .map(|t| (t.tv_sec() as u128) * 1_000_000_000 + t.tv_nsec() as u128)
        .unwrap_or(0)
}

/// `HAG-GUEST seq=N ns=T LINE`.
pub fn datagram(seq: u64, ns: u128, line: &str) -> String {
    format!("HAG-GUEST seq={seq} ns={ns} {line}")
}

/// Printable ASCII as it is, `\` as `\\`, every other byte as `\xNN`: a
/// datagram on one line, and two datagrams' lines equal exactly when their
/// bytes are.
pub fn escape(payload: &[u8]) -> String {
    let mut s = String::with_capacity(payload.len());
    for &b in payload {
        match b {
            b'\\' => s.push_str("\\\\"),
            0x20..=0x7e => s.push(char::from(b)),
            _ => {
                let _ = write!(s, "\\x{b:02x}");
            }
        }
    }
    s
}

/// One log line: `<secs.micros> <from> <escaped payload>`.
pub fn log_line(arrival: SystemTime, from: SocketAddr, payload: &[u8]) -> String {
    let t = arrival.duration_since(UNIX_EPOCH).unwrap_or_default();
    format!(
        "{}.{:06} {from} {}",
        t.as_secs(),
        t.subsec_micros(),
        escape(payload)
    )
}

/// The client: a UDP socket and the count of what it logged.
pub struct Listener {
    socket: UdpSocket,
    count: Arc<AtomicU64>,
    /// Once this file exists, each datagram is answered with [`FINISH`].
    finish_file: Option<PathBuf>,
}

/// The client's receive buffer: a protected VM's output comes in bursts,
/// everything an epoch held at once (after a first synchronisation of a
/// few minutes under TCG, a few hundred datagrams), and a burst that does
/// not fit is dropped by the client's own kernel, which would look like
/// output lost by the protection. Set with SO_RCVBUFFORCE where allowed
/// (root), past `net.core.rmem_max` (208 KiB by default, about 150 small
/// datagrams).
const RECEIVE_BUFFER: usize = 8 << 20;

impl Listener {
    /// Binds `addr`, with a receive buffer of [`RECEIVE_BUFFER`] (or what
    /// the kernel allows this user).
    pub fn bind(addr: SocketAddr) -> io::Result<Listener> {
        use nix::sys::socket::{setsockopt, sockopt};
        let socket = UdpSocket::bind(addr)?;
        if setsockopt(&socket, sockopt::RcvBufForce, &RECEIVE_BUFFER).is_err() {
            let _ = setsockopt(&socket, sockopt::RcvBuf, &RECEIVE_BUFFER);
        }
        Ok(Listener {
            socket,
            count: Arc::new(AtomicU64::new(0)),
            finish_file: None,
        })
    }

    /// Answers every datagram with [`FINISH`] once `file` exists.
    pub fn finish_when(&mut self, file: PathBuf) {
        self.finish_file = Some(file);
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// Answers each TCP connection on `query` with the count so far, on a
    /// thread of its own.
    pub fn serve_count(&self, query: TcpListener) {
        let count = Arc::clone(&self.count);
        std::thread::spawn(move || {
            for mut s in query.incoming().flatten() {
                let _ = writeln!(s, "{}", count.load(Ordering::SeqCst));
            }
        });
    }

    /// Receives one datagram and returns its log line.
    pub fn next_line(&self) -> io::Result<String> {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let (n, from) = self.socket.recv_from(&mut buf)?;
        let line = log_line(SystemTime::now(), from, &buf[..n]);
        if self.finish_file.as_ref().is_some_and(|f| f.exists()) {
            // Lost, it is sent again at the next datagram.
            let _ = self.socket.send_to(FINISH, from);
        }
        Ok(line)
    }

    /// Logs every datagram to `out`, a flushed line each, for ever (or
    /// until receiving or writing fails).
    pub fn run(&self, out: &mut dyn Write) -> io::Result<()> {
        loop {
            let line = self.next_line()?;
            writeln!(out, "{line}")?;
            out.flush()?;
            self.count.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::net::TcpStream;
    use std::time::Duration;

    #[test]
    fn datagrams_and_log_lines() {
        assert_eq!(
            datagram(3, 41_234_567_890, "hag-guest: iteration 12, 6.0 s"),
            "HAG-GUEST seq=3 ns=41234567890 hag-guest: iteration 12, 6.0 s"
        );
        assert_eq!(escape(b"a b\\c\n\xff~"), "a b\\\\c\\x0a\\xff~");
        let at = UNIX_EPOCH + Duration::from_micros(1_700_000_000_000_042);
        assert_eq!(
            log_line(
                at,
                "192.0.2.10:40000".parse().unwrap(),
                b"HAG-GUEST seq=1 ns=5 x"
            ),
            "1700000000.000042 192.0.2.10:40000 HAG-GUEST seq=1 ns=5 x"
        );
    }

    /// A reporter's lines reach a listener on loopback as numbered
    /// datagrams with rising clocks, and the count is served over TCP.
    #[test]
    fn reporter_to_listener_on_loopback() {
        let listener = Listener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let query = TcpListener::bind("127.0.0.1:0").unwrap();
        let query_addr = query.local_addr().unwrap();
        listener.serve_count(query);
        let mut r = Reporter::new(Some(listener.local_addr().unwrap())).unwrap();
        r.line("hag-guest: iteration 1, 2.0 s");
        r.line("HAG-GUEST-RESULT PASS iterations=1 seconds=2.0");
        let mut seen = Vec::new();
        let mut out = Vec::new();
        for _ in 0..2 {
            let line = listener.next_line().unwrap();
            writeln!(out, "{line}").unwrap();
            listener.count.fetch_add(1, Ordering::SeqCst);
            let payload = line.splitn(3, ' ').nth(2).unwrap().to_string();
            seen.push(payload);
        }
        assert!(seen[0].starts_with("HAG-GUEST seq=1 ns="), "{}", seen[0]);
        assert!(seen[0].ends_with(" hag-guest: iteration 1, 2.0 s"));
        assert!(seen[1].starts_with("HAG-GUEST seq=2 ns="));
        assert!(seen[1].ends_with(" HAG-GUEST-RESULT PASS iterations=1 seconds=2.0"));
        let ns = |s: &str| -> u128 {
            s.split(' ')
                .nth(2)
                .unwrap()
                .strip_prefix("ns=")
                .unwrap()
                .parse()
                .unwrap()
        };
        assert!(ns(&seen[0]) <= ns(&seen[1]));
        let mut answer = String::new();
        BufReader::new(TcpStream::connect(query_addr).unwrap())
            .read_line(&mut answer)
            .unwrap();
        assert_eq!(answer, "2\n");
    }

    #[test]
    fn the_listener_asks_for_the_end_once_its_file_exists() {
        let file = std::env::temp_dir().join(format!("hag-guest-finish-{}", std::process::id()));
        let _ = std::fs::remove_file(&file);
        let mut listener = Listener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        listener.finish_when(file.clone());
        let mut r = Reporter::new(Some(listener.local_addr().unwrap())).unwrap();
        let wait_for_answer = |r: &mut Reporter| {
            for _ in 0..100 {
                if r.finish_asked() {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            false
        };
        r.line("hag-guest: iteration 1, 1.0 s");
        listener.next_line().unwrap();
        assert!(!wait_for_answer(&mut r), "asked before the file exists");
        std::fs::write(&file, b"").unwrap();
        r.line("hag-guest: iteration 2, 2.0 s");
        listener.next_line().unwrap();
        assert!(wait_for_answer(&mut r));
        std::fs::remove_file(&file).unwrap();
    }

    #[test]
    fn no_target_sends_nothing() {
        let mut r = Reporter::new(None).unwrap();
        r.line("hag-guest: iteration 1, 2.0 s");
        assert_eq!(r.seq, 0);
    }

    /// An epoch's held output arrives all at once: a burst of a few
    /// hundred datagrams, sent before the client reads any, is received
    /// whole (the kernel's default buffer drops the tail of it).
    #[test]
    fn a_released_burst_fits_the_receive_buffer() {
        let l = Listener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let to = l.local_addr().unwrap();
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let n = 600;
        for seq in 1..=n {
            tx.send_to(
                datagram(seq, 1, "hag-guest: iteration 1, 1.0 s").as_bytes(),
                to,
            )
            .unwrap();
        }
        l.socket
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let mut got = 0;
        while l.next_line().is_ok() {
            got += 1;
        }
        assert_eq!(got, n, "datagrams of the burst dropped");
    }
}
