//! `hag-guest`: the guest GPU driver and workload of hag's real-VM tests,
//! a process inside a Linux guest of QEMU/KVM with a `hag-sim` vGPU
//! attached through vfio-pci.
//!
//! It finds the vGPU (PCI `1234:4847`) in sysfs, maps its BAR0
//! ([`pci`]), takes locked memory whose pages lie scattered in guest
//! physical memory and finds their frames ([`pagemap`]), and drives the
//! vGPU with the guest driver ([`guest_gpu::driver::Driver`]) and `frames`
//! workload ([`guest_gpu::frames::Frames`]) that `hag-vmm` runs too, over
//! that memory: the driver's GTT entries carry the real guest physical frames
//! ([`guest_ram::GuestRam::with_frames`]). Alongside, the CPU rewrites
//! a region of its own ([`cpu`]). It runs for at least `--iterations`
//! iterations and `--seconds` seconds (a migration happens meanwhile),
//! then checks all of it.
//!
//! Console (stdout, each line flushed):
//!
//! ```text
//! hag-guest: vGPU 0000:00:03.0, GPU memory 8 MiB (2048 pages, guest frames 0x1a2b..0x3c4d), CPU region 2 MiB (4 pages per iteration)
//! HAG-GUEST-READY
//! hag-guest: iteration 1234, 12.0 s
//! HAG-GUEST-RESULT PASS iterations=45678 seconds=90.0
//! ```
//!
//! or `HAG-GUEST-RESULT FAIL <what differed>; iterations=N seconds=S`.
//! With `--report HOST:PORT` each progress line and the result also leave
//! as one numbered UDP datagram ([`report`]); `hag-guest listen --port P`,
//! run on another host, is the client that logs them.
//! Exit status 0 on PASS, 1 on FAIL, 2 (after one line `hag-guest: <what>:
//! <why>` on stderr) when it could not run.

mod cpu;
mod disk;
mod pagemap;
mod pci;
mod report;

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use guest_gpu::driver::{Driver, DriverConfig, Registers};
use guest_gpu::frames::{Frames, Mismatches, Step, MAX_DIRTY_PAGES, MAX_ITERATIONS};
use guest_ram::{GuestRam, PAGE_SIZE};

use crate::cpu::CpuRegion;
use crate::pci::Bar0;
use crate::report::{Listener, Reporter};

#[derive(Parser, Debug)]
#[command(
    name = "hag-guest",
    version,
    args_conflicts_with_subcommands = true,
    about = "hag's guest GPU driver and workload, run inside a VM with a hag-sim vGPU",
    long_about = "hag's guest GPU driver and workload, run as root inside a Linux guest of \
                  QEMU/KVM that has a hag-sim vGPU attached (-device \
                  vfio-pci,sysfsdev=/sys/bus/mdev/devices/UUID). It drives the vGPU with \
                  the guest GPU driver hag-vmm uses too and runs its 'frames' GPU workload plus a CPU \
                  workload on its own memory, for at least --iterations iterations and \
                  --seconds seconds, then verifies every byte of both.",
    after_long_help = "\
DEVICE
  The vGPU is the PCI device 1234:4847 under /sys/bus/pci/devices (or
  --device). hag-guest refuses a device a kernel driver has bound, writes 1
  to its 'enable' (memory decoding), sets bus mastering in its command
  register ('config') and maps 'resource0' (BAR0, 2 MiB: registers and GTT;
  O_RDWR|O_SYNC, MAP_SHARED). Every register access is one volatile 32-bit
  load or store, which QEMU traps and forwards to the mdev. There is no
  interrupt: completion is polled.

