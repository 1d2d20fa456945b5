//! GPU workloads whose whole state lives in guest RAM. Each one allocates
//! its buffers in graphics memory, fills data and batch buffers on the CPU
//! side, hands the runner its ring submissions, and afterwards checks every
//! value the GPU should have produced by reading guest RAM.
//!
//! Commands are built with `hag_audit::audit::encode`, the encoders the
//! auditor is tested against.

use anyhow::{bail, ensure, Context};
use hag_audit::audit::encode::{self, BlitRect};
use hag_audit::audit::opcodes::PC_CS_STALL;

use crate::driver::{Driver, DriverError, GfxMem, Registers, Setup, HWS_SEQNO};
use guest_ram::PAGE_SIZE;

/// MI_ATOMIC opcodes (PRM "MI_ATOMIC", ATOMIC_OPCODE, dword forms; bits
/// 6:5 = 0 select 4-byte operands). `hag_audit` encodes any opcode, so the
/// numbers live here.
pub mod atomic_op {
    /// `ATOMIC_4B_MOVE`: memory = operand.
    pub const MOVE: u8 = 0x04;
    /// `ATOMIC_4B_INCREMENT`: memory += 1.
    pub const INC: u8 = 0x05;
    /// `ATOMIC_4B_DECREMENT`: memory -= 1.
    pub const DEC: u8 = 0x06;
    /// `ATOMIC_4B_ADD`: memory += operand.
    pub const ADD: u8 = 0x07;
}

/// What a submission should do on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Run to the end; `user_interrupt`: it raises USER_INTERRUPT.
    Complete {
        /// The submission ends with MI_USER_INTERRUPT.
        user_interrupt: bool,
    },
    /// Be rejected by the auditor at this command of the submission.
    Rejected {
        /// Index of the offending command in [`Submission::commands`].
        command: usize,
    },
    /// Hang (the watchdog stops it).
    Hang,
}

/// One ring submission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Submission {
    /// The ring commands, one `Vec` each (the driver never splits one at
    /// the ring's end).
    pub commands: Vec<Vec<u32>>,
    /// What should happen.
    pub expect: Expect,
}

/// Builds a list of ring commands.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cmds(pub Vec<Vec<u32>>);

impl Cmds {
    /// Appends one command's dwords.
    pub fn push(&mut self, cmd: impl AsRef<[u32]>) -> &mut Self {
        self.0.push(cmd.as_ref().to_vec());
        self
    }
}

