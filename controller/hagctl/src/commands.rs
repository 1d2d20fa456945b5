//! The subcommands: glue between the device, the event socket and the
//! output formats.

use crate::log::info;
use std::io::{self, Write};
use std::time::{Duration, Instant};

use hag_dev::{Device, DirtyError, ListError, OpenError, VersionError};
use nix::errno::Errno;

use crate::events::{EventSocket, ReceiveError, SubscribeError};
use crate::output;

/// Why `hagctl status` failed.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// See [`OpenError`].
    #[error(transparent)]
    Open(#[from] OpenError),
    /// See [`VersionError`].
    #[error(transparent)]
    Version(#[from] VersionError),
    /// See [`ListError`].
    #[error(transparent)]
    List(#[from] ListError),
    /// IOC_VGPU_STATS failed for a listed vGPU (other than it going away).
    #[error(transparent)]
    Stats(#[from] DirtyError),
    /// stdout could not be written.
    #[error("cannot write to stdout")]
    Output(#[source] io::Error),
}

/// `hagctl status`: refuse a module of another ABI, then show its vGPUs
/// and their counters.
pub fn status(json: bool) -> Result<(), StatusError> {
    let device = Device::open()?;
    let module = device.version()?;
    let vgpus = device.list_vgpus()?;
    let mut stats = Vec::with_capacity(vgpus.len());
    for v in &vgpus {
        match device.vgpu_stats(v.id) {
            Ok(s) => stats.push(Some(s)),
            // Removed since the list was read.
            Err(e) if e.errno() == Errno::ENODEV => stats.push(None),
            Err(e) => return Err(e.into()),
        }
    }
    let text = if json {
        output::status_json(&module, &vgpus, &stats) + "\n"
    } else {
        output::status_text(&module, &vgpus, &stats)
    };
    // Protection state of running `hagctl checkpoint`s.
    let protection: Vec<_> = crate::vm_dirs::runtime_dirs()
        .into_iter()
        .flat_map(|(name, dir)| {
            crate::checkpoint::protection_lines(&dir)
                .into_iter()
                .map(move |(st, line)| (name.clone(), st, line))
        })
        .collect();
    let text = if protection.is_empty() {
        text
    } else if json {
        match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(mut v) => {
                v["protection"] = protection
                    .iter()
                    .map(|(name, st, line)| {
                        let mut o = crate::checkpoint::protection_json(st, line);
                        o["vm"] = name.as_ref().map(|n| n.to_string()).into();
                        o
                    })
                    .collect();
                v.to_string() + "\n"
            }
            Err(_) => text,
        }
    } else {
        let mut t = text;
        for (name, _, line) in &protection {
            match name {
                Some(name) => t += &format!("protection of VM {name}: {line}\n"),
                None => t += &format!("protection: {line}\n"),
            }
        }
        t
    };
    match write_out(&mut io::stdout().lock(), &text) {
        // The reader is gone (`hagctl status | head -1`): it saw enough.
        Err(err) if err.kind() != io::ErrorKind::BrokenPipe => Err(StatusError::Output(err)),
        _ => Ok(()),
    }
}

/// Options of `hagctl events`.
pub struct EventsOptions {
    /// One JSON object per line instead of text.
    pub json: bool,
    /// Exit 0 after this many events.
    pub count: Option<u64>,
    /// Stop waiting after this long (an error if `count` was not reached).
    pub timeout: Option<Duration>,
}

/// Why `hagctl events` failed.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// See [`SubscribeError`].
    #[error(transparent)]
    Subscribe(#[from] SubscribeError),
    /// See [`ReceiveError`].
    #[error(transparent)]
    Receive(#[from] ReceiveError),
    /// `--timeout` passed before `--count` events arrived.
    #[error("timed out after {:.1} s with {seen} of {wanted} events", .timeout.as_secs_f64())]
    TimedOut {
        /// The `--timeout` given.
        timeout: Duration,
        /// Events printed.
        seen: u64,
        /// The `--count` given.
        wanted: u64,
    },
    /// stdout could not be written.
    #[error("cannot write to stdout")]
    Output(#[source] io::Error),
}

/// `hagctl events`: print each event as one line, flushed at once so a
/// reader of a redirected stdout sees it immediately.
pub fn events(options: &EventsOptions) -> Result<(), EventsError> {
    let mut socket = EventSocket::subscribe()?;
    info!("listening for hag events");
    let deadline = options.timeout.map(|t| Instant::now() + t);
    let mut seen = 0u64;
    let mut stdout = io::stdout().lock();
    loop {
        if options.count.is_some_and(|wanted| seen >= wanted) {
            return Ok(());
        }
        let remaining = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let Some(events) = socket.receive(remaining)? else {
            return match (options.count, options.timeout) {
                (Some(wanted), Some(timeout)) => Err(EventsError::TimedOut {
                    timeout,
                    seen,
                    wanted,
                }),
                _ => Ok(()),
            };
        };
        for event in &events {
            let line = if options.json {
                output::event_json(event)
            } else {
                output::event_text(event)
            };
            match write_out(&mut stdout, &(line + "\n")) {
                Ok(()) => {}
                // As in `status`: a reader that went away has seen enough.
                Err(err) if err.kind() == io::ErrorKind::BrokenPipe => return Ok(()),
                Err(err) => return Err(EventsError::Output(err)),
            }
            seen += 1;
            if options.count == Some(seen) {
                return Ok(());
            }
        }
    }
}

fn write_out(out: &mut impl Write, text: &str) -> io::Result<()> {
    out.write_all(text.as_bytes())?;
    out.flush()
}
