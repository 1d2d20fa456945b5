//! A unit-test double of the hag-sim register file and engine, written from
//! `docs/sim-vgpu.md`: it audits each submission with the real auditor,
//! marks the audited pages dirty (translated through its GTT), executes the
//! validated commands on guest RAM and reports errors as the contract says.
//! It runs synchronously inside the doorbell write. Like the device, it
//! reaches memory by the guest physical addresses in its GTT; for guest RAM
//! whose pages are scattered ([`GuestRam::with_frames`], as in `hag-guest`)
//! it finds the page of RAM behind each frame, and a frame outside RAM is
//! a fault. The real device is the kernel module, exercised by the VM
//! scenarios; this double lets the driver, the workloads, `hag-vmm`'s
//! dirty check and `hag-guest`'s workload loop be tested without it (their
//! tests turn on this crate's feature `fake`, which compiles this module).

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};

use hag_abi::sim_regs as r;
use hag_audit::audit::{
    self, AddressSpace, AuditConfig, AuditSink, BlitKind, Command, GfxMemory, MemoryFault,
    PostSync, SinkFull, ValidatedCommand,
};

use crate::driver::{RegError, Registers};
use guest_ram::{GuestRam, PAGE_SIZE};

const GFX_MEM: u64 = 64 << 20;
const ENTRIES: u32 = (GFX_MEM / PAGE_SIZE) as u32;

struct State {
    regs: HashMap<u32, u32>,
    gtt: Vec<u64>,
    gprs: HashMap<u32, u32>,
    dirty: BTreeSet<u64>,
    /// Guest pages the fake "forgets" to mark (to test the checker).
    forget: BTreeSet<u64>,
    resets: u32,
    timestamp: u64,
}

/// The fake device.
pub struct FakeGpu<'a> {
    ram: &'a GuestRam,
    /// The page of `ram` at each guest physical frame, when its pages are
    /// scattered; `None`: frame `f` is page `f`.
    page_of: Option<HashMap<u64, u64>>,
    state: RefCell<State>,
}

/// Graphics memory through the fake's GTT.
struct Mem<'s, 'a> {
    ram: &'a GuestRam,
    gtt: &'s [u64],
    page_of: Option<&'s HashMap<u64, u64>>,
}

impl Mem<'_, '_> {
    /// The guest physical address of `gfx` (what dirty bits are kept by).
    fn gpa(&self, gfx: u64) -> Option<u64> {
        let pte = *self.gtt.get(usize::try_from(gfx / PAGE_SIZE).ok()?)?;
        (pte & r::GTT_PRESENT != 0).then_some((pte & r::GTT_ADDR_MASK) + gfx % PAGE_SIZE)
    }

    /// Where `gfx` is in `ram`.
    fn ram_addr(&self, gfx: u64) -> Option<u64> {
        let gpa = self.gpa(gfx)?;
        match self.page_of {
            None => Some(gpa),
            Some(page_of) => Some(page_of.get(&(gpa / PAGE_SIZE))? * PAGE_SIZE + gpa % PAGE_SIZE),
        }
    }

    fn read(&self, gfx: u64, out: &mut [u8]) -> Option<()> {
        for (i, b) in out.iter_mut().enumerate() {
            let mut one = [0u8];
            self.ram
                .read(self.ram_addr(gfx + i as u64)?, &mut one)
                .ok()?;
            *b = one[0];
        }
        Some(())
    }

    fn write(&self, gfx: u64, data: &[u8]) -> Option<()> {
        for (i, b) in data.iter().enumerate() {
            self.ram.write(self.ram_addr(gfx + i as u64)?, &[*b]).ok()?;
        }
        Some(())
    }

    fn read_u32(&self, gfx: u64) -> Option<u32> {
        let mut b = [0u8; 4];
        self.read(gfx, &mut b)?;
        Some(u32::from_le_bytes(b))
    }

    fn write_u32(&self, gfx: u64, v: u32) -> Option<()> {
        self.write(gfx, &v.to_le_bytes())
    }
}

impl GfxMemory for Mem<'_, '_> {
    /// The fake device, like the simulated vGPU, has no PPGTT.
    fn read_dwords(
        &mut self,
        space: AddressSpace,
        gfx_addr: u64,
        out: &mut [u32],
    ) -> Result<(), MemoryFault> {
        if space != AddressSpace::Ggtt {
            return Err(MemoryFault { gfx_addr });
        }
        for (i, o) in out.iter_mut().enumerate() {
            *o = self
                .read_u32(gfx_addr + 4 * i as u64)
                .ok_or(MemoryFault { gfx_addr })?;
        }
        Ok(())
    }
}

