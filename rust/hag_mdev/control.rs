// SPDX-License-Identifier: GPL-2.0-only
//! `/dev/hag` ioctls.
//!
//! Each ioctl reads its argument structure from userspace once, checks it
//! and answers; user addresses and sizes are never trusted (the kernel's
//! user-copy routines fault cleanly on a bad address, and the list ioctl
//! caps how much it writes at what the caller said it has room for).

use kernel::prelude::*;
use kernel::types::{AsBytes, FromBytes};
use kernel::uaccess::UserSlice;

use core::sync::atomic::{AtomicU64, Ordering};

use crate::abi;
use crate::dirty::DirtyLog;
use crate::events::Event;
use crate::vgpu::{Entry, Vgpu, MAX_VGPUS};
use kernel::sync::{Arc, Mutex};
use kernel::{new_mutex, pin_init};
use crate::State;

/// One open of `/dev/hag`: the simulated vGPUs it holds quiesced (by
/// `IOC_QUIESCE`, or a context it restored), let go when its file is
/// released (closed, or its process died), by that release alone.
#[pin_data]
pub(crate) struct Opener {
    /// Names its holds ([`crate::sim::Sim::held_by`]): numbered, never
    /// reused while the module is loaded, so a hold left by an opener
    /// that is gone is never taken for a new one's.
    id: u64,
    /// The vGPUs it held at some point; at most one slot per vGPU, a
    /// removed one's slot reused.
    #[pin]
    holds: Mutex<[Option<Arc<Vgpu>>; MAX_VGPUS]>,
}

/// The last opener's number.
static OPENERS: AtomicU64 = AtomicU64::new(0);

impl Opener {
    fn new() -> Result<Pin<KBox<Self>>> {
        let id = OPENERS.fetch_add(1, Ordering::Relaxed) + 1;
        KBox::pin_init(
            pin_init!(Self { id, holds <- new_mutex!([const { None }; MAX_VGPUS], "hag_opener") }),
            GFP_KERNEL,
        )
    }

    /// Records that this opener holds `vgpu` (its release lets it go).
    fn record_hold(&self, vgpu: &Arc<Vgpu>) -> Result {
        let mut holds = self.holds.lock();
        if holds.iter().flatten().any(|v| Arc::ptr_eq(v, vgpu)) {
            return Ok(());
        }
        // At most MAX_VGPUS vGPUs exist at once: a free or removed slot.
        let slot = holds.iter_mut().find(|s| s.as_ref().is_none_or(|v| v.is_removed())).ok_or(ENOSPC)?;
        *slot = Some(vgpu.clone());
        Ok(())
    }
}

impl crate::glue::FileOps for State {
    type Opened = Opener;

    fn open(&self) -> Result<Pin<KBox<Opener>>> {
        Opener::new()
    }

    fn ioctl(&self, opener: &Opener, cmd: u32, arg: usize) -> Result {
        ioctl(self, opener, cmd, arg)
    }

    /// Every vGPU the opener still holds quiesced (and VFIO migration does
    /// not hold stopped) runs again.
    fn release(&self, opener: Pin<KBox<Opener>>) {
        let holds = core::mem::replace(&mut *opener.holds.lock(), [const { None }; MAX_VGPUS]);
        for vgpu in holds.iter().flatten() {
            vgpu.let_go(opener.id);
        }
    }
}

/// Dispatches one ioctl of a `/dev/hag` opener. Unknown commands get
/// `ENOTTY`, as the kernel's convention for "not my ioctl" asks.
pub(crate) fn ioctl(state: &State, opener: &Opener, cmd: u32, arg: usize) -> Result {
    match cmd {
        abi::IOC_VERSION => version(state, arg),
        abi::IOC_LIST_VGPUS => list_vgpus(state, arg),
        abi::IOC_DIRTY_START => dirty_start(state, arg),
        abi::IOC_DIRTY_STOP => dirty_stop(state, arg),
        abi::IOC_DIRTY_READ_CLEAR => dirty_read_clear(state, arg),
        abi::IOC_VGPU_STATS => vgpu_stats(state, arg),
        abi::IOC_SET_WATCHDOG => set_watchdog(state, arg),
        abi::IOC_INJECT_HANG => inject_hang(state, arg),
        abi::IOC_QUIESCE => quiesce(state, opener, arg),
        abi::IOC_RESUME => resume(state, arg),
        abi::IOC_SAVE_CONTEXT => save_context(state, arg),
        abi::IOC_RESTORE_CONTEXT => restore_context(state, opener, arg),
        _ => Err(ENOTTY),
    }
}

fn dirty_start(state: &State, arg: usize) -> Result {
    let req: abi::HagDirtyStart = read_user(arg)?;
    if req.reserved != 0 {
        return Err(EINVAL);
    }
    let log = DirtyLog::new(req.gpa, req.size)?;
    named(state, req.vgpu_id)?.dirty_start(log)
}