MEMORY
  --mib MiB of anonymous memory, populated, written and locked
  (MAP_POPULATE|MAP_LOCKED, mlock), hold everything the GPU touches: status
  page, ring and the workload's buffers. Its guest physical frames are read
  from /proc/self/pagemap, which shows them only to root (CAP_SYS_ADMIN).
  The driver maps graphics page g to buffer page p in the GTT with p's real
  guest physical address (the vGPU's IOVA is the guest physical address);
  all else addresses the buffer by page. The frames stay put because the
  pages are locked and the guest kernel has neither swap nor page
  migration (no compaction, THP, NUMA, CMA, hotplug, KSM); a kernel that
  migrates pages breaks this, which is why the frames are read again at the
  end and a moved page fails the run.

WORKLOAD
  Each iteration submits one GPU batch of the 'frames' workload (fills and
  copies of 8 frames, a history slot written once per iteration, an
  atomic counter, a status page seqno; --dirty-pages adds synthetic fills)
  and, while the GPU runs it, the CPU rewrites --cpu-pages whole pages of
  its --cpu-mib region with a pattern of (iteration, page), cycling
  through the region, so each page's last writer is known. The VM thus
  dirties memory with the GPU (which only hag's dirty log sees) and the CPU
  (which KVM tracks). The run ends once both --iterations iterations are
  done and --seconds seconds have passed (at most 262144 iterations, the
  history's size: a very fast machine is paced to fit). Progress goes to
  stdout every --progress seconds. SIGTERM (systemctl stop) ends the run
  early: it verifies and reports as at its end.

VERIFICATION
  At the end: no buffer page moved (pagemap again); every GPU-written byte
  against the workload's model (control page, counter, seqno, every
  history slot, every frame pixel, scratch pages) and every page never
  allocated still zero; every CPU region page equal to its last writer's
  pattern (or zero if never written). A GPU write lost in a migration (a
  history slot written after its page was last copied) or a lost CPU write
  makes it FAIL.

CONSOLE (stdout, one flushed line each)
  hag-guest: vGPU BDF, GPU memory ...          what was set up
  HAG-GUEST-READY                              set up, the run starts
  hag-guest: iteration N, S s                  progress (iterations done)
  HAG-GUEST-RESULT PASS iterations=N seconds=S
  HAG-GUEST-RESULT FAIL <check: where, found vs expected (count)>; iterations=N seconds=S

NETWORK
  --report HOST:PORT also sends each progress line and the result line as
  one UDP datagram, 'HAG-GUEST seq=N ns=T <line>': seq counts from 1, ns
  is CLOCK_MONOTONIC at the send (a guest re-executing from an earlier
  state sends other bytes under the same seq). Sent before the line is
  printed. A failed send is said once on the console; the run goes on.
  'hag-guest listen --port P' (on another host) logs them, one line each:
  '<arrival secs.micros> <from> <payload>'. A datagram HAG-GUEST-FINISH
  from that address ends the run at its next progress line, verified as at
  its end (as SIGTERM does); 'listen --finish-file F' answers so once F
  exists.

EXIT STATUS
  0 PASS, 1 FAIL, 2 could not run (one line on stderr:
  'hag-guest: <what>: <why>'), also for usage errors."
)]
struct Cli {
    /// PCI address of the vGPU (0000:00:03.0 or 00:03.0); default: the
    /// only PCI device 1234:4847
    #[arg(long, value_name = "BDF")]
    device: Option<String>,
    /// MiB of locked memory for the GPU (ring, status page, buffers), all
    /// mapped by the GTT: 2 to 64
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u64).range(2..=64))]
    mib: u64,
    /// MiB of memory the CPU rewrites (0: no CPU workload)
    #[arg(long = "cpu-mib", value_name = "M", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(0..=4096))]
    cpu_mib: u64,
    /// Pages of the CPU region rewritten per iteration
    #[arg(long = "cpu-pages", value_name = "K", default_value_t = 4,
          value_parser = clap::value_parser!(u64).range(1..))]
    cpu_pages: u64,
    /// Synthetic GPU-filled pages per iteration (the frames workload's
    /// scratch windows; 4 windows of D pages must fit in --mib)
    #[arg(long = "dirty-pages", value_name = "D", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=i64::from(MAX_DIRTY_PAGES)))]
    dirty_pages: u32,
    /// Run at least N iterations (at most 262144)
    #[arg(long, value_name = "N", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(0..=i64::from(MAX_ITERATIONS)))]
    iterations: u32,
    /// ... and at least S seconds
    #[arg(long, value_name = "S", default_value_t = 30)]
    seconds: u64,
    /// Seconds between progress lines
    #[arg(long, value_name = "SECS", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(1..))]
    progress: u64,
    /// At most R iterations per second (0: as fast as the vGPU goes), so
    /// that runs with and without a vGPU dirty memory at the same rate
    #[arg(long, value_name = "R", default_value_t = 0)]
    rate: u32,
    /// No vGPU: the CPU workload alone, paced by --rate (the benchmark's
    /// VM without a vGPU); needs --cpu-mib and --rate
    #[arg(long = "no-vgpu", requires = "rate")]
    no_vgpu: bool,
    /// Also send each progress line and the result as a UDP datagram here
    /// (an IP address: the guest has no resolver)
    #[arg(long, value_name = "HOST:PORT")]
    report: Option<SocketAddr>,
    /// Also commit numbered records to this block device or file (made,
    /// 64 MiB, if missing), each synced before it counts, and read them
    /// all back at the end (progress lines say how many are committed)
    #[arg(long, value_name = "PATH")]
    disk: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The client of --report, run on another host: log each datagram to
    /// stdout as '<arrival secs.micros> <from> <payload>', a flushed line
    /// each, until killed
    Listen {
        /// UDP port to receive on
        #[arg(long, value_name = "P")]
        port: u16,
        /// Address to bind
        #[arg(long, value_name = "ADDR", default_value = "0.0.0.0")]
        bind: IpAddr,
        /// Also answer each TCP connection on this port with the number of
        /// datagrams logged so far ('N' and a newline)
        #[arg(long = "query-port", value_name = "Q")]
        query_port: Option<u16>,
        /// Once this file exists, answer each datagram with
        /// HAG-GUEST-FINISH: the guest ends its run early, verified
        #[arg(long = "finish-file", value_name = "F")]
        finish_file: Option<std::path::PathBuf>,
    },
}