/// A GPU workload.
pub trait Workload {
    /// Its name on the command line.
    fn name(&self) -> &'static str;
    /// CPU-side setup: allocates buffers, writes initial data and batch
    /// buffers; returns the ring submissions in order.
    fn prepare(&mut self, setup: &mut Setup<'_>) -> Result<Vec<Submission>, DriverError>;
    /// Checks every value the GPU should have produced.
    fn verify(&self, mem: &GfxMem<'_>) -> anyhow::Result<()>;
}

/// MI_SEMAPHORE_WAIT's COMPARE_OPERATION for "memory == data" (PRM;
/// the engine's `SemaphoreWait` arm decodes the same values).
const SEMAPHORE_EQUAL: u8 = 4;

/// Names of the workloads `--workload all` runs, in order.
pub const ALL: [&str; 3] = ["stores", "blit", "batch"];
/// Every workload name.
pub const NAMES: [&str; 5] = ["stores", "blit", "batch", "hang", "reject"];

/// The workload called `name`.
pub fn by_name(name: &str) -> Option<Box<dyn Workload>> {
    Some(match name {
        "stores" => Box::new(Stores::default()),
        "blit" => Box::new(Blit::default()),
        "batch" => Box::new(Batch::default()),
        "hang" => Box::new(Hang::default()),
        "reject" => Box::new(Reject::default()),
        _ => return None,
    })
}

fn check_u32(mem: &GfxMem<'_>, gfx: u64, want: u32, what: &str) -> anyhow::Result<()> {
    let got = mem.read_u32(gfx)?;
    ensure!(
        got == want,
        "{what} at gfx {gfx:#x} is {got:#010x}, expected {want:#010x}"
    );
    Ok(())
}

/// Checks that the status page at `hws` holds `seqno` (every submission ran).
fn check_seqno(mem: &GfxMem<'_>, hws: u64, seqno: u32) -> anyhow::Result<()> {
    check_u32(mem, hws + u64::from(HWS_SEQNO), seqno, "status page seqno")
}

/// Appends the status-page store and interrupt that end a submission.
fn fence(cmds: &mut Cmds, seqno: u32) {
    cmds.push(encode::store_data_index(HWS_SEQNO, seqno))
        .push(encode::user_interrupt());
}

fn complete(cmds: Cmds) -> Submission {
    Submission {
        commands: cmds.0,
        expect: Expect::Complete {
            user_interrupt: true,
        },
    }
}

/// `stores`: MI_STORE_DATA_IMM of distinct values to 128 scattered pages,
/// in 8 submissions of 64 stores, each ending with a sequence number in the
/// status page and MI_USER_INTERRUPT.
#[derive(Default)]
pub struct Stores {
    buf: u64,
    hws: u64,
    last_seqno: u32,
}

impl Stores {
    /// Stores in all.
    pub const STORES: u32 = 512;
    /// Pages stored to.
    pub const PAGES: u32 = 128;
    /// Stores per submission.
    pub const PER_SUBMISSION: u32 = 64;

    fn target(&self, i: u32) -> (u64, u32) {
        let page = u64::from((i * 37) % Self::PAGES);
        let slot = u64::from(i / Self::PAGES);
        (self.buf + page * PAGE_SIZE + slot * 1024, 0x5700_0000 | i)
    }
}

impl Workload for Stores {
    fn name(&self) -> &'static str {
        "stores"
    }

    fn prepare(&mut self, s: &mut Setup<'_>) -> Result<Vec<Submission>, DriverError> {
        self.buf = s.alloc.alloc(u64::from(Self::PAGES) * PAGE_SIZE)?;
        self.hws = s.hws_gfx;
        let mut subs = Vec::new();
        for chunk in 0..Self::STORES / Self::PER_SUBMISSION {
            let mut cmds = Cmds::default();
            for i in chunk * Self::PER_SUBMISSION..(chunk + 1) * Self::PER_SUBMISSION {
                let (addr, value) = self.target(i);
                cmds.push(encode::store_data_imm(addr, value));
            }
            self.last_seqno = s.next_seqno();
            fence(&mut cmds, self.last_seqno);
            subs.push(complete(cmds));
        }
        Ok(subs)
    }

    fn verify(&self, mem: &GfxMem<'_>) -> anyhow::Result<()> {
        for i in 0..Self::STORES {
            let (addr, value) = self.target(i);
            check_u32(mem, addr, value, &format!("store {i}"))?;
        }
        check_seqno(mem, self.hws, self.last_seqno)
    }
}

/// A linear 32-bpp surface.
#[derive(Clone, Copy, Debug, Default)]
struct Surface {
    base: u64,
    width: u32,
    height: u32,
    pitch: u32,
}

impl Surface {
    fn bytes(&self) -> u64 {
        u64::from(self.pitch) * u64::from(self.height)
    }

    fn at(&self, x: u16, y: u16) -> BlitRect {
        BlitRect {
            base: self.base,
            pitch: self.pitch as u16,
            x,
            y,
        }
    }

