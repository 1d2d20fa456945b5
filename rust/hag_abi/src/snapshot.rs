//! The vGPU context snapshot format: what `IOC_SAVE_CONTEXT` writes and
//! `IOC_RESTORE_CONTEXT` accepts, and what travels between hosts.
//!
//! ```text
//! header (32 bytes, little-endian)
//!   magic "HAGC" | version u16 | source u16 | total_len u32 | crc32 u32
//!   gfx_mem_size u64 | section_count u32 | reserved u32 (0)
//! sections, each: tag u32 | len u32 | len bytes, padded to 8
//! ```
//!
//! `crc32` (IEEE) covers every byte of the snapshot, with the `crc32` field
//! itself counted as zero. A reader accepts only
//! [`VERSION`], checks magic, lengths (each section inside `total_len`,
//! `total_len` inside the buffer) and checksum before it looks at a section,
//! and rejects unknown tags. Plain `core`: the kernel module compiles it in.

/// `"HAGC"` little-endian.
pub const MAGIC: u32 = 0x4347_4148;
/// The only version this build writes and reads.
pub const VERSION: u16 = 1;
/// Bytes of the header.
pub const HEADER_BYTES: usize = 32;

/// PCI config space (256 bytes).
pub const TAG_CONFIG: u32 = 1;
/// The register file: [`REGS_WORDS`] little-endian u32 (see the module
/// that writes it for their order).
pub const TAG_REGS: u32 = 2;
/// GTT entries, little-endian u64 each.
pub const TAG_GTT: u32 = 3;
/// Engine state: little-endian u32 halt, queued tail (or `u32::MAX`),
/// watchdog ms, reserved.
pub const TAG_ENGINE: u32 = 4;

/// GVT-g vGPU (source `VGPU_SOURCE_GVT`): its virtual registers, as i915's
/// GVT saves them (`intel_gvt_audit_save_part`); the body is GVT's and
/// only GVT checks it. The four GVT sections are restored in tag order.
pub const TAG_GVT_VREGS: u32 = 5;
/// GVT-g vGPU: its virtual PCI config space, as GVT saves it.
pub const TAG_GVT_CFG_SPACE: u32 = 6;
/// GVT-g vGPU: its guest GGTT entries, as GVT saves them (restored through
/// GVT's own GGTT write emulation, which checks them).
pub const TAG_GVT_GGTT: u32 = 7;
/// GVT-g vGPU: execlist and ring state, as GVT saves them.
pub const TAG_GVT_EXECLIST: u32 = 8;

/// Number of u32 in a [`TAG_REGS`] section.
pub const REGS_WORDS: usize = 16 + 32;

/// Why a snapshot was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotError {
    /// Shorter than its header, or than the length it claims.
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// Not a hag context snapshot.
    BadMagic(u32),
    /// A version this build does not read.
    UnknownVersion(u16),
    /// The checksum does not match: the snapshot was damaged.
    BadChecksum {
        /// Checksum in the header.
        stored: u32,
        /// Checksum of the bytes.
        computed: u32,
    },
    /// A section runs past the end, or a field is malformed.
    Malformed(&'static str),
    /// A section tag this version does not have.
    UnknownSection(u32),
    /// The output buffer is too small.
    NoSpace {
        /// Bytes needed.
        need: usize,
    },
}

impl core::fmt::Display for SnapshotError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Truncated { need, have } => {
                write!(f, "snapshot truncated: {have} bytes of {need}")
            }
            Self::BadMagic(m) => write!(f, "not a hag context snapshot (magic {m:#010x})"),
            Self::UnknownVersion(v) => {
                write!(f, "snapshot version {v}, this build reads {VERSION}")
            }
            Self::BadChecksum { stored, computed } => {
                write!(
                    f,
                    "snapshot damaged: checksum {computed:#010x}, header says {stored:#010x}"
                )
            }
            Self::Malformed(what) => write!(f, "snapshot malformed: {what}"),
            Self::UnknownSection(tag) => write!(f, "snapshot has unknown section {tag}"),
            Self::NoSpace { need } => write!(f, "snapshot needs {need} bytes"),
        }
    }
}

