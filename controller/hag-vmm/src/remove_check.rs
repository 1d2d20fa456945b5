//! `hag-vmm remove-check`: a vGPU removed while calls that already found
//! it are still in flight (issue 13, item 4: `Arc<Vgpu>` clones outlive
//! the remove). Every such call, and every later one naming the vGPU's id,
//! must be refused with `ENODEV` (or, for a quiesce whose hold the VMM's
//! close let go, `ECANCELED`); none may succeed on a vGPU that is gone.
//!
//! * `--mdev UUID`: a quiesce in flight across the remove. A submission is
//!   held at a semaphore that never opens (watchdog far away), so
//!   `IOC_QUIESCE` (30 s) waits; the mdev's
//!   sysfs `remove` then waits too (VFIO waits for the VMM to close the
//!   device). Both must still be waiting after 0.5 s; the VMM closes the
//!   device; the remove must finish, and the quiesce end within seconds,
//!   refused. Then every per-vGPU ioctl for the id gets `ENODEV` and the
//!   vGPU is not listed.
//! * `--held`: each per-vGPU ioctl held past a remove. The module must be
//!   loaded with `test_hold_vgpu_ms=MS` (`--hold-ms`), which makes each
//!   `/dev/hag` ioctl wait that long after it found its vGPU (as a user
//!   copy that blocks would), and `allow_hang_injection=1`. For each ioctl,
//!   on a fresh mdev, set up so that the call would succeed: start it, and
//!   remove the mdev (not open: the remove does not wait) while it is
//!   held. It must return `ENODEV`.

use std::path::Path;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use guest_gpu::driver::{Driver, DriverConfig, GttLayout};
use guest_gpu::workloads::Gate;
use guest_ram::GuestRam;
use hag_abi::abi;
use hag_dev::{Device, DirtyError};
use hag_vmm::vfio::VfioDevice;
use nix::errno::Errno;

const SIM_CREATE: &str = "/sys/class/mdev_bus/hag/mdev_supported_types/hag-sim/create";

fn mdev_remove(uuid: &str) -> std::io::Result<()> {
    std::fs::write(format!("/sys/bus/mdev/devices/{uuid}/remove"), "1")
}

fn mdev_create() -> anyhow::Result<String> {
    let uuid = std::fs::read_to_string("/proc/sys/kernel/random/uuid")?
        .trim()
        .to_owned();
    std::fs::write(SIM_CREATE, &uuid).with_context(|| format!("creating mdev {uuid}"))?;
    Ok(uuid)
}

/// The errno of a per-vGPU call, `None` if it succeeded.
fn errno_of<T>(res: Result<T, DirtyError>) -> Option<Errno> {
    res.err().map(|e| e.errno())
}

/// Every per-vGPU ioctl on `id`, each of which must now fail with ENODEV.
fn all_refused(hag: &Device, id: u32, snapshot: &[u8], what: &str) -> anyhow::Result<()> {
    let calls: [(&str, Option<Errno>); 11] = [
        ("IOC_VGPU_STATS", errno_of(hag.vgpu_stats(id))),
        ("IOC_SET_WATCHDOG", errno_of(hag.set_watchdog(id, 1000))),
        ("IOC_DIRTY_START", errno_of(hag.dirty_start(id, 0, 1 << 20))),
        (
            "IOC_DIRTY_READ_CLEAR",
            errno_of(hag.dirty_read_clear(id, &mut [0u64; 4])),
        ),
        ("IOC_DIRTY_STOP", errno_of(hag.dirty_stop(id))),
        ("IOC_QUIESCE", errno_of(hag.quiesce(id, 100))),
        ("IOC_RESUME", errno_of(hag.resume(id))),
        ("IOC_SAVE_CONTEXT", errno_of(hag.save_context(id))),
        (
            "IOC_RESTORE_CONTEXT",
            errno_of(hag.restore_context(id, snapshot)),
        ),
        ("IOC_INJECT_HANG", errno_of(hag.inject_hang(id))),
        (
            "IOC_DIRTY_READ_CLEAR (big buffer)",
            errno_of(hag.dirty_read_clear(id, &mut vec![0u64; 1024])),
        ),
    ];
    for (name, errno) in calls {
        match errno {
            Some(Errno::ENODEV) => {}
            Some(e) => bail!("{name} for vGPU {id} {what} failed with {e}, expected ENODEV"),
            None => bail!("{name} for vGPU {id} {what} succeeded"),
        }
    }
    ensure!(
        hag.list_vgpus()?.iter().all(|v| v.id != id),
        "vGPU {id} is still listed {what}"
    );
    println!(
        "ok: all {} per-vGPU ioctls for vGPU {id} {what} refused with ENODEV",
        calls.len()
    );
    Ok(())
}

