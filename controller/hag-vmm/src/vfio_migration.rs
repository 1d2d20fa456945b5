//! `hag-vmm vfio-migration-check`: moves a hag-sim vGPU's context from one
//! mdev to another through VFIO's migration interface v2, the way QEMU ≥ 8
//! does (`VFIO_DEVICE_FEATURE_MIGRATION`, `…_MIG_DEVICE_STATE`,
//! `…_MIG_DATA_SIZE`, and the data fd), and checks what the module promises:
//!
//! * a quiesce a `/dev/hag` opener holds outlives STOP → RUNNING, and
//!   goes when that opener's file is released (not another's);
//! * RUNNING → STOP with a submission in flight past the module's 2 s bound
//!   (held at a semaphore) fails (`ETIMEDOUT`) and leaves the device
//!   RUNNING, and the work completes; after a batch that loops until the
//!   work budget calls it hung, STOP succeeds;
//! * STOP → STOP_COPY hands out a snapshot of the reported size;
//!   STOP_COPY → STOP disables the data fd;
//! * on the target, RESUMING → STOP → RUNNING loads it: the registers and
//!   GTT entries equal the source's, and the guest driver carries on there
//!   with a new workload;
//! * a damaged (one flipped byte) snapshot is refused by the write that
//!   completes it, a truncated one at RESUMING → STOP, each leaving the
//!   device RESUMING and its registers as they were; VFIO_DEVICE_RESET
//!   brings it back to RUNNING and disables the fd; a header declaring more
//!   than the module's limit is refused at once (EFBIG);
//! * a data fd kept past the device's close reads nothing (`ENODEV`).
//!
//! One guest RAM serves both mdevs (the "migration" of RAM is free), so
//! the driver's state stays valid when its registers switch to the target.
//!
//! `unsafe` here is the one VFIO ioctl this check adds, `VFIO_DEVICE_FEATURE`.

use std::cell::Cell;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use guest_gpu::driver::{Driver, DriverConfig, DriverError, GttLayout, RegError, Registers};
use guest_gpu::workloads::{self, Gate, Workload};
use guest_ram::GuestRam;
use hag_abi::abi;
use hag_abi::sim_regs as r;
use hag_dev::Device;
use hag_vmm::vfio::VfioDevice;
use hag_vmm::vfio_sys;
use nix::errno::Errno;

/// `enum vfio_device_mig_state`.
const STATE_STOP: u32 = 1;
const STATE_RUNNING: u32 = 2;
const STATE_STOP_COPY: u32 = 3;
const STATE_RESUMING: u32 = 4;

const FEATURE_MIGRATION: u32 = 1;
const FEATURE_MIG_DEVICE_STATE: u32 = 2;
const FEATURE_MIG_DATA_SIZE: u32 = 9;
const FEATURE_GET: u32 = 1 << 16;
const FEATURE_SET: u32 = 1 << 17;
const FEATURE_PROBE: u32 = 1 << 18;
const MIGRATION_STOP_COPY: u64 = 1 << 0;

/// `_IO(VFIO_TYPE, VFIO_BASE + 17)`.
const VFIO_DEVICE_FEATURE: u32 = ((b';' as u32) << 8) | (100 + 17);

/// The module's bound on RUNNING → STOP.
const QUIESCE_BOUND: Duration = Duration::from_secs(2);
/// How long a looping batch may take to spend the module's
/// per-submission work budget: seconds natively, far less than this under
/// emulation on a loaded machine.
const BUDGET_HANG_TIMEOUT: Duration = Duration::from_secs(120);
const SUBMIT_TIMEOUT: Duration = Duration::from_secs(10);

/// `struct vfio_device_feature` with 8 bytes of `data[]`, enough for the
/// three migration features.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Feature {
    argsz: u32,
    flags: u32,
    data: [u8; 8],
}

nix::ioctl_readwrite_bad!(device_feature_raw, VFIO_DEVICE_FEATURE, Feature);

fn device_feature(device: BorrowedFd<'_>, flags: u32, data: [u8; 8]) -> Result<Feature, Errno> {
    let mut arg = Feature {
        argsz: vfio_sys::argsz::<Feature>(),
        flags,
        data,
    };
    // SAFETY: `arg` is a live, writable `struct vfio_device_feature` with
    // `argsz` bytes (8 of data, which each migration feature fits); the
    // kernel reads and writes only inside it. `device` is open for the call.
    unsafe { device_feature_raw(device.as_raw_fd(), &mut arg) }?;
    Ok(arg)
}

