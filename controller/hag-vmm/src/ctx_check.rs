//! `hag-vmm context-check` and `hag-vmm quiesce-check`: the module's
//! refusals around vGPU context snapshots and quiesce, driven through
//! `/dev/hag` (the `hag_dev` crate) with a real guest driver on one vGPU.
//!
//! * context-check: runs a workload on --mdev, quiesces it and saves its
//!   context, then restores into --mdev2 (quiesced, not opened) a snapshot
//!   with a flipped byte and truncated ones (`EINVAL`), one with an unknown
//!   version (`EPROTO`), and ones that describe another vGPU (other
//!   graphics memory size, other source; checksums recomputed) (`EXDEV`),
//!   and ones whose config space differs where a guest cannot write (the
//!   class code, the capabilities pointer; checksums recomputed) (`EINVAL`).
//!   After every refusal --mdev2's context is unchanged; the intact snapshot
//!   is then accepted and reads back byte for byte.
//! * quiesce-check: with a submission held at a semaphore past the
//!   timeout (the `Gate` workload: busy within every budget, so no
//!   watchdog or work budget ends it first), `IOC_QUIESCE` returns
//!   `ETIMEDOUT` no sooner than its timeout and the engine keeps running
//!   (not quiesced: the work completes when the gate opens and new work
//!   runs without `IOC_RESUME`); with ordinary work in flight (a blit; a 16 000-command
//!   batch, whose every increment must have landed when quiesce returns)
//!   and on an idle vGPU it succeeds, and the work completes after
//!   `IOC_RESUME`.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use guest_gpu::driver::{Driver, DriverConfig, GttLayout, Registers, HWS_SEQNO};
use guest_gpu::workloads::{self, Gate, Workload};
use guest_ram::{GuestRam, PAGE_SIZE};
use hag_abi::abi;
use hag_abi::sim_regs as r;
use hag_abi::snapshot;
use hag_audit::audit::encode;
use hag_dev::Device;
use hag_vmm::vfio::VfioDevice;
use nix::errno::Errno;

const SUBMIT_TIMEOUT: Duration = Duration::from_secs(10);
/// The bound for a quiesce that must succeed: it only catches a wedge, so
/// it is far above what emulation on a loaded machine takes. Only the
/// check that wants ETIMEDOUT uses `--timeout-ms`.
const QUIESCE_MS: u32 = 30_000;
/// MI_ATOMIC increments in the long batch (the module takes at most 16384
/// commands per submission).
const LONG_BATCH: usize = 16_000;

fn driver<'m>(
    vfio: &'m VfioDevice,
    ram: &'m GuestRam,
) -> anyhow::Result<Driver<'m, &'m VfioDevice>> {
    let cfg = DriverConfig {
        ring_pages: 2,
        gtt_layout: GttLayout::Scattered,
    };
    Driver::init(vfio, ram, cfg).context("cannot set up the guest GPU driver")
}

/// Runs workload `name` to completion and verifies it.
fn run_workload<R: Registers>(drv: &mut Driver<'_, R>, name: &str) -> anyhow::Result<()> {
    let mut w = workloads::by_name(name).context("unknown workload")?;
    let subs = w.prepare(&mut drv.setup())?;
    for (n, s) in subs.iter().enumerate() {
        drv.submit(&s.commands, SUBMIT_TIMEOUT)
            .map_err(|f| anyhow::anyhow!("{name} submission {n}: {}", f.error))?;
    }
    w.verify(&drv.mem())
        .with_context(|| format!("verifying {name}"))
}

/// `snapshot` with its header checksum recomputed, as a well-formed
/// snapshot of what its header now says.
fn reseal(mut bytes: Vec<u8>) -> Vec<u8> {
    bytes[12..16].fill(0);
    let crc = snapshot::crc32(&bytes);
    bytes[12..16].copy_from_slice(&crc.to_le_bytes());
    bytes
}

fn errno_of(res: Result<(), hag_dev::DirtyError>) -> Option<Errno> {
    res.err().map(|e| e.errno())
}