fn dirty_stop(state: &State, arg: usize) -> Result {
    let req = read_vgpu_ref(arg)?;
    named(state, req.vgpu_id)?.dirty_stop()
}

fn dirty_read_clear(state: &State, arg: usize) -> Result {
    let mut req: abi::HagDirtyRead = read_user(arg)?;
    if req.reserved != 0 {
        return Err(EINVAL);
    }
    let vgpu = named(state, req.vgpu_id)?;
    let mut words = KVVec::new();
    req.dirty_pages = vgpu.dirty_read_clear(req.bitmap_bytes, &mut words)?;
    // The copy happens without the lock: it may fault on user memory. If it
    // does, the bits go back into the log rather than being lost.
    let copied = (|| -> Result {
        let addr = usize::try_from(req.bitmap).map_err(|_| EFAULT)?;
        let mut writer = UserSlice::new(addr, words.len() * 8).writer();
        for word in words.iter() {
            writer.write(word)?;
        }
        write_user(arg, &req)
    })();
    if copied.is_err() {
        vgpu.dirty_merge(&words);
    }
    copied
}

fn vgpu_stats(state: &State, arg: usize) -> Result {
    let req: abi::HagVgpuStats = read_user(arg)?;
    let vgpu = match named(state, req.vgpu_id)? {
        Entry::Sim(vgpu) => vgpu,
        Entry::Gvt(gvt) => {
            // GVT's scanner rejects, hangs are GVT's: hag counts workloads.
            let (s, coverage) = {
                let inner = gvt.inner.lock();
                (inner.stats, inner.coverage())
            };
            let answer = abi::HagVgpuStats {
                vgpu_id: req.vgpu_id,
                state: abi::VGPU_STATE_IDLE,
                submissions: s.workloads,
                commands: s.commands,
                pages_marked: s.pages_marked,
                precise_workloads: coverage.precise,
                fallback_workloads: coverage.fallback,
                ..Default::default()
            };
            return write_user(arg, &answer);
        }
    };
    let answer = {
        let sim = vgpu.lock()?;
        let s = &sim.stats;
        abi::HagVgpuStats {
            vgpu_id: req.vgpu_id,
            state: sim.vgpu_state(),
            submissions: s.submissions,
            rejected: s.rejected,
            commands: s.commands,
            pages_marked: s.pages_marked,
            interrupts: s.interrupts,
            hangs: s.hangs,
            watchdog_ms: sim.watchdog_ms,
            reserved: 0,
            bytes_written: s.bytes_written,
            precise_workloads: s.precise,
            fallback_workloads: 0,
        }
    };
    write_user(arg, &answer)
}

fn set_watchdog(state: &State, arg: usize) -> Result {
    let req: abi::HagWatchdog = read_user(arg)?;
    if !(abi::WATCHDOG_MIN_MS..=abi::WATCHDOG_MAX_MS).contains(&req.timeout_ms) {
        return Err(EINVAL);
    }
    named_sim(state, req.vgpu_id)?.lock()?.watchdog_ms = req.timeout_ms;
    Ok(())
}

fn inject_hang(state: &State, arg: usize) -> Result {
    let req = read_vgpu_ref(arg)?;
    if !crate::glue::hang_injection_allowed() {
        return Err(EPERM);
    }
    named_sim(state, req.vgpu_id)?.lock()?.hang("injected through /dev/hag");
    Ok(())
}

fn version(state: &State, arg: usize) -> Result {
    let mut answer = abi::HagVersion {
        abi_version: abi::ABI_VERSION,
        features: abi::FEATURE_SIM_VGPU
            | if crate::glue::gvt_active() { abi::FEATURE_GVT } else { 0 },
        vgpu_count: u32::try_from(state.vgpu_count()).unwrap_or(u32::MAX),
        ..Default::default()
    };
    let version = crate::MODULE_VERSION.as_bytes();
    // Always leaves at least one NUL at the end.
    let len = version.len().min(answer.module_version.len() - 1);
    answer.module_version[..len].copy_from_slice(&version[..len]);
    write_user(arg, &answer)
}

fn list_vgpus(state: &State, arg: usize) -> Result {
    let mut request: abi::HagVgpuList = read_user(arg)?;
    if request.capacity > abi::LIST_MAX_CAPACITY {
        return Err(EINVAL);
    }
    let entries = usize::try_from(request.entries).map_err(|_| EINVAL)?;
    let entry_size = core::mem::size_of::<abi::HagVgpuInfo>();

    let (infos, count) = state.infos();
    request.count = u32::try_from(count).unwrap_or(u32::MAX);
    let room = usize::try_from(request.capacity).unwrap_or(usize::MAX);
    for (i, info) in infos.iter().take(count.min(room)).enumerate() {
        let addr = i
            .checked_mul(entry_size)
            .and_then(|offset| entries.checked_add(offset))
            .ok_or(EFAULT)?;
        write_user(addr, info)?;
    }
    write_user(arg, &request)
}

