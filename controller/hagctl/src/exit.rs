//! hagctl's exit statuses: one per outcome that a script, a libvirt hook or
//! a cluster manager must tell apart, documented in `hagctl --help` and the
//! README. Anything else that fails is 1; a usage error is 2 (clap exits
//! with it before hagctl runs anything).

use std::fmt;

/// How hagctl ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// The command did what it was asked.
    Success = 0,
    /// It failed (the message says why).
    Failure = 1,
    /// `checkpoint`: a newer generation fenced this primary; its VM was
    /// stopped, the backup runs it.
    Fenced = 3,
    /// `checkpoint`: the VM finished but the backup did not confirm the
    /// end, so it may still resume the last epoch.
    FinishedUnconfirmed = 4,
    /// `checkpoint`: a fence or a hand-over needed the VM stopped, and it
    /// could not be: it may run on two hosts. Act at once.
    StopFailed = 5,
    /// `takeover`, `confirm-backup-down`: the other side refused (its
    /// reason is the message).
    Refused = 6,
    /// `backup`: the VM taken over here ended with a failure.
    VmFailed = 7,
}

/// What `hagctl --help` says about exit statuses.
pub const HELP: &str = "\
Exit status: 0 success; 1 failure; 2 usage; 3 checkpoint: fenced by a newer \
generation (the VM was stopped here); 4 checkpoint: the VM finished but the \
backup did not confirm it (it may still resume the last epoch); 5 \
checkpoint: the VM could not be stopped when it had to be (it may run on two \
hosts); 6 takeover, confirm-backup-down: refused; 7 backup: the VM taken \
over here ended with a failure; 130 a second SIGINT or SIGTERM.";

/// A failure with its own exit status.
#[derive(Debug)]
pub struct Exit {
    /// The status hagctl exits with.
    pub status: Status,
    message: String,
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Exit {}

/// An error that makes hagctl exit with `status`.
pub fn with_status(status: Status, message: impl Into<String>) -> anyhow::Error {
    Exit {
        status,
        message: message.into(),
    }
    .into()
}

/// The status hagctl exits with for `err`.
pub fn status_of(err: &anyhow::Error) -> Status {
    err.chain()
        .find_map(|e| e.downcast_ref::<Exit>())
        .map_or(Status::Failure, |e| e.status)
}

/// `hagctl checkpoint`'s status for its report's outcome (`None`: 0).
pub fn checkpoint_outcome(outcome: &str) -> Option<Status> {
    match outcome {
        "fenced" => Some(Status::Fenced),
        "finished-unconfirmed" => Some(Status::FinishedUnconfirmed),
        "stop-failed" => Some(Status::StopFailed),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_outcome_has_its_status_and_others_fail_with_1() {
        assert_eq!(checkpoint_outcome("fenced"), Some(Status::Fenced));
        assert_eq!(checkpoint_outcome("stop-failed"), Some(Status::StopFailed));
        assert_eq!(
            checkpoint_outcome("finished-unconfirmed"),
            Some(Status::FinishedUnconfirmed)
        );
        for fine in ["finished", "ended", "handed-over", "vm-stopped"] {
            assert_eq!(checkpoint_outcome(fine), None, "{fine}");
        }
        let e = with_status(Status::Refused, "the backup holds no epoch");
        assert_eq!(status_of(&e), Status::Refused);
        assert_eq!(status_of(&e.context("takeover")), Status::Refused);
        assert_eq!(status_of(&anyhow::anyhow!("no")), Status::Failure);
    }

    #[test]
    fn the_help_names_every_status() {
        for s in [
            Status::Success,
            Status::Failure,
            Status::Fenced,
            Status::FinishedUnconfirmed,
            Status::StopFailed,
            Status::Refused,
            Status::VmFailed,
        ] {
            assert!(HELP.contains(&format!(" {} ", s as u8)), "{s:?}");
        }
        // clap's own status for a usage error.
        assert!(HELP.contains(" 2 usage"));
    }
}