/// Prints one line on the console and flushes it (a console that fails
/// cannot be told so).
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// How a run ended.
struct Outcome {
    iterations: u32,
    seconds: f64,
    /// What differed, by check; empty: PASS.
    failures: Vec<String>,
}

/// How long to run.
#[derive(Clone, Copy, Debug)]
struct Plan {
    /// At least this many iterations ...
    iterations: u32,
    /// ... and at least this long.
    time: Duration,
    /// Between progress lines.
    progress: Duration,
    /// At most this many iterations per second (0: no limit).
    rate: u32,
}

/// The CPU workload alone, for a VM without a vGPU (`--no-vgpu`).
fn run_cpu_only(cli: &Cli, reporter: &mut Reporter) -> anyhow::Result<Outcome> {
    if cli.cpu_mib == 0 || cli.rate == 0 {
        bail!("--no-vgpu needs a CPU region (--cpu-mib) and a --rate");
    }
    let cpu = CpuRegion::new(cli.cpu_mib << 8, cli.cpu_pages).context("CPU region")?;
    say(&format!(
        "hag-guest: no vGPU, CPU region {} MiB ({} pages per iteration), {} iterations/s",
        cli.cpu_mib,
        cpu.per_iteration(),
        cli.rate
    ));
    say("HAG-GUEST-READY");
    let start = Instant::now();
    let time = Duration::from_secs(cli.seconds);
    let pace = Duration::from_secs(1) / cli.rate;
    let progress = Duration::from_secs(cli.progress);
    let mut next_progress = progress;
    let mut done = 0u32;
    while (done < cli.iterations || start.elapsed() < time) && !stop_requested() {
        cpu.write(done).context("CPU workload")?;
        done += 1;
        let due = pace * done;
        let elapsed = start.elapsed();
        if elapsed < due {
            std::thread::sleep(due - elapsed);
        }
        if start.elapsed() >= next_progress {
            report(
                reporter,
                &format!(
                    "hag-guest: iteration {done}, {:.1} s",
                    start.elapsed().as_secs_f64()
                ),
            );
            next_progress += progress;
        }
    }
    let found: Mismatches = cpu.check(done)?;
    let failures = if found.is_empty() {
        Vec::new()
    } else {
        vec![format!("CPU memory: {found}")]
    };
    Ok(Outcome {
        iterations: done,
        seconds: start.elapsed().as_secs_f64(),
        failures,
    })
}

