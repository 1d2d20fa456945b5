//! `hag-vmm`: attach a hag-sim vGPU through VFIO, run GPU workloads on it
//! from a built-in guest driver, and check that hag's GPU dirty log holds
//! every guest page the GPU wrote.
//!
//! ```text
//! # hag-vmm run --mdev 83b8f4f2-509f-382f-3c1e-e6bfe0fa1001 --workload all
//! PASS stores: 528 commands, written 129 pages, dirty 129, missed 0, precision 1.00
//! PASS blit: 6 commands, written 31 pages, dirty 31, missed 0, precision 1.00
//! PASS batch: 26 commands, written 4 pages, dirty 4, missed 0, precision 1.00
//! ```
//!
//! Any failure (a workload's check, or the machinery) exits 1 after one
//! line on stderr, `hag-vmm: <what>: <why>`.

use std::collections::BTreeSet;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use hag_abi::abi;
use hag_dev::{bitmap_pages, bitmap_words, Device};
use hag_vmm::check::{run_workload, DirtyLog, Report};
use hag_vmm::driver::{Driver, DriverConfig, GttLayout};
use hag_vmm::ram::GuestRam;
use hag_vmm::vfio::VfioDevice;
use hag_vmm::workloads;

#[derive(Parser)]
#[command(
    name = "hag-vmm",
    version,
    about = "A minimal VFIO test VMM for hag's simulated vGPU",
    long_about = "A minimal VFIO test VMM for hag's simulated vGPU: it attaches a hag-sim mdev \
                  through VFIO as QEMU does, drives it with a built-in guest GPU driver whose \
                  state lives in guest RAM, verifies each workload's results, and checks that \
                  every guest page the GPU changed is in hag's GPU dirty log.\n\n\
                  On failure it prints one line, 'hag-vmm: <what>: <why>', and exits 1."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run GPU workloads on an mdev and check hag's dirty log
    #[command(after_long_help = "\
Workloads: stores, blit, batch (each must complete), hang (must hang the vGPU:
ERROR_STATUS 2 after the watchdog), reject (must be rejected at the offending
command), and all (stores, blit, batch in sequence, on one ring).

Text output, one line per workload:
  PASS stores: 528 commands, written 129 pages, dirty 129, missed 0, precision 1.00
'written' counts guest pages whose bytes the GPU changed, 'dirty' the pages
hag's dirty log marked, 'missed' the written pages it did not mark (must be
0); precision is written/dirty ('n/a' when nothing was marked). hang and
reject add ', hung' or ', rejected at gfx 0x… header 0x… reason N'.

JSON output (--json), one object per workload per line:
  {\"workload\": \"stores\", \"passed\": true, \"commands\": 528, \"submissions\": 8,
   \"written_pages\": 129, \"dirty_pages\": 129, \"missed\": 0, \"missed_gpas\": [],
   \"precision\": 1.0, \"interrupts\": 8, \"outcome\": \"completed\", \"error\": null}

--no-dirty-log stops the vGPU's dirty log instead of starting it, so every
written page counts as missed: the check must then fail.")]
    Run {
        /// UUID of the hag-sim mdev
        #[arg(long, value_name = "UUID")]
        mdev: String,
        /// Workload to run
        #[arg(long, value_name = "NAME", value_parser = workload_name)]
        workload: String,
        /// Guest RAM in MiB
        #[arg(long, value_name = "MIB", default_value_t = 64,
              value_parser = clap::value_parser!(u64).range(1..=4096))]
        ram_mib: u64,
        /// Print one JSON object per workload instead of text
        #[arg(long)]
        json: bool,
        /// Do not start hag's dirty log (the check must then fail)
        #[arg(long)]
        no_dirty_log: bool,
        /// Seconds to wait for one submission
        #[arg(long, value_name = "SECONDS", default_value = "10", value_parser = parse_seconds)]
        timeout: Duration,
        /// Set the vGPU's hang watchdog (milliseconds) through /dev/hag first
        #[arg(long, value_name = "MS",
              value_parser = clap::value_parser!(u32).range(i64::from(abi::WATCHDOG_MIN_MS)..=i64::from(abi::WATCHDOG_MAX_MS)))]
        watchdog_ms: Option<u32>,
        /// Ring size in pages
        #[arg(long, value_name = "PAGES", default_value_t = 2,
              value_parser = clap::value_parser!(u32).range(1..=512))]
        ring_pages: u32,
        /// Map graphics page i to guest page i (default: scattered)
        #[arg(long)]
        identity_gtt: bool,
    },
}

fn workload_name(text: &str) -> Result<String, String> {
    if text == "all" || workloads::NAMES.contains(&text) {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "unknown workload '{text}' (one of: all, {})",
            workloads::NAMES.join(", ")
        ))
    }
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

/// hag's dirty log of one vGPU over guest RAM, through `/dev/hag`.
struct HagLog<'d> {
    dev: &'d Device,
    vgpu_id: u32,
    bitmap: Vec<u64>,
    started: bool,
}

