//! The `frames` workload of `hag-vmm serve`: a long-running guest GPU
//! program whose whole state lives in guest RAM, made to be migrated.
//!
//! Iteration `i` (the next one to run is kept in a guest RAM control page)
//! submits one batch of GPU work and waits for it:
//!
//! - XY_COLOR_BLT fills frame `i % 8` (256 × 64 pixels, 16 pages) with
//!   `color(i)`;
//! - XY_SRC_COPY_BLT copies a 64 × 8 corner of it into frame `(i + 3) % 8`;
//! - MI_STORE_DATA_IMM writes `history(i)` to history slot `i` (dword
//!   `i / 256` of history page `i % 256`: every slot is written once, so a
//!   GPU write lost in a migration stays visible to the end);
//! - MI_ATOMIC increments a counter;
//! - MI_STORE_DATA_INDEX puts `i + 1` in the status page, and
//!   MI_USER_INTERRUPT signals completion.
//!
//! With `dirty_pages` D > 0 (`hag-vmm serve --dirty-pages D`, the
//! evaluation's synthetic workload, swept across dirty rates), each
//! iteration also fills one of [`SCRATCH_WINDOWS`] windows of D pages
//! (XY_COLOR_BLT, one 4 KiB row per page) with `scratch_color(i)`: D more
//! GPU-dirty pages per iteration, each wholly rewritten.
//!
//! Then the CPU writes `i + 1` to the control page. After the last
//! iteration [`Frames::verify`] checks all of guest RAM the workload owns
//! against a model (frames, every history slot, counter, control page,
//! status page seqno) and that every page it never allocated is still zero;
//! [`Frames::check`] does the same and counts every mismatch. A run can
//! also end early, between iterations ([`Frames::finish`]: `hag-guest` runs
//! for a time rather than a number of iterations).
//!
//! The loop is a sequence of [`Frames::step`]s: "submit iteration `i`" and
//! "wait for it, then advance `i`". A VM paused between the two has GPU
//! work in flight; [`FramesState`] (with the driver's [`DriverState`]) is
//! everything kept outside guest RAM.

use std::time::Duration;

use anyhow::{bail, ensure, Context};
use hag_audit::audit::encode::{self, BlitRect};

use crate::driver::{Driver, DriverState, GfxMem, Registers, HWS_SEQNO};
use crate::workloads::atomic_op;
use guest_ram::PAGE_SIZE;

/// Frames.
pub const FRAMES: u32 = 8;
/// Frame width in pixels (32 bpp).
pub const FRAME_W: u32 = 256;
/// Frame height in rows.
pub const FRAME_H: u32 = 64;
/// Bytes per frame row.
pub const PITCH: u32 = FRAME_W * 4;
/// Bytes per frame.
pub const FRAME_BYTES: u64 = PITCH as u64 * FRAME_H as u64;
/// History pages.
pub const HISTORY_PAGES: u32 = 256;
/// Most iterations the history can record.
pub const MAX_ITERATIONS: u32 = HISTORY_PAGES * (PAGE_SIZE as u32 / 4);
/// `--iterations` default: about half a minute under QEMU TCG.
pub const DEFAULT_ITERATIONS: u32 = 30_000;
/// Copy rectangle: width, height, destination row.
const COPY: (u32, u32, u32) = (64, 8, FRAME_H / 2);
/// Second dword of the control page.
const CONTROL_MAGIC: u32 = 0x4652_4d53; // "SMRF"
/// Windows of the synthetic scratch area (iteration `i` fills `i % 4`).
pub const SCRATCH_WINDOWS: u32 = 4;
/// Most `dirty_pages`: 4 windows of 1024 pages are 16 MiB.
pub const MAX_DIRTY_PAGES: u32 = 1024;
/// Version of [`FramesState`]'s encoding.
pub const STATE_VERSION: u32 = 1;

/// The fill color of iteration `i` (never zero).
pub fn color(i: u32) -> u32 {
    0xff00_0000 | (i.wrapping_mul(0x9e37_79b1) >> 8)
}

/// The scratch fill of iteration `i` (never zero, unlike `color(i)`).
pub fn scratch_color(i: u32) -> u32 {
    0x5300_0000 | (i.wrapping_mul(0x2545_f491) >> 8)
}

