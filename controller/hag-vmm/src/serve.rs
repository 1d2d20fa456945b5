//! `hag-vmm serve`: a migratable VM. Guest RAM is a memfd, the vGPU is
//! attached through VFIO, and the [`guest_gpu::frames`] workload runs as the
//! VM, step by step, while a control socket ([`vmm_control`]) lets a
//! controller pause it, read its RAM and CPU dirty log, move its state and
//! resume it (here, or as an `--incoming` VM on another host).
//!
//! The VM loop runs on the main thread and checks for a pause or quit at
//! every step boundary; each control connection has a thread that talks
//! to the loop through [`Shared`] under one mutex and condition variable.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{bail, Context};
use hag_abi::abi;
use hag_dev::Device;

use crate::vfio::VfioDevice;
use guest_gpu::driver::{Driver, DriverConfig, GttLayout};
use guest_gpu::frames::{Frames, FramesState, Step};
use guest_ram::{CpuDirtyLog, GuestRam, PAGE_SIZE};
use vmm_control::{bitmap_hex, hex, send_with_fd, unhex, Reply, Request};

/// Settings of `hag-vmm serve`.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The mdev's UUID.
    pub mdev: String,
    /// Control socket path.
    pub control: PathBuf,
    /// Workload (only `frames`).
    pub workload: String,
    /// Iterations.
    pub iterations: u32,
    /// Guest RAM in MiB.
    pub ram_mib: u64,
    /// Wait to be filled and resumed by a controller.
    pub incoming: bool,
    /// Print a progress line every this many iterations (0: none).
    pub progress: u32,
    /// Synthetic GPU-dirty pages per iteration (0: plain frames).
    pub dirty_pages: u32,
}

/// How serving ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The workload ran to the end; its verification passed or not, with
    /// the result line.
    Finished {
        /// Verification passed.
        passed: bool,
        /// `PASS frames: …` or `FAIL frames: …`.
        line: String,
    },
    /// A controller said `quit`.
    Quit {
        /// Next iteration when it stopped.
        iteration: u32,
    },
}

/// Run states, as `status` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunState {
    /// The loop is stepping.
    Running,
    /// Stopped at a step boundary.
    Paused,
    /// Waiting to be filled and resumed.
    Incoming,
    /// The workload finished.
    Finished,
    /// Quit: the vGPU is closed.
    Stopped,
}

impl RunState {
    fn name(self) -> &'static str {
        match self {
            RunState::Running => "running",
            RunState::Paused => "paused",
            RunState::Incoming => "incoming",
            RunState::Finished => "finished",
            RunState::Stopped => "stopped",
        }
    }
}

/// What the loop and the control threads share.
#[derive(Debug)]
pub struct Shared {
    run: RunState,
    want_pause: bool,
    want_resume: bool,
    want_quit: bool,
    /// A controller asked the workload to end after the iterations done.
    want_finish: bool,
    iteration: u32,
    iterations: u32,
    result: Option<(bool, String)>,
    /// State published by the loop when it paused.
    vm_state: Option<Vec<u8>>,
    /// State a controller set, used at the next resume.
    new_state: Option<Vec<u8>>,
    quit_replied: bool,
    /// Console output is held until a controller releases it (Remus
    /// output commit, see [`vmm_control`]).
    hold_output: bool,
    /// Held lines: the checkpoint epoch they were tagged with (none yet),
    /// the line, and whether it is the final result line (printed by the
    /// caller of [`serve`] once released).
    held: Vec<(Option<u64>, String, bool)>,
    /// The final result line was released (or never held).
    final_released: bool,
}

impl Shared {
    /// Prints (or holds) one console line of the VM.
    fn output(&mut self, line: String) {
        if self.hold_output {
            self.held.push((None, line, false));
        } else {
            print_line(&line);
        }
    }

