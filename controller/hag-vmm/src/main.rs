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
//! `hag-vmm hostile --mdev UUID` attacks the module instead (bad ioctls,
//! bad region accesses, fuzzed command streams; see [`hag_vmm::hostile`]):
//!
//! ```text
//! PASS hostile: 300 rounds (completed 35, rejected 210, hung 25, faults 30), 102 ioctl checks
//! ```
//!
//! Any failure (a workload's check, or the machinery) exits 1 after one
//! line on stderr, `hag-vmm: <what>: <why>`.

mod ctx_check;
mod fault_check;
mod remove_check;
mod vfio_migration;

use std::collections::BTreeSet;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use guest_gpu::driver::{Driver, DriverConfig, GttLayout};
use guest_gpu::workloads;
use guest_ram::GuestRam;
use hag_abi::abi;
use hag_dev::{bitmap_pages, bitmap_words, Device};
use hag_vmm::check::{run_workload_with, DirtyLog, Report};
use hag_vmm::hostile::{self, HostileConfig};
use hag_vmm::vfio::{DmaLogStart, VfioDevice, VfioDmaLog};

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
    /// Check that damaged, truncated, unknown-version and mismatched vGPU
    /// context snapshots are refused by IOC_RESTORE_CONTEXT
    #[command(after_long_help = "\
Runs work on --mdev through VFIO, quiesces it and saves its context, then
restores into --mdev2 (quiesced, not opened): a flipped byte, truncations
(EINVAL), an unknown version (EPROTO), another graphics memory size and a
GVT-g source with valid checksums (EXDEV); --mdev2's context must be
unchanged after each. The intact snapshot must restore and read back
identical. One 'ok:' line per step, then 'PASS context-check: …'.")]
    ContextCheck {
        /// UUID of the hag-sim mdev whose context is saved
        #[arg(long, value_name = "UUID")]
        mdev: String,
        /// UUID of the hag-sim mdev restored into
        #[arg(long, value_name = "UUID")]
        mdev2: String,
    },
    /// Check that IOC_QUIESCE honours its timeout under load and succeeds
    /// with ordinary work
    #[command(after_long_help = "\
On --mdev (through VFIO): quiesce an idle vGPU; quiesce with a blit and
with a 16000-command batch in flight (must succeed after all of the batch
ran; the work completes after resume); quiesce with a
self-chaining batch looping (must return ETIMEDOUT within about
--timeout-ms and leave the engine running until the watchdog declares a
hang); with work held in flight, a quiesce in another process ends when
that process is killed (SIGKILL) and lets its hold go; after a reset, work
and quiesce succeed again. One 'ok:' line per step, then 'PASS
quiesce-check: …'.")]
    QuiesceCheck {
        /// UUID of the hag-sim mdev
        #[arg(long, value_name = "UUID")]
        mdev: String,
        /// IOC_QUIESCE timeout in milliseconds
        #[arg(long, value_name = "MS", default_value_t = 500,
              value_parser = clap::value_parser!(u32).range(1..=10_000))]
        timeout_ms: u32,
    },
    /// Check that a VFIO access whose buffer faults forever stalls only
    /// itself, not its vGPU, another vGPU or /dev/hag
    #[command(after_long_help = "\
The buffer of a BAR0 write, a config read and VFIO_DEVICE_GET_INFO on
--mdev is, in turn, a userfaultfd page left missing (the test kernel needs
CONFIG_USERFAULTFD). While each call waits in its fault, --mdev's config
space and BAR0, --mdev2's config space and /dev/hag's statistics of --mdev
must answer within 10 s; then the fault is resolved with a zero page and
the call must end as it would have. One 'ok:' line per call, then 'PASS
fault-check: …'.")]
    FaultCheck {
        /// UUID of the hag-sim mdev whose calls fault
        #[arg(long, value_name = "UUID")]
        mdev: String,
        /// UUID of another hag-sim mdev
        #[arg(long, value_name = "UUID")]
        mdev2: String,
    },
    /// IOC_QUIESCE of vGPU --vgpu, nothing else (quiesce-check runs it in
    /// a process of its own, to kill it while it waits)
    #[command(hide = true)]
    QuiesceWait {
        /// The vGPU's id (`/dev/hag`)
        #[arg(long)]
        vgpu: u32,
        /// IOC_QUIESCE timeout in milliseconds
        #[arg(long, value_name = "MS")]
        timeout_ms: u32,
    },
    /// Check that calls still in flight when their vGPU is removed, and
    /// every later call for its id, are refused
    #[command(after_long_help = "\
