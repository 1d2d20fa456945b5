//! `hagctl`: look at what the `hag_mdev` kernel module is doing.
//!
//! hag_mdev offers mediated vGPUs. hagctl is its userspace window: `status`
//! lists the vGPUs through the ioctls of `/dev/hag`, and `events` follows
//! the module's `hag` generic netlink family as vGPUs are created, opened,
//! hang or have commands rejected.
//!
//! Its promise:
//! - It speaks exactly one ABI, the one in `hag_abi` it was built with, and
//!   refuses a module (or a netlink family) of any other version instead of
//!   misreading it.
//! - Everything it receives from the kernel is checked before use; a
//!   malformed message is an error that says what was wrong, never a panic.
//! - Output is stable for scripts: `--json` gives one JSON object per line,
//!   and `events` flushes every line as it is printed.
//! - Any failure is one line on stderr, `hagctl: <what>: <why>`, and exit
//!   status 1 (2 for a usage error).
//!
//! ```text
//! $ hagctl status
//! hag_mdev 0.1.0, ABI 1, features: sim
//! 1 vGPU
//!   ID  UUID                                  SOURCE  STATE  GFX-MEM
//!    1  83b8f4f2-509f-382f-3c1e-e6bfe0fa1001  sim     idle   64 MiB
//! $ hagctl events --count 1
//! vgpu-created vgpu=1 uuid=83b8f4f2-509f-382f-3c1e-e6bfe0fa1001 message="created"
//! ```
//!
//! All `unsafe` is in the shared `hag_dev` crate, around the `/dev/hag` ioctls.

mod commands;
mod events;
mod migrate;
mod output;
mod wire;

use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use hag_abi::abi;

#[derive(Parser)]
#[command(
    name = "hagctl",
    about = "Inspect the hag_mdev kernel module: its vGPUs and its events",
    long_about = "Inspect the hag_mdev kernel module: its vGPUs (through /dev/hag) and its \
                  events (through the 'hag' generic netlink family).\n\n\
                  hagctl refuses a module built for another ABI version. On failure it prints \
                  one line, 'hagctl: <what>: <why>', and exits 1."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show the module's version and features, and list its vGPUs
    #[command(after_long_help = "\
Text output: a line 'hag_mdev VERSION, ABI N, features: LIST', a count, and a
table with the columns ID, UUID, SOURCE (sim, gvt), STATE (idle, open) and
GFX-MEM.

JSON output (--json), one object:
  {\"abi_version\": 1, \"module_version\": \"0.1.0\", \"features\": [\"sim\"],
   \"vgpus\": [{\"id\": 1, \"uuid\": \"…\", \"source\": \"sim\", \"state\": \"idle\",
               \"gfx_mem_size\": 67108864}]}
gfx_mem_size is in bytes.")]
    Status {
        /// Print one JSON object instead of text
        #[arg(long)]
        json: bool,
    },
    /// Print the module's events as they happen, one line each
    #[command(after_long_help = "\
Events: vgpu-created, vgpu-removed, vgpu-hung, command-rejected, state-changed
(an event this hagctl does not know prints as 'unknown kind=N').

Text output, one line per event; absent fields are left out:
  vgpu-created vgpu=1 uuid=83b8f4f2-509f-382f-3c1e-e6bfe0fa1001 message=\"…\"

JSON output (--json), one object per line; absent fields are left out:
  {\"event\": \"vgpu-created\", \"vgpu\": 1, \"uuid\": \"…\", \"timestamp_ns\": 123,
   \"message\": \"…\"}
  timestamp_ns is the kernel's monotonic clock (ktime_get_ns); \"kind\" (the
  number) appears only when \"event\" is \"unknown\".

Once subscribed, hagctl prints 'hagctl: listening for hag events' on stderr.
Every line of stdout is flushed as soon as it is printed.")]
    Events {
        /// Print one JSON object per event instead of text
        #[arg(long)]
        json: bool,
        /// Exit (status 0) after N events
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
        /// Stop after SECONDS (fractions allowed); with --count, not having
        /// seen N events by then is an error
        #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
        timeout: Option<Duration>,
    },
    /// Live-migrate a hag-vmm VM with its vGPU to a host running `hagctl receive`
    #[command(after_long_help = "\
Iterative pre-copy of guest RAM: round 0 sends every non-zero page, each
later round the pages the VM's CPU dirtied (from the VMM) or its GPU dirtied
(from hag's dirty log), until a round would send at most --threshold-pages
or --max-rounds is reached. Then stop-and-copy: pause the VM, quiesce the
vGPU, send the last dirty pages, the vGPU context and the VM state; the
target restores them and resumes, and the source VM is stopped. Before the
target's acknowledgement, any failure resumes the source VM and discards
the target's.

Progress on stderr, one line per round:
  round 3: 412 pages, 1.6 MiB → 0.3 MiB compressed
Text report on stdout:
  migrated to 192.0.2.11:7100: downtime 84.2 ms (quiesce 1.3 ms), 3 rounds, …
    round 0 (precopy): 240 pages (0 zero; cpu 0, gpu 0), 0.9 MiB → 0.1 MiB on the wire, 210.4 ms
JSON report (--json): one object with downtime_ms, quiesce_ms, rounds,
per_round [{round, kind, pages, zero_pages, cpu_dirty, gpu_dirty, raw_bytes,
wire_bytes, ms}], total_pages, total_bytes, downtime_bytes, context_bytes,
vm_state_bytes, paused_at_iteration, gpu_dirty, total_ms.

--no-gpu-dirty ignores hag's GPU dirty log: pages only the GPU wrote are
then missed, which the workload's own check must catch (for tests).")]
    Migrate {
        /// Control socket of the source VM (hag-vmm serve --control)
        #[arg(long, value_name = "SOCKET")]
        vm: std::path::PathBuf,
        /// The target, where `hagctl receive` listens
        #[arg(long, value_name = "HOST:PORT")]
        to: String,
        /// Most rounds, the stop-and-copy one included (at least 2)
        #[arg(long, value_name = "N", default_value_t = 8,
              value_parser = clap::value_parser!(u32).range(2..=1000))]
        max_rounds: u32,
        /// Stop and copy once at most this many pages are dirty
        #[arg(long, value_name = "N", default_value_t = 256)]
        threshold_pages: u64,
        /// How long the vGPU may take to go idle at stop time
        #[arg(long, value_name = "MS", default_value_t = 2000,
              value_parser = clap::value_parser!(u32).range(1..=i64::from(abi::QUIESCE_MAX_MS)))]
        quiesce_timeout_ms: u32,
        /// Ignore hag's GPU dirty log (tests: the workload must then fail)
        #[arg(long)]
        no_gpu_dirty: bool,
        /// Keep trying to connect to the target for SECONDS
        #[arg(long, value_name = "SECONDS", default_value = "30", value_parser = parse_seconds)]
        connect_timeout: Duration,
        /// Print one JSON object instead of text
        #[arg(long)]
        json: bool,
    },
    /// Receive one migration into an incoming hag-vmm VM
    #[command(after_long_help = "\