impl<'d> HagLog<'d> {
    fn new(dev: &'d Device, vgpu_id: u32, ram_size: u64, start: bool) -> anyhow::Result<Self> {
        if start {
            dev.dirty_start(vgpu_id, 0, ram_size)?;
        } else {
            // Make sure no earlier log is still running: then the check
            // sees no dirty page at all.
            let _ = dev.dirty_stop(vgpu_id);
        }
        Ok(HagLog {
            dev,
            vgpu_id,
            bitmap: vec![0; bitmap_words(ram_size)],
            started: start,
        })
    }
}

impl DirtyLog for HagLog<'_> {
    fn read_clear(&mut self) -> anyhow::Result<BTreeSet<u64>> {
        self.bitmap.fill(0);
        match self.dev.dirty_read_clear(self.vgpu_id, &mut self.bitmap) {
            Ok(_) => Ok(bitmap_pages(&self.bitmap).collect()),
            // With the log stopped the module may refuse to read it: no
            // page is dirty.
            Err(_) if !self.started => Ok(BTreeSet::new()),
            Err(e) => Err(e.into()),
        }
    }
}

impl Drop for HagLog<'_> {
    fn drop(&mut self) {
        if self.started {
            let _ = self.dev.dirty_stop(self.vgpu_id);
        }
    }
}

struct RunArgs {
    mdev: String,
    workload: String,
    ram_mib: u64,
    json: bool,
    no_dirty_log: bool,
    timeout: Duration,
    watchdog_ms: Option<u32>,
    ring_pages: u32,
    identity_gtt: bool,
}

fn print_report(report: &Report, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        println!("{}", report.summary());
    }
    Ok(())
}

fn run(args: RunArgs) -> anyhow::Result<()> {
    let names: Vec<&str> = if args.workload == "all" {
        workloads::ALL.to_vec()
    } else {
        vec![args.workload.as_str()]
    };
    let ram = GuestRam::with_mib(args.ram_mib)?;
    let dev = Device::open()?;
    dev.version()?;
    let vgpu = dev.find_vgpu(&args.mdev)?;
    if vgpu.source != abi::VGPU_SOURCE_SIM {
        bail!(
            "vGPU {} ({}) is a {} vGPU; hag-vmm drives hag-sim only",
            vgpu.id,
            args.mdev,
            abi::source_name(vgpu.source)
        );
    }
    if let Some(ms) = args.watchdog_ms {
        dev.set_watchdog(vgpu.id, ms)?;
    }
    let vfio = VfioDevice::attach(&args.mdev, &ram)
        .with_context(|| format!("cannot attach mdev {} through VFIO", args.mdev))?;
    let cfg = DriverConfig {
        ring_pages: args.ring_pages,
        gtt_layout: if args.identity_gtt {
            GttLayout::Identity
        } else {
            GttLayout::Scattered
        },
    };
    let mut drv = Driver::init(&vfio, &ram, cfg).context("cannot set up the guest GPU driver")?;
    let mut log = HagLog::new(&dev, vgpu.id, ram.size(), !args.no_dirty_log)?;

    let mut failed = Vec::new();
    for name in names {
        let mut w = workloads::by_name(name).context("unknown workload")?;
        let report = run_workload(&mut drv, &mut log, w.as_mut(), args.timeout)
            .with_context(|| format!("workload {name}"))?;
        print_report(&report, args.json)?;
        if !report.passed {
            failed.push(format!(
                "{name}: {}",
                report.error.as_deref().unwrap_or("failed")
            ));
        }
    }
    if !failed.is_empty() {
        bail!("workload {}", failed.join("; workload "));
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run {
            mdev,
            workload,
            ram_mib,
            json,
            no_dirty_log,
            timeout,
            watchdog_ms,
            ring_pages,
            identity_gtt,
        } => run(RunArgs {
            mdev,
            workload,
            ram_mib,
            json,
            no_dirty_log,
            timeout,
            watchdog_ms,
            ring_pages,
            identity_gtt,
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("hag-vmm: {err:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn workload_names_are_checked() {
        assert!(workload_name("all").is_ok());
        for n in workloads::NAMES {
            assert!(workload_name(n).is_ok());
        }
        assert_eq!(
            workload_name("spin"),
            Err("unknown workload 'spin' (one of: all, stores, blit, batch, hang, reject)".into())
        );
    }

    #[test]
    fn run_parses_with_defaults() {
        let cli = Cli::try_parse_from([
            "hag-vmm",
            "run",
            "--mdev",
            "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001",
            "--workload",
            "stores",
        ])
        .unwrap();
        let Command::Run {
            ram_mib,
            json,
            no_dirty_log,
            timeout,
            ring_pages,
            ..
        } = cli.command;
        assert_eq!(ram_mib, 64);
        assert!(!json && !no_dirty_log);
        assert_eq!(timeout, Duration::from_secs(10));
        assert_eq!(ring_pages, 2);
        assert!(Cli::try_parse_from(["hag-vmm", "run", "--mdev", "x", "--workload", "x"]).is_err());
    }
}
