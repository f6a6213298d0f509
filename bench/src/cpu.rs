//! The CPU floor: how fast this machine does the CPU work a job cannot avoid (hashing,
//! compressing, encrypting), on every CPU, measured in the same run by the fastest
//! implementations at hand: b3sum, the zstd CLI and OpenSSL. A job's CPU floor is the sum
//! of its parts at those speeds; its floor is the larger of that and its disk floor
//! ([`crate::floor::DeviceSpeed`]).
//!
//! Each speed is already spread over every CPU (b3sum's threads, zstd's `-T`, OpenSSL's
//! `-multi`), so the parts add up: together they are the CPU seconds the job must spend,
//! divided by the CPUs.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::process::{ThenSync, run_checked, run_timed, warm_cache};
use crate::tools::Tools;

/// zstd level of a volume's compression floor: the one mover stores a volume's chunks at
/// (`VOLUME_ZSTD_LEVEL` in snapshots' pack.rs; level 1 made its repository larger than
/// restic's, so a cheaper level is no floor for the same repository).
pub const VOLUME_LEVEL: u32 = 2;
/// Runs of each measurement; the fastest counts (the machine is shared).
const RUNS: usize = 2;

/// Bytes per second this machine hashes, compresses and seals on every CPU.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CpuSpeed {
    /// CPUs used by each measurement.
    pub threads: usize,
    /// The zstd level of `compress_bps`.
    pub level: u32,
    /// `b3sum --num-threads N` over the page-cached image.
    pub hash_bps: f64,
    /// `zstd -LEVEL -T N` over the same (its logical size over the time: zstd passes zeros
    /// and data that does not compress quickly, as a compressor that judges first may).
    pub compress_bps: f64,
    /// `openssl speed -evp chacha20-poly1305 -multi N` on 1 MiB messages: the AEAD a
    /// repository seals its blobs with (XChaCha20 adds one HChaCha20 block per blob).
    pub seal_bps: f64,
}

/// The CPU work a job cannot avoid, in bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuWork {
    /// Bytes it must hash.
    pub hash: u64,
    /// Bytes it must compress (at the measured level).
    pub compress: u64,
    /// Bytes it must encrypt and authenticate.
    pub seal: u64,
}

impl CpuWork {
    /// Work that only hashes `bytes`.
    pub fn hashing(bytes: u64) -> Self {
        Self {
            hash: bytes,
            ..Self::default()
        }
    }
}

impl CpuSpeed {
    /// Measures the three speeds over `image` (read into the page cache first, so the
    /// disk is not what is timed) with `threads` CPUs, compressing at zstd `level`. Takes
    /// a few seconds per GiB.
    pub fn measure(tools: &Tools, image: &Path, threads: usize, level: u32) -> Result<Self> {
        let (zstd, openssl) = match (&tools.zstd, &tools.openssl) {
            (Some(zstd), Some(openssl)) => (zstd, openssl),
            _ => bail!("the CPU floor needs `zstd` and `openssl` (apt install zstd openssl)"),
        };
        let size = std::fs::metadata(image)
            .with_context(|| format!("cannot stat {}", image.display()))?
            .len();
        let _cached = warm_cache(image)?;
        let mut b3sum = Command::new(&tools.b3sum);
        b3sum
            .arg("--num-threads")
            .arg(threads.to_string())
            .arg(image);
        let mut compress = Command::new(zstd);
        compress
            .arg(format!("-{level}"))
            .arg(format!("-T{threads}"))
            .args(["-q", "-f", "-o", "/dev/null"])
            .arg(image);
        Ok(Self {
            threads,
            level,
            hash_bps: size as f64 / fastest(&mut b3sum)?,
            compress_bps: size as f64 / fastest(&mut compress)?,
            seal_bps: seal_speed(openssl, threads)?,
        })
    }

    /// The least CPU time `work` takes here, in seconds of wall clock on every CPU.
    pub fn floor_seconds(&self, work: CpuWork) -> f64 {
        work.hash as f64 / self.hash_bps
            + work.compress as f64 / self.compress_bps
            + work.seal as f64 / self.seal_bps
    }

    /// One line for the log: `hash 7489 MB/s (b3sum), compress 902 MB/s (zstd -2), ...`.
    pub fn describe(&self) -> String {
        let mb = |bps: f64| bps / 1e6;
        format!(
            "hash {:.0} MB/s (b3sum), compress {:.0} MB/s (zstd -{}), seal {:.0} MB/s \
             (ChaCha20-Poly1305), on {} CPUs",
            mb(self.hash_bps),
            mb(self.compress_bps),
            self.level,
            mb(self.seal_bps),
            self.threads
        )
    }
}

/// The fastest of [`RUNS`] runs of `cmd`, in seconds.
fn fastest(cmd: &mut Command) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..RUNS {
        best = best.min(run_timed(cmd, ThenSync::No)?.elapsed.as_secs_f64());
    }
    Ok(best)
}

/// ChaCha20-Poly1305 on 1 MiB messages with `threads` processes, in bytes per second
/// (the best of [`RUNS`]).
fn seal_speed(openssl: &Path, threads: usize) -> Result<f64> {
    let mut best: f64 = 0.0;
    for _ in 0..RUNS {
        let mut cmd = Command::new(openssl);
        cmd.args(["speed", "-evp", "chacha20-poly1305", "-bytes", "1048576"])
            .args(["-seconds", "1", "-mr", "-multi"])
            .arg(threads.to_string());
        let out = String::from_utf8_lossy(&run_checked(&mut cmd)?).into_owned();
        best = best.max(parse_speed(&out).with_context(|| {
            format!("cannot read the speed in what `openssl speed` printed: {out:?}")
        })?);
    }
    Ok(best)
}

/// The total of `openssl speed -mr -multi N`: its last line `+F:N:NAME:BYTES_PER_S`
/// (the lines per process start with `Got:`).
fn parse_speed(out: &str) -> Option<f64> {
    out.lines()
        .rfind(|line| line.starts_with("+F:"))?
        .rsplit(':')
        .next()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_total_of_every_process_is_read() {
        let out = "Got: +H:1048576 from 0\nGot: +F:25:ChaCha20-Poly1305:1660072300.99 from 0\n\
                   Got: +F:25:ChaCha20-Poly1305:1513095168.00 from 1\n\
                   +F:25:ChaCha20-Poly1305:3173167468.99\n";
        assert_eq!(parse_speed(out), Some(3_173_167_468.99));
        assert_eq!(parse_speed("Got: +F:25:x:12 from 0\n"), None);
    }

    #[test]
    fn the_parts_add_up() {
        let speed = CpuSpeed {
            threads: 2,
            level: 2,
            hash_bps: 1e9,
            compress_bps: 5e8,
            seal_bps: 2e9,
        };
        let work = CpuWork {
            hash: 1_000_000_000,
            compress: 1_000_000_000,
            seal: 1_000_000_000,
        };
        assert!((speed.floor_seconds(work) - 3.5).abs() < 1e-9);
    }
}