/// The history value of iteration `i` (never zero).
pub fn history(i: u32) -> u32 {
    0x4800_0000 | (i.wrapping_mul(0x85eb_ca6b) & 0x00ff_ffff)
}

/// Where the workload's buffers are, in graphics memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Layout {
    /// Control page: dword 0 the next iteration, dword 1 a magic number.
    pub control: u64,
    /// Counter page: dword 0 incremented by MI_ATOMIC.
    pub counter: u64,
    /// First history page.
    pub history: u64,
    /// First frame (frames follow each other).
    pub frames: u64,
    /// Synthetic scratch area ([`SCRATCH_WINDOWS`] × `dirty_pages` pages;
    /// 0 without one).
    #[serde(default)]
    pub scratch: u64,
}

impl Layout {
    fn frame(&self, k: u32) -> u64 {
        self.frames + u64::from(k) * FRAME_BYTES
    }

    fn window(&self, w: u32, dirty_pages: u32) -> u64 {
        self.scratch + u64::from(w) * u64::from(dirty_pages) * PAGE_SIZE
    }

    fn slot(&self, i: u32) -> u64 {
        self.history + u64::from(i % HISTORY_PAGES) * PAGE_SIZE + u64::from(i / HISTORY_PAGES) * 4
    }
}

/// Where the loop is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Next: submit the iteration in the control page.
    Idle,
    /// Iteration `0` is submitted; next: wait for it.
    Submitted(u32),
    /// All iterations ran.
    Done,
}

/// What a step did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// More steps to go.
    Continue,
    /// Every iteration ran; verify next.
    Finished,
}

/// The VM's state outside guest RAM: the workload's and the driver's.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FramesState {
    /// [`STATE_VERSION`].
    pub version: u32,
    /// Guest RAM size the state belongs to.
    pub ram_size: u64,
    /// Iterations to run.
    pub iterations: u32,
    /// Buffers.
    pub layout: Layout,
    /// Loop position.
    pub phase: Phase,
    /// Synthetic pages filled per iteration.
    #[serde(default)]
    pub dirty_pages: u32,
    /// The driver's state.
    pub driver: DriverState,
}

impl FramesState {
    /// Serialized bytes (JSON).
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses and checks state bytes for a VM with `ram_size` bytes of RAM.
    pub fn from_bytes(bytes: &[u8], ram_size: u64) -> anyhow::Result<Self> {
        let state: FramesState =
            serde_json::from_slice(bytes).context("VM state is not a frames state")?;
        ensure!(
            state.version == STATE_VERSION,
            "VM state version {}, this hag-vmm reads {STATE_VERSION}",
            state.version
        );
        ensure!(
            state.ram_size == ram_size,
            "VM state is for {} MiB of guest RAM, this VM has {} MiB",
            state.ram_size >> 20,
            ram_size >> 20
        );
        ensure!(
            state.dirty_pages <= MAX_DIRTY_PAGES,
            "VM state asks for {} dirty pages per iteration, at most {MAX_DIRTY_PAGES}",
            state.dirty_pages
        );
        ensure!(
            state.iterations <= MAX_ITERATIONS,
            "VM state asks for {} iterations, at most {MAX_ITERATIONS}",
            state.iterations
        );
        Ok(state)
    }
}

/// What [`Frames::check`] found different from the model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Mismatches {
    /// The first mismatch, in [`Frames::verify`]'s words.
    pub first: Option<String>,
    /// Mismatches per kind (a singular noun: `history slot`, `frame
    /// pixel`, `scratch dword`, `non-zero unallocated page`, ...), in the
    /// order first seen.
    pub counts: Vec<(&'static str, u64)>,
}

impl Mismatches {
    /// Counts one mismatch of `kind`; `what` describes it if it is the
    /// first.
    pub fn add(&mut self, kind: &'static str, what: impl FnOnce() -> String) {
        if self.first.is_none() {
            self.first = Some(what());
        }
        match self.counts.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => self.counts.push((kind, 1)),
        }
    }

    /// Mismatches in all.
    pub fn total(&self) -> u64 {
        self.counts.iter().map(|(_, n)| n).sum()
    }

    /// Whether everything matched.
    pub fn is_empty(&self) -> bool {
        self.first.is_none()
    }
}

