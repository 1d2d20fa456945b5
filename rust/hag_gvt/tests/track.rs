//! Workloads in flight (item 2 of issue 15): a workload's pages stay
//! marked on every read-and-clear until GVT says it is done, and an
//! unmodelled one keeps the reachable set marked as long.

use std::collections::BTreeSet;

use hag_gvt::track::{Coverage, InFlight, Remark, Writes};

/// A dirty log with read-and-clear, and the reader's protocol around it:
/// clear, then mark again what is still in flight.
#[derive(Default)]
struct Log {
    bits: BTreeSet<u64>,
}

/// The vGPU's reachable pages in these tests.
const REACHABLE: [u64; 3] = [0x100, 0x101, 0x102];

impl Log {
    fn read_and_clear<const N: usize>(
        &mut self,
        inflight: &InFlight<Vec<u64>, N>,
    ) -> BTreeSet<u64> {
        let out = std::mem::take(&mut self.bits);
        if inflight.remark(|gfn| {
            self.bits.insert(gfn);
        }) == Remark::Reachable
        {
            self.bits.extend(REACHABLE);
        }
        out
    }
}

fn set(gfns: &[u64]) -> BTreeSet<u64> {
    gfns.iter().copied().collect()
}

/// A workload that outlives two reads is reported by both, and by the
/// first read after it is done; not after that.
#[test]
fn pages_stay_marked_until_done() {
    let mut inflight = InFlight::<Vec<u64>, 4>::new();
    let mut log = Log::default();
    // Scan: the hand-off marks the pages and records them.
    log.bits.extend([7, 8]);
    assert!(inflight.scanned(1, Writes::Pages(vec![7, 8])).is_none());
    assert_eq!(log.read_and_clear(&inflight), set(&[7, 8]));
    assert_eq!(log.read_and_clear(&inflight), set(&[7, 8]));
    assert_eq!(inflight.done(1, false), Some(Writes::Pages(vec![7, 8])));
    // The GPU may have written them after the last read.
    assert_eq!(log.read_and_clear(&inflight), set(&[7, 8]));
    assert_eq!(log.read_and_clear(&inflight), set(&[]));
    assert!(inflight.is_empty());
}

/// An unmodelled workload in flight keeps the reachable set marked.
#[test]
fn unmodelled_marks_reachable_while_in_flight() {
    let mut inflight = InFlight::<Vec<u64>, 4>::new();
    let mut log = Log::default();
    log.bits.extend(REACHABLE);
    inflight.scanned(9, Writes::Reachable);
    inflight.scanned(10, Writes::Pages(vec![0x200]));
    log.bits.insert(0x200);
    let mut want = set(&REACHABLE);
    want.insert(0x200);
    assert_eq!(log.read_and_clear(&inflight), want);
    assert_eq!(inflight.done(9, false), Some(Writes::Reachable));
    assert_eq!(log.read_and_clear(&inflight), want);
    assert_eq!(log.read_and_clear(&inflight), set(&[0x200]));
}

/// A full table never drops a workload: the extra one counts as
/// unmodelled until a workload the table does not know is done.
#[test]
fn overflow_is_reachable_until_done() {
    let mut inflight = InFlight::<Vec<u64>, 1>::new();
    assert!(inflight.scanned(1, Writes::Pages(vec![1])).is_none());
    assert_eq!(
        inflight.scanned(2, Writes::Pages(vec![2])),
        Some(Writes::Pages(vec![2]))
    );
    assert_eq!(inflight.len(), 2);
    assert_eq!(inflight.remark(|_| {}), Remark::Reachable);
    assert_eq!(inflight.done(2, false), None);
    assert_eq!(inflight.remark(|_| {}), Remark::Pages);
    assert_eq!(inflight.done(1, false), Some(Writes::Pages(vec![1])));
    assert!(inflight.is_empty());
    // A done for a workload never seen (scanned before hag registered)
    // with nothing overflowed changes nothing.
    assert_eq!(inflight.done(77, false), None);
    assert!(inflight.is_empty());
}