/// A context snapshot of a hag-sim vGPU, from a helper mdev (quiesced
/// idle, saved, removed).
fn some_snapshot(hag: &Device) -> anyhow::Result<Vec<u8>> {
    let uuid = mdev_create()?;
    let id = hag.find_vgpu(&uuid)?.id;
    hag.quiesce(id, 1000).context("quiescing the helper vGPU")?;
    let snap = hag.save_context(id).context("saving the helper vGPU")?;
    hag.resume(id)?;
    mdev_remove(&uuid).context("removing the helper vGPU")?;
    Ok(snap)
}

/// `hag-vmm remove-check --mdev UUID`.
pub fn quiesce_across_remove(mdev: &str) -> anyhow::Result<()> {
    let hag = Device::open()?;
    hag.version()?;
    let id = hag.find_vgpu(mdev)?.id;
    let snapshot = some_snapshot(&hag)?;
    let ram = GuestRam::with_mib(64)?;
    let vfio = VfioDevice::attach(mdev, &ram)
        .with_context(|| format!("cannot attach mdev {mdev} through VFIO"))?;
    let cfg = DriverConfig {
        ring_pages: 2,
        gtt_layout: GttLayout::Scattered,
    };
    let mut drv = Driver::init(&vfio, &ram, cfg).context("cannot set up the guest GPU driver")?;
    hag.set_watchdog(id, abi::WATCHDOG_MAX_MS)?;
    // Never opened: the work stays in flight until the device goes.
    let _gate = Gate::start(&mut drv)?;

    // The quiesce, from a /dev/hag file of its own.
    let (qtx, qrx) = mpsc::channel();
    thread::spawn(move || {
        let res = Device::open()
            .map_err(|e| e.to_string())
            .map(|hag| errno_of(hag.quiesce(id, 30_000)));
        let _ = qtx.send((res, Instant::now()));
    });
    thread::sleep(Duration::from_millis(300));
    ensure!(
        qrx.try_recv().is_err(),
        "IOC_QUIESCE returned while a submission is held in flight"
    );

    // The remove, which waits for the VMM (this process) to close.
    let (rtx, rrx) = mpsc::channel();
    let uuid = mdev.to_owned();
    thread::spawn(move || {
        let res = mdev_remove(&uuid).map_err(|e| e.to_string());
        let _ = rtx.send((res, Instant::now()));
    });
    thread::sleep(Duration::from_millis(500));
    ensure!(
        rrx.try_recv().is_err(),
        "the mdev's remove finished while its VFIO device was open"
    );
    ensure!(
        qrx.try_recv().is_err(),
        "IOC_QUIESCE returned while the remove waited"
    );
    println!("ok: IOC_QUIESCE (30 s) waiting on a looping batch, and the mdev's remove waiting for the VMM");

    // The VMM closes the device: the remove goes on, the quiesce ends.
    let closed = Instant::now();
    drop(drv);
    drop(vfio);
    let (removed, removed_at) = rrx
        .recv_timeout(Duration::from_secs(10))
        .context("the remove did not finish within 10 s of the VMM's close")?;
    removed.map_err(|e| anyhow::anyhow!("the mdev's remove failed: {e}"))?;
    let (quiesced, quiesce_at) = qrx
        .recv_timeout(Duration::from_secs(10))
        .context("IOC_QUIESCE did not return within 10 s of the close and remove")?;
    let quiesced = quiesced.map_err(|e| anyhow::anyhow!("opening /dev/hag: {e}"))?;
    let order = if quiesce_at > removed_at {
        "after the sysfs remove returned"
    } else {
        "before the sysfs remove returned"
    };
    match quiesced {
        Some(e @ (Errno::ENODEV | Errno::ECANCELED)) => println!(
            "ok: the VMM closed; the remove finished {} ms later; IOC_QUIESCE was refused with {e} {} ms after the close ({order})",
            removed_at.duration_since(closed).as_millis(),
            quiesce_at.duration_since(closed).as_millis(),
        ),
        Some(e) => bail!("IOC_QUIESCE across the close and remove failed with {e}, expected ENODEV or ECANCELED"),
        None => bail!("IOC_QUIESCE succeeded although the VMM's close let its hold go and the vGPU was removed"),
    }
    all_refused(&hag, id, &snapshot, "after its remove")?;
    println!("PASS remove-check: a quiesce in flight across the remove was refused, and every later call");
    Ok(())
}

