//! An epoch's device state as a patch against the one the backup last
//! committed (`VM_STATE_DELTA`). QEMU's `x-ignore-shared` stream differs
//! from one epoch to the next in a few hundred bytes when the guest is
//! idle (its ROMs and firmware, most of its 700 KB, never change), so a
//! patch of the changed runs replaces resending it whole. A section whose
//! length changed (the vGPU's) shifts everything after it: the patch then
//! aligns the state's head with the base's head and its tail with the
//! base's tail, split where that leaves the fewest differences. A patch
//! not much smaller than the state is not used: the state goes whole.
//!
//! Patch: `length u32 | split u32 | run*`, a run being `offset u32 | n u32
//! | n bytes`. The state is `base[..split]` followed by the last `length -
//! split` bytes of `base`, with each run written over it; runs in
//! increasing order, not overlapping, inside `length`. All little-endian.
//! [`apply`] checks every bound before it allocates or copies: a patch is
//! a peer's input.

/// Unchanged bytes shorter than this between two changes are sent with
/// them (a run header is 8 bytes).
const JOIN_GAP: usize = 16;

/// Whether byte `i` of `next` differs from `base` with the heads aligned
/// (`tail == false`) or the tails; a byte with no counterpart differs.
fn differs(base: &[u8], next: &[u8], i: usize, tail: bool) -> bool {
    let j = if tail {
        (i + base.len()).checked_sub(next.len())
    } else {
        Some(i)
    };
    j.and_then(|j| base.get(j)) != Some(&next[i])
}

/// Where the head-aligned part ends: the split with the fewest differing
/// bytes (the latest of equals), among those the base can fill.
fn best_split(base: &[u8], next: &[u8]) -> usize {
    let lo = next.len().saturating_sub(base.len());
    let hi = next.len().min(base.len());
    // cost(k) = head differences before k + tail differences from k on
    //         = head(k) - tail(k) + tail(len): minimise head(k) - tail(k).
    let (mut head, mut tail) = (0i64, 0i64);
    let (mut best, mut best_k) = (i64::MAX, lo);
    for k in 0..=hi {
        if k >= lo && head - tail <= best {
            (best, best_k) = (head - tail, k);
        }
        if k < next.len() {
            head += i64::from(differs(base, next, k, false));
            tail += i64::from(differs(base, next, k, true));
        }
    }
    best_k
}

/// The patch that makes `base` into `next`, if worth sending: at most
/// half the size of `next`.
pub fn encode(base: &[u8], next: &[u8]) -> Option<Vec<u8>> {
    let len = u32::try_from(next.len()).ok()?;
    u32::try_from(base.len()).ok()?;
    // More than twice the base: its head and tail cannot cover it.
    if next.len() > 2 * base.len() {
        return None;
    }
    let split = best_split(base, next);
    let differs_at = |i: usize| differs(base, next, i, i >= split);
    let mut out = len.to_le_bytes().to_vec();
    out.extend_from_slice(&(split as u32).to_le_bytes());
    let mut i = 0;
    while i < next.len() {
        if !differs_at(i) {
            i += 1;
            continue;
        }
        // A run: from the first difference until JOIN_GAP equal bytes.
        let start = i;
        let mut end = i + 1;
        let mut j = end;
        while j < next.len() && j - end < JOIN_GAP {
            if differs_at(j) {
                end = j + 1;
            }
            j += 1;
        }
        out.extend_from_slice(&(start as u32).to_le_bytes());
        out.extend_from_slice(&((end - start) as u32).to_le_bytes());
        out.extend_from_slice(&next[start..end]);
        if out.len() > next.len() / 2 {
            return None;
        }
        i = end;
    }
    Some(out)
}