impl std::fmt::Display for Mismatches {
    /// `FIRST (N mismatches: n KINDs, ...)`, or `no mismatch`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Some(first) = &self.first else {
            return write!(f, "no mismatch");
        };
        let total = self.total();
        write!(
            f,
            "{first} ({total} mismatch{}: ",
            if total == 1 { "" } else { "es" }
        )?;
        for (i, (kind, n)) in self.counts.iter().enumerate() {
            let sep = if i > 0 { ", " } else { "" };
            let s = if *n == 1 { "" } else { "s" };
            write!(f, "{sep}{n} {kind}{s}")?;
        }
        write!(f, ")")
    }
}

/// The workload.
#[derive(Clone, Debug)]
pub struct Frames {
    layout: Layout,
    iterations: u32,
    dirty_pages: u32,
    phase: Phase,
    timeout: Duration,
}

impl Frames {
    /// Allocates the buffers and writes the control page: a fresh run of
    /// `iterations` iterations on an initialised driver.
    pub fn start<R: Registers>(drv: &mut Driver<'_, R>, iterations: u32) -> anyhow::Result<Self> {
        Self::start_synthetic(drv, iterations, 0)
    }

    /// [`Self::start`] with `dirty_pages` synthetic pages per iteration.
    pub fn start_synthetic<R: Registers>(
        drv: &mut Driver<'_, R>,
        iterations: u32,
        dirty_pages: u32,
    ) -> anyhow::Result<Self> {
        ensure!(
            iterations <= MAX_ITERATIONS,
            "{iterations} iterations: the history holds at most {MAX_ITERATIONS}"
        );
        ensure!(
            dirty_pages <= MAX_DIRTY_PAGES,
            "{dirty_pages} dirty pages per iteration: at most {MAX_DIRTY_PAGES}"
        );
        let mut layout = Layout {
            control: drv.alloc(PAGE_SIZE)?,
            counter: drv.alloc(PAGE_SIZE)?,
            history: drv.alloc(u64::from(HISTORY_PAGES) * PAGE_SIZE)?,
            frames: drv.alloc(u64::from(FRAMES) * FRAME_BYTES)?,
            scratch: 0,
        };
        if dirty_pages > 0 {
            layout.scratch =
                drv.alloc(u64::from(SCRATCH_WINDOWS) * u64::from(dirty_pages) * PAGE_SIZE)?;
        }
        let mem = drv.mem();
        mem.write_u32(layout.control, 0)?;
        mem.write_u32(layout.control + 4, CONTROL_MAGIC)?;
        Ok(Frames {
            layout,
            iterations,
            dirty_pages,
            phase: Phase::Idle,
            timeout: Duration::from_secs(10),
        })
    }

    /// The workload of a restored [`FramesState`].
    pub fn from_state(state: &FramesState) -> Self {
        Frames {
            layout: state.layout,
            iterations: state.iterations,
            dirty_pages: state.dirty_pages,
            phase: state.phase,
            timeout: Duration::from_secs(10),
        }
    }

    /// The state to hand to another VM (with the driver's).
    pub fn state<R: Registers>(&self, drv: &Driver<'_, R>) -> FramesState {
        FramesState {
            version: STATE_VERSION,
            ram_size: drv.ram().size(),
            iterations: self.iterations,
            layout: self.layout,
            phase: self.phase,
            dirty_pages: self.dirty_pages,
            driver: drv.state(),
        }
    }

    /// Iterations to run.
    pub fn iterations(&self) -> u32 {
        self.iterations
    }

    /// The next iteration, as guest RAM says.
    pub fn iteration(&self, mem: &GfxMem<'_>) -> anyhow::Result<u32> {
        Ok(mem.read_u32(self.layout.control)?)
    }

