use crate::error::{ChunkerError, Result};
use std::{fmt, str::FromStr};

/// The fixed chunk size of a block volume: a power of two from 64 KiB to 8 MiB.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChunkSize(u32);

impl ChunkSize {
    /// The smallest chunk size, 64 KiB.
    pub const MIN: u32 = 64 << 10;
    /// The largest chunk size, 8 MiB.
    pub const MAX: u32 = 8 << 20;
    /// The default, 1 MiB: large enough for fast sequential I/O and cheap indexes,
    /// small enough that a changed chunk is compared page by page quickly.
    pub const DEFAULT: ChunkSize = ChunkSize(1 << 20);

    /// A chunk size of `bytes`, refused unless it is a power of two in range.
    pub fn new(bytes: u64) -> Result<Self> {
        if !(Self::MIN as u64..=Self::MAX as u64).contains(&bytes) || !bytes.is_power_of_two() {
            return Err(ChunkerError::InvalidSize {
                given: bytes.to_string(),
                why: "a chunk size must be a power of two from 64K to 8M (e.g. 256K, 1M, 4M)"
                    .into(),
            });
        }
        Ok(ChunkSize(bytes as u32))
    }

    /// The size in bytes.
    pub fn bytes(self) -> usize {
        self.0 as usize
    }

    /// The size in bytes, as u64 for offset arithmetic.
    pub fn get(self) -> u64 {
        self.0 as u64
    }
}

impl Default for ChunkSize {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl fmt::Display for ChunkSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 >= 1 << 20 {
            write!(f, "{}M", self.0 >> 20)
        } else {
            write!(f, "{}K", self.0 >> 10)
        }
    }
}

impl FromStr for ChunkSize {
    type Err = ChunkerError;
    fn from_str(s: &str) -> Result<Self> {
        ChunkSize::new(parse_size(s)?)
    }
}

/// Parses a byte size such as `4096`, `64K`, `1M`, `1MiB`, `4G` (binary units).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => u32::MAX,
    };
    let n: Option<u64> = num.parse().ok();
    match (n, shift) {
        (Some(n), s) if s != u32::MAX => n.checked_shl(s).filter(|v| v >> s == n).ok_or(()),
        _ => Err(()),
    }
    .map_err(|()| ChunkerError::InvalidSize {
        given: s.to_string(),
        why: "expected a number with an optional unit K, M, G or T (powers of 1024)".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("4g").unwrap(), 4 << 30);
        assert!(parse_size("1.5M").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn chunk_sizes_must_be_powers_of_two_in_range() {
        assert_eq!("1M".parse::<ChunkSize>().unwrap(), ChunkSize::DEFAULT);
        assert_eq!("64K".parse::<ChunkSize>().unwrap().bytes(), 65536);
        assert_eq!("8M".parse::<ChunkSize>().unwrap().to_string(), "8M");
        for bad in ["32K", "16M", "1000K", "3M"] {
            let err = bad.parse::<ChunkSize>().unwrap_err().to_string();
            assert!(err.contains("power of two"), "{bad}: {err}");
        }
    }
}