/// CRC-32 (IEEE 802.3, reflected).
pub fn crc32(bytes: &[u8]) -> u32 {
    !crc32_update(!0, bytes)
}

/// Slicing-by-8 tables, built at compile time: `CRC32_TABLES[0][b]` is the
/// CRC of byte `b`, and `CRC32_TABLES[k][b]` that of `b` followed by `k`
/// zero bytes, so eight bytes fold into the CRC with eight lookups. A
/// snapshot is checksummed in every epoch's pause (about 10 MiB for a
/// GVT-g vGPU): 10 MiB took 58 ms bit by bit and 6.4 ms so, natively
/// (`cargo test --release -p hag_abi crc32_speed -- --ignored --nocapture`).
const CRC32_TABLES: [[u32; 256]; 8] = {
    let mut tables = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
            bit += 1;
        }
        tables[0][i] = crc;
        i += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = tables[k - 1][i];
            tables[k][i] = (prev >> 8) ^ tables[0][(prev & 0xff) as usize];
            i += 1;
        }
        k += 1;
    }
    tables
};

fn crc32_update(mut crc: u32, bytes: &[u8]) -> u32 {
    let t = &CRC32_TABLES;
    let byte = |word: u32, n: u32| ((word >> (8 * n)) & 0xff) as usize;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let lo = u32::from_le_bytes([w[0], w[1], w[2], w[3]]) ^ crc;
        let hi = u32::from_le_bytes([w[4], w[5], w[6], w[7]]);
        crc = t[7][byte(lo, 0)]
            ^ t[6][byte(lo, 1)]
            ^ t[5][byte(lo, 2)]
            ^ t[4][byte(lo, 3)]
            ^ t[3][byte(hi, 0)]
            ^ t[2][byte(hi, 1)]
            ^ t[1][byte(hi, 2)]
            ^ t[0][byte(hi, 3)];
    }
    for &b in words.remainder() {
        crc = t[0][((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    crc
}

/// The snapshot's checksum: everything, with bytes 12..16 (the checksum
/// field) as zero.
fn snapshot_crc(bytes: &[u8]) -> u32 {
    let crc = crc32_update(!0, &bytes[..12]);
    let crc = crc32_update(crc, &[0; 4]);
    !crc32_update(crc, &bytes[16..])
}

fn pad8(len: usize) -> usize {
    (len + 7) & !7
}

/// Writes a snapshot into a caller's buffer, section by section, then
/// [`Writer::finish`] fills in the header.
pub struct Writer<'a> {
    out: &'a mut [u8],
    pos: usize,
    sections: u32,
    source: u16,
    gfx_mem_size: u64,
}

impl<'a> Writer<'a> {
    /// Starts a snapshot of a vGPU of `source` (`VGPU_SOURCE_*`) with
    /// `gfx_mem_size` bytes of graphics memory.
    pub fn new(out: &'a mut [u8], source: u16, gfx_mem_size: u64) -> Result<Self, SnapshotError> {
        if out.len() < HEADER_BYTES {
            return Err(SnapshotError::NoSpace { need: HEADER_BYTES });
        }
        Ok(Self {
            out,
            pos: HEADER_BYTES,
            sections: 0,
            source,
            gfx_mem_size,
        })
    }

    /// Appends a section whose body `fill` writes into the `len` bytes given.
    pub fn section(
        &mut self,
        tag: u32,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), SnapshotError> {
        let need = self
            .pos
            .checked_add(8)
            .and_then(|p| p.checked_add(pad8(len)))
            .ok_or(SnapshotError::Malformed("section too large"))?;
        if need > self.out.len() {
            return Err(SnapshotError::NoSpace { need });
        }
        let len32 =
            u32::try_from(len).map_err(|_| SnapshotError::Malformed("section too large"))?;
        self.out[self.pos..self.pos + 4].copy_from_slice(&tag.to_le_bytes());
        self.out[self.pos + 4..self.pos + 8].copy_from_slice(&len32.to_le_bytes());
        let body = &mut self.out[self.pos + 8..need];
        body.fill(0);
        fill(&mut body[..len]);
        self.pos = need;
        self.sections += 1;
        Ok(())
    }

    /// Writes the header; returns the snapshot's length.
    pub fn finish(self) -> usize {
        let total = self.pos;
        let h = &mut self.out[..HEADER_BYTES];
        h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4..6].copy_from_slice(&VERSION.to_le_bytes());
        h[6..8].copy_from_slice(&self.source.to_le_bytes());
        h[8..12].copy_from_slice(&(total as u32).to_le_bytes());
        h[16..24].copy_from_slice(&self.gfx_mem_size.to_le_bytes());
        h[24..28].copy_from_slice(&self.sections.to_le_bytes());
        h[28..32].fill(0);
        let crc = snapshot_crc(&self.out[..total]);
        self.out[12..16].copy_from_slice(&crc.to_le_bytes());
        total
    }
}

/// A snapshot whose header, lengths and checksum were checked.
pub struct Snapshot<'a> {
    /// `VGPU_SOURCE_*` of the vGPU it was taken from.
    pub source: u16,
    /// Graphics memory size of that vGPU.
    pub gfx_mem_size: u64,
    body: &'a [u8],
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

/// The total length a snapshot's header declares, once `bytes` holds the
/// header and it starts with the magic: how much a stream of it must carry.
pub fn declared_len(bytes: &[u8]) -> Option<usize> {
    if bytes.len() < HEADER_BYTES || le_u32(bytes, 0) != Some(MAGIC) {
        return None;
    }
    le_u32(bytes, 8).map(|total| total as usize)
}

impl<'a> Snapshot<'a> {
    /// Checks `bytes` in a fixed order: size, magic, version, length,
    /// checksum, then that the sections tile the body exactly.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, SnapshotError> {
        let have = bytes.len();
        if have < HEADER_BYTES {
            return Err(SnapshotError::Truncated {
                need: HEADER_BYTES,
                have,
            });
        }
        let magic = le_u32(bytes, 0).unwrap_or(0);
        if magic != MAGIC {
            return Err(SnapshotError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != VERSION {
            return Err(SnapshotError::UnknownVersion(version));
        }
        let source = u16::from_le_bytes([bytes[6], bytes[7]]);
        let total = le_u32(bytes, 8).unwrap_or(0) as usize;
        if total < HEADER_BYTES {
            return Err(SnapshotError::Malformed(
                "total length shorter than the header",
            ));
        }
        if total > have {
            return Err(SnapshotError::Truncated { need: total, have });
        }
        let stored = le_u32(bytes, 12).unwrap_or(0);
        let body = &bytes[HEADER_BYTES..total];
        let computed = snapshot_crc(&bytes[..total]);
        if stored != computed {
            return Err(SnapshotError::BadChecksum { stored, computed });
        }
        let gfx_mem_size = u64::from_le_bytes(bytes[16..24].try_into().unwrap_or([0; 8]));
        let snapshot = Self {
            source,
            gfx_mem_size,
            body,
        };
        let mut count = 0u32;
        for section in snapshot.sections() {
            section?;
            count += 1;
        }
        if le_u32(bytes, 24) != Some(count) {
            return Err(SnapshotError::Malformed("section count does not match"));
        }
        if le_u32(bytes, 28) != Some(0) {
            return Err(SnapshotError::Malformed(
                "reserved header field is not zero",
            ));
        }
        Ok(snapshot)
    }

    /// The sections, in order, as `(tag, bytes)`.
    pub fn sections(&self) -> Sections<'a> {
        Sections {
            body: self.body,
            pos: 0,
        }
    }

    /// The body of the section `tag`, which must be `len` bytes.
    pub fn section(&self, tag: u32, len: usize) -> Result<&'a [u8], SnapshotError> {
        let bytes = self.section_as_saved(tag)?;
        if bytes.len() == len {
            Ok(bytes)
        } else {
            Err(SnapshotError::Malformed("section of the wrong length"))
        }
    }

    /// The body of the section `tag`, of the length it was saved with:
    /// for a part whose size the saved state decides, checked by its
    /// reader.
    pub fn section_as_saved(&self, tag: u32) -> Result<&'a [u8], SnapshotError> {
        for section in self.sections() {
            let (t, bytes) = section?;
            if t == tag {
                return Ok(bytes);
            }
        }
        Err(SnapshotError::Malformed("section missing"))
    }
}