    /// Prints the held lines `pick` selects; returns how many went out.
    fn release(&mut self, pick: impl Fn(Option<u64>) -> bool) -> u64 {
        let mut n = 0;
        let held = std::mem::take(&mut self.held);
        for (tag, line, is_final) in held {
            if !pick(tag) {
                self.held.push((tag, line, is_final));
                continue;
            }
            n += 1;
            if is_final {
                self.final_released = true;
            } else {
                print_line(&line);
            }
        }
        n
    }
}

fn print_line(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

struct Ctl {
    shared: Mutex<Shared>,
    cv: Condvar,
    ram_fd: OwnedFd,
    ram_size: u64,
    cpu_dirty: Arc<CpuDirtyLog>,
    mdev: String,
    vgpu_id: u32,
}

/// Longest a control request waits for the loop (a step may wait for the
/// GPU for up to 10 s).
const LOOP_WAIT: Duration = Duration::from_secs(20);

impl Ctl {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait_until<'a>(
        &'a self,
        mut g: MutexGuard<'a, Shared>,
        mut done: impl FnMut(&Shared) -> bool,
    ) -> (MutexGuard<'a, Shared>, bool) {
        let deadline = std::time::Instant::now() + LOOP_WAIT;
        while !done(&g) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return (g, false);
            }
            g = self
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        (g, true)
    }

    fn status(&self, g: &Shared) -> Reply {
        Reply {
            state: Some(g.run.name().into()),
            iteration: Some(g.iteration),
            iterations: Some(g.iterations),
            passed: g.result.as_ref().map(|r| r.0),
            result: g.result.as_ref().map(|r| r.1.clone()),
            ..Reply::ok()
        }
    }

    /// Answers one request (`ram` is answered by the caller, with the fd).
    fn handle(&self, req: Request) -> Reply {
        let mut g = self.lock();
        match req {
            Request::Status | Request::Ram => self.status(&g),
            Request::Pause => match g.run {
                RunState::Paused | RunState::Incoming => self.status(&g),
                RunState::Running => {
                    g.want_pause = true;
                    self.cv.notify_all();
                    let (g, ok) = self.wait_until(g, |s| s.run != RunState::Running);
                    match (ok, g.run) {
                        (true, RunState::Paused) => self.status(&g),
                        (true, other) => Reply::err(format!("the VM is {}", other.name())),
                        (false, _) => Reply::err(format!(
                            "the VM loop did not reach a step boundary in {LOOP_WAIT:?}"
                        )),
                    }
                }
                other => Reply::err(format!("cannot pause: the VM is {}", other.name())),
            },
            Request::Resume => match g.run {
                RunState::Running => self.status(&g),
                RunState::Incoming if g.new_state.is_none() => {
                    Reply::err("an incoming VM needs set-state before resume")
                }
                RunState::Paused | RunState::Incoming => {
                    g.want_pause = false;
                    g.want_resume = true;
                    self.cv.notify_all();
                    let (g, ok) = self.wait_until(g, |s| !s.want_resume);
                    match (ok, g.run) {
                        (true, RunState::Running | RunState::Finished) => self.status(&g),
                        (true, other) => {
                            Reply::err(format!("the VM did not resume: it is {}", other.name()))
                        }
                        (false, _) => Reply::err("the VM loop did not pick up the resume"),
                    }
                }
                other => Reply::err(format!("cannot resume: the VM is {}", other.name())),
            },
            Request::CpuDirty => {
                let words = self.cpu_dirty.read_clear();
                let pages = words.iter().map(|w| u64::from(w.count_ones())).sum();
                Reply {
                    pages: Some(pages),
                    bitmap: Some(bitmap_hex(&words)),
                    ..Reply::ok()
                }
            }
            Request::Vgpu => Reply {
                mdev: Some(self.mdev.clone()),
                vgpu_id: Some(self.vgpu_id),
                ..Reply::ok()
            },
            Request::GetState => match (&g.new_state, &g.vm_state, g.run) {
                (Some(s), _, RunState::Paused | RunState::Incoming)
                | (None, Some(s), RunState::Paused | RunState::Finished) => Reply {
                    vm_state: Some(hex(s)),
                    ..Reply::ok()
                },
                _ => Reply::err(format!(
                    "no VM state to get: the VM is {} (pause it first)",
                    g.run.name()
                )),
            },
            Request::SetState { vm_state } => {
                if !matches!(g.run, RunState::Paused | RunState::Incoming) {
                    return Reply::err(format!(
                        "cannot set state: the VM is {} (pause it first)",
                        g.run.name()
                    ));
                }
                let Some(bytes) = unhex(&vm_state) else {
                    return Reply::err("vm_state is not hex");
                };
                if let Err(e) = FramesState::from_bytes(&bytes, self.ram_size) {
                    return Reply::err(format!("{e:#}"));
                }
                g.new_state = Some(bytes);
                Reply::ok()
            }
            Request::HoldOutput { hold } => {
                let released = if hold { 0 } else { g.release(|_| true) };
                g.hold_output = hold;
                self.cv.notify_all();
                Reply {
                    released: Some(released),
                    ..Reply::ok()
                }
            }
            Request::MarkEpoch { epoch } => {
                let mut n = 0;
                for (tag, _, _) in g.held.iter_mut().filter(|h| h.0.is_none()) {
                    *tag = Some(epoch);
                    n += 1;
                }
                Reply {
                    released: Some(n),
                    ..Reply::ok()
                }
            }
            Request::ReleaseOutput { epoch } => {
                let n = g.release(|tag| tag.is_some_and(|t| t <= epoch));
                self.cv.notify_all();
                Reply {
                    released: Some(n),
                    ..Reply::ok()
                }
            }
            Request::Finish => {
                if !matches!(g.run, RunState::Running | RunState::Paused) {
                    return Reply::err(format!("cannot finish: the VM is {}", g.run.name()));
                }
                g.want_finish = true;
                self.cv.notify_all();
                Reply {
                    iteration: Some(g.iteration),
                    ..Reply::ok()
                }
            }
            Request::Quit => {
                g.want_quit = true;
                self.cv.notify_all();
                let (g, ok) = self.wait_until(g, |s| s.run == RunState::Stopped);
                if ok || g.run == RunState::Finished {
                    Reply {
                        state: Some(RunState::Stopped.name().into()),
                        ..Reply::ok()
                    }
                } else {
                    Reply::err("the VM loop did not stop in time")
                }
            }
        }
    }

    fn connection(&self, stream: UnixStream) {
        let Ok(read) = stream.try_clone() else {
            return;
        };
        for line in BufReader::new(read).lines() {
            let Ok(line) = line else { return };
            if line.trim().is_empty() {
                continue;
            }
            let (reply, is_ram, is_quit) = match serde_json::from_str::<Request>(&line) {
                Ok(req) => {
                    let is_ram = req == Request::Ram;
                    let is_quit = req == Request::Quit;
                    let mut reply = self.handle(req);
                    if is_ram {
                        reply = Reply {
                            size: Some(self.ram_size),
                            page_size: Some(PAGE_SIZE),
                            ..Reply::ok()
                        };
                    }
                    (reply, is_ram, is_quit)
                }
                Err(e) => (Reply::err(format!("bad request: {e}")), false, false),
            };
            let mut out = serde_json::to_vec(&reply).unwrap_or_default();
            out.push(b'\n');
            let sent = if is_ram {
                send_with_fd(&stream, &out, std::os::fd::AsFd::as_fd(&self.ram_fd))
            } else {
                (&stream).write_all(&out)
            };
            if is_quit {
                self.lock().quit_replied = true;
                self.cv.notify_all();
            }
            if sent.is_err() {
                return;
            }
        }
    }
}