Listens on ADDR:PORT for one `hagctl migrate`, writes the pages into the
incoming VM's guest RAM (hag-vmm serve --incoming), restores the vGPU
context into its vGPU, sets the VM state and resumes it. If the stream is
damaged, truncated or aborted, the incoming VM is told to quit.

Text report: 'received from ADDR: N rounds, P pages (Z zero), … VM resumed
here'. JSON (--json): {from, rounds, pages, zero_pages, context_bytes,
vm_state_bytes, bytes, resumed}.")]
    Receive {
        /// Address and port to listen on
        #[arg(long, value_name = "ADDR:PORT")]
        listen: String,
        /// Control socket of the incoming VM
        #[arg(long, value_name = "SOCKET")]
        vm: std::path::PathBuf,
        /// Print one JSON object instead of text
        #[arg(long)]
        json: bool,
    },
}

fn parse_seconds(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text
        .parse()
        .map_err(|_| format!("'{text}' is not a number of seconds"))?;
    Duration::try_from_secs_f64(seconds)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("'{text}' is not a positive number of seconds"))
}

fn cli() -> Cli {
    // The ABI version is part of the answer to "which hagctl is this?", and
    // clap only takes a version string it can keep.
    let version: &'static str = Box::leak(
        format!(
            "{} (hag ABI {})",
            env!("CARGO_PKG_VERSION"),
            abi::ABI_VERSION
        )
        .into_boxed_str(),
    );
    let matches = Cli::command().version(version).get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|err| err.exit())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Status { json } => commands::status(json)?,
        Command::Events {
            json,
            count,
            timeout,
        } => commands::events(&commands::EventsOptions {
            json,
            count,
            timeout,
        })?,
        Command::Migrate {
            vm,
            to,
            max_rounds,
            threshold_pages,
            quiesce_timeout_ms,
            no_gpu_dirty,
            connect_timeout,
            json,
        } => {
            let report = migrate::migrate(&migrate::MigrateOptions {
                vm,
                to,
                max_rounds,
                threshold_pages,
                quiesce_timeout_ms,
                no_gpu_dirty,
                connect_timeout,
            })?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", report.text());
            }
        }
        Command::Receive { listen, vm, json } => {
            let report = migrate::receive(&migrate::ReceiveOptions { listen, vm })?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", report.text());
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(cli()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("hagctl: {err:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn seconds_parse() {
        assert_eq!(parse_seconds("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_seconds("0.5"), Ok(Duration::from_millis(500)));
        assert!(parse_seconds("0").is_err());
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("soon").is_err());
        assert!(parse_seconds("inf").is_err());
    }
}