/// Sets up the vGPU and memory, runs, verifies.
fn run(cli: &Cli, reporter: &mut Reporter) -> anyhow::Result<Outcome> {
    if cli.no_vgpu {
        return run_cpu_only(cli, reporter);
    }
    pagemap::check_page_size()?;
    let dev = pci::find(Path::new(pci::SYSFS_PCI), cli.device.as_deref())?;
    let bdf = dev
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    pci::enable(&dev)?;
    let bar = Bar0::map(&dev.join("resource0"))?;

    let ram = GuestRam::new_locked(cli.mib << 20).context("GPU memory")?;
    let frames_of = pagemap::frames(ram.host_addr(), ram.pages()).context("GPU memory")?;
    let (lo, hi) = (
        frames_of.iter().min().copied().unwrap_or(0),
        frames_of.iter().max().copied().unwrap_or(0),
    );
    let ram = ram.with_frames(frames_of).context("GPU memory")?;
    let cpu = match cli.cpu_mib {
        0 => None,
        mib => Some(CpuRegion::new(mib << 8, cli.cpu_pages).context("CPU region")?),
    };

    let mut drv =
        Driver::init(&bar, &ram, DriverConfig::default()).with_context(|| format!("vGPU {bdf}"))?;
    if drv.gtt().pages() < ram.pages() {
        bail!(
            "vGPU {bdf}: its GTT maps {} MiB, less than --mib {}",
            (drv.gtt().pages() * PAGE_SIZE) >> 20,
            cli.mib
        );
    }
    let mut frames = Frames::start_synthetic(&mut drv, MAX_ITERATIONS, cli.dirty_pages)
        .context("frames workload")?;
    say(&format!(
        "hag-guest: vGPU {bdf}, GPU memory {} MiB ({} pages, guest frames {lo:#x}..{hi:#x}), {}",
        cli.mib,
        ram.pages(),
        match &cpu {
            Some(c) => format!(
                "CPU region {} MiB ({} pages per iteration)",
                cli.cpu_mib,
                c.per_iteration()
            ),
            None => "no CPU region".to_string(),
        }
    ));
    let disk = match &cli.disk {
        Some(path) => Some(disk::DiskLog::start(path)?),
        None => None,
    };
    say("HAG-GUEST-READY");
    let plan = Plan {
        iterations: cli.iterations,
        time: Duration::from_secs(cli.seconds),
        progress: Duration::from_secs(cli.progress),
        rate: cli.rate,
    };
    let (iterations, seconds) =
        work(
            &mut drv,
            &mut frames,
            cpu.as_ref(),
            plan,
            &mut |l: &str| match &disk {
                Some(d) => report(reporter, &format!("{l}, disk {} records", d.committed())),
                None => report(reporter, l),
            },
        )?;
    let now = pagemap::frames(ram.host_addr(), ram.pages()).context("GPU memory")?;
    let mut failures = verify(&drv, &frames, cpu.as_ref(), iterations, &now)?;
    if let Some(d) = disk {
        let (records, found) = d.finish()?;
        say(&format!(
            "hag-guest: disk: {records} records committed and read back"
        ));
        failures.extend(found);
    }
    Ok(Outcome {
        iterations,
        seconds,
        failures,
    })
}