/// `base` patched by `patch`: a state of at most `max_len` bytes.
pub fn apply(base: &[u8], patch: &[u8], max_len: usize) -> Result<Vec<u8>, String> {
    let word = |at: usize| -> Result<usize, String> {
        patch
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
            .ok_or_else(|| format!("device-state patch cut short at byte {at}"))
    };
    let (len, split) = (word(0)?, word(4)?);
    if len > max_len || split > len || split > base.len() || len - split > base.len() {
        return Err(format!(
            "device-state patch for {len} bytes split at {split}: not a state of at most {max_len} bytes made from the committed state's {}",
            base.len()
        ));
    }
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&base[..split]);
    out.extend_from_slice(&base[base.len() - (len - split)..]);
    let mut at = 8;
    // Where the next run may start: runs are in order, apart.
    let mut free = 0;
    while at < patch.len() {
        let (offset, n) = (word(at)?, word(at + 4)?);
        at += 8;
        let bytes = patch
            .get(at..)
            .and_then(|rest| rest.get(..n))
            .ok_or_else(|| format!("device-state patch: a run of {n} bytes is cut short"))?;
        if n == 0 || offset < free || offset.checked_add(n).is_none_or(|e| e > len) {
            return Err(format!(
                "device-state patch: a run of {n} bytes at {offset} (state of {len} bytes, runs from {free})"
            ));
        }
        out[offset..offset + n].copy_from_slice(bytes);
        free = offset + n;
        at += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = 8 << 20;

    fn state(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn a_few_changed_bytes_make_a_small_patch_that_rebuilds_the_state() {
        let base = state(700_000, 1);
        let mut next = base.clone();
        for at in [0, 5, 30, 400_000, 699_999] {
            next[at] ^= 0xff;
        }
        let patch = encode(&base, &next).unwrap();
        // 0 and 5 join one run; 30 is 25 bytes on: a run of its own.
        assert!(patch.len() < 100, "{}", patch.len());
        assert_eq!(apply(&base, &patch, MAX).unwrap(), next);
        // Nothing changed: the header alone.
        let same = encode(&base, &base).unwrap();
        assert_eq!(same.len(), 8);
        assert_eq!(apply(&base, &same, MAX).unwrap(), base);
    }

    /// A section that grew or shrank shifts the rest: the head and the
    /// tail still match.
    #[test]
    fn a_section_of_another_length_costs_only_its_own_bytes() {
        let base = state(700_000, 1);
        for grown in [0usize, 156, 3] {
            for shrunk in [0usize, 156, 1] {
                let mut next = base[..400_000].to_vec();
                next.extend(std::iter::repeat_n(0xee, grown));
                next.extend_from_slice(&base[400_000 + shrunk..]);
                // And a change on either side.
                next[10] ^= 1;
                let last = next.len() - 7;
                next[last] ^= 1;
                let patch = encode(&base, &next).unwrap();
                assert!(
                    patch.len() < 64 + grown,
                    "{grown}/{shrunk}: {}",
                    patch.len()
                );
                assert_eq!(apply(&base, &patch, MAX).unwrap(), next, "{grown}/{shrunk}");
            }
        }
    }

    #[test]
    fn a_state_mostly_changed_is_sent_whole() {
        let base = state(1000, 1);
        assert_eq!(encode(&base, &state(1000, 2)), None);
        assert_eq!(encode(&base, &state(3000, 1)), None);
        // Over twice the base, even if mostly the base twice over.
        let mut twice = state(100, 1);
        twice.extend(std::iter::repeat_n(9, 50));
        twice.extend(state(100, 1));
        assert_eq!(encode(&state(100, 1), &twice), None);
        assert_eq!(encode(&base, &[]), Some([0; 8].to_vec()));
    }

    #[test]
    fn damaged_patches_are_refused_naming_the_fault() {
        let base = state(100, 1);
        let mut next = base.clone();
        next[50] ^= 1;
        let good = encode(&base, &next).unwrap();
        assert_eq!(apply(&base, &good, MAX).unwrap(), next);
        assert!(apply(&state(49, 1), &good, MAX)
            .unwrap_err()
            .contains("for 100 bytes split at 100"));
        assert!(apply(&base, &good, 99)
            .unwrap_err()
            .contains("at most 99 bytes"));
        assert!(apply(&base, &good[..good.len() - 1], MAX)
            .unwrap_err()
            .contains("cut short"));
        assert!(apply(&base, &good[..6], MAX)
            .unwrap_err()
            .contains("cut short"));
        // A huge length made from a small base is refused before anything
        // is allocated.
        let mut huge = u32::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(&0u32.to_le_bytes());
        assert!(apply(&base, &huge, usize::MAX).is_err());
        let run = |offset: u32, n: u32| {
            let mut p = 100u32.to_le_bytes().to_vec();
            p.extend_from_slice(&100u32.to_le_bytes());
            p.extend_from_slice(&offset.to_le_bytes());
            p.extend_from_slice(&n.to_le_bytes());
            p.extend(std::iter::repeat_n(0u8, n as usize));
            p
        };
        assert!(apply(&base, &run(99, 2), MAX)
            .unwrap_err()
            .contains("a run of 2 bytes at 99"));
        assert!(apply(&base, &run(u32::MAX, 1), MAX).is_err());
        assert!(apply(&base, &run(10, 0), MAX).is_err());
        // Out of order, or overlapping.
        let mut twice = run(10, 5);
        twice.extend_from_slice(&12u32.to_le_bytes());
        twice.extend_from_slice(&1u32.to_le_bytes());
        twice.push(7);
        assert!(apply(&base, &twice, MAX)
            .unwrap_err()
            .contains("runs from 15"));
    }

    #[test]
    fn every_patch_of_random_edits_rebuilds_its_state() {
        // A small deterministic generator: no dependency for a test.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n.max(1) as u64) as usize
        };
        let mut patched = 0;
        for _ in 0..300 {
            let len = 1 + rnd(5000);
            let base = state(len, rnd(256) as u8);
            let mut next = base.clone();
            for _ in 0..rnd(40) {
                let at = rnd(len);
                next[at] = rnd(256) as u8;
            }
            // Sometimes a piece inserted or cut out.
            let at = rnd(len);
            match rnd(3) {
                0 => {
                    let n = rnd(300);
                    next.splice(at..at, std::iter::repeat_n(7u8, n));
                }
                1 => {
                    let end = (at + rnd(300)).min(len);
                    next.drain(at..end);
                }
                _ => {}
            }
            if let Some(patch) = encode(&base, &next) {
                assert_eq!(apply(&base, &patch, MAX).unwrap(), next);
                patched += 1;
            }
        }
        assert!(patched > 150, "only {patched} of 300 patched");
    }
}