/// `hag-vmm context-check --mdev A --mdev2 B`.
pub fn context_check(mdev_a: &str, mdev_b: &str) -> anyhow::Result<()> {
    let hag = Device::open()?;
    hag.version()?;
    let a = hag.find_vgpu(mdev_a)?.id;
    let b = hag.find_vgpu(mdev_b)?.id;
    let ram = GuestRam::with_mib(64)?;
    let vfio = VfioDevice::attach(mdev_a, &ram)
        .with_context(|| format!("cannot attach mdev {mdev_a} through VFIO"))?;
    let mut drv = driver(&vfio, &ram)?;
    for name in ["stores", "batch"] {
        run_workload(&mut drv, name)?;
    }
    hag.quiesce(a, QUIESCE_MS)?;
    let ctx = hag.save_context(a)?;
    let parsed = snapshot::Snapshot::parse(&ctx)
        .map_err(|e| anyhow::anyhow!("the saved context does not parse: {e}"))?;
    println!(
        "ok: context of vGPU {a} saved after work: {} bytes, {} bytes of graphics memory",
        ctx.len(),
        parsed.gfx_mem_size
    );

    hag.quiesce(b, QUIESCE_MS)?;
    let before = hag.save_context(b)?;
    ensure!(before != ctx, "vGPU {b} already holds vGPU {a}'s context");

    let mut flipped = ctx.clone();
    flipped[snapshot::HEADER_BYTES + 40] ^= 0x10;
    let mut version = ctx.clone();
    version[4..6].copy_from_slice(&(snapshot::VERSION + 1).to_le_bytes());
    let mut gfx = ctx.clone();
    gfx[16..24].copy_from_slice(&(abi::SIM_GFX_MEM_SIZE * 2).to_le_bytes());
    let mut gvt = ctx.clone();
    gvt[6..8].copy_from_slice(&(abi::VGPU_SOURCE_GVT as u16).to_le_bytes());
    // Config space bytes a guest cannot write: the class code, and the
    // capabilities pointer (a restore replays config space through the
    // guest's write path, so these must be the vGPU's own).
    let config = parsed
        .section(snapshot::TAG_CONFIG, r::CONFIG_SIZE as usize)
        .map_err(|e| anyhow::anyhow!("the saved context has no config space: {e}"))?;
    let config_at = config.as_ptr() as usize - ctx.as_ptr() as usize;
    let mut class = ctx.clone();
    class[config_at + 0x0b] ^= 0xff;
    let mut caps = ctx.clone();
    caps[config_at + 0x34] = 0x40;
    let cases: Vec<(&str, Vec<u8>, Errno)> = vec![
        ("a flipped byte in the body", flipped, Errno::EINVAL),
        (
            "truncated to half",
            ctx[..ctx.len() / 2].to_vec(),
            Errno::EINVAL,
        ),
        (
            "truncated inside the header",
            ctx[..snapshot::HEADER_BYTES / 2].to_vec(),
            Errno::EINVAL,
        ),
        (
            "one byte short",
            ctx[..ctx.len() - 1].to_vec(),
            Errno::EINVAL,
        ),
        ("an unknown version", reseal(version), Errno::EPROTO),
        (
            "another graphics memory size (checksum valid)",
            reseal(gfx),
            Errno::EXDEV,
        ),
        ("a GVT-g vGPU's (checksum valid)", reseal(gvt), Errno::EXDEV),
        (
            "another PCI class code (checksum valid)",
            reseal(class),
            Errno::EINVAL,
        ),
        (
            "a capabilities pointer (checksum valid)",
            reseal(caps),
            Errno::EINVAL,
        ),
    ];
    for (what, bytes, want) in &cases {
        let got = errno_of(hag.restore_context(b, bytes));
        ensure!(
            got == Some(*want),
            "restoring a snapshot with {what} into vGPU {b}: got {}, expected {want}",
            got.map_or("success".to_owned(), |e| e.to_string())
        );
        let now = hag.save_context(b)?;
        ensure!(
            now == before,
            "vGPU {b}'s context changed although the restore ({what}) was refused"
        );
        println!("ok: snapshot with {what} refused: {want}, vGPU {b} unchanged");
    }

    hag.restore_context(b, &ctx)
        .context("restoring the intact snapshot")?;
    let after = hag.save_context(b)?;
    ensure!(
        after == ctx,
        "vGPU {b}'s context after the restore differs from the snapshot"
    );
    println!("ok: the intact snapshot restored into vGPU {b} and reads back identical");
    hag.resume(b)?;
    hag.resume(a)?;
    run_workload(&mut drv, "stores").context("vGPU A after resume")?;
    println!("ok: vGPU {a} runs work again after resume");
    println!(
        "PASS context-check: {} damaged or mismatched snapshots refused, intact one restored",
        cases.len()
    );
    Ok(())
}