/// Runs `hag-vmm serve` until the workload finishes or a controller quits.
pub fn serve(cfg: &ServeConfig) -> anyhow::Result<Outcome> {
    if cfg.workload != "frames" {
        bail!(
            "unknown serve workload '{}' (serve runs: frames)",
            cfg.workload
        );
    }
    let size = cfg
        .ram_mib
        .checked_mul(1 << 20)
        .context("guest RAM size overflows")?;
    let ram = GuestRam::new_memfd(size).context("cannot create guest RAM")?;
    let dev = Device::open()?;
    dev.version()?;
    let vgpu = dev.find_vgpu(&cfg.mdev)?;
    if vgpu.source != abi::VGPU_SOURCE_SIM {
        bail!(
            "vGPU {} ({}) is a {} vGPU; hag-vmm drives hag-sim only",
            vgpu.id,
            cfg.mdev,
            abi::source_name(vgpu.source)
        );
    }
    let vfio = VfioDevice::attach(&cfg.mdev, &ram)
        .with_context(|| format!("cannot attach mdev {} through VFIO", cfg.mdev))?;
    let ram_fd = ram
        .fd()
        .context("guest RAM has no memfd")?
        .try_clone_to_owned()
        .context("cannot duplicate the guest RAM memfd")?;
    let ctl = Arc::new(Ctl {
        shared: Mutex::new(Shared {
            run: if cfg.incoming {
                RunState::Incoming
            } else {
                RunState::Running
            },
            want_pause: false,
            want_resume: false,
            want_quit: false,
            want_finish: false,
            iteration: 0,
            iterations: cfg.iterations,
            result: None,
            vm_state: None,
            new_state: None,
            quit_replied: false,
            hold_output: false,
            held: Vec::new(),
            final_released: true,
        }),
        cv: Condvar::new(),
        ram_fd,
        ram_size: size,
        cpu_dirty: ram
            .cpu_dirty_log()
            .context("guest RAM keeps no CPU dirty log")?,
        mdev: cfg.mdev.clone(),
        vgpu_id: vgpu.id,
    });

    let _ = std::fs::remove_file(&cfg.control);
    let listener = UnixListener::bind(&cfg.control)
        .with_context(|| format!("cannot listen on {}", cfg.control.display()))?;
    {
        let ctl = ctl.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let ctl = ctl.clone();
                std::thread::spawn(move || ctl.connection(stream));
            }
        });
    }
    eprintln!(
        "hag-vmm: serving vGPU {} ({}) with {} MiB of guest RAM{}, control socket {}",
        vgpu.id,
        cfg.mdev,
        cfg.ram_mib,
        if cfg.incoming { ", incoming" } else { "" },
        cfg.control.display()
    );

    let started = std::time::Instant::now();
    let outcome = run_loop(cfg, &ctl, &vfio, &ram);
    if let Ok(Outcome::Finished { .. }) = &outcome {
        eprintln!(
            "hag-vmm: the workload ended {:.1} s after serving started",
            started.elapsed().as_secs_f64()
        );
    }
    drop(vfio);
    {
        let mut g = ctl.lock();
        if matches!(outcome, Ok(Outcome::Quit { .. })) {
            g.run = RunState::Stopped;
            ctl.cv.notify_all();
            // Let the quit reply go out before the process exits.
            let _ = ctl.wait_until(g, |s| s.quit_replied);
        }
    }
    let _ = std::fs::remove_file(&cfg.control);
    outcome
}