/// Runs iterations of the GPU and CPU workloads until `plan` is met;
/// progress lines go to `say`. Returns the iterations done and the seconds
/// they took.
fn work<R: Registers>(
    drv: &mut Driver<'_, R>,
    frames: &mut Frames,
    cpu: Option<&CpuRegion>,
    plan: Plan,
    say: &mut dyn FnMut(&str),
) -> anyhow::Result<(u32, f64)> {
    let start = Instant::now();
    let mut next_progress = plan.progress;
    let mut last_start = start;
    loop {
        let done = frames.iteration(&drv.mem()).context("frames workload")?;
        let elapsed = start.elapsed();
        if done >= plan.iterations && elapsed >= plan.time {
            break;
        }
        if stop_requested() {
            say(&format!(
                "hag-guest: asked to end (SIGTERM or HAG-GUEST-FINISH): ending the run at {done} iterations after {:.1} s",
                elapsed.as_secs_f64()
            ));
            break;
        }
        if done >= MAX_ITERATIONS {
            say(&format!(
                "hag-guest: stopping at {done} iterations after {:.1} s: the history holds no more",
                elapsed.as_secs_f64()
            ));
            break;
        }
        // Pacing: the history slots must last until `plan.time`, and no
        // faster than --rate.
        if elapsed < plan.time {
            let mut pace = (plan.time - elapsed) / (MAX_ITERATIONS - done);
            if plan.rate > 0 {
                pace = pace.max(Duration::from_secs(1) / plan.rate);
            }
            let since = last_start.elapsed();
            if since < pace {
                std::thread::sleep(pace - since);
            }
        }
        last_start = Instant::now();
        // Submit iteration `done`, let the CPU write while the GPU runs it,
        // then wait for the GPU and advance the control page.
        if frames.step(drv).context("GPU workload")? == Step::Finished {
            break;
        }
        if let Some(cpu) = cpu {
            cpu.write(done).context("CPU workload")?;
        }
        frames.step(drv).context("GPU workload")?;
        let elapsed = start.elapsed();
        if elapsed >= next_progress {
            say(&format!(
                "hag-guest: iteration {}, {:.1} s",
                done + 1,
                elapsed.as_secs_f64()
            ));
            while next_progress <= elapsed {
                next_progress += plan.progress;
            }
        }
    }
    let iterations = frames.finish(drv).context("frames workload")?;
    Ok((iterations, start.elapsed().as_secs_f64()))
}

/// Checks everything after `iterations` iterations: that no page of guest
/// RAM moved from its frame (`frames_now`, read again), the GPU's memory
/// against the frames workload's model, the CPU region against its own,
/// and the vGPU's error state. Returns what differed, one entry per check.
fn verify<R: Registers>(
    drv: &Driver<'_, R>,
    frames: &Frames,
    cpu: Option<&CpuRegion>,
    iterations: u32,
    frames_now: &[u64],
) -> anyhow::Result<Vec<String>> {
    let mut failures = Vec::new();
    let moved = pagemap::moved(drv.ram().frame_table().unwrap_or_default(), frames_now);
    if let Some(&(page, was, is)) = moved.first() {
        failures.push(format!(
            "pinning: buffer page {page} moved from guest frame {was:#x} to {is:#x} during the run, \
             the GPU may have written the old frame ({} page{} moved)",
            moved.len(),
            if moved.len() == 1 { "" } else { "s" }
        ));
    }
    let gpu = frames.check(drv).context("GPU memory")?;
    if !gpu.is_empty() {
        failures.push(format!("GPU memory: {gpu}"));
    }
    if let Some(cpu) = cpu {
        let found: Mismatches = cpu.check(iterations)?;
        if !found.is_empty() {
            failures.push(format!("CPU memory: {found}"));
        }
    }
    if let Some(err) = drv.error_state().context("vGPU")? {
        failures.push(format!("vGPU: {err}"));
    }
    Ok(failures)
}

/// Raised by SIGTERM or the listener's HAG-GUEST-FINISH: the run ends
/// early, verified as at its end.
static STOP: AtomicBool = AtomicBool::new(false);

/// A progress line, on the console and to the listener, which may answer
/// that the run should end.
fn report(reporter: &mut Reporter, line: &str) {
    reporter.line(line);
    if reporter.finish_asked() {
        STOP.store(true, Ordering::Relaxed);
    }
}

fn stop_requested() -> bool {
    STOP.load(Ordering::Relaxed)
}