    /// Where the loop is.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The commands of iteration `i`.
    pub fn commands(&self, i: u32) -> Vec<Vec<u32>> {
        let l = &self.layout;
        let k = i % FRAMES;
        let rect = |base, x, y| BlitRect {
            base,
            pitch: PITCH as u16,
            x,
            y,
        };
        let (cw, ch, cy) = COPY;
        let dst_x = ((i % 4) * cw) as u16;
        let mut synthetic = Vec::new();
        if self.dirty_pages > 0 {
            // One row per page: pitch and row are 4 KiB.
            let base = l.window(i % SCRATCH_WINDOWS, self.dirty_pages);
            let page = BlitRect {
                base,
                pitch: PAGE_SIZE as u16,
                x: 0,
                y: 0,
            };
            synthetic.push(
                encode::xy_color_blt(
                    page,
                    4,
                    (PAGE_SIZE / 4) as u16,
                    self.dirty_pages as u16,
                    scratch_color(i),
                )
                .to_vec(),
            );
        }
        let mut cmds = vec![
            encode::xy_color_blt(
                rect(l.frame(k), 0, 0),
                4,
                FRAME_W as u16,
                FRAME_H as u16,
                color(i),
            )
            .to_vec(),
            encode::xy_src_copy_blt(
                rect(l.frame((i + 3) % FRAMES), dst_x, cy as u16),
                rect(l.frame(k), 0, 0),
                4,
                cw as u16,
                ch as u16,
            )
            .to_vec(),
            encode::store_data_imm(l.slot(i), history(i)).to_vec(),
            encode::atomic(l.counter, atomic_op::INC, 0).to_vec(),
            encode::store_data_index(HWS_SEQNO, i.wrapping_add(1)).to_vec(),
            encode::user_interrupt().to_vec(),
        ];
        // Before the seqno store: the fill is done when the seqno says so.
        let at = cmds.len() - 2;
        cmds.splice(at..at, synthetic);
        cmds
    }

    /// Runs one step: submit the next iteration, or wait for the submitted
    /// one and advance the control page.
    pub fn step<R: Registers>(&mut self, drv: &mut Driver<'_, R>) -> anyhow::Result<Step> {
        match self.phase {
            Phase::Done => Ok(Step::Finished),
            Phase::Idle => {
                let i = self.iteration(&drv.mem())?;
                if i >= self.iterations {
                    self.phase = Phase::Done;
                    return Ok(Step::Finished);
                }
                let pending = drv.write_commands(&self.commands(i))?;
                drv.doorbell(&pending)?;
                self.phase = Phase::Submitted(i);
                Ok(Step::Continue)
            }
            Phase::Submitted(i) => {
                drv.wait(self.timeout)
                    .map_err(|f| f.error)
                    .with_context(|| format!("iteration {i}"))?;
                drv.mem().write_u32(self.layout.control, i + 1)?;
                self.phase = Phase::Idle;
                Ok(Step::Continue)
            }
        }
    }

    /// Ends the run after the iterations done so far, between iterations
    /// (not with one submitted): from then on [`Frames::step`] is finished
    /// and [`Frames::verify`] checks exactly the iterations that ran.
    /// Returns their number.
    pub fn finish<R: Registers>(&mut self, drv: &Driver<'_, R>) -> anyhow::Result<u32> {
        if let Phase::Submitted(i) = self.phase {
            bail!("iteration {i} is still running");
        }
        self.iterations = self.iteration(&drv.mem())?.min(self.iterations);
        self.phase = Phase::Done;
        Ok(self.iterations)
    }

    /// Checks every byte the workload owns after all iterations, and that
    /// every graphics page it never allocated is zero. Returns the
    /// iterations verified, or the first mismatch (see [`Frames::check`]).
    pub fn verify<R: Registers>(&self, drv: &Driver<'_, R>) -> anyhow::Result<u32> {
        let found = self.check(drv)?;
        if let Some(first) = found.first {
            bail!("{first}");
        }
        Ok(self.iterations)
    }

