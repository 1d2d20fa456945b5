// SPDX-License-Identifier: GPL-2.0-only
//! VFIO migration v2 of a vGPU: its state machine and its data files.
//!
//! A VMM moves a vGPU's migration state with
//! `VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE`. VFIO's core picks each arc of
//! the path (`vfio_mig_get_next_state`); [`VfioVgpu::set_state`] walks
//! them: RUNNING <-> STOP stops or runs the vGPU ([`Entry::vfio_stop`],
//! [`Entry::vfio_run`]), and the other arcs open or end the data session:
//! the snapshot read out in STOP_COPY, or the bytes written in RESUMING.
//! The same code runs hag's simulated vGPUs and the GVT-g vGPUs whose
//! kvmgt device delegates migration to hag.
//!
//! A data file ([`MigFile`]) is the VMM's and may outlive its session and
//! the vGPU: once the session ends (the next arc, a reset, the device
//! closed or removed) it is disabled, and reads and writes fail with
//! `ENODEV` until the VMM closes it. A RESUMING file checks the snapshot
//! as it arrives against the vGPU it is for.
//!
//! Locking: a vGPU's migration lock is taken before its device lock, never
//! after; a file's lock is taken under the migration lock or alone, and is
//! the only lock held while a file copies from or to the VMM's memory.

use kernel::prelude::*;
use kernel::sync::{Arc, Mutex};
use kernel::uaccess::UserSlice;
use kernel::{new_mutex, pin_init};

use crate::glue::{self, File, VfioDeviceRef};
use crate::sim::vfio::mig_state;
use crate::vgpu::Entry;

/// Where a vGPU's migration is, and its data session.
struct Migration {
    /// `enum vfio_device_mig_state`.
    state: u32,
    /// In STOP_COPY.
    saving: Option<Arc<MigFile>>,
    /// In RESUMING.
    resuming: Option<Arc<MigFile>>,
}

impl Migration {
    /// Ends the data session: the files the VMM holds read and write
    /// nothing from here on.
    fn end_session(&mut self) {
        for file in [self.saving.take(), self.resuming.take()].into_iter().flatten() {
            file.disable();
        }
    }
}

/// A vGPU as its VFIO device reaches it: the counted reference glue.c
/// keeps in the device's data (hag-sim's `struct hag_vgpu`, or its record
/// of a GVT-g vGPU), from probe (or GVT's add) until remove. It carries
/// the vGPU's VFIO migration.
#[pin_data]
pub(crate) struct VfioVgpu {
    pub(crate) entry: Entry,
    #[pin]
    mig: Mutex<Migration>,
}

impl VfioVgpu {
    pub(crate) fn new(entry: Entry) -> Result<Arc<Self>> {
        let mig = Migration { state: mig_state::RUNNING, saving: None, resuming: None };
        Arc::pin_init(
            pin_init!(Self { entry, mig <- new_mutex!(mig, "hag_vgpu_migration") }),
            GFP_KERNEL,
        )
    }

    /// Walks VFIO's path from the current state to `target`, one arc at a
    /// time; returns the file the last arc opened, if any. A failed arc
    /// leaves the state at the last one reached.
    pub(crate) fn set_state(&self, vdev: &VfioDeviceRef<'_>, target: u32) -> Result<Option<File>> {
        let mut mig = self.mig.lock();
        let mut file = None;
        while mig.state != target {
            // Only the last arc of a path may open a file (STOP_COPY's
            // arcs never make such a path; refused, not assumed).
            if file.is_some() {
                return Err(EINVAL);
            }
            let next = vdev.next_state(mig.state, target)?;
            file = self.arc(&mut mig, next)?;
            mig.state = next;
        }
        Ok(file)
    }

    /// One arc of `VFIO_MIGRATION_STOP_COPY` (VFIO's core picks no other
    /// for a device that offers only it).
    fn arc(&self, mig: &mut Migration, next: u32) -> Result<Option<File>> {
        use mig_state::{RESUMING, RUNNING, STOP, STOP_COPY};
        match (mig.state, next) {
            (RUNNING, STOP) => self.entry.vfio_stop().map(|()| None),
            (STOP, RUNNING) => self.entry.vfio_run().map(|()| None),
            (STOP, STOP_COPY) => self.save(mig).map(Some),
            (STOP_COPY, STOP) => {
                mig.end_session();
                Ok(None)
            }
            (STOP, RESUMING) => self.resume(mig).map(Some),
            (RESUMING, STOP) => self.load(mig).map(|()| None),
            (cur, next) => {
                pr_info!(
                    "vGPU {}: VFIO migration arc {} -> {} is not supported\n",
                    self.entry.id(),
                    mig_state::name(cur),
                    mig_state::name(next)
                );
                Err(EINVAL)
            }
        }
    }