/// SIGTERM, blocked in every thread (call before any other starts), is
/// taken by a thread of its own that raises [`STOP`].
fn watch_sigterm() -> anyhow::Result<()> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.thread_block().context("blocking SIGTERM")?;
    std::thread::Builder::new()
        .name("sigterm".into())
        .spawn(move || {
            if set.wait().is_ok() {
                STOP.store(true, Ordering::Relaxed);
            }
        })
        .context("starting the SIGTERM thread")?;
    Ok(())
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help, --version.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            fail(&usage_error(&e));
            return ExitCode::from(2);
        }
    };
    if let Some(Command::Listen {
        port,
        bind,
        query_port,
        finish_file,
    }) = cli.command
    {
        return match listen(SocketAddr::new(bind, port), query_port, finish_file) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                fail(&format!("listen: {e:#}"));
                ExitCode::from(2)
            }
        };
    }
    if let Err(e) = watch_sigterm() {
        fail(&format!("{e:#}"));
        return ExitCode::from(2);
    }
    let mut reporter = match Reporter::new(cli.report) {
        Ok(r) => r,
        Err(e) => {
            fail(&format!("--report: cannot open a UDP socket: {e}"));
            return ExitCode::from(2);
        }
    };
    match run(&cli, &mut reporter) {
        Ok(o) => {
            reporter.line(&result_line(&o));
            ExitCode::from(if o.failures.is_empty() { 0 } else { 1 })
        }
        Err(e) => {
            fail(&format!("{e:#}"));
            ExitCode::from(2)
        }
    }
}

/// `hag-guest listen`: logs datagrams to stdout until killed.
fn listen(
    at: SocketAddr,
    query_port: Option<u16>,
    finish_file: Option<std::path::PathBuf>,
) -> anyhow::Result<()> {
    let mut listener = Listener::bind(at).with_context(|| format!("binding UDP {at}"))?;
    if let Some(f) = finish_file {
        listener.finish_when(f);
    }
    if let Some(q) = query_port {
        let query = SocketAddr::new(at.ip(), q);
        listener.serve_count(
            std::net::TcpListener::bind(query).with_context(|| format!("binding TCP {query}"))?,
        );
    }
    // stdout is the log: where it listens goes to stderr.
    eprintln!(
        "hag-guest: listening on UDP {}{}",
        listener.local_addr().context("its address")?,
        query_port.map_or(String::new(), |q| format!(", counts on TCP {q}"))
    );
    listener
        .run(&mut std::io::stdout().lock())
        .context("receiving or logging")
}

/// The verdict: `HAG-GUEST-RESULT PASS iterations=N seconds=S`, or `FAIL`
/// with what differed.
fn result_line(o: &Outcome) -> String {
    let tail = format!("iterations={} seconds={:.1}", o.iterations, o.seconds);
    if o.failures.is_empty() {
        format!("HAG-GUEST-RESULT PASS {tail}")
    } else {
        format!("HAG-GUEST-RESULT FAIL {}; {tail}", o.failures.join("; "))
    }
}

/// Prints `hag-guest: <what>` as one line on stderr.
fn fail(what: &str) {
    let _ = std::io::stdout().flush();
    let _ = writeln!(std::io::stderr(), "hag-guest: {}", what.replace('\n', " "));
}