    /// [`Frames::verify`]'s checks, all of them, counting every mismatch
    /// rather than stopping at the first. Fails only when memory cannot be
    /// read.
    pub fn check<R: Registers>(&self, drv: &Driver<'_, R>) -> anyhow::Result<Mismatches> {
        let mem = drv.mem();
        let n = self.iterations;
        let l = &self.layout;
        let scattered = drv.ram().frame_table().is_some();
        let where_ = |gfx: u64| match drv.gtt().translate(gfx) {
            Some(gpa) if scattered => format!(
                "gfx {gfx:#x} (buffer page {}, guest physical {:#x})",
                gpa / PAGE_SIZE,
                drv.ram().frame(gpa / PAGE_SIZE).unwrap_or(0) * PAGE_SIZE + gpa % PAGE_SIZE
            ),
            Some(gpa) => format!("gfx {gfx:#x} (guest page {})", gpa / PAGE_SIZE),
            None => format!("gfx {gfx:#x}"),
        };
        let mut found = Mismatches::default();
        let mut expect = |gfx: u64, want: u32, what: &'static str| -> anyhow::Result<()> {
            let got = mem.read_u32(gfx)?;
            if got != want {
                found.add(what, || {
                    format!(
                        "{what} at {} is {got:#010x}, expected {want:#010x}",
                        where_(gfx)
                    )
                });
            }
            Ok(())
        };
        expect(l.control, n, "control page iteration")?;
        expect(l.control + 4, CONTROL_MAGIC, "control page magic")?;
        expect(l.counter, n, "MI_ATOMIC counter")?;
        if n > 0 {
            expect(drv.hws_gfx() + u64::from(HWS_SEQNO), n, "status page seqno")?;
        }
        // History: slot i written iff i < n.
        let mut page = vec![0u8; PAGE_SIZE as usize];
        for p in 0..HISTORY_PAGES {
            let gfx = l.history + u64::from(p) * PAGE_SIZE;
            mem.read(gfx, &mut page)?;
            for (d, b) in page.chunks_exact(4).enumerate() {
                let i = d as u32 * HISTORY_PAGES + p;
                let got = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                let want = if i < n { history(i) } else { 0 };
                if got != want {
                    found.add("history slot", || {
                        format!(
                            "history slot {i} at {} is {got:#010x}, expected {want:#010x}",
                            where_(gfx + 4 * d as u64)
                        )
                    });
                }
            }
        }
        // Frames: each iteration refills its frame whole, so the last
        // FRAMES iterations replayed on zeroed frames give the final image.
        let mut model = vec![vec![0u32; (FRAME_W * FRAME_H) as usize]; FRAMES as usize];
        for i in n.saturating_sub(FRAMES)..n {
            model[(i % FRAMES) as usize].fill(color(i));
            let (cw, ch, cy) = COPY;
            let dst = &mut model[((i + 3) % FRAMES) as usize];
            for y in cy..cy + ch {
                for x in (i % 4) * cw..(i % 4 + 1) * cw {
                    dst[(y * FRAME_W + x) as usize] = color(i);
                }
            }
        }
        let mut frame = vec![0u8; FRAME_BYTES as usize];
        for (k, want) in model.iter().enumerate() {
            let base = l.frame(k as u32);
            mem.read(base, &mut frame)?;
            for (px, (b, w)) in frame.chunks_exact(4).zip(want).enumerate() {
                let got = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                if got != *w {
                    found.add("frame pixel", || {
                        format!(
                            "frame {k} pixel ({}, {}) at {} is {got:#010x}, expected {w:#010x}",
                            px as u32 % FRAME_W,
                            px as u32 / FRAME_W,
                            where_(base + 4 * px as u64)
                        )
                    });
                }
            }
        }
        // Synthetic windows: the last iteration that filled each.
        let windows = if self.dirty_pages > 0 {
            SCRATCH_WINDOWS
        } else {
            0
        };
        for w in 0..windows {
            let last = (0..n)
                .rev()
                .take(SCRATCH_WINDOWS as usize)
                .find(|i| i % SCRATCH_WINDOWS == w);
            let want = last.map_or(0, scratch_color);
            for pg in 0..self.dirty_pages {
                let gfx = l.window(w, self.dirty_pages) + u64::from(pg) * PAGE_SIZE;
                mem.read(gfx, &mut page)?;
                for (d, b) in page.chunks_exact(4).enumerate() {
                    let got = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    if got != want {
                        found.add("scratch dword", || {
                            format!(
                                "scratch window {w} page {pg} at {} is {got:#010x}, expected {want:#010x}",
                                where_(gfx + 4 * d as u64)
                            )
                        });
                    }
                }
            }
        }
        // Pages nobody allocated stay zero.
        let used = drv.state().next_page;
        for g in used..drv.gtt().pages() {
            mem.read(g * PAGE_SIZE, &mut page)?;
            if let Some(at) = page.iter().position(|&b| b != 0) {
                found.add("non-zero unallocated page", || {
                    format!(
                        "unallocated page at {} is not zero (byte {at:#x} is {:#04x})",
                        where_(g * PAGE_SIZE),
                        page[at]
                    )
                });
            }
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::{Driver, DriverConfig};
    use crate::fake::FakeGpu;
    use guest_ram::GuestRam;

    fn run_to_end(frames: &mut Frames, drv: &mut Driver<'_, &FakeGpu<'_>>) {
        while frames.step(drv).unwrap() == Step::Continue {}
    }

    #[test]
    fn runs_and_verifies_on_the_fake_device() {
        let ram = GuestRam::with_mib(4).unwrap();
        let gpu = FakeGpu::new(&ram);
        let mut drv = Driver::init(&gpu, &ram, DriverConfig::default()).unwrap();
        let mut frames = Frames::start(&mut drv, 50).unwrap();
        run_to_end(&mut frames, &mut drv);
        assert_eq!(frames.verify(&drv).unwrap(), 50);
    }

    #[test]
    fn the_synthetic_fill_runs_and_verifies() {
        let ram = GuestRam::with_mib(8).unwrap();
        let gpu = FakeGpu::new(&ram);
        let mut drv = Driver::init(&gpu, &ram, DriverConfig::default()).unwrap();
        let mut frames = Frames::start_synthetic(&mut drv, 11, 3).unwrap();
        run_to_end(&mut frames, &mut drv);
        assert_eq!(frames.verify(&drv).unwrap(), 11);
        // Window 1 was last filled by iteration 9; a page of it lost:
        let gfx = frames.layout.window(1, 3) + 2 * PAGE_SIZE;
        drv.mem().write_u32(gfx + 8, 0).unwrap();
        let err = frames.verify(&drv).unwrap_err().to_string();
        assert!(err.starts_with("scratch window 1 page 2 at gfx"), "{err}");
        assert!(Frames::start_synthetic(&mut drv, 1, MAX_DIRTY_PAGES + 1).is_err());
    }

    #[test]
    fn a_lost_gpu_write_fails_verification() {
        let ram = GuestRam::with_mib(4).unwrap();
        let gpu = FakeGpu::new(&ram);
        let mut drv = Driver::init(&gpu, &ram, DriverConfig::default()).unwrap();
        let mut frames = Frames::start(&mut drv, 20).unwrap();
        run_to_end(&mut frames, &mut drv);
        // Undo history slot 5 as a migration that missed it would.
        let slot = frames.layout.slot(5);
        drv.mem().write_u32(slot, 0).unwrap();
        let err = frames.verify(&drv).unwrap_err().to_string();
        assert!(err.starts_with("history slot 5 at gfx"), "{err}");
    }

    /// The guest's layout: RAM pages scattered over guest physical memory
    /// (`hag-guest`'s buffer). The GTT carries the frames, the workload
    /// runs and verifies, and a lost GPU write still fails verification.
    #[test]
    fn runs_and_verifies_on_scattered_guest_memory() {
        let ram = crate::fake::scattered_ram(4);
        let gpu = FakeGpu::new(&ram);
        let mut drv = Driver::init(&gpu, &ram, DriverConfig::default()).unwrap();
        for g in 0..drv.gtt().pages() {
            let page = drv.gtt().guest_page(g).unwrap();
            let want = (ram.frame(page).unwrap() << 12) | 1;
            assert_eq!(gpu.gtt_entry(g), want, "GTT entry {g}");
            assert_ne!(ram.frame(page), Some(page));
        }
        let mut frames = Frames::start(&mut drv, MAX_ITERATIONS).unwrap();
        for _ in 0..2 * 40 {
            assert_eq!(frames.step(&mut drv).unwrap(), Step::Continue);
        }
        assert_eq!(frames.finish(&drv).unwrap(), 40);
        assert_eq!(frames.step(&mut drv).unwrap(), Step::Finished);
        assert_eq!(frames.verify(&drv).unwrap(), 40);
        assert!(frames.check(&drv).unwrap().is_empty());
        // The device saw every write at its guest physical frame.
        let dirty = gpu.take_dirty();
        let slot = frames.layout.slot(5);
        let page = drv.gtt().translate(slot).unwrap() / PAGE_SIZE;
        assert!(dirty.contains(&ram.frame(page).unwrap()));
        assert!(!dirty.contains(&page));

        // History slot 5, written once by the GPU, lost as a migration that
        // copied its page before the write would lose it.
        drv.mem().write_u32(slot, 0).unwrap();
        let err = frames.verify(&drv).unwrap_err().to_string();
        let at = format!(
            "history slot 5 at gfx {slot:#x} (buffer page {page}, guest physical {:#x}) is 0x00000000, expected {:#010x}",
            ram.frame(page).unwrap() * PAGE_SIZE + slot % PAGE_SIZE,
            history(5)
        );
        assert_eq!(err, at);
        let found = frames.check(&drv).unwrap();
        assert_eq!(found.counts, vec![("history slot", 1)]);
        assert_eq!(
            found.to_string(),
            format!("{at} (1 mismatch: 1 history slot)")
        );

        // A whole frame page left as it was before the last iterations.
        let gfx = frames.layout.frame(2) + PAGE_SIZE;
        drv.mem().write(gfx, &[0u8; PAGE_SIZE as usize]).unwrap();
        let found = frames.check(&drv).unwrap();
        assert_eq!(found.first.as_deref(), Some(at.as_str()));
        assert_eq!(
            found.counts,
            vec![("history slot", 1), ("frame pixel", PAGE_SIZE / 4)]
        );
        assert_eq!(found.total(), 1 + PAGE_SIZE / 4);
        assert!(found
            .to_string()
            .ends_with("(1025 mismatches: 1 history slot, 1024 frame pixels)"));
    }

    #[test]
    fn a_run_ends_early_between_iterations_only() {
        let ram = GuestRam::with_mib(4).unwrap();
        let gpu = FakeGpu::new(&ram);
        let mut drv = Driver::init(&gpu, &ram, DriverConfig::default()).unwrap();
        let mut frames = Frames::start(&mut drv, 100).unwrap();
        for _ in 0..2 * 7 + 1 {
            frames.step(&mut drv).unwrap();
        }
        assert_eq!(frames.phase(), Phase::Submitted(7));
        assert!(frames.finish(&drv).is_err());
        frames.step(&mut drv).unwrap();
        assert_eq!(frames.finish(&drv).unwrap(), 8);
        assert_eq!(frames.iterations(), 8);
        assert_eq!(frames.verify(&drv).unwrap(), 8);
        // Slot 8 was never written: a stray value there is caught.
        drv.mem().write_u32(frames.layout.slot(8), 1).unwrap();
        let err = frames.verify(&drv).unwrap_err().to_string();
        assert!(err.starts_with("history slot 8 at gfx"), "{err}");
        assert!(err.contains("(guest page "), "{err}");
    }

    #[test]
    fn state_moves_the_loop_to_another_driver_mid_iteration() {
        let ram = GuestRam::with_mib(4).unwrap();
        let gpu = FakeGpu::new(&ram);
        let mut drv = Driver::init(&gpu, &ram, DriverConfig::default()).unwrap();
        let mut frames = Frames::start(&mut drv, 30).unwrap();
        for _ in 0..21 {
            frames.step(&mut drv).unwrap();
        }
        assert_eq!(frames.phase(), Phase::Submitted(10));
        let bytes = frames.state(&drv).to_bytes();
        drop(drv);
        let state = FramesState::from_bytes(&bytes, ram.size()).unwrap();
        let mut drv = Driver::restore(&gpu, &ram, &state.driver).unwrap();
        let mut frames = Frames::from_state(&state);
        run_to_end(&mut frames, &mut drv);
        assert_eq!(frames.verify(&drv).unwrap(), 30);
        assert!(FramesState::from_bytes(&bytes, 2 * ram.size()).is_err());
        assert!(FramesState::from_bytes(b"{}", ram.size()).is_err());
    }
}