    /// STOP -> STOP_COPY: the snapshot, in a file to read it from.
    fn save(&self, mig: &mut Migration) -> Result<File> {
        let mut data = KVVec::from_elem(0u8, self.entry.snapshot_bytes()?, GFP_KERNEL)?;
        let used = self.entry.mig_save(&mut data)?;
        if glue::mig_data_corrupted() && used > 0 {
            data[used / 2] ^= 0x5a;
        }
        let contents = MigFile::new(data, used, None)?;
        let file = glue::mig_file::<crate::State>(contents.clone(), false)?;
        mig.saving = Some(contents);
        Ok(file)
    }

    /// STOP -> RESUMING: a file to write a snapshot into, checked against
    /// this vGPU as it arrives.
    fn resume(&self, mig: &mut Migration) -> Result<File> {
        let cap = usize::try_from(self.entry.snapshot_max_bytes()).map_err(|_| EINVAL)?;
        let data = KVVec::from_elem(0u8, cap, GFP_KERNEL)?;
        let contents = MigFile::new(data, 0, Some(self.entry.clone()))?;
        let file = glue::mig_file::<crate::State>(contents.clone(), true)?;
        mig.resuming = Some(contents);
        Ok(file)
    }

    /// RESUMING -> STOP: loads what was written, then ends the session.
    /// Refused, the session stays (the VMM may reset).
    fn load(&self, mig: &mut Migration) -> Result {
        {
            let file = mig.resuming.as_ref().ok_or(EINVAL)?;
            let contents = file.contents.lock();
            self.entry.mig_restore(&contents.data[..contents.size])?;
        }
        mig.end_session();
        Ok(())
    }

    /// The migration state (`enum vfio_device_mig_state`).
    pub(crate) fn state(&self) -> u32 {
        self.mig.lock().state
    }

    /// Bytes of the STOP_COPY snapshot: the open session's, or what one
    /// taken now would be.
    pub(crate) fn data_bytes(&self) -> Result<usize> {
        let mig = self.mig.lock();
        match &mig.saving {
            Some(file) => Ok(file.contents.lock().size),
            None => self.entry.snapshot_bytes(),
        }
    }

    /// Close or reset: back to RUNNING with no data session, the vGPU let
    /// go if migration held it stopped.
    pub(crate) fn reset(&self) {
        let mut mig = self.mig.lock();
        mig.end_session();
        if mig.state != mig_state::RUNNING {
            self.entry.mig_reset();
        }
        mig.state = mig_state::RUNNING;
    }

    /// The vGPU is being removed: any data session ends.
    pub(crate) fn end_session(&self) {
        self.mig.lock().end_session();
    }
}

/// What a data file holds.
struct Contents {
    /// The session ended: reads and writes fail until the VMM closes it.
    disabled: bool,
    /// kvmalloc'd; its length is the most the file holds.
    data: KVVec<u8>,
    /// Bytes of `data` that are valid.
    size: usize,
    /// Where the next read starts (a stream file has no position).
    read_at: usize,
}

/// A VFIO migration data file's contents: the file's `private_data`, given
/// back when the VMM closes it.
#[pin_data]
pub(crate) struct MigFile {
    /// A RESUMING file's vGPU, against which the snapshot is checked as it
    /// arrives; `None` for a STOP_COPY file, which only reads.
    checked_against: Option<Entry>,
    #[pin]
    contents: Mutex<Contents>,
}

impl MigFile {
    fn new(data: KVVec<u8>, size: usize, checked_against: Option<Entry>) -> Result<Arc<Self>> {
        let contents = Contents { disabled: false, data, size, read_at: 0 };
        Arc::pin_init(
            pin_init!(Self { checked_against, contents <- new_mutex!(contents, "hag_mig_file") }),
            GFP_KERNEL,
        )
    }

    fn disable(&self) {
        let mut contents = self.contents.lock();
        contents.disabled = true;
        contents.size = 0;
        contents.read_at = 0;
    }

    /// A read by the VMM: the snapshot, from where the last read ended.
    pub(crate) fn read(&self, user: UserSlice, len: usize) -> Result<usize> {
        let mut contents = self.contents.lock();
        if contents.disabled {
            return Err(ENODEV);
        }
        let from = contents.read_at;
        let n = len.min(contents.size - from);
        user.writer().write_slice(&contents.data[from..from + n])?;
        contents.read_at = from + n;
        Ok(n)
    }

    /// A write by the VMM: appended, and the snapshot so far checked. The
    /// write that completes a damaged or foreign snapshot is refused (its
    /// bytes stay out), so the VMM's load fails, and the migration with
    /// it, before the VM would start here.
    pub(crate) fn write(&self, user: UserSlice, len: usize) -> Result<usize> {
        let vgpu = self.checked_against.as_ref().ok_or(EINVAL)?;
        let mut contents = self.contents.lock();
        if contents.disabled {
            return Err(ENODEV);
        }
        let size = contents.size;
        let room = contents.data.len() - size;
        if len > room {
            return Err(EFBIG);
        }
        user.reader().read_slice(&mut contents.data[size..size + len])?;
        let more = vgpu.mig_check(&contents.data[..size + len])?;
        // A header that declares more than the file can hold.
        if more > room - len {
            return Err(EFBIG);
        }
        contents.size = size + len;
        Ok(len)
    }
}