/// Issue 23, item 9: a done for a cookie the table never saw must not end
/// an overflowed workload still in flight (its pages would no longer be
/// marked); past the spill's room, the reachable set is marked until
/// the table is cleared.
#[test]
fn an_unknown_done_never_ends_an_overflowed_workload() {
    let mut inflight = InFlight::<Vec<u64>, 1>::new();
    inflight.scanned(1, Writes::Pages(vec![1]));
    assert!(inflight.scanned(2, Writes::Pages(vec![2])).is_some());
    assert_eq!(inflight.done(77, false), None);
    assert_eq!(inflight.remark(|_| {}), Remark::Reachable, "2 is in flight");
    assert_eq!(inflight.done(2, false), None);
    assert_eq!(inflight.remark(|_| {}), Remark::Pages);
    // Table and spill full: a third extra workload cannot be told apart.
    assert!(inflight.scanned(3, Writes::Reachable).is_some());
    assert!(inflight.scanned(4, Writes::Reachable).is_some());
    assert_eq!(inflight.len(), 3);
    inflight.done(3, false);
    inflight.done(4, false);
    inflight.done(1, false);
    assert_eq!(
        inflight.remark(|_| {}),
        Remark::Reachable,
        "4 may still run"
    );
    inflight.clear(drop);
    assert_eq!(inflight.remark(|_| {}), Remark::Pages);
    assert!(inflight.is_empty());
}

#[test]
fn clear_frees_everything() {
    let mut inflight = InFlight::<Vec<u64>, 2>::new();
    inflight.scanned(1, Writes::Pages(vec![1]));
    inflight.scanned(2, Writes::Reachable);
    inflight.scanned(3, Writes::Reachable);
    let mut freed = 0;
    inflight.clear(|_| freed += 1);
    assert_eq!(freed, 2);
    assert!(inflight.is_empty());
}

// ---- Per-vGPU counts of precise and fallback workloads (issue 15, item 5).

fn coverage(precise: u64, fallback: u64) -> Coverage {
    Coverage { precise, fallback }
}

/// An audited workload counts as precise when it is done, not before
/// (it could still turn into a fallback); an unmodelled one is a fallback
/// as soon as it is recorded, and its done counts nothing more.
#[test]
fn coverage_counts_each_workload_once_when_final() {
    let mut inflight = InFlight::<Vec<u64>, 4>::new();
    assert_eq!(inflight.coverage(), coverage(0, 0));
    inflight.scanned(1, Writes::Pages(vec![7]));
    inflight.scanned(2, Writes::Reachable);
    // 1 in flight, 2 final.
    assert_eq!(inflight.coverage(), coverage(0, 1));
    assert!(inflight.done(1, false).is_some());
    assert_eq!(inflight.coverage(), coverage(1, 1));
    // A changed batch under an unmodelled workload: still one fallback.
    assert_eq!(inflight.done(2, true), Some(Writes::Reachable));
    assert_eq!(inflight.coverage(), coverage(1, 1));
    // A done GVT reports twice, or for a workload never handed over.
    assert_eq!(inflight.done(1, false), None);
    assert_eq!(inflight.done(99, true), None);
    assert_eq!(inflight.coverage(), coverage(1, 1));
}

/// A PPGTT batch changed after the scan makes an audited workload a
/// fallback (the reachable set is marked at done): never also precise.
#[test]
fn changed_batch_makes_an_audited_workload_a_fallback() {
    let mut inflight = InFlight::<Vec<u64>, 4>::new();
    inflight.scanned(1, Writes::Pages(vec![7]));
    inflight.scanned(2, Writes::Pages(vec![8]));
    inflight.done(2, true);
    inflight.done(1, false);
    assert_eq!(inflight.coverage(), coverage(1, 1));
}

/// A workload that finds the table full is a fallback at once (the
/// caller marks the reachable set), and its done counts nothing more;
/// workloads forgotten by clear are counted neither way.
#[test]
fn overflow_and_clear_in_the_counts() {
    let mut inflight = InFlight::<Vec<u64>, 1>::new();
    inflight.scanned(1, Writes::Pages(vec![1]));
    assert!(inflight.scanned(2, Writes::Pages(vec![2])).is_some());
    assert!(inflight.scanned(3, Writes::Reachable).is_some());
    assert_eq!(inflight.coverage(), coverage(0, 2));
    inflight.done(2, false);
    inflight.done(3, true);
    assert_eq!(inflight.coverage(), coverage(0, 2));
    inflight.clear(drop);
    inflight.done(1, false);
    assert_eq!(inflight.coverage(), coverage(0, 2));
}

