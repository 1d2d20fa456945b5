//! The faults the tests inject through hagctl's command line: a damaged
//! migration stream (`migrate --inject-fault`), a checkpoint that withholds
//! the CPU dirty log or the disks' deltas (`checkpoint
//! --test-withhold-cpu-dirty`, `--test-withhold-disk-delta`), a backup
//! that plays a fault named in a file (`backup --test-fault-file`); and the
//! checkpoint benchmark's ablations (`checkpoint --test-ablation`: epochs
//! paused but not sent, or sent without a pause).
//!
//! They exist so a scenario can show that a check fails when the thing it
//! checks is missing, and a benchmark can take an epoch's cost apart. A production hagctl must not be able to lose a VM's
//! writes on a mistyped flag, so the switches are compiled only with the
//! `test-switches` feature (`make controller` builds the test hagctl with
//! it; `cargo build --release` and the packages build without): without
//! it, each set below is empty, clap knows no such flag, and each accessor
//! answers "no fault".

use std::path::PathBuf;

use crate::checkpoint::Ablation;
use crate::migrate::Fault;

#[cfg(feature = "test-switches")]
mod compiled {
    use super::*;

    /// `hagctl migrate`'s test switches.
    #[derive(clap::Args, Debug, Default)]
    #[group(skip)]
    pub struct Migrate {
        /// For tests only: damage the stream (corrupt-page, truncate-context)
        #[arg(
            long,
            value_name = "FAULT",
            value_enum,
            hide_short_help = true,
            conflicts_with = "qmp"
        )]
        inject_fault: Option<Fault>,
    }

    impl Migrate {
        pub fn inject_fault(&self) -> Option<Fault> {
            self.inject_fault
        }
    }

    /// `hagctl checkpoint`'s test switches.
    #[derive(clap::Args, Debug, Default)]
    #[group(skip)]
    pub struct Checkpoint {
        /// For tests only: withhold the CPU dirty log (a takeover must fail)
        #[arg(long, hide = true, requires = "qmp")]
        test_withhold_cpu_dirty: bool,
        /// For tests only: send the disks' first copy but no epoch's disk
        /// delta (a takeover must fail)
        #[arg(long, hide = true, requires = "qmp")]
        test_withhold_disk_delta: bool,
        /// For benchmarks only: after epoch 2, pause without sending
        /// (pause-only) or send without pausing (send-only); the VM is
        /// not protected
        #[arg(
            long,
            value_name = "ABLATION",
            value_enum,
            hide = true,
            requires = "qmp"
        )]
        test_ablation: Option<Ablation>,
    }

    impl Checkpoint {
        pub fn withhold_cpu_dirty(&self) -> bool {
            self.test_withhold_cpu_dirty
        }
        pub fn withhold_disk_delta(&self) -> bool {
            self.test_withhold_disk_delta
        }
        pub fn ablation(&self) -> Option<Ablation> {
            self.test_ablation
        }
    }

    /// `hagctl backup`'s test switches.
    #[derive(clap::Args, Debug, Default)]
    #[group(skip)]
    pub struct Backup {
        /// For tests only: a file naming a fault to play while it says so
        /// (mute: send the primary nothing; drop-acks: never acknowledge;
        /// hold-takeover: a takeover waits before its fence)
        #[arg(long, value_name = "FILE", hide = true)]
        test_fault_file: Option<PathBuf>,
    }

    impl Backup {
        pub fn fault_file(&self) -> Option<PathBuf> {
            self.test_fault_file.clone()
        }
    }
}

#[cfg(not(feature = "test-switches"))]
mod compiled {
    use super::*;

    /// `hagctl migrate`'s test switches: none in this build.
    #[derive(clap::Args, Debug, Default)]
    #[group(skip)]
    pub struct Migrate {}

    impl Migrate {
        pub fn inject_fault(&self) -> Option<Fault> {
            None
        }
    }

    /// `hagctl checkpoint`'s test switches: none in this build.
    #[derive(clap::Args, Debug, Default)]
    #[group(skip)]
    pub struct Checkpoint {}

    impl Checkpoint {
        pub fn withhold_cpu_dirty(&self) -> bool {
            false
        }
        pub fn withhold_disk_delta(&self) -> bool {
            false
        }
        pub fn ablation(&self) -> Option<Ablation> {
            None
        }
    }

    /// `hagctl backup`'s test switches: none in this build.
    #[derive(clap::Args, Debug, Default)]
    #[group(skip)]
    pub struct Backup {}

    impl Backup {
        pub fn fault_file(&self) -> Option<PathBuf> {
            None
        }
    }
}

pub use compiled::{Backup, Checkpoint, Migrate};

/// Whether this hagctl was built with the test switches (`hagctl
/// --version` says so: a host running one is a test host).
pub const COMPILED: bool = cfg!(feature = "test-switches");
