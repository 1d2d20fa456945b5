//! hagctl's log on stderr: levelled, timestamped where no one else
//! stamps it, and as quiet or as chatty as `-q`/`-v` ask.
//!
//! Two kinds of line go to stderr:
//! - **log lines** (`hagctl: …`, `hagctl: warning: …`), written with
//!   [`error!`], [`warning!`], [`info!`] and [`debug!`];
//! - **progress lines** of a running job (`epoch 12: pause …`, a migration's
//!   progress, JSON progress objects with `--json`), written with
//!   [`progress!`] exactly as given, so that scripts can read them.
//!
//! How a line looks depends on where stderr goes:
//! - to systemd's journal (`$JOURNAL_STREAM` names stderr): each line starts
//!   with its syslog priority, `<4>hagctl: warning: …` (sd-daemon(3)); the
//!   journal keeps the level and adds the time (`journalctl -p warning`);
//! - to a terminal: `hagctl: …`, as typed commands print;
//! - anywhere else (a file, a pipe, a supervisor's log): log lines start
//!   with the UTC time, `2026-12-03T21:50:01.123Z hagctl: …`.
//!
//! `-q` keeps errors and warnings only (no progress); `-v` adds debug lines.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// A line's level; the numbers are syslog's priorities.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Level {
    Error = 3,
    Warn = 4,
    Info = 6,
    Debug = 7,
}

/// The most verbose level shown.
static SHOWN: AtomicU8 = AtomicU8::new(Level::Info as u8);
static STYLE: OnceLock<Style> = OnceLock::new();

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Style {
    Journal,
    Terminal,
    Timestamped,
}

/// Sets the level from `-q` (quiet) and `-v` (verbose).
pub fn init(quiet: bool, verbose: bool) {
    let shown = match (quiet, verbose) {
        (true, _) => Level::Warn,
        (false, true) => Level::Debug,
        (false, false) => Level::Info,
    };
    SHOWN.store(shown as u8, Ordering::Relaxed);
}

/// Whether lines of `level` are shown.
pub fn enabled(level: Level) -> bool {
    level as u8 <= SHOWN.load(Ordering::Relaxed)
}

fn style() -> Style {
    *STYLE.get_or_init(|| {
        if journal_is_stderr() {
            Style::Journal
        } else if std::io::stderr().is_terminal() {
            Style::Terminal
        } else {
            Style::Timestamped
        }
    })
}

/// `$JOURNAL_STREAM` is `DEV:INODE` of the journal's stream, set by
/// systemd; it names stderr only if stderr still is that stream.
fn journal_is_stderr() -> bool {
    use std::os::fd::AsFd;
    is_journal(std::io::stderr().as_fd())
}

/// Whether stdout is systemd's journal stream too (a unit's default): then
/// what is printed there and logged as well would show twice.
pub fn stdout_is_journal() -> bool {
    use std::os::fd::AsFd;
    is_journal(std::io::stdout().as_fd())
}

fn is_journal(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(st) = nix::sys::stat::fstat(fd) else {
        return false;
    };
    stream.to_str() == Some(&format!("{}:{}", st.st_dev, st.st_ino))
}

/// The text of a log line, without its newline.
fn format_line(style: Style, level: Level, now: std::time::SystemTime, message: &str) -> String {
    let kind = match level {
        Level::Warn => "warning: ",
        Level::Debug => "debug: ",
        Level::Error | Level::Info => "",
    };
    match style {
        Style::Journal => format!("<{}>hagctl: {kind}{message}", level as u8),
        Style::Terminal => format!("hagctl: {kind}{message}"),
        Style::Timestamped => format!(
            "{} hagctl: {kind}{message}",
            humantime::format_rfc3339_millis(now)
        ),
    }
}

/// Writes one log line (the macros call this).
pub fn write(level: Level, message: std::fmt::Arguments<'_>) {
    if !enabled(level) {
        return;
    }
    let line = format_line(
        style(),
        level,
        std::time::SystemTime::now(),
        &message.to_string(),
    );
    // One write per line, so lines of several threads never interleave.
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("{line}\n").as_bytes());
}

/// Writes one progress line as it is (the `progress!` macro calls this).
pub fn write_progress(line: std::fmt::Arguments<'_>) {
    if !enabled(Level::Info) {
        return;
    }
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("{line}\n").as_bytes());
}

/// `error!("…")`: a failure, `hagctl: …`.
macro_rules! error {
    ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Error, format_args!($($arg)*)) };
}
/// `warning!("…")`: `hagctl: warning: …`.
macro_rules! warning {
    ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Warn, format_args!($($arg)*)) };
}
/// `info!("…")`: what hagctl does, `hagctl: …`.
macro_rules! info {
    ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Info, format_args!($($arg)*)) };
}
/// `debug!("…")`: shown with `-v`, `hagctl: debug: …`.
macro_rules! debug {
    ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Debug, format_args!($($arg)*)) };
}
/// `progress!("…")`: a job's progress line, printed as given.
macro_rules! progress {
    ($($arg:tt)*) => { $crate::log::write_progress(format_args!($($arg)*)) };
}
pub(crate) use {debug, error, info, progress, warning};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_destination_gets_the_lines_it_can_read() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_796_334_601_123);
        assert_eq!(
            format_line(Style::Journal, Level::Warn, t, "no hang events"),
            "<4>hagctl: warning: no hang events"
        );
        assert_eq!(
            format_line(Style::Terminal, Level::Info, t, "backup listening"),
            "hagctl: backup listening"
        );
        assert_eq!(
            format_line(Style::Timestamped, Level::Error, t, "takeover: refused"),
            "2026-12-03T21:50:01.123Z hagctl: takeover: refused"
        );
        assert_eq!(
            format_line(Style::Journal, Level::Debug, t, "QMP"),
            "<7>hagctl: debug: QMP"
        );
    }

    #[test]
    fn quiet_keeps_warnings_and_verbose_adds_debug() {
        init(true, false);
        assert!(enabled(Level::Warn) && !enabled(Level::Info));
        init(false, true);
        assert!(enabled(Level::Debug));
        init(false, false);
        assert!(enabled(Level::Info) && !enabled(Level::Debug));
    }
}