With --mdev: a batch loops on the vGPU, IOC_QUIESCE (30 s) waits for it, and
the mdev's sysfs remove waits for the VMM (this process) to close; both must
still wait after 0.5 s. The VMM then closes: the remove must finish and the
quiesce be refused (ENODEV, or ECANCELED: the close let its hold go) within
seconds, and every per-vGPU ioctl for the id must fail with ENODEV. The
module must be loaded with allow_hang_injection=1.

With --held: the module must be loaded with test_hold_vgpu_ms=--hold-ms
(each /dev/hag ioctl then waits that long after it found its vGPU, as a
blocked user copy would) and allow_hang_injection=1. For each of ten
per-vGPU ioctls, on a fresh mdev set up so that it would succeed: start it,
remove the mdev while it is held; it must fail with ENODEV.

One 'ok:' line per step, then 'PASS remove-check: …'.")]
    RemoveCheck {
        /// UUID of the hag-sim mdev to quiesce and remove (it is removed)
        #[arg(long, value_name = "UUID", required_unless_present = "held")]
        mdev: Option<String>,
        /// Hold each ioctl past a remove (test_hold_vgpu_ms)
        #[arg(long, conflicts_with = "mdev")]
        held: bool,
        /// The module's test_hold_vgpu_ms
        #[arg(long, value_name = "MS", default_value_t = 1500,
              value_parser = clap::value_parser!(u64).range(100..=10_000))]
        hold_ms: u64,
    },
    /// Move a vGPU's context between two mdevs through VFIO migration v2
    /// and check the module's side of it
    #[command(after_long_help = "\
Attaches both mdevs, runs workloads on --mdev, checks that RUNNING -> STOP
fails with ETIMEDOUT while a batch loops, then STOP, STOP_COPY (reads the
data fd to EOF), RESUMING on --mdev2 with the data, STOP, RUNNING; compares
registers and GTT entries, runs a workload on --mdev2, and checks that a
damaged or truncated snapshot and too many bytes are refused. One 'ok:'
line per step, then 'PASS vfio-migration: …'; any failure exits 1.")]
    VfioMigrationCheck {
        /// UUID of the source hag-sim mdev
        #[arg(long, value_name = "UUID")]
        mdev: String,
        /// UUID of the target hag-sim mdev
        #[arg(long, value_name = "UUID")]
        mdev2: String,
    },
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
   \"precision\": 1.0, \"gpu_bytes_written\": 2112, \"interrupts\": 8,
   \"outcome\": \"completed\", \"error\": null}
gpu_bytes_written is what the vGPU's engine wrote during the workload (the
module's counter): the audit's precision in bytes is it over dirty_pages × 4096.

--no-dirty-log stops the vGPU's dirty log instead of starting it, so every
written page counts as missed: the check must then fail.