/// Iterator over a snapshot's sections.
pub struct Sections<'a> {
    body: &'a [u8],
    pos: usize,
}

impl<'a> Iterator for Sections<'a> {
    type Item = Result<(u32, &'a [u8]), SnapshotError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.pos >= self.body.len() {
            return None;
        }
        let parsed = (|| {
            let tag = le_u32(self.body, self.pos)
                .ok_or(SnapshotError::Malformed("section header truncated"))?;
            let len = le_u32(self.body, self.pos + 4)
                .ok_or(SnapshotError::Malformed("section header truncated"))?
                as usize;
            let start = self.pos + 8;
            let end = start.checked_add(len).filter(|&e| e <= self.body.len());
            let end = end.ok_or(SnapshotError::Malformed("section runs past the end"))?;
            if !matches!(
                tag,
                TAG_CONFIG
                    | TAG_REGS
                    | TAG_GTT
                    | TAG_ENGINE
                    | TAG_GVT_VREGS
                    | TAG_GVT_CFG_SPACE
                    | TAG_GVT_GGTT
                    | TAG_GVT_EXECLIST
            ) {
                return Err(SnapshotError::UnknownSection(tag));
            }
            Ok((tag, start, end))
        })();
        match parsed {
            Ok((tag, start, end)) => {
                self.pos = start + pad8(end - start);
                Some(Ok((tag, &self.body[start..end])))
            }
            Err(e) => {
                self.pos = self.body.len();
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(buf: &mut [u8]) -> usize {
        let mut w = Writer::new(buf, 1, 64 << 20).unwrap();
        w.section(TAG_CONFIG, 256, |b| b[0] = 0x34).unwrap();
        w.section(TAG_ENGINE, 16, |b| b[0] = 1).unwrap();
        w.section(TAG_GTT, 24, |b| b[23] = 9).unwrap();
        w.finish()
    }

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    /// Not a check: prints what slicing-by-8 costs against bit by bit.
    #[test]
    #[ignore]
    fn crc32_speed() {
        extern crate std;
        let mut data = std::vec![0u8; 10 << 20];
        for (i, b) in data.iter_mut().enumerate() {
            *b = ((i as u32).wrapping_mul(2_654_435_761) >> 13) as u8;
        }
        let t0 = std::time::Instant::now();
        let fast = core::hint::black_box(crc32(core::hint::black_box(&data)));
        let d_fast = t0.elapsed();
        let t1 = std::time::Instant::now();
        let slow = core::hint::black_box(crc32_by_bits(core::hint::black_box(&data)));
        let d_slow = t1.elapsed();
        assert_eq!(fast, slow);
        std::println!(
            "10 MiB: slicing-by-8 {:.1} ms, bit by bit {:.1} ms ({:.1}x)",
            d_fast.as_secs_f64() * 1e3,
            d_slow.as_secs_f64() * 1e3,
            d_slow.as_secs_f64() / d_fast.as_secs_f64()
        );
    }

    fn crc32_by_bits(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
            }
        }
        !crc
    }