/// `hag-vmm quiesce-check --mdev UUID --timeout-ms MS`.
/// With work held in flight on vGPU `id`: an IOC_QUIESCE (30 s) in a
/// process of its own waits, and ends once that process is killed
/// (SIGKILL), letting its hold go: a VMM or migration stuck behind a
/// wedged vGPU can always be killed.
fn killed_quiesce<R: Registers>(id: u32, drv: &Driver<'_, R>) -> anyhow::Result<()> {
    let mut waiter = std::process::Command::new(std::env::current_exe()?)
        .args([
            "quiesce-wait",
            "--vgpu",
            &id.to_string(),
            "--timeout-ms",
            "30000",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("starting a quiesce in another process")?;
    std::thread::sleep(Duration::from_millis(500));
    if let Some(status) = waiter.try_wait()? {
        bail!("the other process's IOC_QUIESCE ended at once ({status}): it did not wait for the held work");
    }
    waiter.kill()?;
    let killed = Instant::now();
    while waiter.try_wait()?.is_none() {
        ensure!(
            killed.elapsed() < Duration::from_secs(10),
            "IOC_QUIESCE still waits 10 s after its process was killed (SIGKILL): the wait cannot be killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let engine = drv.regs().read(r::ENGINE_STATUS)?;
    ensure!(
        engine & r::ENGINE_QUIESCED == 0,
        "after the killed quiesce the engine status is {engine:#x}: its hold stayed"
    );
    println!(
        "ok: a quiesce in another process, waiting on the held work, ended {} ms after that process was killed; its hold went with it",
        killed.elapsed().as_millis()
    );
    Ok(())
}

pub fn quiesce_check(mdev: &str, timeout_ms: u32) -> anyhow::Result<()> {
    let hag = Device::open()?;
    hag.version()?;
    let id = hag.find_vgpu(mdev)?.id;
    let ram = GuestRam::with_mib(64)?;
    let vfio = VfioDevice::attach(mdev, &ram)
        .with_context(|| format!("cannot attach mdev {mdev} through VFIO"))?;
    let mut drv = driver(&vfio, &ram)?;
    let timeout = Duration::from_millis(u64::from(timeout_ms));

    // An idle vGPU quiesces at once.
    let t = Instant::now();
    hag.quiesce(id, QUIESCE_MS)
        .context("quiesce of an idle vGPU")?;
    let idle_ms = t.elapsed().as_millis();
    ensure!(
        drv.regs().read(r::ENGINE_STATUS)? & r::ENGINE_QUIESCED != 0,
        "ENGINE_STATUS does not show QUIESCED after IOC_QUIESCE"
    );
    hag.resume(id)?;
    println!("ok: idle vGPU quiesced in {idle_ms} ms and resumed");

    // Ordinary work in flight: quiesce waits for it, holds the rest.
    let mut w = workloads::by_name("blit").context("no blit workload")?;
    let subs = w.prepare(&mut drv.setup())?;
    let mut quiesced_once = None;
    for (n, s) in subs.iter().enumerate() {
        let pending = drv.write_commands(&s.commands)?;
        drv.doorbell(&pending)?;
        if quiesced_once.is_none() {
            let t = Instant::now();
            hag.quiesce(id, QUIESCE_MS)
                .context("quiesce with ordinary work in flight")?;
            let ms = t.elapsed();
            let engine = drv.regs().read(r::ENGINE_STATUS)?;
            ensure!(
                engine & r::ENGINE_QUIESCED != 0 && engine & r::ENGINE_IDLE != 0,
                "after IOC_QUIESCE the engine status is {engine:#x}, expected idle and quiesced"
            );
            hag.resume(id)?;
            quiesced_once = Some(ms);
        }
        drv.wait(SUBMIT_TIMEOUT).map_err(|f| {
            anyhow::anyhow!("blit submission {n} after quiesce/resume: {}", f.error)
        })?;
    }
    w.verify(&drv.mem()).context("verifying blit")?;
    println!(
        "ok: quiesce with a blit in flight succeeded in {} ms; the workload completed and verified after resume",
        quiesced_once.unwrap_or_default().as_millis()
    );

    // A long but finite batch in flight: quiesce waits for all of it.
    let counter = drv.alloc(PAGE_SIZE)?;
    let mut batch = Vec::with_capacity(LONG_BATCH * 3 + 1);
    for _ in 0..LONG_BATCH {
        batch.extend(encode::atomic(counter, workloads::atomic_op::INC, 0));
    }
    batch.extend(encode::batch_buffer_end());
    let lp = drv.alloc(batch.len() as u64 * 4)?;
    drv.mem().write_dwords(lp, &batch)?;
    let seqno = drv.setup().next_seqno();
    let ring = [
        encode::batch_buffer_start(lp, false).to_vec(),
        encode::store_data_index(HWS_SEQNO, seqno).to_vec(),
        encode::user_interrupt().to_vec(),
    ];
    let pending = drv.write_commands(&ring)?;
    drv.doorbell(&pending)?;
    let t = Instant::now();
    let busy = drv.regs().read(r::ENGINE_STATUS)? & r::ENGINE_IDLE == 0;
    hag.quiesce(id, QUIESCE_MS)
        .context("quiesce with a long batch in flight")?;
    let ms = t.elapsed().as_millis();
    let done = drv.mem().read_u32(counter)?;
    ensure!(
        done == LONG_BATCH as u32,
        "after IOC_QUIESCE the long batch's counter is {done}, expected {LONG_BATCH}: work in flight was cut"
    );
    hag.resume(id)?;
    drv.wait(SUBMIT_TIMEOUT)
        .map_err(|f| anyhow::anyhow!("the long batch after quiesce/resume: {}", f.error))?;
    println!(
        "ok: quiesce with a {LONG_BATCH}-command batch in flight (engine {}) waited {ms} ms for all of it ({done} increments)",
        if busy { "busy" } else { "already idle" }
    );

    // Work that outlasts the timeout (a submission held at a semaphore,
    // busy within every budget until its gate opens): quiesce gives up
    // with ETIMEDOUT and leaves the engine running, not quiesced, so the
    // work completes once the gate opens and new work needs no IOC_RESUME.
    hag.set_watchdog(id, abi::WATCHDOG_MAX_MS)?;
    let gate = Gate::start(&mut drv)?;
    let started = Instant::now();
    let res = hag.quiesce(id, timeout_ms);
    let waited = started.elapsed();
    match res {
        Err(e) if e.errno() == Errno::ETIMEDOUT => {}
        Err(e) => bail!("IOC_QUIESCE with work held in flight failed with {e}, expected ETIMEDOUT"),
        Ok(()) => bail!("IOC_QUIESCE succeeded with a submission held at a semaphore"),
    }
    // The lower bound only: how late the call returns is the scheduler's.
    ensure!(
        waited + Duration::from_millis(50) >= timeout,
        "IOC_QUIESCE gave up after {waited:?}, before its {timeout:?} timeout"
    );
    let engine = drv.regs().read(r::ENGINE_STATUS)?;
    ensure!(
        engine & (r::ENGINE_QUIESCED | r::ENGINE_IDLE | r::ENGINE_HUNG) == 0,
        "after ETIMEDOUT the engine status is {engine:#x}: expected running, not quiesced"
    );
    killed_quiesce(id, &drv)?;
    gate.open(&drv.mem())?;
    drv.wait(SUBMIT_TIMEOUT)
        .map_err(|f| anyhow::anyhow!("the held submission, its gate opened: {}", f.error))?;
    gate.verify(&drv.mem())?;
    hag.set_watchdog(id, abi::WATCHDOG_DEFAULT_MS)?;
    run_workload(&mut drv, "stores").context("stores after the timed-out quiesce")?;
    println!(
        "ok: work held in flight: IOC_QUIESCE({timeout_ms} ms) returned ETIMEDOUT after {} ms; the engine kept running: the work completed and new work ran without IOC_RESUME",
        waited.as_millis()
    );

    let t = Instant::now();
    hag.quiesce(id, QUIESCE_MS)
        .context("quiesce after the timed-out one")?;
    hag.resume(id)?;
    println!(
        "ok: quiesce succeeds again on the idle engine ({} ms)",
        t.elapsed().as_millis()
    );
    println!("PASS quiesce-check: timeout {timeout_ms} ms honoured with work held in flight; work in flight and idle quiesce");
    Ok(())
}