fn run_loop(
    cfg: &ServeConfig,
    ctl: &Ctl,
    vfio: &VfioDevice,
    ram: &GuestRam,
) -> anyhow::Result<Outcome> {
    let mut vm: Option<(Driver<'_, &VfioDevice>, Frames)> = None;
    if !cfg.incoming {
        let dcfg = DriverConfig {
            ring_pages: 4,
            gtt_layout: GttLayout::Scattered,
        };
        let mut drv =
            Driver::init(vfio, ram, dcfg).context("cannot set up the guest GPU driver")?;
        let frames = Frames::start_synthetic(&mut drv, cfg.iterations, cfg.dirty_pages)?;
        vm = Some((drv, frames));
    }
    // Benchmarks (qemu-tests/bench-checkpoint) time the workload on stderr,
    // which output commit does not hold.
    let loop_started = std::time::Instant::now();
    loop {
        // A step boundary: honour pause, resume and quit.
        {
            let mut g = ctl.lock();
            loop {
                if g.want_quit {
                    return Ok(Outcome::Quit {
                        iteration: g.iteration,
                    });
                }
                if g.want_resume {
                    if let Some(bytes) = g.new_state.take() {
                        let restored =
                            FramesState::from_bytes(&bytes, ram.size()).and_then(|state| {
                                let drv = Driver::restore(vfio, ram, &state.driver)
                                    .context("cannot take over the restored vGPU")?;
                                Ok((drv, Frames::from_state(&state)))
                            });
                        match restored {
                            Ok((drv, frames)) => {
                                g.iterations = frames.iterations();
                                vm = Some((drv, frames));
                            }
                            Err(e) => {
                                let line =
                                    format!("FAIL frames: cannot resume from the state set: {e:#}");
                                g.want_resume = false;
                                g.run = RunState::Finished;
                                g.result = Some((false, line.clone()));
                                ctl.cv.notify_all();
                                return Ok(Outcome::Finished {
                                    passed: false,
                                    line,
                                });
                            }
                        }
                    }
                    g.want_resume = false;
                    g.vm_state = None;
                    g.run = RunState::Running;
                    ctl.cv.notify_all();
                }
                if g.run == RunState::Running && g.want_pause {
                    g.run = RunState::Paused;
                    g.vm_state = vm.as_ref().map(|(d, f)| f.state(d).to_bytes());
                    ctl.cv.notify_all();
                }
                if g.run == RunState::Running && vm.is_some() {
                    break;
                }
                g = ctl.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        }
        let Some((drv, frames)) = vm.as_mut() else {
            continue;
        };
        {
            // Between iterations only: with one submitted, finish waits
            // for the next boundary.
            let mut g = ctl.lock();
            if g.want_finish {
                if let Ok(n) = frames.finish(drv) {
                    g.want_finish = false;
                    g.iterations = n;
                }
            }
        }
        let step = frames.step(drv);
        let iteration = frames.iteration(&drv.mem()).unwrap_or(0);
        let finished = match step {
            Ok(Step::Continue) => None,
            Ok(Step::Finished) => Some(match frames.verify(drv) {
                Ok(n) => (true, format!("PASS frames: {n} iterations verified")),
                Err(e) => (false, format!("FAIL frames: {e:#}")),
            }),
            Err(e) => Some((
                false,
                format!("FAIL frames: at iteration {iteration}: {e:#}"),
            )),
        };
        let mut g = ctl.lock();
        if cfg.progress > 0 && iteration != g.iteration && iteration % cfg.progress == 0 {
            g.output(format!("frames: iteration {iteration}"));
            eprintln!(
                "hag-vmm: iteration {iteration} at {:.3} s",
                loop_started.elapsed().as_secs_f64()
            );
        }
        g.iteration = iteration;
        if let Some((passed, line)) = finished {
            eprintln!(
                "hag-vmm: last step (iteration {iteration}) at {:.3} s",
                loop_started.elapsed().as_secs_f64()
            );
            g.run = RunState::Finished;
            g.result = Some((passed, line.clone()));
            if g.hold_output {
                // Output commit: the result line goes out only once the
                // checkpoint epoch holding it is acknowledged. Until then
                // the finished VM can still be checkpointed.
                g.vm_state = Some(frames.state(drv).to_bytes());
                g.held.push((None, line.clone(), true));
                g.final_released = false;
            }
            ctl.cv.notify_all();
            while !g.final_released && !g.want_quit {
                g = ctl.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            if !g.final_released {
                return Ok(Outcome::Quit {
                    iteration: g.iteration,
                });
            }
            return Ok(Outcome::Finished { passed, line });
        }
    }
}