/// Every sequence of scans and dones: each workload counts at most once,
/// and once all are done, exactly once (no clear).
#[test]
fn coverage_adds_up_for_any_order() {
    // A small exhaustive walk: 5 workloads, each audited or not, done in
    // a rotated order, some with a changed batch, in a table of 3.
    for mask in 0u32..(1 << 10) {
        for rot in 0..5 {
            let mut inflight = InFlight::<Vec<u64>, 3>::new();
            let mut reach_now = 0u64;
            for w in 0..5u64 {
                let audited = mask & (1 << w) != 0;
                let writes = if audited {
                    Writes::Pages(vec![w])
                } else {
                    Writes::Reachable
                };
                if inflight.scanned(w, writes).is_some() || !audited {
                    reach_now += 1;
                }
                let c = inflight.coverage();
                assert!(c.precise + c.fallback <= w + 1);
            }
            assert_eq!(inflight.coverage().fallback, reach_now);
            let mut changed_pages = 0u64;
            for i in 0..5u64 {
                let w = (i + rot) % 5;
                let changed = mask & (1 << (5 + w)) != 0;
                if let Some(Writes::Pages(_)) = inflight.done(w, changed) {
                    changed_pages += u64::from(changed);
                }
            }
            let c = inflight.coverage();
            assert_eq!(c.precise + c.fallback, 5, "mask {mask:#x} rot {rot}");
            assert_eq!(c.fallback, reach_now + changed_pages);
            assert!(inflight.is_empty());
        }
    }
}

// ---- The reachable set (issue 15, item 5): the bounded fallback.

use std::collections::BTreeMap;

use hag_gvt::track::{FrameCounts, Marked, Reach, MAX_MAP_PAGES};

/// A map with room for `room` frames.
struct Counts {
    map: BTreeMap<u64, u32>,
    room: usize,
}

impl Counts {
    fn with_room(room: usize) -> Self {
        Counts {
            map: BTreeMap::new(),
            room,
        }
    }
}

impl FrameCounts for Counts {
    fn count_mut(&mut self, gfn: u64) -> Option<&mut u32> {
        self.map.get_mut(&gfn)
    }
    fn insert(&mut self, gfn: u64) -> bool {
        if self.map.len() >= self.room {
            return false;
        }
        self.map.insert(gfn, 1);
        true
    }
    fn remove(&mut self, gfn: u64) {
        self.map.remove(&gfn);
    }
    fn for_each(&self, f: &mut dyn FnMut(u64)) {
        self.map.keys().for_each(|&g| f(g));
    }
    fn len(&self) -> usize {
        self.map.len()
    }
}

fn marked(reach: &Reach<Counts>) -> (Marked, BTreeSet<u64>) {
    let mut out = BTreeSet::new();
    let m = reach.mark(|g| {
        out.insert(g);
    });
    (m, out)
}

/// The fallback marks exactly the pages GVT has mapped, each held while
/// any mapping holds it; an unmapped page is marked as it goes.
#[test]
fn reachable_set_is_what_gvt_mapped() {
    let mut reach = Reach::new(Counts::with_room(1 << 20));
    reach.map(0x100, 1, |_, _| {});
    reach.map(0x200, 16, |_, _| {}); // a 64K page
    reach.map(0x100, 1, |_, _| {}); // a second mapping of the same page
    let (m, pages) = marked(&reach);
    assert_eq!(m, Marked::Frames(17));
    assert!(pages.contains(&0x100) && pages.contains(&0x20f) && !pages.contains(&0x210));

    let mut unmapped = Vec::new();
    reach.unmap(0x100, 1, |g| unmapped.push(g));
    assert_eq!(unmapped, [0x100], "marked as it is unmapped");
    assert!(
        marked(&reach).1.contains(&0x100),
        "still held by the other mapping"
    );
    reach.unmap(0x100, 1, |_| {});
    assert!(!marked(&reach).1.contains(&0x100));
    reach.unmap(0x200, 16, |_| {});
    assert!(reach.is_empty());
    // An unmap of a page never mapped (before hag registered) only marks.
    let mut m = 0;
    reach.unmap(0x900, 1, |_| m += 1);
    assert_eq!((m, reach.len()), (1, 0));
}

/// Without memory for a frame, or with a report larger than any GPU page,
/// the set is not known: the caller marks everything, as before.
#[test]
fn lost_reach_marks_everything() {
    let mut reach = Reach::new(Counts::with_room(2));
    reach.map(1, 3, |_, _| {});
    assert!(reach.lost());
    assert_eq!(marked(&reach).0, Marked::Everything);

    let mut reach = Reach::new(Counts::with_room(1 << 20));
    reach.map(0, MAX_MAP_PAGES, |_, _| {}); // a 2 MiB page
    assert_eq!(marked(&reach).0, Marked::Frames(MAX_MAP_PAGES));
    reach.map(0, MAX_MAP_PAGES + 1, |_, _| {});
    assert_eq!(marked(&reach).0, Marked::Everything);
}