    fn pixel_addr(&self, x: u32, y: u32) -> u64 {
        self.base + u64::from(y) * u64::from(self.pitch) + u64::from(x) * 4
    }
}

/// A host model of a surface's pixels.
type Image = Vec<u32>;

fn model_fill(img: &mut Image, s: &Surface, r: (u32, u32, u32, u32), color: u32) {
    let (x0, y0, w, h) = r;
    for y in y0..y0 + h {
        for x in x0..x0 + w {
            img[(y * s.width + x) as usize] = color;
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn model_copy(
    dst: &mut Image,
    ds: &Surface,
    src: &Image,
    ss: &Surface,
    (dx, dy): (u32, u32),
    (sx, sy): (u32, u32),
    w: u32,
    h: u32,
) {
    for y in 0..h {
        for x in 0..w {
            dst[((dy + y) * ds.width + dx + x) as usize] =
                src[((sy + y) * ss.width + sx + x) as usize];
        }
    }
}

/// `blit`: XY_COLOR_BLT fills a rectangle of surface A (which the CPU filled
/// with a pattern), XY_SRC_COPY_BLT copies part of A into B, and
/// XY_FAST_COPY_BLT copies part of B into C. Surfaces are pitched (rows do
/// not align with pages); every pixel of A, B and C is checked.
#[derive(Default)]
pub struct Blit {
    a: Surface,
    b: Surface,
    c: Surface,
    want: [Image; 3],
    hws: u64,
    seqno: u32,
}

impl Blit {
    const FILL: (u32, u32, u32, u32) = (16, 8, 100, 40);
    const COLOR: u32 = 0xff33_6699;
    // (dst xy, src xy, w, h)
    const COPY_AB: ((u32, u32), (u32, u32), u32, u32) = ((20, 10), (10, 4), 120, 50);
    const COPY_BC: ((u32, u32), (u32, u32), u32, u32) = ((4, 2), (30, 12), 64, 32);

    fn pattern(x: u32, y: u32) -> u32 {
        0x0100_0000 | (y << 12) | x
    }
}

impl Workload for Blit {
    fn name(&self) -> &'static str {
        "blit"
    }

    fn prepare(&mut self, s: &mut Setup<'_>) -> Result<Vec<Submission>, DriverError> {
        let mut surface = |width, height, pitch| -> Result<Surface, DriverError> {
            let mut sf = Surface {
                base: 0,
                width,
                height,
                pitch,
            };
            sf.base = s.alloc.alloc(sf.bytes())?;
            Ok(sf)
        };
        self.a = surface(256, 64, 1088)?;
        self.b = surface(256, 64, 1088)?;
        self.c = surface(128, 48, 512)?;
        self.hws = s.hws_gfx;
        let (a, b, c) = (self.a, self.b, self.c);

        // CPU-side: the pattern in A.
        let mut img_a: Image = Vec::new();
        for y in 0..a.height {
            let row: Vec<u32> = (0..a.width).map(|x| Self::pattern(x, y)).collect();
            s.mem.write_dwords(a.pixel_addr(0, y), &row)?;
            img_a.extend(row);
        }
        let mut img_b = vec![0; (b.width * b.height) as usize];
        let mut img_c = vec![0; (c.width * c.height) as usize];

        let (fx, fy, fw, fh) = Self::FILL;
        let mut dw = Cmds::default();
        dw.push(encode::xy_color_blt(
            a.at(fx as u16, fy as u16),
            4,
            fw as u16,
            fh as u16,
            Self::COLOR,
        ));
        model_fill(&mut img_a, &a, Self::FILL, Self::COLOR);

        let ((dx, dy), (sx, sy), w, h) = Self::COPY_AB;
        dw.push(encode::xy_src_copy_blt(
            b.at(dx as u16, dy as u16),
            a.at(sx as u16, sy as u16),
            4,
            w as u16,
            h as u16,
        ));
        model_copy(&mut img_b, &b, &img_a, &a, (dx, dy), (sx, sy), w, h);

        let ((dx, dy), (sx, sy), w, h) = Self::COPY_BC;
        dw.push(encode::xy_fast_copy_blt(
            c.at(dx as u16, dy as u16),
            b.at(sx as u16, sy as u16),
            4,
            w as u16,
            h as u16,
        ));
        model_copy(&mut img_c, &c, &img_b, &b, (dx, dy), (sx, sy), w, h);

        self.seqno = s.next_seqno();
        fence(&mut dw, self.seqno);
        self.want = [img_a, img_b, img_c];
        Ok(vec![complete(dw)])
    }

    fn verify(&self, mem: &GfxMem<'_>) -> anyhow::Result<()> {
        for (name, sf, want) in [
            ("A", &self.a, &self.want[0]),
            ("B", &self.b, &self.want[1]),
            ("C", &self.c, &self.want[2]),
        ] {
            for y in 0..sf.height {
                let mut row = vec![0u8; sf.width as usize * 4];
                mem.read(sf.pixel_addr(0, y), &mut row)?;
                for x in 0..sf.width {
                    let i = x as usize * 4;
                    let got = u32::from_le_bytes([row[i], row[i + 1], row[i + 2], row[i + 3]]);
                    let exp = want[(y * sf.width + x) as usize];
                    if got != exp {
                        bail!(
                            "surface {name} pixel ({x}, {y}) at gfx {:#x} is {got:#010x}, expected {exp:#010x}",
                            sf.pixel_addr(x, y)
                        );
                    }
                }
            }
        }
        check_seqno(mem, self.hws, self.seqno)
    }
}

/// `batch`: the ring starts a first-level batch, which calls a
/// second-level batch (stores, a qword store, MI_ATOMIC increments and an
/// inline add, a GPR loaded with MI_LOAD_REGISTER_IMM and stored with
/// MI_STORE_REGISTER_MEM), copies a dword with MI_COPY_MEM_MEM and chains
/// to another first-level batch with PIPE_CONTROL and MI_FLUSH_DW post-sync
/// writes.
#[derive(Default)]
pub struct Batch {
    data: u64,
    counters: u64,
    post: u64,
    hws: u64,
    seqno: u32,
}

impl Batch {
    const COUNTER_INIT: u32 = 7;
    const INCREMENTS: u32 = 3;
    const ADDEND_INIT: u32 = 100;
    const ADD: u32 = 5;
    const QWORD: u64 = 0x1122_3344_5566_7788;
    const GPR_VALUE: u32 = 0x00c0_ffee;
    const PC_VALUE: u64 = 0xaabb_ccdd_0011_2233;
    const FLUSH_VALUE: u32 = 0x600d;

    fn data_value(i: u32) -> u32 {
        0xb000 + i
    }
}

impl Workload for Batch {
    fn name(&self) -> &'static str {
        "batch"
    }

    fn prepare(&mut self, s: &mut Setup<'_>) -> Result<Vec<Submission>, DriverError> {
        self.data = s.alloc.alloc(PAGE_SIZE)?;
        self.counters = s.alloc.alloc(PAGE_SIZE)?;
        self.post = s.alloc.alloc(PAGE_SIZE)?;
        let l1 = s.alloc.alloc(PAGE_SIZE)?;
        let l1b = s.alloc.alloc(PAGE_SIZE)?;
        let l2 = s.alloc.alloc(PAGE_SIZE)?;
        self.hws = s.hws_gfx;
        let (d, k, p) = (self.data, self.counters, self.post);
        s.mem.write_u32(k, Self::COUNTER_INIT)?;
        s.mem.write_u32(k + 0x40, Self::ADDEND_INIT)?;

        let gpr0 = hag_abi::sim_regs::GPR_BASE;
        let mut b2 = Vec::new();
        for i in 0..8 {
            b2.extend(encode::store_data_imm(
                d + 4 * u64::from(i),
                Self::data_value(i),
            ));
        }
        b2.extend(encode::store_qword_imm(d + 0x40, Self::QWORD));
        for _ in 0..Self::INCREMENTS {
            b2.extend(encode::atomic(k, atomic_op::INC, 0));
        }
        b2.extend(encode::atomic_inline(
            k + 0x40,
            atomic_op::ADD,
            0,
            [Self::ADD, 0, 0, 0, 0, 0, 0, 0],
        ));
        b2.extend(encode::load_register_imm(gpr0, Self::GPR_VALUE));
        b2.extend(encode::store_register_mem(gpr0, k + 0xc0));
        b2.extend(encode::batch_buffer_end());

        let mut b1 = encode::batch_buffer_start(l2, true).to_vec();
        b1.extend(encode::copy_mem_mem(k + 0x80, d + 8));
        b1.extend(encode::batch_buffer_start(l1b, false));

        let mut b1b = encode::pipe_control_write_imm(PC_CS_STALL, p, Self::PC_VALUE).to_vec();
        b1b.extend(encode::flush_dw_store(p + 0x40, Self::FLUSH_VALUE));
        b1b.extend(encode::batch_buffer_end());

        s.mem.write_dwords(l2, &b2)?;
        s.mem.write_dwords(l1, &b1)?;
        s.mem.write_dwords(l1b, &b1b)?;

        let mut ring = Cmds::default();
        ring.push(encode::batch_buffer_start(l1, false));
        self.seqno = s.next_seqno();
        fence(&mut ring, self.seqno);
        Ok(vec![complete(ring)])
    }

    fn verify(&self, mem: &GfxMem<'_>) -> anyhow::Result<()> {
        let (d, k, p) = (self.data, self.counters, self.post);
        for i in 0..8 {
            check_u32(
                mem,
                d + 4 * u64::from(i),
                Self::data_value(i),
                "batch store",
            )?;
        }
        let q = mem.read_u64(d + 0x40)?;
        ensure!(
            q == Self::QWORD,
            "qword store at gfx {:#x} is {q:#x}, expected {:#x}",
            d + 0x40,
            Self::QWORD
        );
        check_u32(
            mem,
            k,
            Self::COUNTER_INIT + Self::INCREMENTS,
            "MI_ATOMIC increment counter",
        )?;
        check_u32(
            mem,
            k + 0x40,
            Self::ADDEND_INIT + Self::ADD,
            "MI_ATOMIC add",
        )?;
        check_u32(
            mem,
            k + 0x80,
            Self::data_value(2),
            "MI_COPY_MEM_MEM destination",
        )?;
        check_u32(
            mem,
            k + 0xc0,
            Self::GPR_VALUE,
            "MI_STORE_REGISTER_MEM of GPR0",
        )?;
        let pc = mem.read_u64(p)?;
        ensure!(
            pc == Self::PC_VALUE,
            "PIPE_CONTROL post-sync qword at gfx {p:#x} is {pc:#x}, expected {:#x}",
            Self::PC_VALUE
        );
        check_u32(
            mem,
            p + 0x40,
            Self::FLUSH_VALUE,
            "MI_FLUSH_DW post-sync write",
        )?;
        check_seqno(mem, self.hws, self.seqno)
    }
}

/// `hang`: a batch buffer that increments a counter and chains to itself.
/// The vGPU must hang (ERROR_STATUS 2 after the watchdog); the counter
/// shows the loop ran, and the status page never sees the sequence number.
#[derive(Default)]
pub struct Hang {
    counter: u64,
    hws: u64,
    seqno: u32,
}

impl Workload for Hang {
    fn name(&self) -> &'static str {
        "hang"
    }

    fn prepare(&mut self, s: &mut Setup<'_>) -> Result<Vec<Submission>, DriverError> {
        self.counter = s.alloc.alloc(PAGE_SIZE)?;
        let lp = s.alloc.alloc(PAGE_SIZE)?;
        self.hws = s.hws_gfx;
        let mut b = encode::atomic(self.counter, atomic_op::INC, 0).to_vec();
        b.extend(encode::batch_buffer_start(lp, false));
        s.mem.write_dwords(lp, &b)?;
        let mut ring = Cmds::default();
        ring.push(encode::batch_buffer_start(lp, false));
        self.seqno = s.next_seqno();
        fence(&mut ring, self.seqno);
        Ok(vec![Submission {
            commands: ring.0,
            expect: Expect::Hang,
        }])
    }

    fn verify(&self, mem: &GfxMem<'_>) -> anyhow::Result<()> {
        let n = mem.read_u32(self.counter)?;
        ensure!(
            n >= 1,
            "the looping batch never ran: counter at gfx {:#x} is 0",
            self.counter
        );
        let seq = mem.read_u32(self.hws + u64::from(HWS_SEQNO))?;
        ensure!(
            seq != self.seqno,
            "the status page has seqno {seq} although the ring never got past the hung batch"
        );
        Ok(())
    }
}

/// A submission held at an `MI_SEMAPHORE_WAIT` until the CPU opens its
/// gate: work in flight for as long as the test wants, within every budget
/// (each poll is two operations, and the engine polls a stalled semaphore
/// once a millisecond), so a check that needs the engine busy past a bound
/// does not race the per-submission work budget as a looping batch does.
/// The ring head stays at the wait: set the watchdog above the time held.
/// Not in [`NAMES`]: it completes only when [`Gate::open`] is called.
#[derive(Default)]
pub struct Gate {
    gate: u64,
    done: u64,
    hws: u64,
    seqno: u32,
}

impl Gate {
    const OPEN: u32 = 1;
    const DONE: u32 = 0x6a7e_d0e5;

