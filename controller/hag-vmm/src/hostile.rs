//! `hag-vmm hostile`: tests hag's promise that the kernel never pays for a
//! guest's mistakes. Against the real module and vGPU it
//!
//! 1. abuses `/dev/hag`: unknown ioctl numbers, bad pointers, every range
//!    and id check of the control ioctls, each answer's exact errno, and
//!    the module must still answer `IOC_VERSION` after each;
//! 2. abuses the VFIO device fd: bad region/IRQ indexes and `argsz`,
//!    malformed `SET_IRQS`, BAR0 and config accesses of wrong size,
//!    alignment or place (never a success, never a changed register);
//! 3. fuzzes the command stream from the guest side: for each round the
//!    ring and batch buffers get random dwords or mutated valid commands,
//!    the GTT is rewritten and the ring moved while work runs, the doorbell
//!    rung; whatever happens (completed, rejected, hung, DMA fault) the
//!    vGPU is reset. After each round no guest page outside what some GTT
//!    entry mapped during the round may have changed, every changed page
//!    must be in hag's dirty log, and the device must still answer;
//! 4. sends valid streams that are expensive rather than malformed: a ring
//!    of 2 MiB of register loads (over a million validated commands: must
//!    be refused, never a kernel warning), blits of one-byte rows at pitch
//!    0 and 1 (BAR0, GTT writes and dirty-log reads must stay answered
//!    within [`RESPONSIVE`] meanwhile), a chain into a batch already
//!    audited from a later batch and batches called again (must complete,
//!    with the hardware's counts); and the small checks: a snapshot taken
//!    after a DMA fault restores, `HWS_PGA` outside graphics memory is
//!    refused, `IOC_SAVE_CONTEXT`'s reserved field is checked, and a
//!    quiesce left by a process that exits is undone.
//!
//! The command generator ([`Gen`]) and the GTT bookkeeping ([`GttModel`])
//! are plain values, tested without the device.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{bail, Context};
use hag_abi::{abi, sim_regs as r};
use hag_audit::audit::encode::{self, BlitRect};
use hag_dev::{bitmap_pages, bitmap_words, BadAddress, Device};
use nix::errno::Errno;
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::uio::{pread, pwrite};
use std::os::fd::{AsFd, AsRawFd};

use crate::vfio::VfioDevice;
use crate::vfio_sys as sys;
use guest_gpu::driver::{Driver, DriverConfig, DriverError, GttLayout, Pending, Registers};
use guest_ram::{GuestRam, PAGE_SIZE};

/// Graphics memory of a hag-sim vGPU.
const GFX: u64 = abi::SIM_GFX_MEM_SIZE;
/// GTT entries of a hag-sim vGPU.
const GTT_ENTRIES: u64 = GFX / PAGE_SIZE;
/// Guest RAM of the hostile VM: small, so that snapshots are cheap, and
/// mostly *not* mapped by the GTT, so that a stray write shows.
pub const RAM_MIB: u64 = 4;
/// Graphics pages `[0, WINDOW_PAGES)` stay mapped (status page, ring,
/// batches, data); every other entry is not present except the two
/// [`EDGE_PAGES`].
const WINDOW_PAGES: u64 = 32;
/// The last two graphics pages, mapped so that accesses at the very end of
/// graphics memory reach guest RAM.
const EDGE_PAGES: [u64; 2] = [GTT_ENTRIES - 2, GTT_ENTRIES - 1];
/// Ring size in pages.
const RING_PAGES: u32 = 2;
/// Batch buffer pages.
const BATCH_PAGES: u64 = 8;
/// Data pages (targets of valid writes).
const DATA_PAGES: u64 = 16;

/// What `hag-vmm hostile` is asked to do.
#[derive(Clone, Debug)]
pub struct HostileConfig {
    /// UUID of the hag-sim mdev.
    pub mdev: String,
    /// PRNG seed.
    pub seed: u64,
    /// Fuzzing rounds.
    pub iterations: u32,
    /// How long to wait for one round's submission.
    pub round_timeout: Duration,
}

/// What happened, for the summary line or JSON.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct HostileReport {
    /// No expectation was violated.
    pub passed: bool,
    /// The PRNG seed.
    pub seed: u64,
    /// Fuzzing rounds run.
    pub rounds: u32,
    /// Rounds whose submission ran to the end.
    pub completed: u32,
    /// Rounds the auditor rejected.
    pub rejected: u32,
    /// Rounds that hung (the watchdog stopped them).
    pub hung: u32,
    /// Rounds that ended in a DMA fault.
    pub faults: u32,
    /// Rounds still running when the wait ended (then reset).
    pub timeouts: u32,
    /// Checks of parts 1 and 2 together.
    pub ioctl_checks: u32,
    /// `/dev/hag` checks.
    pub hag_checks: u32,
    /// VFIO device fd checks.
    pub vfio_checks: u32,
    /// GTT entry halves rewritten by the fuzzer.
    pub gtt_rewrites: u64,
    /// Rounds that moved `RING_START` while work ran.
    pub ring_moves: u32,
    /// Rounds that rang the doorbell a second time while work ran.
    pub queued_tails: u32,
    /// Rounds that shrank the ring to one page under a long submission's
    /// head and rang again.
    pub ring_shrinks: u32,
    /// Guest pages the engine changed, summed over rounds.
    pub pages_written: u64,
    /// Expensive valid streams sent (part 4).
    pub expensive: u32,
    /// The slowest BAR0 access, GTT write or dirty-log read while one of
    /// them ran, in milliseconds.
    pub slowest_access_ms: u64,
    /// Every violated expectation, in order (at most 50).
    pub violations: Vec<String>,
}

impl HostileReport {
    /// The one-line summary.
    pub fn summary(&self) -> String {
        let mut line = format!(
            "{} hostile: {} rounds (completed {}, rejected {}, hung {}, faults {}",
            if self.passed { "PASS" } else { "FAIL" },
            self.rounds,
            self.completed,
            self.rejected,
            self.hung,
            self.faults
        );
        if self.timeouts > 0 {
            line.push_str(&format!(", timeouts {}", self.timeouts));
        }
        line.push_str(&format!("), {} ioctl checks", self.ioctl_checks));
        if let Some(first) = self.violations.first() {
            line.push_str(&format!(
                "; {} violation(s), first: {first}",
                self.violations.len()
            ));
        }
        line
    }
}

// ---------------------------------------------------------------------------
// A tiny deterministic PRNG

/// xorshift64, seeded through splitmix64 (so seeds 0, 1, 2… differ well).
#[derive(Clone, Debug)]
pub struct XorShift(u64);

impl XorShift {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        XorShift(if z == 0 { 1 } else { z })
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// The next 32 bits.
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// A value in `[0, n)` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    /// One of `items` (which must not be empty).
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

// ---------------------------------------------------------------------------
// The command generator

/// Where things are in graphics memory (all inside the mapped window).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Hardware status page.
    pub hws: u64,
    /// Ring.
    pub ring: u64,
    /// Ring size in bytes.
    pub ring_size: u32,
    /// Batch pages.
    pub batches: Vec<u64>,
    /// First data page.
    pub data: u64,
    /// Data pages.
    pub data_pages: u64,
}

impl Layout {
    /// The layout used without a driver (tests): status page at 0, ring at
    /// 1, batches, then data.
    pub fn packed() -> Self {
        let ring = PAGE_SIZE;
        let first_batch = ring + u64::from(RING_PAGES) * PAGE_SIZE;
        Layout {
            hws: 0,
            ring,
            ring_size: RING_PAGES * PAGE_SIZE as u32,
            batches: (0..BATCH_PAGES)
                .map(|i| first_batch + i * PAGE_SIZE)
                .collect(),
            data: first_batch + BATCH_PAGES * PAGE_SIZE,
            data_pages: DATA_PAGES,
        }
    }
}

/// Generates hostile ring and batch contents.
pub struct Gen {
    /// The PRNG (shared with the device-side choices of a round).
    pub rng: XorShift,
    /// Where things are.
    pub lay: Layout,
    /// This round is mostly valid work with the odd hostile field (so the
    /// engine, not only the auditor, gets hostile input).
    pub mild: bool,
}

/// GPR MMIO offsets (the registers commands may name).
fn gpr(n: u64) -> u32 {
    r::GPR_BASE + 4 * (n as u32 % (2 * r::GPR_COUNT))
}

impl Gen {
    /// A generator over `lay` from `seed`.
    pub fn new(seed: u64, lay: Layout) -> Self {
        Gen {
            rng: XorShift::new(seed),
            lay,
            mild: false,
        }
    }

    /// Starts a round: decides how hostile it is.
    pub fn begin_round(&mut self) {
        self.mild = self.rng.chance(1, 2);
    }

    /// A graphics address: mostly valid targets, often edges, sometimes
    /// nonsense. Aligned down to `align` unless deliberately not.
    pub fn addr(&mut self, align: u64) -> u64 {
        let rng = &mut self.rng;
        let align_down = |a: u64| a & !(align.max(1) - 1);
        let pick = if self.mild {
            // Valid for the auditor; now and then on a page no entry maps
            // (a DMA fault for the engine) or at the very end.
            match rng.below(20) {
                0..=17 => 0,
                18 => 12,
                _ => 14,
            }
        } else {
            rng.below(20)
        };
        match pick {
            0..=6 => align_down(self.lay.data + rng.below(self.lay.data_pages * PAGE_SIZE)),
            7 | 8 => {
                let mut pages = vec![self.lay.hws, self.lay.ring];
                pages.extend_from_slice(&self.lay.batches);
                align_down(rng.pick(&pages) + rng.below(PAGE_SIZE))
            }
            9 | 10 => GFX - rng.pick(&[1u64, 2, 4, 8, 12, 16, 32, 4096, 4097, 8192]),
            11 => GFX + rng.below(4) * 8,
            12 | 13 => {
                let pages = EDGE_PAGES[0] - WINDOW_PAGES;
                align_down((WINDOW_PAGES + rng.below(pages)) * PAGE_SIZE + rng.below(PAGE_SIZE))
            }
            14 => align_down(rng.pick(&EDGE_PAGES) * PAGE_SIZE + rng.below(PAGE_SIZE)),
            15 => rng.next_u64() & 0xffff_ffff_ffff,
            16 => u64::MAX - rng.below(16),
            17 => 0xffff_ffff_f000 + rng.below(PAGE_SIZE),
            18 => (self.lay.data + rng.below(self.lay.data_pages * PAGE_SIZE)) | (1 + rng.below(7)),
            _ => rng.below(4) * 4,
        }
    }