/// A fallback walks the set once per log per read cycle: a log that holds
/// it (covered, its bits not taken since) is not walked again, and a page
/// mapped meanwhile is marked in it as it is mapped.
#[test]
fn the_set_is_walked_once_per_log_until_its_bits_are_taken() {
    const DEV: u8 = 1;
    const VFIO: u8 = 2;
    let mut reach = Reach::new(Counts::with_room(1 << 20));
    reach.map(0x10, 4, |_, _| panic!("no log holds the set yet"));
    let mut walked = Vec::new();
    let cover = reach.cover(DEV | VFIO, |g, which| walked.push((g, which)));
    assert_eq!(cover, Some((DEV | VFIO, Marked::Frames(4))));
    assert_eq!(
        walked,
        [(0x10, 3), (0x11, 3), (0x12, 3), (0x13, 3)],
        "one walk, both logs"
    );
    // Held: no second walk, for either log.
    assert_eq!(reach.cover(DEV | VFIO, |_, _| panic!("walked again")), None);
    // A page mapped now goes to both logs at once.
    let mut mapped = Vec::new();
    reach.map(0x20, 1, |g, which| mapped.push((g, which)));
    assert_eq!(mapped, [(0x20, DEV | VFIO)]);
    // /dev/hag's log read and cleared: only it is walked again.
    reach.taken(DEV);
    let mut again = Vec::new();
    assert_eq!(
        reach.cover(DEV | VFIO, |g, which| again.push((g, which))),
        Some((DEV, Marked::Frames(5)))
    );
    assert!(again.iter().all(|&(_, which)| which == DEV) && again.len() == 5);
    // A lost set: no log holds "everything" until it is covered again.
    reach.map(0, MAX_MAP_PAGES + 1, |_, _| {
        panic!("a lost set marks nothing page by page")
    });
    assert_eq!(
        reach.cover(VFIO, |_, _| panic!("a lost set is not walked")),
        Some((VFIO, Marked::Everything))
    );
}

/// What happens at a time (a GTT entry remapped) concerns the workloads
/// scanned before it, and stops mattering once they are all done, however
/// many were scanned since: under constant load the table is never empty.
#[test]
fn a_remap_is_outlived_once_every_earlier_workload_is_done() {
    let mut inflight: InFlight<Vec<u64>, 2> = InFlight::new();
    inflight.scanned(1, Writes::Pages(vec![1]));
    let t1 = inflight.now();
    inflight.scanned(2, Writes::Pages(vec![2]));
    let t2 = inflight.now();
    assert!(!inflight.outlived(t1), "workload 1 is in flight");
    inflight.done(1, false);
    assert!(inflight.outlived(t1), "all before t1 are done");
    assert!(!inflight.outlived(t2), "workload 2 is in flight");
    // Constant load: 3 comes before 2 ends; t2 is outlived all the same.
    inflight.scanned(3, Writes::Reachable);
    inflight.done(2, false);
    assert!(inflight.outlived(t2) && !inflight.is_empty());
    assert!(!inflight.outlived(inflight.now()), "3 is in flight");
    // Spilled workloads count by their own time.
    inflight.scanned(4, Writes::Pages(vec![4]));
    assert!(
        inflight.scanned(5, Writes::Reachable).is_some(),
        "the table is full: 5 spills"
    );
    let t5 = inflight.now();
    inflight.done(3, false);
    inflight.done(4, false);
    assert!(
        !inflight.outlived(t5),
        "spilled 5, scanned before t5, is in flight"
    );
    inflight.done(5, false);
    assert!(inflight.outlived(t5) && inflight.is_empty());
    // One that found the spill full too: its time is not known.
    let mut tiny: InFlight<Vec<u64>, 1> = InFlight::new();
    tiny.scanned(1, Writes::Reachable);
    tiny.scanned(2, Writes::Reachable);
    tiny.scanned(3, Writes::Reachable);
    tiny.done(1, false);
    tiny.done(2, false);
    assert!(!tiny.outlived(0), "a lost workload may be from any time");
}