    /// Submits the gated work: from here the engine is busy until
    /// [`Gate::open`].
    pub fn start<R: Registers>(drv: &mut Driver<'_, R>) -> Result<Self, DriverError> {
        let mut gate = Self::default();
        let subs = gate.prepare(&mut drv.setup())?;
        let pending = drv.write_commands(&subs[0].commands)?;
        drv.doorbell(&pending)?;
        Ok(gate)
    }

    /// Lets the held submission run on.
    pub fn open(&self, mem: &GfxMem<'_>) -> Result<(), DriverError> {
        mem.write_u32(self.gate, Self::OPEN)
    }
}

impl Workload for Gate {
    fn name(&self) -> &'static str {
        "gate"
    }

    fn prepare(&mut self, s: &mut Setup<'_>) -> Result<Vec<Submission>, DriverError> {
        self.gate = s.alloc.alloc(PAGE_SIZE)?;
        self.done = s.alloc.alloc(PAGE_SIZE)?;
        self.hws = s.hws_gfx;
        s.mem.write_u32(self.gate, 0)?;
        let mut ring = Cmds::default();
        ring.push(encode::semaphore_wait(
            self.gate,
            Self::OPEN,
            SEMAPHORE_EQUAL,
        ))
        .push(encode::store_data_imm(self.done, Self::DONE));
        self.seqno = s.next_seqno();
        fence(&mut ring, self.seqno);
        Ok(vec![complete(ring)])
    }