struct Collect(Vec<ValidatedCommand>);

impl AuditSink for Collect {
    fn command(&mut self, cmd: &ValidatedCommand) -> Result<(), SinkFull> {
        self.0.push(*cmd);
        Ok(())
    }
}

/// `mib` MiB of guest RAM laid out as a process buffer inside a guest
/// (`hag-guest`'s): page `p` at guest physical frame `0x40000 + 3 *
/// ((p * 613) % pages)`, a permutation far from the page numbers, so
/// that a GTT entry holding a page number instead of its frame faults.
pub fn scattered_ram(mib: u64) -> GuestRam {
    let ram = GuestRam::with_mib(mib).unwrap();
    let pages = ram.pages();
    let frames = (0..pages)
        .map(|p| 0x40000 + 3 * ((p * 613) % pages))
        .collect();
    ram.with_frames(frames).unwrap()
}

impl<'a> FakeGpu<'a> {
    /// A fake hag-sim over `ram`, in its reset state.
    pub fn new(ram: &'a GuestRam) -> Self {
        let mut regs = HashMap::new();
        regs.insert(r::HAG_ID, r::HAG_ID_VALUE);
        regs.insert(r::HAG_REVISION, r::HAG_REVISION_VALUE);
        regs.insert(r::GFX_MEM_SIZE_LO, GFX_MEM as u32);
        regs.insert(r::GFX_MEM_SIZE_HI, (GFX_MEM >> 32) as u32);
        regs.insert(r::GTT_OFFSET_REG, r::GTT_OFFSET);
        regs.insert(r::GTT_ENTRIES_REG, ENTRIES);
        regs.insert(r::INT_MASK, u32::MAX);
        regs.insert(r::ENGINE_STATUS, r::ENGINE_IDLE);
        let page_of = ram
            .frame_table()
            .map(|frames| frames.iter().copied().zip(0..).collect());
        FakeGpu {
            ram,
            page_of,
            state: RefCell::new(State {
                regs,
                gtt: vec![0; ENTRIES as usize],
                gprs: HashMap::new(),
                dirty: BTreeSet::new(),
                forget: BTreeSet::new(),
                resets: 0,
                timestamp: 0x1000,
            }),
        }
    }

    /// Sets a register behind the driver's back.
    pub fn poke(&self, off: u32, v: u32) {
        self.state.borrow_mut().regs.insert(off, v);
    }

    /// A register's value.
    pub fn peek(&self, off: u32) -> u32 {
        self.state.borrow().regs.get(&off).copied().unwrap_or(0)
    }

    /// GTT entry `page`.
    pub fn gtt_entry(&self, page: u64) -> u64 {
        self.state.borrow().gtt[page as usize]
    }

    /// How often `RESET` was written.
    pub fn resets(&self) -> u32 {
        self.state.borrow().resets
    }

    /// Takes the dirty guest pages (guest physical frames, as the device
    /// keeps them) marked so far and clears them.
    pub fn take_dirty(&self) -> BTreeSet<u64> {
        std::mem::take(&mut self.state.borrow_mut().dirty)
    }

    /// Never marks guest page `page` dirty (a deliberately broken audit).
    pub fn forget_page(&self, page: u64) {
        self.state.borrow_mut().forget.insert(page);
    }

    fn reset(st: &mut State) {
        st.resets += 1;
        for reg in [
            r::RING_HEAD,
            r::RING_TAIL,
            r::ERROR_STATUS,
            r::ERROR_ADDR_LO,
            r::ERROR_ADDR_HI,
            r::ERROR_HEADER,
            r::ERROR_REASON,
            r::INT_IDENTITY,
        ] {
            st.regs.insert(reg, 0);
        }
        let ctl = st.regs.get(&r::RING_CTL).copied().unwrap_or(0);
        st.regs.insert(r::RING_CTL, ctl & !r::RING_CTL_ENABLE);
        st.regs.insert(r::ENGINE_STATUS, r::ENGINE_IDLE);
    }

    fn raise(st: &mut State, cause: u32) {
        *st.regs.entry(r::INT_IDENTITY).or_insert(0) |= cause;
    }

