//! The console gate: a protected QEMU VM's serial console held as its
//! network output is, released epoch by epoch as the backup acknowledges
//! them (output commit on the console, as hag-vmm holds its own).
//!
//! QEMU gives the console to a socket chardev
//! (`-chardev socket,id=con0,path=SOCK,server=on,wait=off -serial
//! chardev:con0`; libvirt: `<serial type='unix'><source mode='bind'
//! path='SOCK'/>`). [`ConsoleGate::connect`] connects to it; a reader
//! thread takes what the guest writes into [`Held`], and what an
//! acknowledged epoch wrote is appended to the console log (a file, as
//! QEMU's and libvirt's `logfile`). Output goes out at once until the
//! first epoch's boundary (before an epoch is acknowledged there is
//! nothing to take over, so nothing written then can be contradicted) and
//! is held from then on.
//!
//! An epoch boundary is taken while the VM is paused: what the reader has
//! read by then belongs to the epoch being captured. Bytes the guest wrote
//! before the pause that the reader has not read yet (in the socket, or in
//! QEMU's serial FIFO) are counted to a later epoch: held longer, never
//! released early.
//!
//! Memory is bounded: past [`MAX_HELD`] bytes held the reader stops
//! reading, the socket fills and QEMU's serial port makes the guest wait,
//! as a slow serial line would; nothing is dropped.

use crate::log::info;
use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::vmm::copy::OutputGate;

/// At most this much console output is held.
pub const MAX_HELD: usize = 8 << 20;

/// Held console output and its epoch boundaries (no I/O: the gate's rules).
#[derive(Debug)]
pub struct Held {
    bytes: Vec<u8>,
    /// (epoch, end of its output in `bytes`), oldest first.
    marks: VecDeque<(u64, usize)>,
    /// Nothing is held: before the first epoch's boundary, or once
    /// protection ended.
    passing: bool,
    /// Protection ended: no boundary makes it hold again.
    ended: bool,
}

impl Default for Held {
    fn default() -> Held {
        Held {
            bytes: Vec::new(),
            marks: VecDeque::new(),
            passing: true,
            ended: false,
        }
    }
}

impl Held {
    /// What the guest wrote: returns what may go out now (all of it
    /// before the first boundary and once protection ended, else nothing).
    pub fn push<'a>(&mut self, data: &'a [u8]) -> &'a [u8] {
        if self.passing {
            return data;
        }
        self.bytes.extend_from_slice(data);
        &[]
    }

    /// Everything held so far belongs to `epoch` (or an earlier one).
    pub fn mark(&mut self, epoch: u64) {
        if self.ended || self.marks.back().is_some_and(|&(e, _)| e >= epoch) {
            return;
        }
        self.passing = false;
        self.marks.push_back((epoch, self.bytes.len()));
    }

    /// `epoch` was acknowledged: takes the output of it and of every
    /// earlier epoch.
    pub fn release(&mut self, epoch: u64) -> Vec<u8> {
        let mut end = 0;
        while let Some(&(e, at)) = self.marks.front() {
            if e > epoch {
                break;
            }
            end = at;
            self.marks.pop_front();
        }
        for m in &mut self.marks {
            m.1 -= end;
        }
        self.bytes.drain(..end).collect()
    }

    /// Protection ended: takes everything held, and holds nothing more.
    pub fn release_all(&mut self) -> Vec<u8> {
        self.passing = true;
        self.ended = true;
        self.marks.clear();
        std::mem::take(&mut self.bytes)
    }

    /// How much is held.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }
}

struct Shared {
    held: Mutex<Held>,
    /// Signalled when the held output shrinks.
    room: Condvar,
    log: Mutex<File>,
}

impl Shared {
    fn held(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self, data: &[u8]) -> std::io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log.write_all(data)?;
        log.flush()
    }
}

/// A QEMU VM's console, held (see the module docs).
pub struct ConsoleGate {
    socket: PathBuf,
    log_path: PathBuf,
    stream: UnixStream,
    shared: Arc<Shared>,
}

impl ConsoleGate {
    /// Connects to QEMU's console socket `socket` and holds what the
    /// guest writes there; released output is appended to `log`.
    pub fn connect(socket: &Path, log: &Path) -> Result<ConsoleGate, String> {
        let stream = UnixStream::connect(socket).map_err(|e| {
            format!(
                "cannot connect to the VM's console socket {}: {e} (QEMU: -chardev socket,id=con0,path={},server=on,wait=off -serial chardev:con0)",
                socket.display(),
                socket.display()
            )
        })?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| format!("cannot open the console log {}: {e}", log.display()))?;
        let shared = Arc::new(Shared {
            held: Mutex::new(Held::default()),
            room: Condvar::new(),
            log: Mutex::new(file),
        });
        let reader = stream
            .try_clone()
            .map_err(|e| format!("console socket {}: {e}", socket.display()))?;
        let s = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("console".into())
            .spawn(move || read_console(reader, &s))
            .map_err(|e| format!("cannot start the console reader: {e}"))?;
        Ok(ConsoleGate {
            socket: socket.to_owned(),
            log_path: log.to_owned(),
            stream,
            shared,
        })
    }

    fn write(&self, data: &[u8]) -> Result<(), String> {
        self.shared.write(data).map_err(|e| {
            format!(
                "cannot write the console log {}: {e}",
                self.log_path.display()
            )
        })
    }
}