    /// The table gives what the polynomial gives bit by bit, for every
    /// byte value in every position of the running CRC.
    #[test]
    fn crc32_by_table_is_crc32_by_bits() {
        let mut bytes = [0u8; 4096];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = ((i as u32).wrapping_mul(2_654_435_761) >> 13) as u8;
        }
        for len in [0, 1, 7, 255, 256, 1000, 4096] {
            assert_eq!(
                crc32(&bytes[..len]),
                crc32_by_bits(&bytes[..len]),
                "{len} bytes"
            );
        }
    }

    #[test]
    fn the_declared_length_is_known_once_the_header_is() {
        let mut buf = [0u8; 1024];
        let len = sample(&mut buf);
        assert_eq!(declared_len(&buf[..HEADER_BYTES - 1]), None);
        assert_eq!(declared_len(&buf[..HEADER_BYTES]), Some(len));
        assert_eq!(declared_len(&buf[..len]), Some(len));
        buf[0] ^= 1;
        assert_eq!(declared_len(&buf[..len]), None, "no magic, no length");
    }

    #[test]
    fn round_trip() {
        let mut buf = [0u8; 1024];
        let len = sample(&mut buf);
        let s = Snapshot::parse(&buf[..len]).unwrap();
        assert_eq!((s.source, s.gfx_mem_size), (1, 64 << 20));
        assert_eq!(s.section(TAG_CONFIG, 256).unwrap()[0], 0x34);
        assert_eq!(s.section(TAG_GTT, 24).unwrap()[23], 9);
        assert!(s.section(TAG_GTT, 16).is_err());
        assert!(s.section(TAG_REGS, 4).is_err());
        // A part whose saved state decides its size: as saved, unpadded.
        assert_eq!(s.section_as_saved(TAG_ENGINE).unwrap().len(), 16);
        assert_eq!(s.section_as_saved(TAG_GTT).unwrap().len(), 24);
        assert!(s.section_as_saved(TAG_REGS).is_err());
    }

    #[test]
    fn gvt_sections_round_trip_and_unknown_tags_are_refused() {
        let mut buf = [0u8; 256];
        let mut w = Writer::new(&mut buf, 2, 4 << 30).unwrap();
        for (i, tag) in [
            TAG_GVT_VREGS,
            TAG_GVT_CFG_SPACE,
            TAG_GVT_GGTT,
            TAG_GVT_EXECLIST,
        ]
        .into_iter()
        .enumerate()
        {
            w.section(tag, 3 + i, |b| b.fill(tag as u8)).unwrap();
        }
        let len = w.finish();
        let s = Snapshot::parse(&buf[..len]).unwrap();
        assert_eq!((s.source, s.gfx_mem_size), (2, 4 << 30));
        assert_eq!(s.section(TAG_GVT_GGTT, 5).unwrap(), [7; 5]);
        assert_eq!(s.section(TAG_GVT_EXECLIST, 6).unwrap(), [8; 6]);

        let mut w = Writer::new(&mut buf, 2, 0).unwrap();
        w.section(TAG_GVT_EXECLIST + 1, 4, |_| {}).unwrap();
        let len = w.finish();
        assert_eq!(
            Snapshot::parse(&buf[..len]).err(),
            Some(SnapshotError::UnknownSection(TAG_GVT_EXECLIST + 1))
        );
    }

    #[test]
    fn every_flipped_bit_is_refused() {
        let mut buf = [0u8; 1024];
        let len = sample(&mut buf);
        for bit in 0..len * 8 {
            let mut damaged = buf;
            damaged[bit / 8] ^= 1 << (bit % 8);
            assert!(
                Snapshot::parse(&damaged[..len]).is_err(),
                "bit {bit} flip accepted"
            );
        }
    }

    #[test]
    fn every_truncation_is_refused() {
        let mut buf = [0u8; 1024];
        let len = sample(&mut buf);
        for cut in 0..len {
            assert!(
                Snapshot::parse(&buf[..cut]).is_err(),
                "cut at {cut} accepted"
            );
        }
    }

    #[test]
    fn version_and_magic_are_named() {
        let mut buf = [0u8; 1024];
        let len = sample(&mut buf);
        let mut v2 = buf;
        v2[4] = 2;
        assert_eq!(
            Snapshot::parse(&v2[..len]).err(),
            Some(SnapshotError::UnknownVersion(2))
        );
        let mut junk = buf;
        junk[0] = 0;
        assert!(matches!(
            Snapshot::parse(&junk[..len]),
            Err(SnapshotError::BadMagic(_))
        ));
    }

    #[test]
    fn small_buffers_say_how_much_is_needed() {
        let mut buf = [0u8; 100];
        let mut w = Writer::new(&mut buf, 1, 0).unwrap();
        assert_eq!(
            w.section(TAG_CONFIG, 256, |_| {}),
            Err(SnapshotError::NoSpace { need: 32 + 8 + 256 })
        );
    }

    #[test]
    fn garbage_never_panics() {
        let mut x = 0x1234_5678u32;
        for _ in 0..2000 {
            let mut buf = [0u8; 96];
            for b in buf.iter_mut() {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                *b = x as u8;
            }
            buf[0..4].copy_from_slice(&MAGIC.to_le_bytes());
            buf[4] = 1;
            buf[5] = 0;
            let _ = Snapshot::parse(&buf);
        }
    }
}