    fn doorbell(&self, st: &mut State, tail: u32) {
        st.regs.insert(r::RING_TAIL, tail);
        let ctl = st.regs[&r::RING_CTL];
        let err = st.regs.get(&r::ERROR_STATUS).copied().unwrap_or(0);
        if ctl & r::RING_CTL_ENABLE == 0 || err != 0 {
            return;
        }
        let size = (((ctl >> r::RING_CTL_PAGES_SHIFT) & r::RING_CTL_PAGES_MASK) + 1) * 4096;
        let start = u64::from(st.regs[&r::RING_START]);
        let head = st.regs.get(&r::RING_HEAD).copied().unwrap_or(0);
        let hws = u64::from(st.regs.get(&r::HWS_PGA).copied().unwrap_or(0));
        let ram = self.ram;
        let gtt = std::mem::take(&mut st.gtt);
        let mut mem = Mem {
            ram,
            gtt: &gtt,
            page_of: self.page_of.as_ref(),
        };
        // As the device: a wrapped submission is audited as two runs, so a
        // command split at the ring's end is truncated.
        let parts = if tail > head {
            vec![(head, tail)]
        } else {
            vec![(head, size), (0, tail)]
        };
        let regs = crate::driver::gpr_registers();
        let cfg = AuditConfig::new(GFX_MEM, hws).with_registers(&regs);
        let mut sink = Collect(Vec::new());
        let mut result = Ok(());
        for (from, to) in parts {
            let ring: Vec<u32> = (from..to)
                .step_by(4)
                .map(|off| mem.read_u32(start + u64::from(off)).unwrap_or(u32::MAX))
                .collect();
            if let Err(e) = audit::audit(&ring, start + u64::from(from), &cfg, &mut mem, &mut sink)
            {
                result = Err(e);
                break;
            }
        }
        match result {
            Err(e) => {
                let addr = e.gfx_addr;
                st.regs.insert(r::ERROR_STATUS, r::ERROR_COMMAND_REJECTED);
                st.regs.insert(r::ERROR_ADDR_LO, addr as u32);
                st.regs.insert(r::ERROR_ADDR_HI, (addr >> 32) as u32);
                st.regs.insert(r::ERROR_HEADER, e.header.unwrap_or(0));
                st.regs.insert(r::ERROR_REASON, e.reason.code());
                st.regs.insert(r::ENGINE_STATUS, r::ENGINE_STOPPED);
                Self::raise(st, r::INT_COMMAND_ERROR);
            }
            Ok(_) => {
                for cmd in &sink.0 {
                    for page in cmd.kind.write_set().pages() {
                        if let Some(gpa) = mem.gpa(page * PAGE_SIZE) {
                            let gp = gpa / PAGE_SIZE;
                            if !st.forget.contains(&gp) {
                                st.dirty.insert(gp);
                            }
                        }
                    }
                }
                let hung = self.execute(st, &mem, &sink.0);
                if hung {
                    st.regs.insert(r::ERROR_STATUS, r::ERROR_HANG);
                    st.regs.insert(r::ENGINE_STATUS, r::ENGINE_HUNG);
                    Self::raise(st, r::INT_HANG);
                } else {
                    st.regs.insert(r::RING_HEAD, tail);
                    st.regs.insert(r::ENGINE_STATUS, r::ENGINE_IDLE);
                }
            }
        }
        st.gtt = gtt;
    }