/// `IOC_SAVE_CONTEXT` with room for a whole snapshot (`snap` is one of
/// the same vGPU type), so that the one ioctl held is the one that saves
/// (`Device::save_context` may ask for the size first).
fn save_into_room(hag: &Device, id: u32, snap: &[u8]) -> Result<(), DirtyError> {
    let mut buf = vec![0u8; snap.len()];
    let mut arg = abi::HagContextBuf {
        vgpu_id: id,
        reserved: 0,
        buf: buf.as_mut_ptr().expose_provenance() as u64,
        buf_bytes: buf.len() as u64,
        used_bytes: 0,
    };
    hag.save_context_raw(&mut arg)
        .map_err(|errno| DirtyError::Ioctl {
            ioctl: "IOC_SAVE_CONTEXT",
            vgpu_id: id,
            errno,
        })?;
    // `buf` outlived the call.
    drop(buf);
    Ok(())
}

/// One held ioctl: what it needs first, and the call.
type Call = fn(&Device, u32, &[u8]) -> Result<(), DirtyError>;

/// `hag-vmm remove-check --held --hold-ms MS`.
pub fn held_across_remove(hold_ms: u64) -> anyhow::Result<()> {
    ensure!(
        Path::new("/sys/module/hag_mdev/parameters/test_hold_vgpu_ms").exists(),
        "hag_mdev has no test_hold_vgpu_ms parameter"
    );
    let param = std::fs::read_to_string("/sys/module/hag_mdev/parameters/test_hold_vgpu_ms")?;
    ensure!(
        param.trim() == hold_ms.to_string(),
        "hag_mdev was loaded with test_hold_vgpu_ms={}, not {hold_ms}",
        param.trim()
    );
    let hag = Device::open()?;
    hag.version()?;
    let snapshot = some_snapshot(&hag)?;
    let hold = Duration::from_millis(hold_ms);

    // Each set up (on the vGPU, before the held call) so that it would
    // succeed on a vGPU that is still there.
    let cases: [(&str, Option<Call>, Call); 10] = [
        ("IOC_VGPU_STATS", None, |h, id, _| {
            h.vgpu_stats(id).map(drop)
        }),
        ("IOC_SET_WATCHDOG", None, |h, id, _| {
            h.set_watchdog(id, 1000)
        }),
        ("IOC_DIRTY_START", None, |h, id, _| {
            h.dirty_start(id, 0, 1 << 20)
        }),
        (
            "IOC_DIRTY_READ_CLEAR",
            Some(|h, id, _| h.dirty_start(id, 0, 1 << 20)),
            |h, id, _| h.dirty_read_clear(id, &mut [0u64; 4]).map(drop),
        ),
        (
            "IOC_DIRTY_STOP",
            Some(|h, id, _| h.dirty_start(id, 0, 1 << 20)),
            |h, id, _| h.dirty_stop(id),
        ),
        ("IOC_QUIESCE", None, |h, id, _| h.quiesce(id, 1000)),
        (
            "IOC_RESUME",
            Some(|h, id, _| h.quiesce(id, 1000)),
            |h, id, _| h.resume(id),
        ),
        (
            "IOC_SAVE_CONTEXT",
            Some(|h, id, _| h.quiesce(id, 1000)),
            save_into_room,
        ),
        ("IOC_RESTORE_CONTEXT", None, |h, id, snap| {
            h.restore_context(id, snap)
        }),
        ("IOC_INJECT_HANG", None, |h, id, _| h.inject_hang(id)),
    ];
    let mut wrong = Vec::new();
    for (name, setup, call) in cases {
        let uuid = mdev_create()?;
        let id = hag.find_vgpu(&uuid)?.id;
        if let Some(setup) = setup {
            setup(&hag, id, &snapshot).with_context(|| format!("setting up {name}"))?;
        }
        let (tx, rx) = mpsc::channel();
        let snap = snapshot.clone();
        let (ready_tx, ready_rx) = mpsc::channel();
        thread::spawn(move || {
            let res = Device::open().map_err(|e| e.to_string()).map(|hag| {
                let called = Instant::now();
                let _ = ready_tx.send(());
                let errno = errno_of(call(&hag, id, &snap));
                (errno, called.elapsed())
            });
            let _ = tx.send((res, Instant::now()));
        });
        // Whatever the scheduler does, the remove comes after the call.
        let _ = ready_rx.recv_timeout(Duration::from_secs(10));
        thread::sleep(hold / 3);
        let remove_started = Instant::now();
        mdev_remove(&uuid).with_context(|| format!("removing mdev {uuid} while {name} is held"))?;
        let removed_at = Instant::now();
        let (res, returned_at) = rx
            .recv_timeout(hold + Duration::from_secs(10))
            .with_context(|| format!("{name} did not return"))?;
        let (errno, took) = res.map_err(|e| anyhow::anyhow!("opening /dev/hag: {e}"))?;
        // The module's hold is an msleep, counted in jiffies, which under
        // emulation drift from CLOCK_MONOTONIC by a fraction of a percent:
        // "held" allows for that, not for a call that was never held.
        ensure!(
            took >= hold - hold / 20,
            "{name} returned after {took:?}, well before the {hold:?} hold ended: the test did not hold it"
        );
        // Order on one clock: the remove did not wait for the call.
        ensure!(
            removed_at < returned_at,
            "the remove returned after the held {name} did: it waited for the call"
        );
        let remove_took = removed_at.duration_since(remove_started);
        match errno {
            Some(Errno::ENODEV) => println!(
                "ok: {name} held {hold_ms} ms past the remove of vGPU {id} (remove took {} ms): ENODEV",
                remove_took.as_millis()
            ),
            Some(e) => wrong.push(format!("{name} failed with {e}, expected ENODEV")),
            None => wrong.push(format!("{name} succeeded")),
        }
        if let Some(w) = wrong.last().filter(|_| errno != Some(Errno::ENODEV)) {
            println!("WRONG: vGPU {id} removed while the call was held: {w}");
        }
    }
    ensure!(
        wrong.is_empty(),
        "{} of {} ioctls on a vGPU removed while they were held were not refused with ENODEV: {}",
        wrong.len(),
        cases.len(),
        wrong.join("; ")
    );
    println!(
        "PASS remove-check: {} ioctls held past their vGPU's remove, each refused with ENODEV",
        cases.len()
    );
    Ok(())
}