/// A usage error in one line: `usage: <clap's message> (see --help)`.
fn usage_error(e: &clap::Error) -> String {
    let text = e.kind().to_string();
    let detail = e
        .render()
        .to_string()
        .lines()
        .next()
        .unwrap_or_default()
        .trim_start_matches("error: ")
        .to_string();
    let detail = if detail.is_empty() { text } else { detail };
    format!("usage: {detail} (see --help)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use guest_gpu::fake;
    use hag_abi::sim_regs as r;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
        let cli =
            Cli::try_parse_from(["hag-guest", "--seconds=90", "--mib=8", "--cpu-mib=8"]).unwrap();
        assert_eq!(
            (cli.seconds, cli.mib, cli.cpu_mib, cli.iterations),
            (90, 8, 8, 1000)
        );
        assert!(Cli::try_parse_from(["hag-guest", "--mib=65"]).is_err());
        assert!(Cli::try_parse_from(["hag-guest", "--mib=1"]).is_err());
        assert!(Cli::try_parse_from(["hag-guest", "--iterations=262145"]).is_err());
        assert!(Cli::try_parse_from(["hag-guest", "--dirty-pages=1025"]).is_err());
        assert!(Cli::try_parse_from(["hag-guest", "--cpu-pages=0"]).is_err());
        let err = Cli::try_parse_from(["hag-guest", "--mib=65"]).unwrap_err();
        assert_eq!(
            usage_error(&err),
            "usage: invalid value '65' for '--mib <N>': 65 is not in 2..=64 (see --help)"
        );
        assert_eq!(MAX_ITERATIONS, 262_144, "the help text says so");
        assert_eq!(r::PCI_VENDOR_ID, 0x1234);
        assert_eq!(r::PCI_DEVICE_ID, 0x4847);
    }

    /// The whole run on the fake device, over guest RAM scattered like a
    /// guest process's buffer: it passes; then a lost GPU write, a lost
    /// CPU write and a moved page each make it fail, and say where.
    #[test]
    fn a_run_on_the_fake_device_passes_and_lost_writes_fail_it() {
        let ram = fake::scattered_ram(4);
        let gpu = fake::FakeGpu::new(&ram);
        let mut drv = Driver::init(&gpu, &ram, DriverConfig::default()).unwrap();
        let mut frames = Frames::start_synthetic(&mut drv, MAX_ITERATIONS, 2).unwrap();
        let cpu = CpuRegion::new(16, 3).unwrap();
        let plan = Plan {
            iterations: 40,
            time: Duration::ZERO,
            progress: Duration::from_secs(1),
            rate: 0,
        };
        let mut lines = Vec::new();
        let (n, seconds) = work(&mut drv, &mut frames, Some(&cpu), plan, &mut |l: &str| {
            lines.push(l.to_string())
        })
        .unwrap();
        assert_eq!(n, 40);
        for l in &lines {
            assert!(
                l.starts_with("hag-guest: iteration ") && l.ends_with(" s"),
                "{l}"
            );
        }
        let table = ram.frame_table().unwrap().to_vec();
        let failures = verify(&drv, &frames, Some(&cpu), n, &table).unwrap();
        assert_eq!(failures, Vec::<String>::new());
        let pass = result_line(&Outcome {
            iterations: n,
            seconds,
            failures,
        });
        assert_eq!(
            pass,
            format!("HAG-GUEST-RESULT PASS iterations=40 seconds={seconds:.1}")
        );

        // The history slot of iteration 7 lost, as a migration that copied
        // its page before the GPU wrote it would lose it, and CPU page 1
        // left as iteration 32 wrote it (its last writer is 37).
        // (Slot i is dword i / 256 of history page i % 256.)
        let slot = frames.state(&drv).layout.history + 7 * PAGE_SIZE;
        drv.mem().write_u32(slot, 0).unwrap();
        assert_eq!(cpu.last_writer(1, 40), Some(37));
        let mut old = vec![0u8; 4096];
        for (d, b) in old.chunks_exact_mut(4).enumerate() {
            b.copy_from_slice(&cpu::word(32, 1, d).to_le_bytes());
        }
        cpu.mem().write(4096, &old).unwrap();
        let mut now = table.clone();
        now[9] += 1;
        let failures = verify(&drv, &frames, Some(&cpu), n, &now).unwrap();
        assert_eq!(failures.len(), 3, "{failures:?}");
        assert!(failures[0].starts_with(&format!(
            "pinning: buffer page 9 moved from guest frame {:#x} to {:#x} during the run",
            table[9],
            table[9] + 1
        )));
        assert!(
            failures[1].starts_with("GPU memory: history slot 7 at gfx ")
                && failures[1].ends_with("(1 mismatch: 1 history slot)"),
            "{}",
            failures[1]
        );
        assert!(
            failures[2].starts_with("CPU memory: CPU region page 1 dword 0 (offset 0x1000) is 0x00000020, expected 0x00000025")
                && failures[2].ends_with("holds iteration 32's write (1 mismatch: 1 CPU region page)"),
            "{}",
            failures[2]
        );
        let fail = result_line(&Outcome {
            iterations: n,
            seconds: 1.25,
            failures,
        });
        assert!(
            fail.starts_with("HAG-GUEST-RESULT FAIL pinning: "),
            "{fail}"
        );
        assert!(fail.ends_with("; iterations=40 seconds=1.2"), "{fail}");
        assert_eq!(fail.lines().count(), 1);
    }
}