    /// Runs validated commands; returns whether they loop (a revisited
    /// batch: the engine would run forever, so the watchdog fires).
    fn execute(&self, st: &mut State, mem: &Mem<'_, '_>, cmds: &[ValidatedCommand]) -> bool {
        let write64 = |addr: u64, lo: u32, hi: u32| {
            mem.write_u32(addr, lo).unwrap();
            mem.write_u32(addr + 4, hi).unwrap();
        };
        for cmd in cmds {
            match cmd.kind {
                Command::BatchStart {
                    already_audited: true,
                    ..
                } => return true,
                Command::StoreDataImm {
                    addr, data, qword, ..
                }
                | Command::StoreDataIndex {
                    addr, data, qword, ..
                } => {
                    mem.write_u32(addr, data[0]).unwrap();
                    if qword {
                        mem.write_u32(addr + 4, data[1]).unwrap();
                    }
                }
                Command::LoadRegisterImm { reg, value, .. } => {
                    st.gprs.insert(reg, value);
                }
                Command::StoreRegisterMem { reg, addr, .. } => {
                    mem.write_u32(addr, st.gprs.get(&reg).copied().unwrap_or(0))
                        .unwrap();
                }
                Command::LoadRegisterMem { reg, addr, .. } => {
                    st.gprs.insert(reg, mem.read_u32(addr).unwrap());
                }
                Command::CopyMemMem { dst, src, .. } => {
                    mem.write_u32(dst, mem.read_u32(src).unwrap()).unwrap();
                }
                Command::Atomic {
                    addr,
                    opcode,
                    inline_data,
                    ..
                } => {
                    let old = mem.read_u32(addr).unwrap();
                    let operand = inline_data.map_or(0, |d| d[0]);
                    let new = match opcode {
                        0x04 => operand,
                        0x05 => old.wrapping_add(1),
                        0x06 => old.wrapping_sub(1),
                        0x07 => old.wrapping_add(operand),
                        0x08 => old.wrapping_sub(operand),
                        0x01 => old & operand,
                        0x02 => old | operand,
                        0x03 => old ^ operand,
                        other => panic!("fake: atomic opcode {other:#x}"),
                    };
                    mem.write_u32(addr, new).unwrap();
                }
                Command::FlushDw { post_sync, notify } => {
                    Self::post_sync(st, &write64, post_sync);
                    if notify {
                        Self::raise(st, r::INT_USER);
                    }
                }
                Command::PipeControl { post_sync, .. } => Self::post_sync(st, &write64, post_sync),
                Command::UserInterrupt => Self::raise(st, r::INT_USER),
                Command::Blit(b) => {
                    let bpp = usize::from(b.bpp);
                    let row = usize::from(b.width) * bpp;
                    for y in 0..u64::from(b.height) {
                        let d = b.dst.base
                            + (u64::from(b.dst.y) + y) * u64::from(b.dst.pitch)
                            + u64::from(b.dst.x) * bpp as u64;
                        let mut buf = vec![0u8; row];
                        match (b.kind, b.src) {
                            (BlitKind::Color, _) => {
                                let c = b.color.to_le_bytes();
                                for px in buf.chunks_mut(bpp) {
                                    px.copy_from_slice(&c[..bpp]);
                                }
                            }
                            (_, Some(s)) => {
                                let a = s.base
                                    + (u64::from(s.y) + y) * u64::from(s.pitch)
                                    + u64::from(s.x) * bpp as u64;
                                mem.read(a, &mut buf).unwrap();
                            }
                            (_, None) => unreachable!("copies have a source"),
                        }
                        mem.write(d, &buf).unwrap();
                    }
                }
                Command::Noop
                | Command::ArbCheck
                | Command::ArbOnOff { .. }
                | Command::BatchStart { .. }
                | Command::BatchEnd
                | Command::SemaphoreWait { .. } => {}
            }
        }
        false
    }

    fn post_sync(st: &mut State, write64: &impl Fn(u64, u32, u32), ps: PostSync) {
        match ps {
            PostSync::None => {}
            PostSync::WriteImm { addr, data, .. } => write64(addr, data[0], data[1]),
            PostSync::DepthCount { addr, .. } => write64(addr, 0, 0),
            PostSync::Timestamp { addr, .. } => {
                st.timestamp += 1;
                write64(addr, st.timestamp as u32, (st.timestamp >> 32) as u32);
            }
        }
    }
}

impl Registers for FakeGpu<'_> {
    fn read(&self, off: u32) -> Result<u32, RegError> {
        let st = self.state.borrow();
        if off >= r::GTT_OFFSET {
            let i = ((off - r::GTT_OFFSET) / 8) as usize;
            let pte = st.gtt[i];
            return Ok(if off % 8 == 0 {
                pte as u32
            } else {
                (pte >> 32) as u32
            });
        }
        Ok(st.regs.get(&off).copied().unwrap_or(0))
    }

    fn write(&self, off: u32, v: u32) -> Result<(), RegError> {
        let mut st = self.state.borrow_mut();
        if off >= r::GTT_OFFSET {
            let i = ((off - r::GTT_OFFSET) / 8) as usize;
            let pte = &mut st.gtt[i];
            *pte = if off % 8 == 0 {
                (*pte & !0xffff_ffff) | u64::from(v)
            } else {
                (*pte & 0xffff_ffff) | (u64::from(v) << 32)
            };
            return Ok(());
        }
        match off {
            r::RESET => Self::reset(&mut st),
            r::INT_IDENTITY => {
                *st.regs.entry(off).or_insert(0) &= !v;
            }
            r::RING_TAIL => self.doorbell(&mut st, v),
            r::HAG_ID
            | r::HAG_REVISION
            | r::GFX_MEM_SIZE_LO
            | r::GFX_MEM_SIZE_HI
            | r::GTT_OFFSET_REG
            | r::GTT_ENTRIES_REG
            | r::ERROR_STATUS
            | r::RING_HEAD
            | r::ENGINE_STATUS => {}
            _ => {
                st.regs.insert(off, v);
            }
        }
        Ok(())
    }

    fn wait_interrupt(&self, _timeout: std::time::Duration) -> Result<u64, RegError> {
        Ok(0)
    }
}