    fn rect(&mut self) -> BlitRect {
        let base = self.addr(4);
        let rng = &mut self.rng;
        if self.mild && rng.chance(9, 10) {
            let pitch = 4 * (1 + rng.below(64)) as u16;
            let (x, y) = (rng.below(16) as u16, rng.below(16) as u16);
            return BlitRect { base, pitch, x, y };
        }
        let pitch = match rng.below(4) {
            0 | 1 => 4 * (1 + rng.below(256)) as u16,
            2 => rng.next_u32() as u16,
            _ => 0,
        };
        let (x, y) = if rng.chance(3, 4) {
            (rng.below(16) as u16, rng.below(16) as u16)
        } else {
            (rng.next_u32() as u16, rng.next_u32() as u16)
        };
        BlitRect { base, pitch, x, y }
    }

    /// An offset in the status page: in mild rounds a valid one.
    fn hws_offset(&mut self) -> u16 {
        if self.mild && self.rng.chance(9, 10) {
            (self.rng.below(PAGE_SIZE / 8 - 1) * 8) as u16
        } else {
            self.rng.next_u32() as u16
        }
    }

    fn extent(&mut self) -> u16 {
        if self.mild && self.rng.chance(9, 10) {
            return 1 + self.rng.below(16) as u16;
        }
        match self.rng.below(6) {
            0..=2 => 1 + self.rng.below(32) as u16,
            3 => self.rng.next_u32() as u16,
            4 => 0xffff,
            _ => 0,
        }
    }

    fn register(&mut self) -> u32 {
        if self.mild && self.rng.chance(9, 10) {
            return gpr(self.rng.below(64));
        }
        match self.rng.below(8) {
            0..=5 => gpr(self.rng.below(64)),
            6 => self.rng.pick(&[
                r::RING_TAIL,
                r::RING_START,
                r::HWS_PGA,
                r::RESET,
                r::GTT_OFFSET,
            ]),
            _ => self.rng.next_u32(),
        }
    }

    /// A batch start target: mostly a batch page, sometimes inside one,
    /// the ring, or anywhere.
    fn batch_target(&mut self) -> u64 {
        if self.mild && self.rng.chance(9, 10) {
            return self.rng.pick(&self.lay.batches);
        }
        match self.rng.below(10) {
            0..=4 => self.rng.pick(&self.lay.batches),
            5 | 6 => self.rng.pick(&self.lay.batches) + self.rng.below(512) * 8,
            7 => self.lay.ring + self.rng.below(u64::from(self.lay.ring_size) / 8) * 8,
            _ => self.addr(4),
        }
    }

    /// One command from the encoder with hostile fields, sometimes mutated
    /// after encoding.
    pub fn command(&mut self) -> Vec<u32> {
        let v = self.rng.next_u32();
        // Mild rounds wait on semaphores more often (most never hold: a
        // hang for the watchdog).
        let kind = match self.rng.below(28) {
            // No MI_BATCH_BUFFER_END (refused in the ring) in mild rounds.
            2 if self.mild => 21,
            _ if self.mild && self.rng.chance(1, 12) => 21,
            k => k,
        };
        let mut cmd: Vec<u32> = match kind {
            0 => encode::noop().to_vec(),
            1 => encode::user_interrupt().to_vec(),
            2 => encode::batch_buffer_end().to_vec(),
            3 => encode::store_data_imm(self.addr(4), v).to_vec(),
            4 => encode::store_qword_imm(self.addr(8), u64::from(v) << 7).to_vec(),
            5 => encode::store_data_index(self.hws_offset(), v).to_vec(),
            6 => encode::store_qword_index(self.hws_offset(), u64::from(v)).to_vec(),
            7 => encode::load_register_imm(self.register(), v).to_vec(),
            8 => {
                let reg = self.register();
                encode::store_register_mem(reg, self.addr(4)).to_vec()
            }
            9 => {
                let reg = self.register();
                encode::load_register_mem(reg, self.addr(4)).to_vec()
            }
            10 => encode::copy_mem_mem(self.addr(4), self.addr(4)).to_vec(),
            11 => {
                let op = self.rng.next_u32() as u8;
                encode::atomic(self.addr(8), op, self.rng.below(4) as u8).to_vec()
            }
            12 => {
                let op = self
                    .rng
                    .pick(&[0x04u8, 0x05, 0x06, 0x07, 0x08, 0x01, 0x02, 0x03]);
                let size = self.rng.below(3) as u8;
                let data = [v, !v, 1, 2, 3, 4, 5, 6];
                encode::atomic_inline(self.addr(8), op, size, data).to_vec()
            }
            13 => encode::flush_dw().to_vec(),
            14 => encode::flush_dw_store(self.addr(8), v).to_vec(),
            15 => encode::flush_dw_store_qword(self.addr(8), u64::from(v)).to_vec(),
            16 => {
                let off = self.hws_offset();
                encode::flush_dw_store_index(off, v, self.rng.chance(1, 2)).to_vec()
            }
            17 => encode::flush_dw_timestamp(self.addr(8)).to_vec(),
            18 => encode::pipe_control(self.rng.next_u32()).to_vec(),
            19 => {
                let flags = if self.rng.chance(1, 2) {
                    0
                } else {
                    self.rng.next_u32()
                };
                encode::pipe_control_write_imm(flags, self.addr(8), u64::from(v)).to_vec()
            }
            20 => encode::pipe_control_timestamp(0, self.addr(8)).to_vec(),
            21 => {
                let compare = self.rng.below(8) as u8;
                encode::semaphore_wait(self.addr(4), self.rng.below(4) as u32, compare).to_vec()
            }
            22 => {
                let (dst, bpp) = (self.rect(), self.rng.pick(&[1u8, 2, 4, 8, 16, 3, 0]));
                let (w, h) = (self.extent(), self.extent());
                encode::xy_color_blt(dst, bpp, w, h, v).to_vec()
            }
            23 => {
                let (dst, src) = (self.rect(), self.rect());
                let bpp = self.rng.pick(&[1u8, 2, 4, 8, 16, 3, 0]);
                let (w, h) = (self.extent(), self.extent());
                encode::xy_src_copy_blt(dst, src, bpp, w, h).to_vec()
            }
            24 => {
                let (dst, src) = (self.rect(), self.rect());
                let bpp = self.rng.pick(&[1u8, 2, 4, 8, 16, 3, 0]);
                let (w, h) = (self.extent(), self.extent());
                encode::xy_fast_copy_blt(dst, src, bpp, w, h).to_vec()
            }
            // Valid but expensive: a register load of many pairs (each a
            // validated command the module must keep), a tall blit of
            // one-byte rows at pitch 0 or 1 (a DMA call per row).
            26 => {
                let pairs = 1 + self.rng.below(127) as u8;
                let mut lri = vec![encode::load_register_imm_header(pairs)];
                for _ in 0..pairs {
                    let reg = self.register();
                    lri.extend([reg, self.rng.next_u32()]);
                }
                lri
            }
            27 => {
                let pitch = self.rng.below(2) as u16;
                let dst = BlitRect {
                    base: self.lay.data + self.rng.below(PAGE_SIZE),
                    pitch: 0,
                    x: 0,
                    y: 0,
                };
                let src = BlitRect {
                    base: self.lay.data,
                    pitch,
                    x: 0,
                    y: 0,
                };
                let (w, h) = (
                    1 + self.rng.below(4) as u16,
                    1 + self.rng.below(0x7fff) as u16,
                );
                if self.rng.chance(1, 2) {
                    encode::xy_src_copy_blt(dst, src, 1, w, h).to_vec()
                } else {
                    encode::xy_color_blt(dst, 1, w, h, v).to_vec()
                }
            }
            _ => {
                let target = self.batch_target();
                encode::batch_buffer_start(target, self.rng.chance(1, 3)).to_vec()
            }
        };
        if self.rng.chance(1, if self.mild { 40 } else { 4 }) {
            self.mutate(&mut cmd);
        }
        cmd
    }

    /// Breaks an encoded command a little.
    fn mutate(&mut self, cmd: &mut Vec<u32>) {
        let i = self.rng.below(cmd.len() as u64) as usize;
        match self.rng.below(7) {
            0 => cmd[i] ^= 1 << self.rng.below(32),
            1 => cmd[0] = (cmd[0] & !0xff) | (cmd[0].wrapping_add(1) & 0xff),
            2 => cmd[0] = (cmd[0] & !0xff) | (cmd[0].wrapping_sub(1) & 0xff),
            3 => cmd[0] = (cmd[0] & !(0x3f << 23)) | ((self.rng.next_u32() & 0x3f) << 23),
            4 if cmd.len() > 1 => {
                cmd.pop();
            }
            5 => cmd.push(self.rng.next_u32()),
            _ => cmd[i] = self.rng.next_u32(),
        }
    }

    /// A random dword, biased towards plausible headers.
    pub fn dword(&mut self) -> u32 {
        let rng = &mut self.rng;
        match rng.below(5) {
            0 | 1 => rng.next_u32(),
            2 => ((rng.below(64) as u32) << 23) | rng.below(256) as u32,
            3 => (2 << 29) | ((rng.below(128) as u32) << 22) | rng.below(64) as u32,
            _ => rng.below(GFX) as u32 & !3,
        }
    }

    /// Ring contents for one round, starting at ring offset 0: an even
    /// number of dwords (so the tail is 8-byte aligned), at most the ring
    /// size less one qword.
    pub fn ring(&mut self) -> Vec<u32> {
        let max = (self.lay.ring_size / 4 - 2) as usize;
        let mut out = Vec::new();
        if !self.mild && self.rng.chance(1, 3) {
            let n = 1 + self.rng.below(256) as usize;
            out.extend((0..n).map(|_| self.dword()));
        } else {
            let n = 1 + self.rng.below(if self.mild { 8 } else { 24 });
            for _ in 0..n {
                out.extend(self.command());
            }
            if self.rng.chance(1, 2) {
                out.extend(encode::user_interrupt());
            }
        }
        out.truncate(max);
        if out.len() % 2 == 1 {
            out.push(encode::noop()[0]);
        }
        out
    }