/// The vGPU an ioctl names. Its `Arc` is held from here to the end of the
/// ioctl, across user copies that may fault and sleep: a remove meanwhile
/// makes every later use of it fail with `ENODEV` ([`Vgpu::lock`]). The
/// test-only parameter `test_hold_vgpu_ms` stretches that window, as a user
/// copy that blocks would.
fn named(state: &State, id: u32) -> Result<Entry> {
    let entry = state.entry(id)?;
    let hold = crate::glue::test_hold_vgpu_ms();
    if hold > 0 {
        crate::glue::msleep(hold);
    }
    Ok(entry)
}

/// As [`named`], for what only a simulated vGPU has (`EOPNOTSUPP` for a
/// GVT-g one).
fn named_sim(state: &State, id: u32) -> Result<Arc<Vgpu>> {
    match named(state, id)? {
        Entry::Sim(v) => Ok(v),
        Entry::Gvt(_) => Err(crate::errno(kernel::bindings::EOPNOTSUPP)),
    }
}

fn read_user<T: FromBytes>(addr: usize) -> Result<T> {
    UserSlice::new(addr, core::mem::size_of::<T>()).reader().read()
}

fn write_user<T: AsBytes>(addr: usize, value: &T) -> Result {
    UserSlice::new(addr, core::mem::size_of::<T>()).writer().write(value)
}

fn quiesce(state: &State, opener: &Opener, arg: usize) -> Result {
    let req: abi::HagQuiesce = read_user(arg)?;
    if req.timeout_ms > abi::QUIESCE_MAX_MS {
        return Err(EINVAL);
    }
    let vgpu = named(state, req.vgpu_id)?;
    match &vgpu {
        Entry::Sim(sim) => {
            // Recorded first: a hold it then takes is never unrecorded.
            opener.record_hold(sim)?;
            sim.quiesce(req.timeout_ms, Some(opener.id))?;
        }
        // GVT's own wait: it does not hold new workloads, and its
        // timeout is GVT's.
        Entry::Gvt(gvt) => gvt.quiesce()?,
    }
    vgpu.event("quiesced");
    Ok(())
}

fn resume(state: &State, arg: usize) -> Result {
    let req = read_vgpu_ref(arg)?;
    let vgpu = match named(state, req.vgpu_id)? {
        Entry::Sim(vgpu) => vgpu,
        // Quiescing a GVT-g vGPU holds nothing: nothing to let go.
        Entry::Gvt(_) => return Ok(()),
    };
    {
        let mut sim = vgpu.lock()?;
        // A VMM stopped it for VFIO migration: only the VMM restarts it.
        if sim.vfio_stopped {
            return Err(EBUSY);
        }
        sim.resume();
    }
    Event::new(abi::EVENT_STATE_CHANGED, vgpu.id, &vgpu.uuid).message("resumed").send();
    Ok(())
}

fn save_context(state: &State, arg: usize) -> Result {
    let mut req: abi::HagContextBuf = read_user(arg)?;
    if req.reserved != 0 {
        return Err(EINVAL);
    }
    let vgpu = named(state, req.vgpu_id)?;
    let need = vgpu.snapshot_bytes()?;
    if req.buf_bytes < need as u64 {
        req.used_bytes = need as u64;
        write_user(arg, &req)?;
        return Err(ENOSPC);
    }
    let mut bytes = KVVec::from_elem(0u8, need, GFP_KERNEL)?;
    let used = vgpu.save(&mut bytes)?;
    let buf = usize::try_from(req.buf).map_err(|_| EFAULT)?;
    UserSlice::new(buf, used).writer().write_slice(&bytes[..used])?;
    req.used_bytes = used as u64;
    write_user(arg, &req)
}

fn restore_context(state: &State, opener: &Opener, arg: usize) -> Result {
    let req: abi::HagContextBuf = read_user(arg)?;
    if req.reserved != 0 {
        return Err(EINVAL);
    }
    let vgpu = named(state, req.vgpu_id)?;
    if req.buf_bytes > vgpu.snapshot_max_bytes() {
        return Err(EINVAL);
    }
    let len = req.buf_bytes as usize;
    let mut bytes = KVVec::from_elem(0u8, len, GFP_KERNEL)?;
    let buf = usize::try_from(req.buf).map_err(|_| EFAULT)?;
    UserSlice::new(buf, len).reader().read_slice(&mut bytes)?;
    if let Entry::Sim(sim) = &vgpu {
        opener.record_hold(sim)?;
    }
    vgpu.restore(&bytes, opener.id)?;
    vgpu.event("restored");
    Ok(())
}

/// A [`abi::HagVgpuRef`] argument, with its reserved field checked.
fn read_vgpu_ref(arg: usize) -> Result<abi::HagVgpuRef> {
    let req: abi::HagVgpuRef = read_user(arg)?;
    if req.reserved != 0 {
        return Err(EINVAL);
    }
    Ok(req)
}