/// `VFIO_DEVICE_FEATURE_MIGRATION` (GET): the migration flags.
fn migration_flags(device: BorrowedFd<'_>) -> Result<u64, Errno> {
    let f = device_feature(device, FEATURE_GET | FEATURE_MIGRATION, [0; 8])?;
    Ok(u64::from_ne_bytes(f.data))
}

fn get_state(device: BorrowedFd<'_>) -> Result<u32, Errno> {
    let f = device_feature(device, FEATURE_GET | FEATURE_MIG_DEVICE_STATE, [0; 8])?;
    Ok(u32::from_ne_bytes([
        f.data[0], f.data[1], f.data[2], f.data[3],
    ]))
}

/// `VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE` (SET): moves to `state`; returns
/// the data fd if the arc makes one.
fn set_state(device: BorrowedFd<'_>, state: u32) -> Result<Option<File>, Errno> {
    let mut data = [0u8; 8];
    data[..4].copy_from_slice(&state.to_ne_bytes());
    data[4..].copy_from_slice(&(-1i32).to_ne_bytes());
    let f = device_feature(device, FEATURE_SET | FEATURE_MIG_DEVICE_STATE, data)?;
    let fd = i32::from_ne_bytes([f.data[4], f.data[5], f.data[6], f.data[7]]);
    if fd < 0 {
        return Ok(None);
    }
    // SAFETY: on success the kernel installed `fd` in this process's table
    // for us (vfio_ioct_mig_return_fd); nothing else owns it.
    Ok(Some(File::from(unsafe { OwnedFd::from_raw_fd(fd) })))
}

fn data_size(device: BorrowedFd<'_>) -> Result<u64, Errno> {
    let f = device_feature(device, FEATURE_GET | FEATURE_MIG_DATA_SIZE, [0; 8])?;
    Ok(u64::from_ne_bytes(f.data))
}

fn state_name(state: u32) -> &'static str {
    match state {
        STATE_STOP => "STOP",
        STATE_RUNNING => "RUNNING",
        STATE_STOP_COPY => "STOP_COPY",
        STATE_RESUMING => "RESUMING",
        0 => "ERROR",
        _ => "other",
    }
}

/// Moves `dev` to `state`, naming the failure.
fn go(dev: &VfioDevice, state: u32) -> anyhow::Result<Option<File>> {
    set_state(dev.device_fd(), state).with_context(|| {
        format!(
            "VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE to {} on {}",
            state_name(state),
            dev.uuid()
        )
    })
}

fn expect_state(dev: &VfioDevice, want: u32) -> anyhow::Result<()> {
    let got = get_state(dev.device_fd())
        .with_context(|| format!("GET MIG_DEVICE_STATE of {}", dev.uuid()))?;
    ensure!(
        got == want,
        "{} is in migration state {} ({got}), expected {}",
        dev.uuid(),
        state_name(got),
        state_name(want)
    );
    Ok(())
}

/// The registers of whichever mdev the guest currently runs on: the guest
/// driver is "migrated" by switching this.
struct Migratable<'a> {
    devs: [&'a VfioDevice; 2],
    current: Cell<usize>,
}

impl Migratable<'_> {
    fn dev(&self) -> &VfioDevice {
        self.devs[self.current.get()]
    }
}

impl Registers for Migratable<'_> {
    fn read(&self, off: u32) -> Result<u32, RegError> {
        self.dev().read(off)
    }
    fn write(&self, off: u32, v: u32) -> Result<(), RegError> {
        self.dev().write(off, v)
    }
    fn wait_interrupt(&self, timeout: Duration) -> Result<u64, RegError> {
        self.dev().wait_interrupt(timeout)
    }
}