    /// Contents for batch page `index` (at most one page of dwords), or
    /// `None` to leave it as it is.
    pub fn batch(&mut self, index: usize) -> Option<Vec<u32>> {
        let own = self.lay.batches[index];
        let mut out = Vec::new();
        let kind = match self.rng.below(10) {
            // Mild rounds: mostly valid batches, some looping or chained.
            0..=6 if self.mild => 0,
            7 if self.mild => 5,
            8 if self.mild => 6,
            _ if self.mild => 9,
            k => k,
        };
        match kind {
            0..=4 => {
                let n = 1 + self.rng.below(16);
                for _ in 0..n {
                    out.extend(self.command());
                }
                if self.rng.chance(9, 10) {
                    out.extend(encode::batch_buffer_end());
                }
            }
            5 => {
                // Chains to itself: the engine loops until the watchdog.
                if self.rng.chance(1, 2) {
                    out.extend(self.command());
                }
                out.extend(encode::batch_buffer_start(own, self.rng.chance(1, 2)));
            }
            6 => {
                let other = self.rng.pick(&self.lay.batches);
                out.extend(self.command());
                out.extend(encode::batch_buffer_start(other, self.rng.chance(1, 2)));
                out.extend(encode::batch_buffer_end());
            }
            7 | 8 => {
                let n = 1 + self.rng.below(64) as usize;
                out.extend((0..n).map(|_| self.dword()));
            }
            _ => return None,
        }
        out.truncate((PAGE_SIZE / 4) as usize);
        Some(out)
    }

    /// A hostile GTT entry value.
    pub fn pte(&mut self, ram_pages: u64, window_gpas: &[u64]) -> u64 {
        let rng = &mut self.rng;
        let present = r::GTT_PRESENT;
        match rng.below(8) {
            0 => 0,
            1 => rng.next_u64() & !present,
            // Present, outside guest RAM.
            2 => ((ram_pages + rng.below(1 << 20)) * PAGE_SIZE) | present,
            3 => (r::GTT_ADDR_MASK & !0xfff) | present,
            // Present, aliasing a page the window maps.
            4 | 5 => rng.pick(window_gpas) | present,
            // Present, any guest page: that page may then be written.
            6 => (rng.below(ram_pages) * PAGE_SIZE) | present,
            // Garbage in the bits above the address.
            _ => rng.next_u64() | present,
        }
    }
}

// ---------------------------------------------------------------------------
// GTT bookkeeping

/// The GTT as written to the device, the baseline to restore after each
/// round, and which guest pages some entry has mapped during the round.
#[derive(Clone, Debug)]
pub struct GttModel {
    entries: Vec<u64>,
    baseline: Vec<u64>,
    touched: BTreeSet<usize>,
    ram_pages: u64,
    /// Per guest page: mapped by some present entry during this round.
    allowed: Vec<bool>,
    baseline_allowed: Vec<bool>,
}

impl GttModel {
    /// A model whose baseline is `entries`, over `ram_pages` guest pages.
    pub fn new(entries: Vec<u64>, ram_pages: u64) -> Self {
        let mut allowed = vec![false; ram_pages as usize];
        for &pte in &entries {
            Self::allow(&mut allowed, ram_pages, pte);
        }
        GttModel {
            baseline: entries.clone(),
            entries,
            touched: BTreeSet::new(),
            ram_pages,
            baseline_allowed: allowed.clone(),
            allowed,
        }
    }

    fn allow(allowed: &mut [bool], ram_pages: u64, pte: u64) {
        if pte & r::GTT_PRESENT != 0 {
            let page = (pte & r::GTT_ADDR_MASK) / PAGE_SIZE;
            if page < ram_pages {
                allowed[page as usize] = true;
            }
        }
    }

    /// Starts a round: only the baseline's pages are allowed.
    pub fn begin_round(&mut self) {
        self.allowed.clone_from(&self.baseline_allowed);
    }

    /// Entry `index` now.
    pub fn entry(&self, index: usize) -> u64 {
        self.entries[index]
    }

    /// Records a 32-bit write of one half of entry `index`: the entry's
    /// value after it (an intermediate state of a two-half update is a
    /// real mapping too) counts as mapped this round.
    pub fn write_half(&mut self, index: usize, high: bool, value: u32) -> u64 {
        let old = self.entries[index];
        let new = if high {
            (old & 0xffff_ffff) | (u64::from(value) << 32)
        } else {
            (old & !0xffff_ffff) | u64::from(value)
        };
        self.entries[index] = new;
        self.touched.insert(index);
        Self::allow(&mut self.allowed, self.ram_pages, new);
        new
    }

    /// Whether guest page `page` was mapped by some entry this round.
    pub fn allowed(&self, page: u64) -> bool {
        self.allowed.get(page as usize).copied().unwrap_or(false)
    }

    /// Entries changed since the last restore, with their baseline values;
    /// the model takes the baseline back.
    pub fn take_restore(&mut self) -> Vec<(usize, u64)> {
        let out: Vec<(usize, u64)> = std::mem::take(&mut self.touched)
            .into_iter()
            .filter(|&i| self.entries[i] != self.baseline[i])
            .map(|i| (i, self.baseline[i]))
            .collect();
        for &(i, v) in &out {
            self.entries[i] = v;
        }
        out
    }
}

// ---------------------------------------------------------------------------
// Checks with expected errnos

#[derive(Default)]
struct Checks {
    count: u32,
    violations: Vec<String>,
}

fn errno_list(want: &[Errno]) -> String {
    want.iter()
        .map(|e| format!("{e:?}"))
        .collect::<Vec<_>>()
        .join(" or ")
}

impl Checks {
    fn violation(&mut self, what: String) {
        if self.violations.len() < 50 {
            self.violations.push(what);
        }
    }

    /// Counts a check that `got` failed with one of `want`.
    fn errno<T: std::fmt::Debug>(&mut self, what: &str, got: Result<T, Errno>, want: &[Errno]) {
        self.count += 1;
        match got {
            Err(e) if want.contains(&e) => {}
            Err(e) => self.violation(format!(
                "{what}: got {e:?} ({}), expected {}",
                e.desc(),
                errno_list(want)
            )),
            Ok(v) => self.violation(format!(
                "{what}: succeeded ({v:?}), expected {}",
                errno_list(want)
            )),
        }
    }

    /// Counts a check that `ok` holds.
    fn that(&mut self, what: &str, ok: bool, detail: impl FnOnce() -> String) {
        self.count += 1;
        if !ok {
            self.violation(format!("{what}: {}", detail()));
        }
    }
}

/// Builds an ioctl number as `<linux/ioctl.h>` does.
const fn ioc(dir: u32, ty: u8, nr: u8, size: u32) -> u32 {
    (dir << 30) | (size << 16) | ((ty as u32) << 8) | nr as u32
}
const IOC_W: u32 = 1;
const IOC_R: u32 = 2;

