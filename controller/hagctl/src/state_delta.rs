//! An epoch's device state as a patch against the one the backup last
//! committed (`VM_STATE_DELTA`). QEMU's `x-ignore-shared` stream is the
//! same length from one epoch to the next and differs in a few dozen
//! bytes when the guest is idle (its ROMs and firmware, most of its 700
//! KB, never change), so a patch of the changed runs replaces resending it
//! whole. A stream whose length changed, or a patch not much smaller than
//! the state, is sent whole.
//!
//! Patch: `length u32 | run*`, a run being `offset u32 | n u32 | n bytes`,
//! runs in increasing order, not overlapping, inside `length`, which must
//! be the base's length. All little-endian. [`apply`] checks every bound
//! before it copies: a patch is a peer's input.

/// Unchanged bytes shorter than this between two changes are sent with
/// them (a run header is 8 bytes).
const JOIN_GAP: usize = 16;

/// The patch that makes `base` into `next`, if worth sending: same length,
/// and the patch at most half the state.
pub fn encode(base: &[u8], next: &[u8]) -> Option<Vec<u8>> {
    if base.len() != next.len() {
        return None;
    }
    let len = u32::try_from(next.len()).ok()?;
    let mut out = len.to_le_bytes().to_vec();
    let mut i = 0;
    while i < next.len() {
        if base[i] == next[i] {
            i += 1;
            continue;
        }
        // A run: from the first difference until JOIN_GAP equal bytes.
        let start = i;
        let mut end = i + 1;
        let mut j = end;
        while j < next.len() && j - end < JOIN_GAP {
            if base[j] != next[j] {
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

/// `base` patched by `patch`.
pub fn apply(base: &[u8], patch: &[u8]) -> Result<Vec<u8>, String> {
    let word = |at: usize| -> Result<usize, String> {
        patch
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
            .ok_or_else(|| format!("device-state patch cut short at byte {at}"))
    };
    let len = word(0)?;
    if len != base.len() {
        return Err(format!(
            "device-state patch for {len} bytes, but the committed state has {}",
            base.len()
        ));
    }
    let mut out = base.to_vec();
    let mut at = 4;
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
        assert_eq!(apply(&base, &patch).unwrap(), next);
        // Nothing changed: the length alone.
        assert_eq!(apply(&base, &encode(&base, &base).unwrap()).unwrap(), base);
    }

    #[test]
    fn a_state_of_another_length_or_mostly_changed_is_sent_whole() {
        let base = state(1000, 1);
        assert_eq!(encode(&base, &state(1001, 1)), None);
        assert_eq!(encode(&base, &state(1000, 2)), None);
    }

    #[test]
    fn damaged_patches_are_refused_naming_the_fault() {
        let base = state(100, 1);
        let mut next = base.clone();
        next[50] ^= 1;
        let good = encode(&base, &next).unwrap();
        assert!(apply(&state(99, 1), &good)
            .unwrap_err()
            .contains("for 100 bytes, but the committed state has 99"));
        assert!(apply(&base, &good[..good.len() - 1])
            .unwrap_err()
            .contains("cut short"));
        assert!(apply(&base, &good[..2]).unwrap_err().contains("cut short"));
        let run = |offset: u32, n: u32| {
            let mut p = 100u32.to_le_bytes().to_vec();
            p.extend_from_slice(&offset.to_le_bytes());
            p.extend_from_slice(&n.to_le_bytes());
            p.extend(std::iter::repeat_n(0u8, n as usize));
            p
        };
        assert!(apply(&base, &run(99, 2))
            .unwrap_err()
            .contains("a run of 2 bytes at 99"));
        assert!(apply(&base, &run(u32::MAX, 1)).is_err());
        assert!(apply(&base, &run(10, 0)).is_err());
        // Out of order, or overlapping.
        let mut twice = run(10, 5);
        twice.extend_from_slice(&12u32.to_le_bytes());
        twice.extend_from_slice(&1u32.to_le_bytes());
        twice.push(7);
        assert!(apply(&base, &twice).unwrap_err().contains("runs from 15"));
    }

    #[test]
    fn every_patch_of_random_edits_rebuilds_its_state() {
        // A small deterministic generator: no dependency for a test.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        };
        for _ in 0..200 {
            let len = 1 + rnd(5000);
            let base = state(len, rnd(256) as u8);
            let mut next = base.clone();
            for _ in 0..rnd(40) {
                let at = rnd(len);
                next[at] = rnd(256) as u8;
            }
            if let Some(patch) = encode(&base, &next) {
                assert_eq!(apply(&base, &patch).unwrap(), next);
            }
        }
    }
}