/// The reader thread: until the console closes.
fn read_console(mut from: UnixStream, shared: &Shared) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        {
            let mut held = shared.held();
            while held.len() >= MAX_HELD {
                held = shared.room.wait(held).unwrap_or_else(|e| e.into_inner());
            }
        }
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let out = shared.held().push(&buf[..n]).to_vec();
        if shared.write(&out).is_err() {
            // Released output that cannot be logged: say it once, go on
            // draining so the guest is not blocked.
            info!("cannot write the VM's console log; its output from now on is lost");
        }
    }
}

impl OutputGate for ConsoleGate {
    fn mark(&mut self, epoch: u64) -> Result<(), String> {
        self.shared.held().mark(epoch);
        Ok(())
    }

    fn release(&mut self, epoch: u64) -> Result<bool, String> {
        let out = self.shared.held().release(epoch);
        self.shared.room.notify_all();
        self.write(&out)?;
        Ok(!out.is_empty())
    }

    fn release_all(&mut self) -> Result<(), String> {
        let out = self.shared.held().release_all();
        self.shared.room.notify_all();
        self.write(&out)
    }
}

impl Drop for ConsoleGate {
    /// What is still held is dropped, never released; the reader ends.
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
        self.shared.room.notify_all();
    }
}

impl std::fmt::Debug for ConsoleGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleGate")
            .field("socket", &self.socket)
            .field("log", &self.log_path)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Output goes out only with the acknowledgement of the epoch it
    /// belongs to, in order, and all of it once protection ends.
    #[test]
    fn releases_by_epoch() {
        let mut h = Held::default();
        // Before the first boundary nothing can be contradicted.
        assert_eq!(h.push(b"sync "), b"sync ");
        h.mark(1);
        assert!(h.push(b"zero ").is_empty());
        h.mark(2);
        h.push(b"one ");
        h.mark(3);
        h.push(b"two ");
        h.mark(4);
        h.push(b"open");
        assert_eq!(h.release(1), b"");
        assert_eq!(h.release(2), b"zero ");
        // An old ack releases nothing more.
        assert_eq!(h.release(2), b"");
        assert_eq!(h.release(4), b"one two ");
        assert_eq!(h.len(), 4);
        assert_eq!(h.release_all(), b"open");
        assert_eq!(h.push(b"after"), b"after");
        // Protection over: a late boundary holds nothing again.
        h.mark(5);
        assert_eq!(h.push(b"late"), b"late");
    }

    /// A boundary taken twice for one epoch (a retried capture) keeps the
    /// first: output after it belongs to the next epoch.
    #[test]
    fn a_mark_never_moves_back_or_twice() {
        let mut h = Held::default();
        h.mark(1);
        h.push(b"a");
        h.mark(2);
        h.push(b"b");
        h.mark(2);
        h.mark(1);
        assert_eq!(h.release(2), b"a");
        h.mark(3);
        assert_eq!(h.release(3), b"b");
    }

    /// Through a real socket: what the reader took is held until its
    /// epoch is acknowledged.
    #[test]
    fn holds_a_real_console() {
        let dir = std::env::temp_dir().join(format!("hag-console-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("con.sock");
        let log = dir.join("con.log");
        let _ = std::fs::remove_file(&sock);
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let mut gate = ConsoleGate::connect(&sock, &log).unwrap();
        let (mut qemu, _) = listener.accept().unwrap();
        let wait = |what: &str, done: &dyn Fn() -> bool| {
            for _ in 0..500 {
                if done() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            panic!("{what}");
        };
        // Before the first boundary the console goes straight to its log.
        qemu.write_all(b"sync\n").unwrap();
        wait("the console was held before any epoch", &|| {
            std::fs::read(&log).unwrap() == b"sync\n"
        });
        gate.mark(1).unwrap();
        qemu.write_all(b"epoch two\n").unwrap();
        let shared = gate.shared.clone();
        wait("the reader never took 10 bytes", &|| {
            shared.held().len() >= 10
        });
        gate.mark(2).unwrap();
        qemu.write_all(b"epoch three\n").unwrap();
        assert_eq!(std::fs::read(&log).unwrap(), b"sync\n");
        assert!(gate.release(2).unwrap());
        assert_eq!(std::fs::read(&log).unwrap(), b"sync\nepoch two\n");
        gate.release_all().unwrap();
        drop(gate);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