/// The module must answer `IOC_VERSION` after each check.
fn alive(dev: &Device, after: &str) -> anyhow::Result<()> {
    dev.version()
        .with_context(|| format!("the module no longer answers IOC_VERSION after {after}"))?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Part 1: /dev/hag

fn hag_ioctl_checks(dev: &Device, vgpu: u32, ram_size: u64, c: &mut Checks) -> anyhow::Result<()> {
    let ids: Vec<u32> = dev.list_vgpus()?.iter().map(|v| v.id).collect();
    let nobody = (u32::MAX - 16..=u32::MAX)
        .find(|id| !ids.contains(id))
        .context("no free vGPU id")?;
    let e = |r: Result<(), hag_dev::DirtyError>| r.map_err(|e| e.errno());
    let mib = 1 << 20;

    macro_rules! check {
        ($what:expr, $got:expr, $($want:expr),+) => {{
            let what: String = $what.into();
            c.errno(&what, $got, &[$($want),+]);
            alive(dev, &what)?;
        }};
    }

    // Numbers the module does not know.
    check!(
        "unknown ioctl _IO(0xB8, 0x7f)",
        dev.raw_ioctl_scratch(ioc(0, abi::IOC_MAGIC, 0x7f, 0)),
        Errno::ENOTTY
    );
    check!(
        "IOC_VERSION's nr with size 47",
        dev.raw_ioctl_scratch(ioc(IOC_R, abi::IOC_MAGIC, 0, 47)),
        Errno::ENOTTY
    );
    check!(
        "IOC_LIST_VGPUS's nr without its write direction",
        dev.raw_ioctl_scratch(ioc(IOC_R, abi::IOC_MAGIC, 1, 16)),
        Errno::ENOTTY
    );
    check!(
        "IOC_VERSION's nr as a write, _IOW(0xB8, 0, 48)",
        dev.raw_ioctl_scratch(ioc(IOC_W, abi::IOC_MAGIC, 0, 48)),
        Errno::ENOTTY
    );
    check!(
        "an ioctl of another type, _IOR('x', 0, 48)",
        dev.raw_ioctl_scratch(ioc(IOC_R, b'x', 0, 48)),
        Errno::ENOTTY
    );

    // Argument structures at bad addresses.
    for bad in [BadAddress::Low, BadAddress::Kernel, BadAddress::NoAccess] {
        check!(
            format!("IOC_VERSION into {}", bad.name()),
            dev.raw_ioctl_bad_arg(abi::IOC_VERSION, bad),
            Errno::EFAULT
        );
    }
    for (name, cmd, bad) in [
        ("IOC_LIST_VGPUS", abi::IOC_LIST_VGPUS, BadAddress::NoAccess),
        ("IOC_DIRTY_START", abi::IOC_DIRTY_START, BadAddress::Kernel),
        ("IOC_DIRTY_STOP", abi::IOC_DIRTY_STOP, BadAddress::Low),
        (
            "IOC_DIRTY_READ_CLEAR",
            abi::IOC_DIRTY_READ_CLEAR,
            BadAddress::NoAccess,
        ),
        (
            "IOC_VGPU_STATS",
            abi::IOC_VGPU_STATS,
            BadAddress::NonCanonical,
        ),
        ("IOC_SET_WATCHDOG", abi::IOC_SET_WATCHDOG, BadAddress::Null),
        ("IOC_INJECT_HANG", abi::IOC_INJECT_HANG, BadAddress::Kernel),
    ] {
        check!(
            format!("{name} with its argument at {}", bad.name()),
            dev.raw_ioctl_bad_arg(cmd, bad),
            Errno::EFAULT
        );
    }

    // IOC_LIST_VGPUS.
    check!(
        format!(
            "IOC_LIST_VGPUS with capacity {}",
            abi::LIST_MAX_CAPACITY + 1
        ),
        dev.list_vgpus_raw(abi::LIST_MAX_CAPACITY + 1, None),
        Errno::EINVAL
    );
    check!(
        "IOC_LIST_VGPUS with capacity u32::MAX",
        dev.list_vgpus_raw(u32::MAX, Some(BadAddress::NoAccess)),
        Errno::EINVAL
    );
    for bad in [
        BadAddress::Null,
        BadAddress::Low,
        BadAddress::Kernel,
        BadAddress::NoAccess,
    ] {
        check!(
            format!("IOC_LIST_VGPUS with entries at {}", bad.name()),
            dev.list_vgpus_raw(8, Some(bad)),
            Errno::EFAULT
        );
    }

    // IOC_DIRTY_START.
    let start = |vgpu_id, reserved, gpa, size| {
        dev.dirty_start_raw(abi::HagDirtyStart {
            vgpu_id,
            reserved,
            gpa,
            size,
        })
    };
    for (what, gpa, size) in [
        ("unaligned gpa", 0x800, mib),
        ("unaligned size", 0, 4097),
        ("size 0", 0, 0),
        (
            "size DIRTY_MAX_BYTES + 4 KiB",
            0,
            abi::DIRTY_MAX_BYTES + 4096,
        ),
        ("size !0xfff", 0, !0xfff),
        ("gpa + size overflowing", !0xfff, 0x2000),
    ] {
        check!(
            format!("IOC_DIRTY_START with {what} (gpa {gpa:#x}, size {size:#x})"),
            start(vgpu, 0, gpa, size),
            Errno::EINVAL
        );
    }
    check!(
        "IOC_DIRTY_START with reserved 1",
        start(vgpu, 1, 0, mib),
        Errno::EINVAL
    );
    check!(
        format!("IOC_DIRTY_START of unknown vGPU {nobody}"),
        start(nobody, 0, 0, mib),
        Errno::ENODEV
    );

    // IOC_DIRTY_STOP and IOC_DIRTY_READ_CLEAR.
    check!(
        format!("IOC_DIRTY_STOP of unknown vGPU {nobody}"),
        e(dev.dirty_stop(nobody)),
        Errno::ENODEV
    );
    dev.dirty_stop(vgpu).context("stopping the dirty log")?;
    let words = bitmap_words(ram_size);
    let mut bitmap = vec![0u64; words * 2];
    check!(
        "IOC_DIRTY_READ_CLEAR without a started log",
        dev.dirty_read_clear(vgpu, &mut bitmap)
            .map_err(|e| e.errno()),
        Errno::ENOENT
    );
    check!(
        format!("IOC_DIRTY_READ_CLEAR of unknown vGPU {nobody}"),
        dev.dirty_read_clear(nobody, &mut bitmap)
            .map_err(|e| e.errno()),
        Errno::ENODEV
    );
    dev.dirty_start(vgpu, 0, ram_size)
        .context("starting the dirty log")?;
    let need = (words * 8) as u64;
    for claim in [need - 8, 0] {
        check!(
            format!("IOC_DIRTY_READ_CLEAR with a {claim}-byte bitmap ({need} needed)"),
            dev.dirty_read_clear_claiming(vgpu, &mut bitmap, claim),
            Errno::ENOSPC
        );
    }
    for bad in [BadAddress::Low, BadAddress::Kernel, BadAddress::NoAccess] {
        check!(
            format!("IOC_DIRTY_READ_CLEAR into a bitmap at {}", bad.name()),
            dev.dirty_read_clear_bad(vgpu, need, bad),
            Errno::EFAULT
        );
    }

    // IOC_SET_WATCHDOG.
    let before = dev.vgpu_stats(vgpu)?.watchdog_ms;
    for ms in [
        0,
        abi::WATCHDOG_MIN_MS - 1,
        abi::WATCHDOG_MAX_MS + 1,
        u32::MAX,
    ] {
        check!(
            format!("IOC_SET_WATCHDOG to {ms} ms"),
            e(dev.set_watchdog(vgpu, ms)),
            Errno::EINVAL
        );
    }
    let after = dev.vgpu_stats(vgpu)?.watchdog_ms;
    c.that(
        "refused IOC_SET_WATCHDOG calls leave the watchdog alone",
        after == before,
        || format!("it was {before} ms, is {after} ms"),
    );
    check!(
        format!("IOC_SET_WATCHDOG of unknown vGPU {nobody}"),
        e(dev.set_watchdog(nobody, 1000)),
        Errno::ENODEV
    );

    // IOC_INJECT_HANG (the module is loaded without allow_hang_injection).
    check!(
        "IOC_INJECT_HANG without allow_hang_injection",
        e(dev.inject_hang(vgpu)),
        Errno::EPERM
    );
    check!(
        format!("IOC_INJECT_HANG of unknown vGPU {nobody} without allow_hang_injection"),
        e(dev.inject_hang(nobody)),
        Errno::EPERM
    );

    // IOC_VGPU_STATS.
    check!(
        format!("IOC_VGPU_STATS of unknown vGPU {nobody}"),
        dev.vgpu_stats(nobody).map_err(|e| e.errno()),
        Errno::ENODEV
    );
    c.that(
        "the vGPU list is intact",
        dev.list_vgpus()?.iter().any(|v| v.id == vgpu),
        || format!("vGPU {vgpu} is gone"),
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Part 2: the VFIO device fd

fn vfio_checks(vfio: &VfioDevice, c: &mut Checks) -> anyhow::Result<()> {
    let fd = vfio.device_fd();
    let bar0 = vfio.bar0();
    let config = vfio.config();
    let regs_of_interest = [
        r::RING_START,
        r::RING_CTL,
        r::INT_MASK,
        r::RING_TAIL,
        r::HWS_PGA,
    ];
    let before: Vec<u32> = regs_of_interest
        .iter()
        .map(|&o| vfio.read(o))
        .collect::<Result<_, _>>()?;

    macro_rules! check {
        ($what:expr, $got:expr, $($want:expr),+) => {{
            let what: String = $what.into();
            c.errno(&what, $got, &[$($want),+]);
            let id = vfio.read(r::HAG_ID).with_context(|| format!("BAR0 unreadable after {what}"))?;
            if id != r::HAG_ID_VALUE {
                bail!("HAG_ID reads {id:#x} after {what}");
            }
        }};
    }

    // Info ioctls.
    let region = |index, argsz| {
        sys::device_get_region_info_raw(
            fd,
            sys::VfioRegionInfo {
                argsz,
                index,
                ..Default::default()
            },
        )
    };
    let full = sys::argsz::<sys::VfioRegionInfo>();
    check!(
        "GET_REGION_INFO of region 9",
        region(9, full),
        Errno::EINVAL
    );
    check!(
        "GET_REGION_INFO of region u32::MAX",
        region(u32::MAX, full),
        Errno::EINVAL
    );
    check!(
        "GET_REGION_INFO with argsz 16",
        region(0, 16),
        Errno::EINVAL
    );
    check!("GET_REGION_INFO with argsz 0", region(0, 0), Errno::EINVAL);
    let irq = |index, argsz| {
        sys::device_get_irq_info_raw(
            fd,
            sys::VfioIrqInfo {
                argsz,
                index,
                ..Default::default()
            },
        )
    };
    let full = sys::argsz::<sys::VfioIrqInfo>();
    check!("GET_IRQ_INFO of index 5", irq(5, full), Errno::EINVAL);
    check!(
        "GET_IRQ_INFO of index u32::MAX",
        irq(u32::MAX, full),
        Errno::EINVAL
    );
    check!("GET_IRQ_INFO with argsz 8", irq(1, 8), Errno::EINVAL);
    check!(
        "GET_INFO with argsz 4",
        sys::device_get_info_raw(fd, 4),
        Errno::EINVAL
    );
    check!(
        "unknown VFIO device ioctl _IO(';', 160)",
        sys::device_ioctl_scratch(fd, sys::vfio_io(60)),
        Errno::ENOTTY
    );

    // SET_IRQS: each variant would install a fresh eventfd if accepted.
    let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC)?;
    let good = sys::VfioIrqSetEventfd {
        argsz: sys::argsz::<sys::VfioIrqSetEventfd>(),
        flags: sys::VFIO_IRQ_SET_DATA_EVENTFD | sys::VFIO_IRQ_SET_ACTION_TRIGGER,
        index: sys::VFIO_PCI_MSI_IRQ_INDEX,
        start: 0,
        count: 1,
        fd: efd.as_fd().as_raw_fd(),
    };
    let variants: [(&str, sys::VfioIrqSetEventfd, &[Errno]); 12] = [
        (
            "an unknown flag bit",
            sys::VfioIrqSetEventfd {
                flags: good.flags | 1 << 10,
                ..good
            },
            &[Errno::EINVAL],
        ),
        (
            "two data types",
            sys::VfioIrqSetEventfd {
                flags: good.flags | sys::VFIO_IRQ_SET_DATA_NONE,
                ..good
            },
            &[Errno::EINVAL],
        ),
        (
            "action MASK",
            sys::VfioIrqSetEventfd {
                flags: sys::VFIO_IRQ_SET_DATA_EVENTFD | 1 << 3,
                ..good
            },
            &[Errno::EINVAL],
        ),
        (
            "index 0 (INTx)",
            sys::VfioIrqSetEventfd { index: 0, ..good },
            &[Errno::EINVAL],
        ),
        (
            "index 4",
            sys::VfioIrqSetEventfd { index: 4, ..good },
            &[Errno::EINVAL],
        ),
        (
            "index u32::MAX",
            sys::VfioIrqSetEventfd {
                index: u32::MAX,
                ..good
            },
            &[Errno::EINVAL],
        ),
        (
            "count 2",
            sys::VfioIrqSetEventfd { count: 2, ..good },
            &[Errno::EINVAL],
        ),
        (
            "start 1",
            sys::VfioIrqSetEventfd { start: 1, ..good },
            &[Errno::EINVAL],
        ),
        (
            "argsz 20 (no room for the fd)",
            sys::VfioIrqSetEventfd { argsz: 20, ..good },
            &[Errno::EINVAL],
        ),
        (
            "argsz 0",
            sys::VfioIrqSetEventfd { argsz: 0, ..good },
            &[Errno::EINVAL],
        ),
        (
            "the VFIO device fd as eventfd",
            sys::VfioIrqSetEventfd {
                fd: fd.as_raw_fd(),
                ..good
            },
            &[Errno::EBADF, Errno::EINVAL],
        ),
        (
            "a closed fd as eventfd",
            sys::VfioIrqSetEventfd {
                fd: 0x3fff_fff0,
                ..good
            },
            &[Errno::EBADF, Errno::EINVAL],
        ),
    ];
    for (what, set, want) in variants {
        let what = format!("SET_IRQS with {what}");
        c.errno(&what, sys::device_set_irqs_raw(fd, set), want);
        if vfio.read(r::HAG_ID)? != r::HAG_ID_VALUE {
            bail!("HAG_ID wrong after {what}");
        }
    }

    // Region reads and writes.
    let rd = |pos: u64, len: usize| {
        let mut buf = vec![0u8; len];
        pread(fd, &mut buf, pos as i64).map(|n| buf[..n].to_vec())
    };
    let wr = |pos: u64, data: &[u8]| pwrite(fd, data, pos as i64);
    let b = bar0.offset;
    for len in [1, 2, 8] {
        check!(
            format!("BAR0 read of {len} bytes at 0"),
            rd(b, len),
            Errno::EINVAL
        );
    }
    for off in [1u64, 2, 0x2032] {
        check!(
            format!("BAR0 read at unaligned offset {off:#x}"),
            rd(b + off, 4),
            Errno::EINVAL
        );
    }
    for off in [bar0.size, bar0.size - 2, (1 << r::REGION_SHIFT) - 4] {
        check!(
            format!(
                "BAR0 read at offset {off:#x} (BAR0 is {:#x} bytes)",
                bar0.size
            ),
            rd(b + off, 4),
            Errno::EINVAL
        );
    }
    for (off, len) in [(r::RING_TAIL, 1usize), (r::RING_START, 2), (r::INT_MASK, 8)] {
        check!(
            format!("BAR0 write of {len} bytes at {off:#x}"),
            wr(b + u64::from(off), &vec![0xa5; len]),
            Errno::EINVAL
        );
    }
    for off in [0x2032u64, bar0.size] {
        check!(
            format!("BAR0 write at offset {off:#x}"),
            wr(b + off, &[0x5a; 4]),
            Errno::EINVAL
        );
    }
    for index in [1u64, 2, 3, 4, 5, 6, 8, 9, 0x7f_ffff] {
        check!(
            format!("read of region {index}"),
            rd(index << r::REGION_SHIFT, 4),
            Errno::EINVAL
        );
    }
    check!(
        "write of region 3",
        wr(3 << r::REGION_SHIFT, &[0; 4]),
        Errno::EINVAL
    );
    let cfg = config.offset;
    for (off, len) in [(256u64, 4usize), (254, 4), (0, 257), (0, 4096)] {
        check!(
            format!("config read of {len} bytes at {off}"),
            rd(cfg + off, len),
            Errno::EINVAL
        );
    }
    for (off, len) in [(256u64, 4usize), (0, 300)] {
        check!(
            format!("config write of {len} bytes at {off}"),
            wr(cfg + off, &vec![0xff; len]),
            Errno::EINVAL
        );
    }
    check!(
        "read at a negative file offset",
        {
            let mut buf = [0u8; 4];
            pread(fd, &mut buf, -4)
        },
        Errno::EINVAL
    );
    let whole = rd(cfg, 256);
    c.that(
        "config space reads whole (256 bytes at 0)",
        matches!(&whole, Ok(v) if v.len() == 256
            && u16::from_le_bytes([v[0], v[1]]) == r::PCI_VENDOR_ID),
        || format!("got {:?}", whole.as_ref().map(|v| v.len())),
    );
    let last = rd(cfg + 255, 1);
    c.that(
        "config space's last byte reads",
        matches!(&last, Ok(v) if v.len() == 1),
        || format!("got {last:?}"),
    );
    let after: Vec<u32> = regs_of_interest
        .iter()
        .map(|&o| vfio.read(o))
        .collect::<Result<_, _>>()?;
    c.that(
        "refused BAR0 writes changed no register",
        after == before,
        || format!("RING_START, RING_CTL, INT_MASK, RING_TAIL, HWS_PGA were {before:x?}, are {after:x?}"),
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Part 3: fuzzing the command stream

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Completed,
    Rejected,
    Hung,
    Fault,
    Timeout,
}

struct Fuzz<'a, 'm> {
    drv: Driver<'m, &'a VfioDevice>,
    dev: &'a Device,
    vgpu: u32,
    gen: Gen,
    gtt: GttModel,
    window_gpas: Vec<u64>,
    before: Vec<u8>,
    bitmap: Vec<u64>,
}

impl Fuzz<'_, '_> {
    fn write_gtt(
        &mut self,
        index: usize,
        pte: u64,
        report: &mut HostileReport,
    ) -> anyhow::Result<()> {
        let off = r::GTT_OFFSET + index as u32 * r::GTT_ENTRY_BYTES;
        let halves = [(false, pte as u32), (true, (pte >> 32) as u32)];
        let order = if self.gen.rng.chance(1, 2) {
            [0, 1]
        } else {
            [1, 0]
        };
        for i in order {
            let (high, value) = halves[i];
            self.gtt.write_half(index, high, value);
            self.drv
                .regs()
                .write(off + if high { 4 } else { 0 }, value)?;
            report.gtt_rewrites += 1;
        }
        Ok(())
    }

    /// Rewrites `n` random GTT entries with hostile values.
    fn gtt_chaos(&mut self, n: u64, report: &mut HostileReport) -> anyhow::Result<()> {
        let ram_pages = self.drv.ram().pages();
        for _ in 0..n {
            let rng = &mut self.gen.rng;
            let index = match rng.below(5) {
                0 | 1 => rng.below(WINDOW_PAGES),
                2 => rng.pick(&EDGE_PAGES),
                _ => rng.below(GTT_ENTRIES),
            } as usize;
            let pte = self.gen.pte(ram_pages, &self.window_gpas);
            self.write_gtt(index, pte, report)?;
        }
        Ok(())
    }

    fn dirty_pages(&mut self) -> anyhow::Result<BTreeSet<u64>> {
        self.bitmap.fill(0);
        self.dev.dirty_read_clear(self.vgpu, &mut self.bitmap)?;
        Ok(bitmap_pages(&self.bitmap).collect())
    }

    fn round(
        &mut self,
        n: u32,
        timeout: Duration,
        report: &mut HostileReport,
        c: &mut Checks,
    ) -> anyhow::Result<()> {
        self.drv
            .reset()
            .with_context(|| format!("round {n}: RESET"))?;
        self.gtt.begin_round();
        self.gen.begin_round();
        // Batches and ring, written by the CPU before the snapshot.
        for i in 0..self.gen.lay.batches.len() {
            if let Some(dwords) = self.gen.batch(i) {
                let gfx = self.gen.lay.batches[i];
                self.drv.mem().write_dwords(gfx, &dwords)?;
            }
        }
        let mut ring = self.gen.ring();
        let ring_size = self.drv.ring_size();
        // Now and then: a long submission, then the ring shrunk to one page
        // under its head and the doorbell rung again.
        let shrink = self.gen.rng.chance(1, 15);
        if shrink {
            let len = (ring_size / 4 - 2) as usize - 2 * self.gen.rng.below(64) as usize;
            ring.resize(len, encode::noop()[0]);
        }
        self.drv.mem().write_dwords(self.drv.ring_gfx(), &ring)?;
        let tail = if self.gen.rng.chance(1, 40) {
            // Past the ring's end: refused at the doorbell.
            ring_size + 8 * self.gen.rng.below(1 << 16) as u32
        } else {
            ring.len() as u32 * 4
        };
        if self.gen.rng.chance(1, 6) {
            let k = 1 + self.gen.rng.below(6);
            self.gtt_chaos(k, report)?;
        }
        self.drv.ram().snapshot_into(&mut self.before);
        self.dirty_pages()?;

        let pending = |tail| Pending {
            start: 0,
            tail,
            offsets: Vec::new(),
            parts: Vec::new(),
        };
        self.drv.doorbell(&pending(tail))?;
        // While it runs: GTT rewrites, a moved ring, a second doorbell.
        if self.gen.rng.chance(1, 4) {
            let k = 1 + self.gen.rng.below(8);
            self.gtt_chaos(k, report)?;
        }
        if self.gen.rng.chance(1, 8) {
            let start = match self.gen.rng.below(3) {
                0 => self.gen.rng.pick(&self.gen.lay.batches.clone()) as u32,
                1 => self.gen.rng.next_u32(),
                _ => (GFX - PAGE_SIZE) as u32,
            };
            self.drv.regs().write(r::RING_START, start)?;
            if self.gen.rng.chance(1, 3) {
                let ctl = self.gen.rng.next_u32();
                self.drv.regs().write(r::RING_CTL, ctl)?;
            }
            report.ring_moves += 1;
        }
        if self.gen.rng.chance(1, 12) {
            let hws = self.gen.rng.next_u32();
            self.drv.regs().write(r::HWS_PGA, hws)?;
        }
        if shrink {
            self.drv.regs().write(r::RING_CTL, r::RING_CTL_ENABLE)?;
            let second = 8 * self.gen.rng.below(PAGE_SIZE / 8) as u32;
            self.drv.doorbell(&pending(second))?;
            report.ring_shrinks += 1;
        } else if tail < ring_size && self.gen.rng.chance(1, 10) {
            let second = 8 * self.gen.rng.below(u64::from(ring_size / 8)) as u32;
            self.drv.doorbell(&pending(second))?;
            report.queued_tails += 1;
        }

        let outcome = match self.drv.wait(timeout) {
            Ok(_) => Outcome::Completed,
            Err(f) => match f.error {
                DriverError::Rejected { .. } => Outcome::Rejected,
                DriverError::Hung { .. } => Outcome::Hung,
                DriverError::DmaFault { .. } => Outcome::Fault,
                DriverError::Timeout { .. } => Outcome::Timeout,
                DriverError::UnknownError(status) => {
                    c.violation(format!(
                        "round {n}: ERROR_STATUS {status} is not in the contract"
                    ));
                    Outcome::Fault
                }
                other => bail!("round {n}: the device stopped answering: {other}"),
            },
        };
        match outcome {
            Outcome::Completed => report.completed += 1,
            Outcome::Rejected => report.rejected += 1,
            Outcome::Hung => report.hung += 1,
            Outcome::Fault => report.faults += 1,
            Outcome::Timeout => report.timeouts += 1,
        }
        // Stop the engine before looking: after RESET nothing runs.
        self.drv
            .reset()
            .with_context(|| format!("round {n}: RESET after {outcome:?}"))?;

        let changed = self.drv.ram().changed_since(&self.before);
        let dirty = self.dirty_pages()?;
        report.pages_written += changed.len() as u64;
        for &page in &changed {
            if !self.gtt.allowed(page) {
                c.violation(format!(
                    "round {n} ({outcome:?}): the engine wrote guest page {:#x}, which no GTT entry mapped during the round",
                    page * PAGE_SIZE
                ));
            }
            if !dirty.contains(&page) {
                c.violation(format!(
                    "round {n} ({outcome:?}): guest page {:#x} changed but is not in the dirty log",
                    page * PAGE_SIZE
                ));
            }
        }
        for (index, pte) in self.gtt.take_restore() {
            let off = r::GTT_OFFSET + index as u32 * r::GTT_ENTRY_BYTES;
            self.drv.regs().write(off, pte as u32)?;
            self.drv.regs().write(off + 4, (pte >> 32) as u32)?;
        }
        let id = self.drv.regs().read(r::HAG_ID)?;
        if id != r::HAG_ID_VALUE {
            bail!("round {n} ({outcome:?}): HAG_ID reads {id:#x} afterwards");
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Part 4: valid streams that are expensive, and the small checks

/// The longest a BAR0 access, a GTT write or a dirty-log read may take
/// while an expensive submission runs: the module holds the vGPU's lock
/// for one bounded slice of work at a time, a few milliseconds even under
/// TCG and a debug kernel.
pub const RESPONSIVE: Duration = Duration::from_millis(1000);
/// Graphics page where part 4 maps its 2 MiB ring (outside the window).
const BIG_RING_PAGE: u64 = 2048;
/// Pages of that ring (the largest `RING_CTL` allows).
const BIG_RING_PAGES: u64 = 512;
/// `ERROR_REASON` of a submission with too many validated commands
/// (`Reason::TooManyEntries`).
const REASON_TOO_MANY_ENTRIES: u32 = 16;

/// One page of register loads: four `MI_LOAD_REGISTER_IMM` of 127 pairs
/// and four `MI_NOOP`, so that pages can follow each other in a ring.
pub fn register_load_page() -> Vec<u32> {
    let mut page = Vec::with_capacity((PAGE_SIZE / 4) as usize);
    for _ in 0..4 {
        page.push(encode::load_register_imm_header(127));
        for i in 0..127u32 {
            page.extend([gpr(u64::from(i)), i]);
        }
    }
    page.resize((PAGE_SIZE / 4) as usize, encode::noop()[0]);
    page
}

/// A ring's worth of blits whose rows are one byte: at destination pitch 0
/// from a source of pitch 1 (every row differs: each is run) and fills at
/// pitch 0 (every row the same: one row is the whole blit). The source is
/// the 32 KiB at `data` (32767 rows, the most a blit has).
pub fn tiny_pitch_blits(data: u64, ring_dwords: usize) -> Vec<u32> {
    let dst = BlitRect {
        base: data + 0x100,
        pitch: 0,
        x: 0,
        y: 0,
    };
    let src = BlitRect {
        base: data,
        pitch: 1,
        x: 0,
        y: 0,
    };
    let copy = encode::xy_src_copy_blt(dst, src, 1, 1, 0x7fff);
    let fill = encode::xy_color_blt(dst, 1, 1, 0x7fff, 0x5a);
    let mut out = Vec::new();
    while out.len() + copy.len() + fill.len() + 2 <= ring_dwords {
        out.extend(copy);
        out.extend(fill);
    }
    if out.len() % 2 == 1 {
        out.push(encode::noop()[0]);
    }
    out
}

/// Batches that call, chain and start again batches already audited, and
/// the count each leaves at its counter: the hardware's.
pub struct Reentry {
    /// Batch page contents, by index into the layout's batches.
    pub batches: Vec<(usize, Vec<u32>)>,
    /// The ring.
    pub ring: Vec<u32>,
    /// Counters (graphics addresses) and the value each must end with.
    pub counts: Vec<(u64, u32)>,
}

/// The reentry streams over `lay`, counting at `data + 0x800` on.
pub fn reentry(lay: &Layout) -> Vec<Reentry> {
    let b = &lay.batches;
    let (c1, c2) = (lay.data + 0x800, lay.data + 0x808);
    let inc = |at| encode::atomic(at, 0x05, 0).to_vec();
    let end = || encode::batch_buffer_end().to_vec();
    let chain = |k: usize| encode::batch_buffer_start(b[k], false).to_vec();
    let call = |k: usize| encode::batch_buffer_start(b[k], true).to_vec();
    let cat = |parts: &[Vec<u32>]| parts.concat();
    let pad = |mut v: Vec<u32>| {
        if v.len() % 2 == 1 {
            v.push(encode::noop()[0]);
        }
        v
    };
    vec![
        // A chains to B; C chains to B again (audited): B runs twice, the
        // ring goes on after C. (A walk that returned from B's second run
        // into the ring after A would loop over the ring's middle, its
        // head moving, for ever.)
        Reentry {
            batches: vec![(0, chain(1)), (1, cat(&[inc(c1), end()])), (2, chain(1))],
            ring: pad(cat(&[chain(0), inc(c2), chain(2), inc(c2)])),
            counts: vec![(c1, 2), (c2, 2)],
        },
        // The ring starts A twice; A calls B twice: B runs four times.
        Reentry {
            batches: vec![
                (0, cat(&[call(1), call(1), end()])),
                (1, cat(&[inc(c1), end()])),
            ],
            ring: pad(cat(&[chain(0), chain(0), inc(c2)])),
            counts: vec![(c1, 4), (c2, 1)],
        },
        // A calls B, which chains to C; the ring then starts C itself
        // (another level, another entry) and A again.
        Reentry {
            batches: vec![
                (0, cat(&[call(1), inc(c2), end()])),
                (1, chain(2)),
                (2, cat(&[inc(c1), end()])),
            ],
            ring: pad(cat(&[chain(0), chain(2), chain(0)])),
            counts: vec![(c1, 3), (c2, 2)],
        },
    ]
}

impl Fuzz<'_, '_> {
    /// Runs `f`, keeping the slowest time it took in `slowest`.
    fn timed<T>(slowest: &mut Duration, f: impl FnOnce() -> T) -> T {
        let start = std::time::Instant::now();
        let out = f();
        *slowest = (*slowest).max(start.elapsed());
        out
    }

    /// Rings the doorbell at `tail` of the ring programmed now and waits
    /// up to `timeout`, meanwhile reading BAR0, rewriting the GTT entry of
    /// graphics page `busy_page` (with its own value) and reading the dirty
    /// log, each timed. Returns the outcome, `ERROR_REASON` and the slowest
    /// access.
    fn run_timed(
        &mut self,
        tail: u32,
        busy_page: u64,
        timeout: Duration,
    ) -> anyhow::Result<(Outcome, u32, Duration)> {
        let mut slowest = Duration::ZERO;
        let regs = self.drv.regs();
        let pte = self.gtt.entry(busy_page as usize);
        let off = r::GTT_OFFSET + busy_page as u32 * r::GTT_ENTRY_BYTES;
        regs.write(r::RING_TAIL, tail)?;
        let start = std::time::Instant::now();
        let outcome = loop {
            let status = Self::timed(&mut slowest, || regs.read(r::ERROR_STATUS))?;
            match status {
                r::ERROR_NONE => {}
                r::ERROR_COMMAND_REJECTED => break Outcome::Rejected,
                r::ERROR_HANG => break Outcome::Hung,
                _ => break Outcome::Fault,
            }
            let engine = Self::timed(&mut slowest, || regs.read(r::ENGINE_STATUS))?;
            let head = Self::timed(&mut slowest, || regs.read(r::RING_HEAD))?;
            if engine & r::ENGINE_IDLE != 0 && head == tail {
                break Outcome::Completed;
            }
            if start.elapsed() >= timeout {
                break Outcome::Timeout;
            }
            Self::timed(&mut slowest, || -> anyhow::Result<()> {
                regs.write(off, pte as u32)?;
                regs.write(off + 4, (pte >> 32) as u32)?;
                Ok(())
            })?;
            let bitmap = &mut self.bitmap;
            let dev = self.dev;
            let vgpu = self.vgpu;
            Self::timed(&mut slowest, || dev.dirty_read_clear(vgpu, bitmap))?;
            std::thread::sleep(Duration::from_millis(2));
        };
        let reason = regs.read(r::ERROR_REASON)?;
        Ok((outcome, reason, slowest))
    }

    fn expensive(
        &mut self,
        timeout: Duration,
        report: &mut HostileReport,
        c: &mut Checks,
    ) -> anyhow::Result<()> {
        let lay = self.gen.lay.clone();
        let data_page = lay.data / PAGE_SIZE;
        let mut slowest = Duration::ZERO;

        // 2 MiB of register loads: 512 graphics pages onto one guest page.
        self.drv.reset()?;
        self.drv
            .mem()
            .write_dwords(lay.data, &register_load_page())?;
        let pte = self.gtt.entry(data_page as usize);
        for page in BIG_RING_PAGE..BIG_RING_PAGE + BIG_RING_PAGES {
            let off = r::GTT_OFFSET + page as u32 * r::GTT_ENTRY_BYTES;
            self.drv.regs().write(off, pte as u32)?;
            self.drv.regs().write(off + 4, (pte >> 32) as u32)?;
        }
        let regs = self.drv.regs();
        regs.write(r::RING_START, (BIG_RING_PAGE * PAGE_SIZE) as u32)?;
        regs.write(
            r::RING_CTL,
            ((BIG_RING_PAGES as u32 - 1) << r::RING_CTL_PAGES_SHIFT) | r::RING_CTL_ENABLE,
        )?;
        let tail = (BIG_RING_PAGES * PAGE_SIZE) as u32 - 8;
        let (outcome, reason, took) = self.run_timed(tail, data_page, timeout)?;
        slowest = slowest.max(took);
        report.expensive += 1;
        c.that(
            "a 2 MiB ring of register loads is refused for its validated commands",
            outcome == Outcome::Rejected && reason == REASON_TOO_MANY_ENTRIES,
            || format!("outcome {outcome:?}, ERROR_REASON {reason}"),
        );
        for page in BIG_RING_PAGE..BIG_RING_PAGE + BIG_RING_PAGES {
            let off = r::GTT_OFFSET + page as u32 * r::GTT_ENTRY_BYTES;
            self.drv.regs().write(off, 0)?;
            self.drv.regs().write(off + 4, 0)?;
        }

        // Blits of one-byte rows, in the driver's ring.
        self.drv.reset()?;
        let ring_dwords = (self.drv.ring_size() / 4 - 2) as usize;
        let blits = tiny_pitch_blits(lay.data, ring_dwords);
        self.drv.mem().write_dwords(self.drv.ring_gfx(), &blits)?;
        let tail = blits.len() as u32 * 4;
        let (outcome, _, took) =
            self.run_timed(tail, data_page, timeout.min(Duration::from_secs(3)))?;
        slowest = slowest.max(took);
        report.expensive += 1;
        c.that(
            "blits of one-byte rows run, hang or are stopped, never wedge the device",
            matches!(
                outcome,
                Outcome::Completed | Outcome::Hung | Outcome::Timeout
            ),
            || format!("outcome {outcome:?}"),
        );

        // Batches started again, through chains and calls.
        for (n, case) in reentry(&lay).into_iter().enumerate() {
            self.drv.reset()?;
            for (k, dwords) in &case.batches {
                self.drv.mem().write_dwords(lay.batches[*k], dwords)?;
            }
            for &(at, _) in &case.counts {
                self.drv.mem().write_u32(at, 0)?;
            }
            self.drv
                .mem()
                .write_dwords(self.drv.ring_gfx(), &case.ring)?;
            let tail = case.ring.len() as u32 * 4;
            let (outcome, reason, took) = self.run_timed(tail, data_page, timeout)?;
            slowest = slowest.max(took);
            report.expensive += 1;
            c.that(
                &format!("batches started again (case {n}) complete"),
                outcome == Outcome::Completed,
                || format!("outcome {outcome:?}, ERROR_REASON {reason}"),
            );
            for &(at, want) in &case.counts {
                let got = self.drv.mem().read_u32(at)?;
                c.that(
                    &format!("batches started again (case {n}): counter at {at:#x}"),
                    got == want || outcome != Outcome::Completed,
                    || format!("is {got}, the hardware leaves {want}"),
                );
            }
        }
        report.slowest_access_ms = slowest.as_millis() as u64;
        c.that(
            "BAR0, GTT writes and dirty-log reads answer while expensive work runs",
            slowest <= RESPONSIVE,
            || {
                format!(
                    "one took {} ms (at most {} ms)",
                    slowest.as_millis(),
                    RESPONSIVE.as_millis()
                )
            },
        );
        self.drv.reset()?;
        Ok(())
    }

    /// The small checks of part 4.
    fn small_checks(&mut self, c: &mut Checks) -> anyhow::Result<()> {
        let lay = self.gen.lay.clone();
        // A DMA fault after a three-dword command: the ring head stays
        // qword aligned, so the snapshot taken then restores.
        self.drv.reset()?;
        let unmapped = (WINDOW_PAGES + 3) * PAGE_SIZE;
        let ring = [
            encode::load_register_imm(gpr(0), 1).to_vec(),
            encode::store_data_imm(unmapped, 1).to_vec(),
            encode::noop().to_vec(),
        ]
        .concat();
        self.drv.mem().write_dwords(self.drv.ring_gfx(), &ring)?;
        let pending = Pending {
            start: 0,
            tail: ring.len() as u32 * 4,
            offsets: Vec::new(),
            parts: Vec::new(),
        };
        self.drv.doorbell(&pending)?;
        let outcome = self.drv.wait(Duration::from_secs(10));
        c.that(
            "a store to an unmapped page after a register load faults",
            matches!(&outcome, Err(f) if matches!(f.error, DriverError::DmaFault { .. })),
            || format!("{:?}", outcome.as_ref().map_err(|f| f.error.to_string())),
        );
        let head = self.drv.regs().read(r::RING_HEAD)?;
        c.that(
            "RING_HEAD after a fault is qword aligned",
            head % 8 == 0,
            || format!("it is {head:#x}"),
        );
        self.dev.quiesce(self.vgpu, 1000)?;
        let snap = self.dev.save_context(self.vgpu)?;
        let restored = self.dev.restore_context(self.vgpu, &snap);
        c.that(
            "a snapshot taken after a DMA fault restores",
            restored.is_ok(),
            || format!("{:?}", restored.as_ref().map_err(|e| e.errno())),
        );
        // IOC_SAVE_CONTEXT checks its reserved field (while quiesced, when
        // it would otherwise answer).
        let mut arg = abi::HagContextBuf {
            vgpu_id: self.vgpu,
            reserved: 1,
            buf: 0,
            buf_bytes: 0,
            used_bytes: 0,
        };
        c.errno(
            "IOC_SAVE_CONTEXT with reserved 1",
            self.dev.save_context_raw(&mut arg),
            &[Errno::EINVAL],
        );
        self.dev.resume(self.vgpu)?;

        // HWS_PGA: a status page outside graphics memory is refused.
        let regs = self.drv.regs();
        let before = regs.read(r::HWS_PGA)?;
        for bad in [
            GFX as u32,
            (GFX - PAGE_SIZE) as u32 + 1 + PAGE_SIZE as u32,
            u32::MAX,
        ] {
            regs.write(r::HWS_PGA, bad)?;
            let now = regs.read(r::HWS_PGA)?;
            c.that(
                &format!("HWS_PGA {bad:#x} is refused"),
                now == before,
                || format!("it reads {now:#x}, was {before:#x}"),
            );
        }
        let last = (GFX - PAGE_SIZE) as u32;
        regs.write(r::HWS_PGA, last)?;
        let now = regs.read(r::HWS_PGA)?;
        c.that("HWS_PGA at the last page is taken", now == last, || {
            format!("it reads {now:#x}")
        });
        self.drv.reset()?;

        // A process quiesces the vGPU and exits without resuming it.
        let vgpu = self.vgpu;
        // SAFETY: `hag-vmm hostile` runs no other thread, so the child may
        // allocate and open files; it only opens /dev/hag, quiesces and
        // leaves with `_exit`.
        let child = unsafe { nix::libc::fork() };
        if child < 0 {
            bail!("fork: {}", Errno::last());
        }
        if child == 0 {
            let code = match Device::open().map(|d| d.quiesce(vgpu, 2000).is_ok()) {
                Ok(true) => 0,
                _ => 1,
            };
            // SAFETY: ends the child at once, running none of the parent's
            // destructors; the kernel closes its files.
            unsafe { nix::libc::_exit(code) }
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above; `status` is a live int.
        let waited = unsafe { nix::libc::waitpid(child, &mut status, 0) };
        c.that(
            "a child process quiesces the vGPU and exits",
            waited == child && nix::libc::WIFEXITED(status) && nix::libc::WEXITSTATUS(status) == 0,
            || format!("waitpid {waited}, status {status:#x}"),
        );
        let engine = self.drv.regs().read(r::ENGINE_STATUS)?;
        c.that(
            "a quiesce left by a process that exited is undone",
            engine & r::ENGINE_QUIESCED == 0,
            || format!("ENGINE_STATUS {engine:#x} still has QUIESCED"),
        );
        if engine & r::ENGINE_QUIESCED != 0 {
            self.dev.resume(self.vgpu)?;
        }
        let _ = lay;
        Ok(())
    }
}

/// A store and a user interrupt that must complete: the vGPU works.
fn sanity<R: Registers>(
    drv: &mut Driver<'_, R>,
    gfx: u64,
    value: u32,
    when: &str,
) -> anyhow::Result<()> {
    drv.reset()?;
    let cmds = [
        encode::store_data_imm(gfx, value).to_vec(),
        encode::user_interrupt().to_vec(),
    ];
    drv.submit(&cmds, Duration::from_secs(10))
        .map_err(|f| anyhow::anyhow!("{}", f.error))
        .with_context(|| format!("a plain store {when} did not complete"))?;
    let got = drv.mem().read_u32(gfx)?;
    if got != value {
        bail!("a plain store {when} wrote {got:#x}, expected {value:#x}");
    }
    Ok(())
}

/// Runs all three parts. Errors are for what stops the test (the device or
/// module no longer answering, setup failing); violated expectations are
/// collected in the report.
pub fn run(cfg: &HostileConfig) -> anyhow::Result<HostileReport> {
    let mut report = HostileReport {
        seed: cfg.seed,
        ..HostileReport::default()
    };
    let ram = GuestRam::with_mib(RAM_MIB)?;
    let dev = Device::open()?;
    dev.version()?;
    let vgpu = dev.find_vgpu(&cfg.mdev)?;
    if vgpu.source != abi::VGPU_SOURCE_SIM {
        bail!("vGPU {} ({}) is not a hag-sim vGPU", vgpu.id, cfg.mdev);
    }

    // Part 1.
    let mut c = Checks::default();
    hag_ioctl_checks(&dev, vgpu.id, ram.size(), &mut c).context("/dev/hag checks")?;
    report.hag_checks = c.count;

    // Part 2.
    let vfio = VfioDevice::attach(&cfg.mdev, &ram)
        .with_context(|| format!("cannot attach mdev {} through VFIO", cfg.mdev))?;
    vfio_checks(&vfio, &mut c).context("VFIO checks")?;
    report.vfio_checks = c.count - report.hag_checks;
    report.ioctl_checks = c.count;

    // Part 3.
    dev.set_watchdog(vgpu.id, abi::WATCHDOG_MIN_MS)?;
    let drv_cfg = DriverConfig {
        ring_pages: RING_PAGES,
        gtt_layout: GttLayout::Scattered,
    };
    let mut drv =
        Driver::init(&vfio, &ram, drv_cfg).context("cannot set up the guest GPU driver")?;
    let batches: Vec<u64> = (0..BATCH_PAGES)
        .map(|_| drv.alloc(PAGE_SIZE))
        .collect::<Result<_, _>>()?;
    let data = drv.alloc(DATA_PAGES * PAGE_SIZE)?;
    let lay = Layout {
        hws: drv.hws_gfx(),
        ring: drv.ring_gfx(),
        ring_size: drv.ring_size(),
        batches,
        data,
        data_pages: DATA_PAGES,
    };
    if data + DATA_PAGES * PAGE_SIZE > WINDOW_PAGES * PAGE_SIZE {
        bail!("the driver's buffers do not fit the mapped window");
    }
    // Unmap everything outside the window; map the two edge pages onto
    // guest pages nothing else maps.
    let mut entries: Vec<u64> = (0..GTT_ENTRIES).map(|p| drv.gtt().pte(p)).collect();
    let window_gpas: Vec<u64> = (0..WINDOW_PAGES)
        .filter_map(|p| drv.gtt().translate(p * PAGE_SIZE))
        .collect();
    for page in WINDOW_PAGES..GTT_ENTRIES {
        let pte = if let Some(k) = EDGE_PAGES.iter().position(|&e| e == page) {
            drv.gtt().pte(WINDOW_PAGES + k as u64)
        } else {
            0
        };
        if entries[page as usize] != pte {
            let off = r::GTT_OFFSET + page as u32 * r::GTT_ENTRY_BYTES;
            drv.regs().write(off, pte as u32)?;
            drv.regs().write(off + 4, (pte >> 32) as u32)?;
            entries[page as usize] = pte;
        }
    }
    sanity(&mut drv, data, 0x600d_0001, "before fuzzing")?;
    let mut fuzz = Fuzz {
        drv,
        dev: &dev,
        vgpu: vgpu.id,
        gen: Gen::new(cfg.seed, lay),
        gtt: GttModel::new(entries, ram.pages()),
        window_gpas,
        before: Vec::new(),
        bitmap: vec![0; bitmap_words(ram.size())],
    };
    for n in 0..cfg.iterations {
        fuzz.round(n, cfg.round_timeout, &mut report, &mut c)?;
        report.rounds += 1;
    }

    // Part 4.
    fuzz.expensive(
        cfg.round_timeout.max(Duration::from_secs(5)),
        &mut report,
        &mut c,
    )
    .context("expensive streams")?;
    fuzz.small_checks(&mut c).context("small checks")?;
    sanity(&mut fuzz.drv, data + 8, 0x600d_0002, "after fuzzing")?;
    dev.set_watchdog(vgpu.id, abi::WATCHDOG_DEFAULT_MS)?;
    let _ = dev.dirty_stop(vgpu.id);

    report.violations = c.violations;
    report.passed = report.violations.is_empty();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hag_audit::audit::{audit, AddressSpace, AuditConfig, GfxMemory, MemoryFault, NoSink};

    #[test]
    fn prng_is_deterministic_and_seeds_differ() {
        let a: Vec<u64> = {
            let mut g = XorShift::new(7);
            (0..4).map(|_| g.next_u64()).collect()
        };
        let mut g = XorShift::new(7);
        assert_eq!(a, (0..4).map(|_| g.next_u64()).collect::<Vec<_>>());
        assert_ne!(XorShift::new(0).next_u64(), XorShift::new(1).next_u64());
        let mut g = XorShift::new(0);
        assert!((0..1000).all(|_| g.below(3) < 3));
        assert_eq!(g.below(0), 0);
    }

    /// Graphics memory for the host-side auditor: batch pages as generated,
    /// everything else in the window zero, the rest unmapped.
    struct Pages(std::collections::HashMap<u64, Vec<u32>>);

    impl GfxMemory for Pages {
        fn read_dwords(
            &mut self,
            space: AddressSpace,
            gfx_addr: u64,
            out: &mut [u32],
        ) -> Result<(), MemoryFault> {
            assert_eq!(space, AddressSpace::Ggtt, "the simulated vGPU has no PPGTT");
            for (i, o) in out.iter_mut().enumerate() {
                let a = gfx_addr + 4 * i as u64;
                let page = a / PAGE_SIZE;
                let mapped = page < WINDOW_PAGES || EDGE_PAGES.contains(&page);
                if !mapped {
                    return Err(MemoryFault { gfx_addr: a });
                }
                let dw = self.0.get(&(page * PAGE_SIZE));
                *o = dw
                    .and_then(|d| d.get(((a % PAGE_SIZE) / 4) as usize))
                    .copied()
                    .unwrap_or(0);
            }
            Ok(())
        }
    }

    #[test]
    fn generated_rounds_fit_and_mix_accepted_and_rejected() {
        let mut gen = Gen::new(42, Layout::packed());
        let regs = guest_gpu::driver::gpr_registers();
        let cfg = AuditConfig::new(GFX, gen.lay.hws).with_registers(&regs);
        let mut pages = Pages(Default::default());
        let (mut accepted, mut rejected) = (0, 0);
        for _ in 0..500 {
            gen.begin_round();
            for i in 0..gen.lay.batches.len() {
                if let Some(b) = gen.batch(i) {
                    assert!(b.len() <= 1024);
                    pages.0.insert(gen.lay.batches[i], b);
                }
            }
            let ring = gen.ring();
            assert!(!ring.is_empty() && ring.len() % 2 == 0);
            assert!(ring.len() * 4 <= gen.lay.ring_size as usize - 8);
            match audit(&ring, gen.lay.ring, &cfg, &mut pages, &mut NoSink) {
                Ok(_) => accepted += 1,
                Err(_) => rejected += 1,
            }
        }
        // Both paths of the kernel get exercised.
        eprintln!("{accepted} of 500 rounds pass the audit");
        assert!(
            accepted >= 150,
            "only {accepted} of 500 rounds pass the audit"
        );
        assert!(rejected >= 50, "only {rejected} of 500 rounds are rejected");
    }

    /// What the hardware leaves at each counter: runs the audited list with
    /// the auditor's own walk (as the module's engine does) and counts the
    /// increments.
    fn run_counts(ring: &[u32], ring_gfx: u64, pages: &mut Pages, lay: &Layout) -> Vec<(u64, u32)> {
        use hag_audit::audit::flow::Exec;
        use hag_audit::audit::{AuditSink, SinkFull, ValidatedCommand};
        struct Keep(Vec<ValidatedCommand>);
        impl AuditSink for Keep {
            fn command(&mut self, cmd: &ValidatedCommand) -> Result<(), SinkFull> {
                self.0.push(*cmd);
                Ok(())
            }
        }
        let regs = guest_gpu::driver::gpr_registers();
        let cfg = AuditConfig::new(GFX, lay.hws).with_registers(&regs);
        let mut keep = Keep(Vec::new());
        audit(ring, ring_gfx, &cfg, pages, &mut keep).expect("the stream is valid");
        let cmds = keep.0;
        let mut exec = Exec::new(&cmds);
        let mut counts = std::collections::BTreeMap::new();
        for _ in 0..10_000 {
            let Some(i) = exec.current(&cmds).unwrap() else {
                break;
            };
            if let hag_audit::audit::Command::Atomic { addr, .. } = cmds[i].kind {
                *counts.entry(addr).or_insert(0u32) += 1;
            }
            exec.advance(&cmds).unwrap();
        }
        assert!(exec.current(&cmds).unwrap().is_none(), "the stream ends");
        counts.into_iter().collect()
    }

    #[test]
    fn reentry_streams_leave_the_hardware_counts() {
        let lay = Layout::packed();
        for (n, case) in reentry(&lay).into_iter().enumerate() {
            let mut pages = Pages(Default::default());
            for (k, dw) in &case.batches {
                pages.0.insert(lay.batches[*k], dw.clone());
            }
            assert!(case.ring.len() % 2 == 0);
            let got = run_counts(&case.ring, lay.ring, &mut pages, &lay);
            assert_eq!(got, case.counts, "case {n}");
        }
    }

    #[test]
    fn expensive_streams_are_valid_and_refused_only_for_their_size() {
        let lay = Layout::packed();
        let regs = guest_gpu::driver::gpr_registers();
        let cfg = AuditConfig::new(GFX, lay.hws).with_registers(&regs);
        // One page of register loads is valid on its own, and pages of it
        // follow each other; 512 of them are over the entry limit only.
        let page = register_load_page();
        assert_eq!(page.len() as u64, PAGE_SIZE / 4);
        let mut pages = Pages(Default::default());
        audit(&page, lay.ring, &cfg, &mut pages, &mut NoSink).unwrap();
        let ring: Vec<u32> = (0..BIG_RING_PAGES)
            .flat_map(|_| page.iter().copied())
            .collect();
        let ring = &ring[..ring.len() - 2];
        let e = audit(ring, lay.ring, &cfg, &mut pages, &mut NoSink).unwrap_err();
        assert_eq!(e.reason.code(), REASON_TOO_MANY_ENTRIES, "{e}");
        // The blits fill the ring and pass.
        let blits = tiny_pitch_blits(lay.data, (lay.ring_size / 4 - 2) as usize);
        assert!(blits.len() > 500 && blits.len() % 2 == 0);
        audit(&blits, lay.ring, &cfg, &mut pages, &mut NoSink).unwrap();
    }

    #[test]
    fn generator_is_deterministic() {
        let run = |seed| {
            let mut g = Gen::new(seed, Layout::packed());
            (0..20).flat_map(|_| g.ring()).collect::<Vec<u32>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn gtt_model_counts_intermediate_mappings_and_restores() {
        // 8 guest pages; entry 0 maps page 1.
        let mut entries = vec![0u64; 16];
        entries[0] = 0x1000 | 1;
        let mut m = GttModel::new(entries, 8);
        m.begin_round();
        assert!(m.allowed(1) && !m.allowed(2));
        // Low half first: entry 3 becomes 0x2001 for a moment (page 2),
        // then the high half moves it outside guest RAM.
        assert_eq!(m.write_half(3, false, 0x2001), 0x2001);
        assert_eq!(m.write_half(3, true, 0x10), 0x10_0000_2001);
        assert!(m.allowed(2));
        // Bits above the address are masked as the device masks them.
        m.write_half(4, true, 0xff80_0000);
        m.write_half(4, false, 0x3001);
        assert!(m.allowed(3));
        // Not present maps nothing; beyond RAM is ignored.
        m.write_half(5, false, 0x4000);
        m.write_half(6, false, 0x9000 | 1);
        assert!(!m.allowed(4) && !m.allowed(9));
        let restore = m.take_restore();
        assert_eq!(
            restore.iter().map(|r| r.0).collect::<Vec<_>>(),
            vec![3, 4, 5, 6]
        );
        assert!(restore.iter().all(|&(_, v)| v == 0));
        assert_eq!(m.entry(3), 0);
        m.begin_round();
        assert!(m.allowed(1) && !m.allowed(2) && !m.allowed(3));
        assert!(m.take_restore().is_empty());
    }

    #[test]
    fn summary_line() {
        let mut rep = HostileReport {
            passed: true,
            rounds: 300,
            completed: 40,
            rejected: 200,
            hung: 30,
            faults: 30,
            ioctl_checks: 41,
            ..Default::default()
        };
        assert_eq!(
            rep.summary(),
            "PASS hostile: 300 rounds (completed 40, rejected 200, hung 30, faults 30), 41 ioctl checks"
        );
        rep.passed = false;
        rep.timeouts = 2;
        rep.violations = vec!["x: got EINVAL".into()];
        assert_eq!(
            rep.summary(),
            "FAIL hostile: 300 rounds (completed 40, rejected 200, hung 30, faults 30, timeouts 2), 41 ioctl checks; 1 violation(s), first: x: got EINVAL"
        );
    }

    #[test]
    fn ioctl_numbers_are_built_like_the_c_macros() {
        assert_eq!(ioc(IOC_R, abi::IOC_MAGIC, 0, 48), abi::IOC_VERSION);
        assert_eq!(
            ioc(IOC_R | IOC_W, abi::IOC_MAGIC, 1, 16),
            abi::IOC_LIST_VGPUS
        );
    }

    #[test]
    fn checks_name_the_errno() {
        let mut c = Checks::default();
        c.errno::<()>("a", Err(Errno::EINVAL), &[Errno::EINVAL]);
        c.errno::<()>("b", Err(Errno::EFAULT), &[Errno::EINVAL]);
        c.errno("c", Ok(3), &[Errno::EBADF, Errno::EINVAL]);
        assert_eq!(c.count, 3);
        assert_eq!(
            c.violations,
            vec![
                "b: got EFAULT (Bad address), expected EINVAL".to_owned(),
                "c: succeeded (3), expected EBADF or EINVAL".to_owned()
            ]
        );
    }
}