/// The registers a snapshot must carry, by name and BAR0 offset: the
/// engine's, the general-purpose registers and a spread of GTT entries.
fn compared_registers(mapped_pages: u32, gtt_entries: u32) -> Vec<(String, u32)> {
    let mut regs: Vec<(String, u32)> = [
        ("RING_START", r::RING_START),
        ("RING_CTL", r::RING_CTL),
        ("HWS_PGA", r::HWS_PGA),
        ("RING_HEAD", r::RING_HEAD),
        ("RING_TAIL", r::RING_TAIL),
        ("INT_MASK", r::INT_MASK),
        ("INT_ENABLE", r::INT_ENABLE),
        ("ERROR_STATUS", r::ERROR_STATUS),
    ]
    .into_iter()
    .map(|(n, o)| (n.to_owned(), o))
    .collect();
    for i in 0..r::GPR_COUNT * 2 {
        regs.push((format!("GPR dword {i}"), r::GPR_BASE + 4 * i));
    }
    let mut pages = vec![
        0,
        1,
        2,
        3,
        7,
        mapped_pages / 2,
        mapped_pages.saturating_sub(1),
    ];
    pages.push(mapped_pages.min(gtt_entries - 1));
    pages.push(gtt_entries - 1);
    for p in pages {
        let off = r::GTT_OFFSET + p * r::GTT_ENTRY_BYTES;
        regs.push((format!("GTT[{p}] low"), off));
        regs.push((format!("GTT[{p}] high"), off + 4));
    }
    regs
}

fn read_registers(dev: &VfioDevice, list: &[(String, u32)]) -> anyhow::Result<Vec<u32>> {
    list.iter()
        .map(|(name, off)| {
            dev.read(*off)
                .map_err(|e| anyhow::anyhow!("{name} of {}: {e}", dev.uuid()))
        })
        .collect()
}

fn differences(list: &[(String, u32)], a: &[u32], b: &[u32]) -> Vec<String> {
    list.iter()
        .zip(a.iter().zip(b))
        .filter(|(_, (x, y))| x != y)
        .map(|((name, _), (x, y))| format!("{name} {x:#x} vs {y:#x}"))
        .collect()
}

/// Runs workload `name` to completion on the driver and verifies it.
fn run_workload<R: Registers>(drv: &mut Driver<'_, R>, name: &str) -> anyhow::Result<()> {
    let mut w = workloads::by_name(name).context("unknown workload")?;
    let subs = w
        .prepare(&mut drv.setup())
        .with_context(|| format!("preparing {name}"))?;
    for (n, s) in subs.iter().enumerate() {
        drv.submit(&s.commands, SUBMIT_TIMEOUT)
            .map_err(|f| anyhow::anyhow!("{name} submission {n}: {}", f.error))?;
    }
    w.verify(&drv.mem())
        .with_context(|| format!("verifying {name}"))
}

/// Writes `bytes` to a RESUMING data fd in pieces, as a VMM streams it.
fn write_stream(fd: &mut File, bytes: &[u8]) -> std::io::Result<()> {
    for chunk in bytes.chunks(4096 + 512) {
        fd.write_all(chunk)?;
    }
    Ok(())
}

/// Where a load was refused.
#[derive(Debug)]
enum Refused {
    /// A write to the RESUMING data fd failed (the snapshot was complete
    /// and did not check out, or was not a snapshot).
    Write(Errno),
    /// RESUMING -> STOP failed.
    Load(Errno),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Write(e) => write!(f, "by the write that completed it: {e}"),
            Refused::Load(e) => write!(f, "at RESUMING -> STOP: {e}"),
        }
    }
}

/// Loads `bytes` into `dev` (RUNNING or STOP → RESUMING, write, → STOP);
/// returns where it was refused, if it was.
fn load(dev: &VfioDevice, bytes: &[u8]) -> anyhow::Result<Result<(), Refused>> {
    let mut fd = go(dev, STATE_RESUMING)?.context("RESUMING returned no data fd")?;
    if let Err(e) = write_stream(&mut fd, bytes) {
        let errno = errno_of(&e).context("writing the snapshot to the RESUMING data fd")?;
        return Ok(Err(Refused::Write(errno)));
    }
    Ok(set_state(dev.device_fd(), STATE_STOP)
        .map(|_| ())
        .map_err(Refused::Load))
}

fn errno_of(e: &std::io::Error) -> Option<Errno> {
    e.raw_os_error().map(Errno::from_raw)
}