VFIO's standard DMA logging (VFIO_DEVICE_FEATURE_DMA_LOGGING_START over guest
RAM as one range, 4 KiB pages; a REPORT after each workload) is checked the
same way: every written page must be in its report too. The text line then
shows both logs, 'dirty 129 (vfio 129), missed 0 (vfio 0)', and the JSON
object adds \"vfio_dirty_pages\", \"vfio_missed\" and \"vfio_missed_gpas\".
On a kernel without DMA-logging support (ENOTTY, no CONFIG_IOMMUFD_DRIVER)
hag-vmm prints 'vfio dma logging: unsupported by this kernel' on stderr and
checks hag's log only. --no-vfio-dirty-log skips VFIO's log.")]
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
        /// Do not start or check VFIO's DMA logging
        #[arg(long)]
        no_vfio_dirty_log: bool,
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
    /// Attack the module: bad /dev/hag ioctls, bad VFIO accesses, fuzzed
    /// command streams
    #[command(after_long_help = "\
Part 1 calls every /dev/hag ioctl with bad numbers, pointers, ranges and ids
and checks the exact errno of each answer (the module must be loaded
without allow_hang_injection). Part 2 does the same on the VFIO device fd
(region and IRQ info, SET_IRQS, BAR0 and config reads and writes). Part 3
runs --iterations rounds of hostile command streams (random dwords, mutated
valid commands, self-chaining batches, GTT entries rewritten and the ring
moved while work runs) with the watchdog at its minimum, resetting the vGPU
after each; no guest page outside what the GTT mapped during a round may
change, each changed page must be in hag's dirty log, and the vGPU must
still answer.

Text output:
  PASS hostile: 300 rounds (completed X, rejected Y, hung Z, faults W), N ioctl checks
JSON output (--json): one object with the same counts, the seed and
'violations'. Any violated expectation fails the run (exit 1), naming it.")]
    Hostile {
        /// UUID of the hag-sim mdev
        #[arg(long, value_name = "UUID")]
        mdev: String,
        /// Seed of the command generator
        #[arg(long, value_name = "N", default_value_t = 1)]
        seed: u64,
        /// Fuzzing rounds
        #[arg(long, value_name = "N", default_value_t = 300)]
        iterations: u32,
        /// Seconds to wait for one round's submission
        #[arg(long, value_name = "SECONDS", default_value = "3", value_parser = parse_seconds)]
        round_timeout: Duration,
        /// Print one JSON object instead of text
        #[arg(long)]
        json: bool,
    },
    /// Run a long GPU workload as a migratable VM, controlled through a
    /// unix socket
    #[command(after_long_help = "\
Guest RAM is a memfd; the vGPU is attached through VFIO. The 'frames'
workload runs --iterations iterations (blits, stores, an MI_ATOMIC counter,
all state in guest RAM), then verifies all of it and prints one line:
  PASS frames: 3000 iterations verified
  FAIL frames: history slot 812 at gfx 0x3000 (guest page 1234) is 0x00000000, expected …
and exits 0 or 1. A controller (hagctl migrate / receive) talks to the VM
through --control; the protocol is in the vmm-control crate. A VM stopped
with 'quit' prints 'stopped: quit at iteration N' and exits 0.

