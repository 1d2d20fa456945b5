//! The one grammar of hagctl's durations, sizes and rates, so that every
//! flag reads them alike.
//!
//! - A duration is what `humantime` reads (`2s`, `300ms`, `1m 30s`,
//!   `1h`), or a bare number in the flag's documented unit (seconds for
//!   timeouts and intervals, milliseconds for `--max-downtime`, as QEMU's
//!   downtime-limit and virsh's migrate-setmaxdowntime), fractions allowed.
//! - A size is a number with qemu-img's suffixes (`k`/`K`, `M`, `G`, `T`,
//!   `P`, `E`: powers of 1024; a bare number is bytes), the same with `iB`
//!   (`GiB`), `B` for bytes, or libvirt's decimal units (`KB`, `MB`, `GB`,
//!   `TB`: powers of 1000, as in a domain's `<memory unit='GB'>`).
//! - A rate is a size per second, `/s` optional; a bare number is MiB/s,
//!   as virsh migrate's `--bandwidth`.

use std::time::Duration;

/// A duration whose bare number is seconds.
pub fn seconds(text: &str) -> Result<Duration, String> {
    duration(text, 1.0, "s")
}

/// A duration whose bare number is milliseconds.
pub fn millis(text: &str) -> Result<Duration, String> {
    duration(text, 1e-3, "ms")
}

fn duration(text: &str, bare_unit_secs: f64, bare_unit: &str) -> Result<Duration, String> {
    let t = text.trim();
    let d = match t.parse::<f64>() {
        Ok(n) => Duration::try_from_secs_f64(n * bare_unit_secs).map_err(|_| {
            format!("'{text}' is not a duration (a number of {bare_unit}, or e.g. 2s, 300ms, 1m 30s)")
        })?,
        Err(_) => humantime::parse_duration(t).map_err(|e| {
            format!("'{text}' is not a duration ({e}; e.g. 2s, 300ms, 1m 30s, or a bare number of {bare_unit})")
        })?,
    };
    if d.is_zero() {
        return Err(format!("'{text}': the duration must be more than 0"));
    }
    Ok(d)
}

/// A size in bytes (at least 1).
pub fn size(text: &str) -> Result<u64, String> {
    scaled(text, 1.0, "a size (e.g. 16G, 512M, 16GiB, 4096)", 1.0)
}

/// A size in bytes where 0 means none (e.g. a cache turned off).
pub fn size_or_zero(text: &str) -> Result<u64, String> {
    scaled(text, 1.0, "a size (e.g. 64M, 64MiB, 0)", 0.0)
}

/// A rate in bytes per second (at least 1).
pub fn rate(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let t = t.strip_suffix("/s").unwrap_or(t).trim_end();
    scaled(
        t,
        MIB,
        "a rate (e.g. 100, 512K, 1.5G/s; a bare number is MiB/s)",
        1.0,
    )
    .map_err(|e| e.replacen(&format!("'{t}'"), &format!("'{text}'"), 1))
}

const MIB: f64 = 1024.0 * 1024.0;

/// `text` in bytes, at least `least`: a number, then a unit (none:
/// `bare` bytes each).
fn scaled(text: &str, bare: f64, what: &str, least: f64) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let unit = unit.trim();
    let scale = if unit.is_empty() {
        bare
    } else {
        unit_scale(unit).ok_or_else(|| {
            format!(
                "'{text}': unknown unit '{unit}' (qemu-img's k, M, G, T, P, E or KiB, MiB, GiB, \
                 TiB: powers of 1024; KB, MB, GB, TB: powers of 1000; B)"
            )
        })?
    };
    let n: f64 = number
        .parse()
        .map_err(|_| format!("'{text}' is not {what}"))?;
    let bytes = n * scale;
    if !(least..1.8e19).contains(&bytes) {
        return Err(format!("'{text}' is not {what}: out of range"));
    }
    Ok(bytes as u64)
}

fn unit_scale(unit: &str) -> Option<f64> {
    const POWERS: &str = "KMGTPE";
    if unit == "B" || unit == "b" {
        return Some(1.0);
    }
    let (letter, rest) = unit.split_at(1);
    let power = POWERS.find(&letter.to_ascii_uppercase())? as i32 + 1;
    match rest {
        // qemu-img's single letters, and the IEC names.
        "" | "iB" | "ib" => Some(1024f64.powi(power)),
        // libvirt's decimal units.
        "B" => Some(1000f64.powi(power)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_alike_whatever_the_flag() {
        for (text, secs) in [
            ("2s", 2.0),
            ("300ms", 0.3),
            ("1m 30s", 90.0),
            ("1h", 3600.0),
            ("30", 30.0),
            ("0.5", 0.5),
        ] {
            assert_eq!(seconds(text), Ok(Duration::from_secs_f64(secs)), "{text}");
        }
        assert_eq!(millis("300"), Ok(Duration::from_millis(300)));
        assert_eq!(millis("300ms"), Ok(Duration::from_millis(300)));
        assert_eq!(millis("1s"), Ok(Duration::from_secs(1)));
        for bad in ["0", "0s", "-1", "soon", "2 parsecs", ""] {
            let e = seconds(bad).unwrap_err();
            assert!(e.contains(&format!("'{bad}'")), "{bad}: {e}");
        }
    }

    #[test]
    fn sizes_take_qemu_img_and_libvirt_units() {
        const G: u64 = 1 << 30;
        for (text, bytes) in [
            ("16G", 16 * G),
            ("16g", 16 * G),
            ("16GiB", 16 * G),
            ("16GB", 16_000_000_000),
            ("512M", 512 << 20),
            ("1.5G", 3 * G / 2),
            ("4096", 4096),
            ("4096B", 4096),
            ("1T", 1 << 40),
        ] {
            assert_eq!(size(text), Ok(bytes), "{text}");
        }
        for bad in ["16Q", "G", "0", "16 parsecs", "1e3G", "99999999E"] {
            let e = size(bad).unwrap_err();
            assert!(e.contains(&format!("'{bad}'")), "{bad}: {e}");
        }
    }

    #[test]
    fn a_size_that_may_be_zero_takes_the_same_units() {
        for (text, bytes) in [("0", 0), ("0MiB", 0), ("0.0 G", 0), ("64MiB", 64 << 20)] {
            assert_eq!(size_or_zero(text), Ok(bytes), "{text}");
        }
        for bad in ["0Q", "-1", "none"] {
            let e = size_or_zero(bad).unwrap_err();
            assert!(e.contains(&format!("'{bad}'")), "{bad}: {e}");
        }
    }

    #[test]
    fn rates_are_sizes_per_second_and_bare_mib() {
        assert_eq!(rate("100"), Ok(100 << 20));
        assert_eq!(rate("512K"), Ok(512 << 10));
        assert_eq!(rate("512KiB/s"), Ok(512 << 10));
        assert_eq!(rate("1.5G/s"), Ok(3 << 29));
        assert_eq!(rate("10MB/s"), Ok(10_000_000));
        let e = rate("fast/s").unwrap_err();
        assert!(e.contains("'fast/s'"), "{e}");
    }
}