/// The whole check; prints one line per step and a summary.
pub fn run(mdev_a: &str, mdev_b: &str) -> anyhow::Result<()> {
    let ram = GuestRam::with_mib(64)?;
    let hag = Device::open()?;
    let vgpu_a = hag.find_vgpu(mdev_a)?;
    let a = VfioDevice::attach(mdev_a, &ram)
        .with_context(|| format!("cannot attach mdev {mdev_a} through VFIO"))?;
    let b = VfioDevice::attach(mdev_b, &ram)
        .with_context(|| format!("cannot attach mdev {mdev_b} through VFIO"))?;

    // The device says what it supports.
    for dev in [&a, &b] {
        device_feature(
            dev.device_fd(),
            FEATURE_PROBE | FEATURE_GET | FEATURE_MIGRATION,
            [0; 8],
        )
        .with_context(|| format!("PROBE of VFIO_DEVICE_FEATURE_MIGRATION on {}", dev.uuid()))?;
        let flags = migration_flags(dev.device_fd())
            .with_context(|| format!("GET VFIO_DEVICE_FEATURE_MIGRATION on {}", dev.uuid()))?;
        ensure!(
            flags & MIGRATION_STOP_COPY != 0,
            "{} reports migration flags {flags:#x} without STOP_COPY",
            dev.uuid()
        );
        expect_state(dev, STATE_RUNNING)?;
    }
    println!("ok: both mdevs offer VFIO migration v2 (STOP_COPY), RUNNING");

    let regs = Migratable {
        devs: [&a, &b],
        current: Cell::new(0),
    };
    let cfg = DriverConfig {
        ring_pages: 2,
        gtt_layout: GttLayout::Scattered,
    };
    let mut drv =
        Driver::init(&regs, &ram, cfg).context("cannot set up the guest GPU driver on A")?;

    // A quiesce a /dev/hag opener holds outlives the VMM's STOP ->
    // RUNNING: VFIO's resume lets go only of what VFIO's stop took.
    hag.quiesce(vgpu_a.id, 1000)
        .context("IOC_QUIESCE of idle A")?;
    go(&a, STATE_STOP)?;
    go(&a, STATE_RUNNING)?;
    let engine = drv.regs().read(r::ENGINE_STATUS)?;
    ensure!(
        engine & r::ENGINE_QUIESCED != 0,
        "VFIO STOP -> RUNNING let go of a /dev/hag opener's quiesce (engine status {engine:#x})"
    );
    hag.resume(vgpu_a.id)?;
    let engine = drv.regs().read(r::ENGINE_STATUS)?;
    ensure!(
        engine & r::ENGINE_QUIESCED == 0,
        "IOC_RESUME left A quiesced (engine status {engine:#x})"
    );
    println!(
        "ok: a /dev/hag opener's quiesce held across VFIO STOP -> RUNNING, until its IOC_RESUME"
    );

    // A quiesce is its opener's: another opener's close leaves it, and its
    // own file's release (the process closed /dev/hag, or died) lets it go.
    let other = Device::open()?;
    let holder = Device::open()?;
    holder
        .quiesce(vgpu_a.id, 1000)
        .context("IOC_QUIESCE of idle A by a second opener")?;
    drop(other);
    let engine = drv.regs().read(r::ENGINE_STATUS)?;
    ensure!(
        engine & r::ENGINE_QUIESCED != 0,
        "closing another /dev/hag opener let go of A's quiesce (engine status {engine:#x})"
    );
    drop(holder);
    let engine = drv.regs().read(r::ENGINE_STATUS)?;
    ensure!(
        engine & r::ENGINE_QUIESCED == 0,
        "closing /dev/hag left A quiesced by the closed opener (engine status {engine:#x})"
    );
    println!("ok: a /dev/hag opener's quiesce goes with its own file's release, not another's");

    // Work in flight is never snapshotted: with a submission held at a
    // semaphore (busy, within every budget, for as long as the gate stays
    // shut), RUNNING -> STOP gives up after the bound and leaves A running.
    hag.set_watchdog(vgpu_a.id, abi::WATCHDOG_MAX_MS)?;
    let gate = Gate::start(&mut drv)?;
    let started = Instant::now();
    match set_state(a.device_fd(), STATE_STOP) {
        Err(Errno::ETIMEDOUT) => {}
        Err(e) => bail!("RUNNING -> STOP with work in flight failed with {e}, expected ETIMEDOUT"),
        Ok(_) => bail!("RUNNING -> STOP succeeded with a submission held at a semaphore"),
    }
    let waited = started.elapsed();
    // The lower bound only: how late the call returns is the scheduler's.
    ensure!(
        waited >= QUIESCE_BOUND - Duration::from_millis(100),
        "RUNNING -> STOP gave up after {waited:?}, before the module's {QUIESCE_BOUND:?} bound"
    );
    expect_state(&a, STATE_RUNNING)?;
    gate.open(&drv.mem())?;
    drv.wait(SUBMIT_TIMEOUT)
        .map_err(|f| anyhow::anyhow!("the held submission, its gate opened: {}", f.error))?;
    gate.verify(&drv.mem())?;
    println!(
        "ok: RUNNING -> STOP with work in flight: ETIMEDOUT after {} ms, still RUNNING; the work then completed",
        waited.as_millis()
    );

    // The work budget's own hang: a batch that chains to itself is called
    // hung once it has done more work than any submission may (the
    // watchdog is far above that); the engine is then idle and STOP
    // succeeds.
    let mut hang = workloads::by_name("hang").context("no hang workload")?;
    let subs = hang.prepare(&mut drv.setup())?;
    let pending = drv.write_commands(&subs[0].commands)?;
    drv.doorbell(&pending)?;
    match drv.wait(BUDGET_HANG_TIMEOUT) {
        Err(f) if matches!(f.error, DriverError::Hung { .. }) => {}
        Err(f) => bail!("the looping batch ended with {}, expected a hang", f.error),
        Ok(_) => bail!("the looping batch completed"),
    }
    ensure!(go(&a, STATE_STOP)?.is_none(), "STOP returned a data fd");
    expect_state(&a, STATE_STOP)?;
    ensure!(
        go(&a, STATE_RUNNING)?.is_none(),
        "RUNNING returned a data fd"
    );
    drv.reset().context("resetting A after the hang")?;
    hag.set_watchdog(vgpu_a.id, abi::WATCHDOG_DEFAULT_MS)?;
    println!("ok: a looping batch hung on the work budget; RUNNING -> STOP then succeeded");

    for name in ["stores", "batch"] {
        run_workload(&mut drv, name).with_context(|| format!("workload {name} on A"))?;
    }
    println!("ok: workloads stores, batch on A");

    // Save A.
    let info = drv.info();
    let mapped = u32::try_from(drv.gtt().pages())?;
    let list = compared_registers(mapped, info.gtt_entries);
    let estimate = data_size(a.device_fd()).context("GET MIG_DATA_SIZE of A")?;
    ensure!(go(&a, STATE_STOP)?.is_none(), "STOP returned a data fd");
    expect_state(&a, STATE_STOP)?;
    let mut save_fd = go(&a, STATE_STOP_COPY)?.context("STOP_COPY returned no data fd")?;
    expect_state(&a, STATE_STOP_COPY)?;
    let size = data_size(a.device_fd()).context("GET MIG_DATA_SIZE of A in STOP_COPY")?;
    let mut snapshot = Vec::new();
    save_fd
        .read_to_end(&mut snapshot)
        .context("reading the STOP_COPY data fd")?;
    ensure!(
        snapshot.len() as u64 == size && size <= estimate && !snapshot.is_empty(),
        "read {} bytes from the data fd; MIG_DATA_SIZE says {size} (estimate {estimate})",
        snapshot.len()
    );
    let regs_a = read_registers(&a, &list)?;
    ensure!(
        go(&a, STATE_STOP)?.is_none(),
        "STOP_COPY -> STOP returned a data fd"
    );
    let mut byte = [0u8; 1];
    match save_fd.read(&mut byte) {
        Err(e) if errno_of(&e) == Some(Errno::ENODEV) => {}
        other => bail!("the data fd still reads after STOP_COPY -> STOP: {other:?}"),
    }
    drop(save_fd);
    println!(
        "ok: A saved: STOP, STOP_COPY, {} bytes read to EOF (MIG_DATA_SIZE {size}), STOP; the old data fd reads ENODEV",
        snapshot.len()
    );

    // Load it into B.
    let fresh_b = read_registers(&b, &list)?;
    ensure!(
        !differences(&list, &regs_a, &fresh_b).is_empty(),
        "B already has A's registers before the migration"
    );
    if let Err(e) = load(&b, &snapshot)? {
        bail!("B refused a good snapshot {e}");
    }
    expect_state(&b, STATE_STOP)?;
    ensure!(
        go(&b, STATE_RUNNING)?.is_none(),
        "RUNNING returned a data fd"
    );
    expect_state(&b, STATE_RUNNING)?;
    let regs_b = read_registers(&b, &list)?;
    let diff = differences(&list, &regs_a, &regs_b);
    ensure!(
        diff.is_empty(),
        "B's registers differ from A's after the migration: {}",
        diff.join(", ")
    );
    println!(
        "ok: B resumed from the snapshot: RESUMING, STOP, RUNNING; {} registers and GTT entries equal A's",
        list.len()
    );

    // The guest carries on, on B.
    regs.current.set(1);
    run_workload(&mut drv, "blit").context("workload blit on B after the migration")?;
    println!("ok: the guest driver carries on on B: workload blit verified");

    // A damaged snapshot is refused and changes nothing.
    let mut damaged = snapshot.clone();
    let at = damaged.len() / 2;
    damaged[at] ^= 0x40;
    let truncated = &snapshot[..snapshot.len() / 2];
    // A damaged one is refused as it arrives (so that QEMU's load of the
    // device state fails, and the migration with it, before the VM starts
    // on the target); a truncated one, which never completes, when loaded.
    for (what, bytes, write_time) in [
        ("damaged", &damaged[..], true),
        ("truncated", truncated, false),
    ] {
        let before = read_registers(&b, &list)?;
        match load(&b, bytes)? {
            Ok(()) => bail!("B accepted a {what} snapshot"),
            Err(e @ Refused::Write(_)) if write_time => {
                println!("ok: a {what} snapshot is refused {e}")
            }
            Err(e @ Refused::Load(_)) if !write_time => {
                println!("ok: a {what} snapshot is refused {e}")
            }
            Err(e) => bail!("a {what} snapshot was refused, but {e}"),
        }
        expect_state(&b, STATE_RESUMING)?;
        let now = read_registers(&b, &list)?;
        let diff = differences(&list, &before, &now);
        ensure!(
            diff.is_empty(),
            "the refused {what} snapshot changed B: {}",
            diff.join(", ")
        );
        vfio_sys::device_reset(b.device_fd()).context("VFIO_DEVICE_RESET of B")?;
        expect_state(&b, STATE_RUNNING)?;
    }

    // No more than the module's limit can be written: a header declaring
    // more is refused at once.
    let mut fd = go(&b, STATE_RESUMING)?.context("RESUMING returned no data fd")?;
    let limit = usize::try_from(abi::SIM_CONTEXT_MAX_BYTES)?;
    let mut header = snapshot[..32].to_vec();
    header[8..12].copy_from_slice(&u32::try_from(limit + 4096)?.to_le_bytes());
    match fd.write(&header) {
        Err(e) if errno_of(&e) == Some(Errno::EFBIG) => {
            println!("ok: a header declaring more than {limit} bytes is refused: {e}")
        }
        other => {
            bail!("a RESUMING data fd took a header declaring more than {limit} bytes: {other:?}")
        }
    }
    ensure!(
        set_state(b.device_fd(), STATE_STOP).is_err(),
        "B loaded a refused header as a snapshot"
    );
    vfio_sys::device_reset(b.device_fd()).context("VFIO_DEVICE_RESET of B")?;
    expect_state(&b, STATE_RUNNING)?;
    match fd.write(&[0]) {
        Err(e) if errno_of(&e) == Some(Errno::ENODEV) => {}
        other => bail!("a RESUMING data fd still writes after the reset: {other:?}"),
    }
    drop(fd);
    println!("ok: VFIO_DEVICE_RESET returns RESUMING to RUNNING and disables its data fd");

    // A data fd outliving its device.
    let mut late = go(&b, STATE_STOP_COPY)?.context("STOP_COPY on B returned no data fd")?;
    drop(drv);
    drop(b);
    match late.read(&mut byte) {
        Err(e) if errno_of(&e) == Some(Errno::ENODEV) => {}
        other => bail!("a data fd kept past the device's close still reads: {other:?}"),
    }
    drop(late);
    drop(a);
    println!("ok: a data fd kept past the device's close reads ENODEV");
    println!(
        "PASS vfio-migration: {} bytes moved from {mdev_a} to {mdev_b}, damaged and truncated snapshots refused",
        snapshot.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_number_and_layout_match_the_uapi() {
        assert_eq!(VFIO_DEVICE_FEATURE, 0x3b75);
        assert_eq!(core::mem::size_of::<Feature>(), 16);
    }

    #[test]
    fn compared_registers_cover_engine_and_gtt() {
        let list = compared_registers(16384, 16384);
        assert!(list
            .iter()
            .any(|(n, o)| n == "RING_START" && *o == r::RING_START));
        assert!(list.iter().any(|(n, _)| n == "GTT[16383] high"));
        assert!(differences(&list, &vec![0; list.len()], &vec![0; list.len()]).is_empty());
    }
}