--incoming attaches the vGPU and guest RAM but does not initialise either:
it waits for a controller to fill RAM, restore the vGPU context, set the VM
state and resume it, then continues the workload where it was.")]
    Serve {
        /// UUID of the hag-sim mdev
        #[arg(long, value_name = "UUID")]
        mdev: String,
        /// Path of the control socket
        #[arg(long, value_name = "PATH")]
        control: std::path::PathBuf,
        /// Workload (frames)
        #[arg(long, value_name = "NAME", default_value = "frames")]
        workload: String,
        /// Iterations of the workload
        #[arg(long, value_name = "N", default_value_t = guest_gpu::frames::DEFAULT_ITERATIONS,
              value_parser = clap::value_parser!(u32).range(0..=i64::from(guest_gpu::frames::MAX_ITERATIONS)))]
        iterations: u32,
        /// Guest RAM in MiB
        #[arg(long, value_name = "MIB", default_value_t = 64,
              value_parser = clap::value_parser!(u64).range(1..=4096))]
        ram_mib: u64,
        /// Wait for a controller to fill the VM and resume it
        #[arg(long)]
        incoming: bool,
        /// Print 'frames: iteration N' every N iterations (0: never); held
        /// like the result line while a checkpoint holds output
        #[arg(long, value_name = "N", default_value_t = 0)]
        progress: u32,
        /// The synthetic workload: each iteration also fills N more pages
        /// (one of 4 windows of N pages), to sweep the GPU's dirty rate
        #[arg(long, value_name = "N", default_value_t = 0,
              value_parser = clap::value_parser!(u32).range(0..=i64::from(guest_gpu::frames::MAX_DIRTY_PAGES)))]
        dirty_pages: u32,
    },
    /// Ask the VM a `serve --control PATH` runs to end its workload after
    /// the iterations done so far, verified as at its end (it prints its
    /// PASS/FAIL line then); prints the iteration it was at. For tests
    /// that end a run once they have seen what they wait for.
    Finish {
        /// Path of the VM's control socket
        #[arg(long, value_name = "PATH")]
        control: std::path::PathBuf,
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
    no_vfio_dirty_log: bool,
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
    let mut vfio_log: Option<VfioDmaLog<'_>> = None;
    if !args.no_vfio_dirty_log {
        match VfioDmaLog::start(&vfio, 0, ram.size())? {
            DmaLogStart::Started(l) => vfio_log = Some(l),
            DmaLogStart::Unsupported => eprintln!(
                "vfio dma logging: unsupported by this kernel \
                 (VFIO_DEVICE_FEATURE_DMA_LOGGING_START: ENOTTY); checking hag's dirty log only"
            ),
        }
    }

    let mut failed = Vec::new();
    for name in names {
        let mut w = workloads::by_name(name).context("unknown workload")?;
        let vfio_dyn = vfio_log.as_mut().map(|l| l as &mut dyn DirtyLog);
        let written0 = dev.vgpu_stats(vgpu.id)?.bytes_written;
        let mut report = run_workload_with(&mut drv, &mut log, vfio_dyn, w.as_mut(), args.timeout)
            .with_context(|| format!("workload {name}"))?;
        report.gpu_bytes_written = Some(
            dev.vgpu_stats(vgpu.id)?
                .bytes_written
                .wrapping_sub(written0),
        );
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

fn run_hostile(cfg: &HostileConfig, json: bool) -> anyhow::Result<()> {
    let report = hostile::run(cfg)?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", report.summary());
        for v in &report.violations {
            println!("  violated: {v}");
        }
    }
    if let Some(first) = report.violations.first() {
        bail!(
            "hostile: {} expectation(s) violated, first: {first}",
            report.violations.len()
        );
    }
    Ok(())
}

fn run_serve(cfg: &hag_vmm::serve::ServeConfig) -> anyhow::Result<()> {
    match hag_vmm::serve::serve(cfg)? {
        hag_vmm::serve::Outcome::Finished { passed: true, line } => {
            println!("{line}");
            Ok(())
        }
        hag_vmm::serve::Outcome::Finished {
            passed: false,
            line,
        } => {
            println!("{line}");
            bail!("the frames workload failed its verification")
        }
        hag_vmm::serve::Outcome::Quit { iteration } => {
            println!("stopped: quit at iteration {iteration}");
            Ok(())
        }
    }
}

fn quiesce_wait(vgpu: u32, timeout_ms: u32) -> anyhow::Result<()> {
    Device::open()?.quiesce(vgpu, timeout_ms)?;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::VfioMigrationCheck { mdev, mdev2 } => vfio_migration::run(&mdev, &mdev2),
        Command::ContextCheck { mdev, mdev2 } => ctx_check::context_check(&mdev, &mdev2),
        Command::QuiesceCheck { mdev, timeout_ms } => ctx_check::quiesce_check(&mdev, timeout_ms),
        Command::QuiesceWait { vgpu, timeout_ms } => quiesce_wait(vgpu, timeout_ms),
        Command::FaultCheck { mdev, mdev2 } => fault_check::fault_check(&mdev, &mdev2),
        Command::RemoveCheck {
            mdev,
            held,
            hold_ms,
        } => match mdev {
            Some(mdev) if !held => remove_check::quiesce_across_remove(&mdev),
            _ => remove_check::held_across_remove(hold_ms),
        },
        Command::Run {
            mdev,
            workload,
            ram_mib,
            json,
            no_dirty_log,
            no_vfio_dirty_log,
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
            no_vfio_dirty_log,
            timeout,
            watchdog_ms,
            ring_pages,
            identity_gtt,
        }),
        Command::Hostile {
            mdev,
            seed,
            iterations,
            round_timeout,
            json,
        } => run_hostile(
            &HostileConfig {
                mdev,
                seed,
                iterations,
                round_timeout,
            },
            json,
        ),
        Command::Serve {
            mdev,
            control,
            workload,
            iterations,
            ram_mib,
            incoming,
            progress,
            dirty_pages,
        } => run_serve(&hag_vmm::serve::ServeConfig {
            mdev,
            control,
            workload,
            iterations,
            ram_mib,
            incoming,
            progress,
            dirty_pages,
        }),
        Command::Finish { control } => finish(&control),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("hag-vmm: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// `hag-vmm finish`: the request, and the iteration the VM was at.
fn finish(control: &std::path::Path) -> anyhow::Result<()> {
    let mut vm = vmm_control::VmClient::connect(control)?;
    let (reply, _) = vm.call(&vmm_control::Request::Finish)?;
    println!(
        "finishing after iteration {}",
        reply.iteration.unwrap_or_default()
    );
    Ok(())
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
        } = cli.command
        else {
            panic!("not run");
        };
        assert_eq!(ram_mib, 64);
        assert!(!json && !no_dirty_log);
        let cli = Cli::try_parse_from([
            "hag-vmm",
            "run",
            "--mdev",
            "u",
            "--workload",
            "all",
            "--no-vfio-dirty-log",
        ])
        .unwrap();
        assert!(matches!(
            cli.command,
            Command::Run {
                no_vfio_dirty_log: true,
                no_dirty_log: false,
                ..
            }
        ));
        assert_eq!(timeout, Duration::from_secs(10));
        assert_eq!(ring_pages, 2);
        assert!(Cli::try_parse_from(["hag-vmm", "run", "--mdev", "x", "--workload", "x"]).is_err());
    }

    #[test]
    fn serve_parses_with_defaults() {
        let cli =
            Cli::try_parse_from(["hag-vmm", "serve", "--mdev", "u", "--control", "/s"]).unwrap();
        let Command::Serve {
            workload,
            iterations,
            ram_mib,
            incoming,
            ..
        } = cli.command
        else {
            panic!("not serve");
        };
        assert_eq!(workload, "frames");
        assert_eq!(iterations, guest_gpu::frames::DEFAULT_ITERATIONS);
        assert_eq!((ram_mib, incoming), (64, false));
    }

    #[test]
    fn hostile_parses_with_defaults() {
        let cli = Cli::try_parse_from(["hag-vmm", "hostile", "--mdev", "u"]).unwrap();
        let Command::Hostile {
            seed,
            iterations,
            round_timeout,
            json,
            ..
        } = cli.command
        else {
            panic!("not hostile");
        };
        assert_eq!((seed, iterations, json), (1, 300, false));
        assert_eq!(round_timeout, Duration::from_secs(3));
        let cli = Cli::try_parse_from([
            "hag-vmm",
            "hostile",
            "--mdev",
            "u",
            "--seed",
            "9",
            "--iterations",
            "5",
            "--json",
        ])
        .unwrap();
        assert!(matches!(
            cli.command,
            Command::Hostile {
                seed: 9,
                iterations: 5,
                json: true,
                ..
            }
        ));
    }
}