    fn verify(&self, mem: &GfxMem<'_>) -> anyhow::Result<()> {
        check_u32(mem, self.done, Self::DONE, "the store after the gate")?;
        check_seqno(mem, self.hws, self.seqno)
    }
}

/// `reject`: a valid store followed by a store just past the end of
/// graphics memory. The whole submission must be rejected at the second
/// command, and the first must not have run.
#[derive(Default)]
pub struct Reject {
    valid: u64,
}

impl Reject {
    const VALUE: u32 = 0x1234_5678;
}

impl Workload for Reject {
    fn name(&self) -> &'static str {
        "reject"
    }

    fn prepare(&mut self, s: &mut Setup<'_>) -> Result<Vec<Submission>, DriverError> {
        self.valid = s.alloc.alloc(PAGE_SIZE)?;
        let mut ring = Cmds::default();
        ring.push(encode::store_data_imm(self.valid, Self::VALUE));
        let bad = ring.0.len();
        ring.push(encode::store_data_imm(s.gfx_mem_size, 0xdead));
        let seq = s.next_seqno();
        fence(&mut ring, seq);
        Ok(vec![Submission {
            commands: ring.0,
            expect: Expect::Rejected { command: bad },
        }])
    }

    fn verify(&self, mem: &GfxMem<'_>) -> anyhow::Result<()> {
        check_u32(mem, self.valid, 0, "store before the rejected command")
            .context("a rejected submission must not run at all")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::{gpr_registers, Driver, DriverConfig};
    use crate::fake::FakeGpu;
    use guest_ram::GuestRam;
    use hag_audit::audit::{self, NoSink, Reason};

    /// Every workload's submissions, ring and batch buffers read from guest
    /// RAM through the driver's GTT, pass the real auditor — or, for
    /// `reject`, fail it at the intended command for the intended reason.
    #[test]
    fn workloads_are_valid_command_streams() {
        for name in NAMES {
            let ram = GuestRam::with_mib(16).unwrap();
            let gpu = FakeGpu::new(&ram);
            let mut drv = Driver::init(&gpu, &ram, DriverConfig::default()).unwrap();
            let mut w = by_name(name).unwrap();
            let subs = w.prepare(&mut drv.setup()).unwrap();
            assert!(!subs.is_empty(), "{name}");
            let regs = gpr_registers();
            let cfg = drv.audit_config(&regs);
            for sub in &subs {
                let base = 0x4000;
                let dwords: Vec<u32> = sub.commands.concat();
                let res = audit::audit(&dwords, base, &cfg, &mut drv.mem(), &mut NoSink);
                match sub.expect {
                    Expect::Rejected { command } => {
                        let e = res.unwrap_err();
                        let at: usize = sub.commands[..command].iter().map(Vec::len).sum();
                        assert_eq!(e.gfx_addr, base + 4 * at as u64, "{name}");
                        assert_eq!(e.header, Some(sub.commands[command][0]));
                        assert!(
                            matches!(e.reason, Reason::AddressOutOfRange { addr, .. } if addr == 64 << 20),
                            "{name}: {e}"
                        );
                    }
                    Expect::Hang => {
                        let summary = res.unwrap_or_else(|e| panic!("{name}: {e}"));
                        assert_eq!(summary.revisits, 1, "{name}: the batch loops");
                    }
                    Expect::Complete { .. } => {
                        res.unwrap_or_else(|e| panic!("{name}: {e}"));
                    }
                }
            }
        }
    }

    #[test]
    fn batch_uses_both_batch_levels_and_a_chain() {
        let ram = GuestRam::with_mib(16).unwrap();
        let gpu = FakeGpu::new(&ram);
        let mut drv = Driver::init(&gpu, &ram, DriverConfig::default()).unwrap();
        let mut w = by_name("batch").unwrap();
        let subs = w.prepare(&mut drv.setup()).unwrap();
        let regs = gpr_registers();
        let cfg = drv.audit_config(&regs);
        let dwords = subs[0].commands.concat();
        let summary = audit::audit(&dwords, 0x4000, &cfg, &mut drv.mem(), &mut NoSink).unwrap();
        assert_eq!(summary.max_depth, 2);
        assert_eq!(summary.batches, 3);
    }

    #[test]
    fn every_name_resolves() {
        for n in NAMES {
            assert_eq!(by_name(n).unwrap().name(), n);
        }
        for n in ALL {
            assert!(NAMES.contains(&n));
        }
        assert!(by_name("all").is_none());
    }
}
