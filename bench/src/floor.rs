//! The device floor: how fast the disk under the bench's work directory reads and writes
//! with O_DIRECT, measured in the same run as the jobs it judges, and the least time a job
//! that must read R bytes and write W bytes could take on it. And `--throttle`: the same
//! disk made slow with the block cgroup's throttle, so a result is seen on a slow day too.
//!
//! A ratio against a peer moves with the day's disk; a time over the floor measured a
//! minute earlier on the same disk does not.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

/// Every judged mover job's time over its floor (the disk's or the CPU's, the larger) is
/// at most this: issue 57's target.
pub const MAX_OVER_FLOOR: f64 = 1.3;

/// Request size of the floor's reads and writes (dd's `bs=4M`).
const REQUEST: usize = 4 << 20;
/// How long each measurement runs at most.
const SPELL: Duration = Duration::from_millis(1500);
/// How many bytes each measurement moves at most.
const SPELL_BYTES: u64 = 1 << 30;

/// What the disk did with O_DIRECT, in bytes per second: alone, and with a reader and a
/// writer at once (a copy's two streams on one disk).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct DeviceSpeed {
    /// Reads alone: the faster of one and two 4 MiB requests in flight.
    pub read_bps: f64,
    /// Writes alone (durable: the time includes a final fdatasync), likewise.
    pub write_bps: f64,
    /// Reads while one writer writes.
    pub mixed_read_bps: f64,
    /// Writes while one reader reads.
    pub mixed_write_bps: f64,
}

impl DeviceSpeed {
    /// Measures the disk holding `dir`: reads of `read_from` (a file of at least a few
    /// hundred MiB on that disk; O_DIRECT skips the page cache) and writes of a scratch
    /// file in `dir`, removed afterwards. Takes about 8 seconds.
    pub fn measure(dir: &Path, read_from: &Path) -> Result<Self> {
        let source = open_direct(read_from, false)?;
        let len = source.metadata()?.len();
        if len < REQUEST as u64 * 4 {
            bail!(
                "{} is too small ({len} bytes) to measure the disk's read speed",
                read_from.display()
            );
        }
        let scratch = dir.join(".floor-write.tmp");
        let result = (|| -> Result<Self> {
            let read_bps = best_of_depths(|depth| read_spell(&source, len, depth, None));
            let write_bps = best_of_depths(|depth| write_spell(&scratch, depth));
            let stop = AtomicBool::new(false);
            let (mixed_read_bps, mixed_write_bps) = std::thread::scope(|s| {
                let reader = s.spawn(|| read_spell(&source, len, 1, Some(&stop)));
                let written = write_spell(&scratch, 1);
                stop.store(true, Ordering::Relaxed);
                let read = reader.join().expect("floor reader panicked");
                (read, written)
            });
            Ok(Self {
                read_bps: read_bps?,
                write_bps: write_bps?,
                mixed_read_bps: mixed_read_bps?,
                mixed_write_bps: mixed_write_bps?,
            })
        })();
        let _ = std::fs::remove_file(&scratch);
        result.with_context(|| format!("cannot measure the disk under {}", dir.display()))
    }

    /// The least time a job reading `read` and writing `write` bytes could take on this
    /// disk: the two one after the other at full speed, or both at once at the speeds
    /// they get together, whichever is less.
    pub fn floor_seconds(&self, read: u64, write: u64) -> f64 {
        let (read, write) = (read as f64, write as f64);
        let serial = read / self.read_bps + write / self.write_bps;
        let overlapped = (read / self.mixed_read_bps).max(write / self.mixed_write_bps);
        serial.min(overlapped)
    }

    /// One line for the log: `read 1210 MB/s, write 556 MB/s (together 610 + 420)`.
    pub fn describe(&self) -> String {
        let mb = |bps: f64| bps / 1e6;
        format!(
            "read {:.0} MB/s, write {:.0} MB/s (together {:.0} + {:.0})",
            mb(self.read_bps),
            mb(self.write_bps),
            mb(self.mixed_read_bps),
            mb(self.mixed_write_bps)
        )
    }
}

/// The faster of `spell` with one and with two requests in flight.
fn best_of_depths(spell: impl Fn(usize) -> Result<f64>) -> Result<f64> {
    Ok(spell(1)?.max(spell(2)?))
}

/// Opens `path` with O_DIRECT, for reading or (created, truncated) for writing.
fn open_direct(path: &Path, write: bool) -> Result<File> {
    let mut options = OpenOptions::new();
    options.custom_flags(libc::O_DIRECT);
    if write {
        options.write(true).create(true).truncate(true);
    } else {
        options.read(true);
    }
    options
        .open(path)
        .with_context(|| format!("cannot open {} with O_DIRECT", path.display()))
}

/// A 4 KiB-aligned buffer of `REQUEST` random bytes (O_DIRECT needs the alignment; random
/// so no layer below can compress or skip it).
struct AlignedBuffer {
    bytes: Vec<u8>,
    start: usize,
}

impl AlignedBuffer {
    fn new(seed: u64) -> Self {
        let mut bytes = vec![0u8; REQUEST + 4096];
        let start = bytes.as_ptr().align_offset(4096);
        crate::prng::SplitMix64::new(seed, 7).fill(&mut bytes[start..start + REQUEST]);
        Self { bytes, start }
    }

    fn get(&mut self) -> &mut [u8] {
        &mut self.bytes[self.start..self.start + REQUEST]
    }
}

/// Reads `source` from the start (wrapping) with `depth` requests in flight for one
/// spell, or until `stop`; returns bytes per second.
fn read_spell(source: &File, len: u64, depth: usize, stop: Option<&AtomicBool>) -> Result<f64> {
    let requests = len / REQUEST as u64;
    timed_lanes(
        depth,
        stop,
        |buffer, index| source.read_exact_at(buffer, (index % requests) * REQUEST as u64),
        || Ok(()),
    )
}

/// Writes a new file at `path` with `depth` requests in flight for one spell, then
/// fdatasyncs it; returns bytes per second, the sync included.
fn write_spell(path: &Path, depth: usize) -> Result<f64> {
    let file = open_direct(path, true)?;
    timed_lanes(
        depth,
        None,
        |buffer, index| file.write_all_at(buffer, index * REQUEST as u64),
        || Ok(file.sync_data()?),
    )
}

/// Runs `depth` lanes at once for one spell (or until `stop`), lane `l` doing requests
/// `l`, `l + depth`, ... with `request(buffer, index)` from a buffer of its own, then
/// `finish`; returns their bytes per second together, `finish` included.
fn timed_lanes(
    depth: usize,
    stop: Option<&AtomicBool>,
    request: impl Fn(&mut [u8], u64) -> std::io::Result<()> + Sync,
    finish: impl FnOnce() -> Result<()>,
) -> Result<f64> {
    let lane = |lane: usize| -> Result<u64> {
        let mut buffer = AlignedBuffer::new(lane as u64);
        let (start, mut done, mut index) = (Instant::now(), 0u64, lane as u64);
        while start.elapsed() < SPELL
            && done < SPELL_BYTES / depth as u64
            && !stop.is_some_and(|s| s.load(Ordering::Relaxed))
        {
            request(buffer.get(), index)?;
            done += REQUEST as u64;
            index += depth as u64;
        }
        Ok(done)
    };
    let started = Instant::now();
    let bytes = std::thread::scope(|s| {
        let lane = &lane;
        let lanes: Vec<_> = (0..depth).map(|l| s.spawn(move || lane(l))).collect();
        lanes
            .into_iter()
            .map(|l| l.join().expect("floor lane panicked"))
            .sum::<Result<u64>>()
    })?;
    finish()?;
    Ok(bytes as f64 / started.elapsed().as_secs_f64())
}

/// A disk made slow for the length of the run with the block cgroup's throttle (v1
/// `blkio.throttle.*_bps_device` on the root group, or v2 `io.max` on a group the bench
/// moves into), on every request to the disk: direct I/O, loop devices' and writeback's
/// alike. Lifted on drop.
#[derive(Debug)]
pub struct Throttle {
    /// `MAJOR:MINOR` of the whole disk.
    device: String,
    /// What was set, to say so and to lift it.
    how: ThrottleKind,
    /// Bytes per second.
    write_bps: u64,
    /// Bytes per second, 0 for none.
    read_bps: u64,
}

#[derive(Debug)]
enum ThrottleKind {
    /// cgroup v1: the root group's files under this directory.
    V1(PathBuf),
    /// cgroup v2: a group of the bench under the unified hierarchy.
    V2(PathBuf),
}

/// cgroup v1's blkio hierarchy.
const BLKIO_V1: &str = "/sys/fs/cgroup/blkio";
/// cgroup v2's unified hierarchy, where the io controller lives on most systems.
const UNIFIED: &[&str] = &["/sys/fs/cgroup", "/sys/fs/cgroup/unified"];

impl Throttle {
    /// Throttles the disk holding `dir` to `write_bps` (and `read_bps`, if not 0).
    pub fn apply(dir: &Path, write_bps: u64, read_bps: u64) -> Result<Self> {
        let device = whole_disk_of(dir)?;
        let how = if Path::new(BLKIO_V1)
            .join("blkio.throttle.write_bps_device")
            .exists()
        {
            let root = PathBuf::from(BLKIO_V1);
            write_v1(&root, &device, write_bps, read_bps)?;
            ThrottleKind::V1(root)
        } else if let Some(unified) = UNIFIED.iter().map(Path::new).find(|u| has_io_controller(u)) {
            let group = unified.join("mover-bench-throttle");
            std::fs::create_dir_all(&group)
                .with_context(|| format!("cannot create the cgroup {}", group.display()))?;
            let _ = std::fs::write(unified.join("cgroup.subtree_control"), "+io");
            let rbps = if read_bps == 0 {
                "max".to_string()
            } else {
                read_bps.to_string()
            };
            write_file(
                &group.join("io.max"),
                &format!("{device} wbps={write_bps} rbps={rbps}"),
            )?;
            write_file(&group.join("cgroup.procs"), &std::process::id().to_string())?;
            ThrottleKind::V2(group)
        } else {
            bail!(
                "--throttle needs the block cgroup: neither {BLKIO_V1} (v1) nor an io \
                 controller under {} (v2) is here",
                UNIFIED.join(" or ")
            );
        };
        Ok(Self {
            device,
            how,
            write_bps,
            read_bps,
        })
    }

    /// The throttle `--throttle` asked for (`None`: none), applied to the disk of `dir`
    /// and said on stderr by `bench`.
    pub fn from_arg(dir: &Path, arg: Option<(u64, u64)>, bench: &str) -> Result<Option<Self>> {
        let Some((write, read)) = arg else {
            return Ok(None);
        };
        let throttle = Self::apply(dir, write, read)?;
        eprintln!("{bench}: {}", throttle.describe());
        Ok(Some(throttle))
    }

    /// What is throttled, for the log and the results.
    pub fn describe(&self) -> String {
        let mb = |bps: u64| bps as f64 / 1e6;
        let read = if self.read_bps == 0 {
            "reads unlimited".to_string()
        } else {
            format!("reads {:.0} MB/s", mb(self.read_bps))
        };
        format!(
            "disk {} throttled: writes {:.0} MB/s, {read}",
            self.device,
            mb(self.write_bps)
        )
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        let lifted = match &self.how {
            ThrottleKind::V1(root) => write_v1(root, &self.device, 0, 0),
            ThrottleKind::V2(group) => {
                let parent = group.parent().unwrap_or(Path::new("/sys/fs/cgroup"));
                write_file(
                    &parent.join("cgroup.procs"),
                    &std::process::id().to_string(),
                )
                .and_then(|()| std::fs::remove_dir(group).map_err(Into::into))
            }
        };
        if let Err(err) = lifted {
            let by_hand = match &self.how {
                ThrottleKind::V1(root) => format!(
                    "write `{} 0` into {}/blkio.throttle.{{write,read}}_bps_device",
                    self.device,
                    root.display()
                ),
                ThrottleKind::V2(group) => format!("remove the cgroup {}", group.display()),
            };
            eprintln!(
                "mover-bench: warning: cannot lift the throttle on disk {}: {err:#}; {by_hand}",
                self.device
            );
        }
    }
}

/// Sets (or with 0, lifts) the v1 root group's limits on `device`.
fn write_v1(root: &Path, device: &str, write_bps: u64, read_bps: u64) -> Result<()> {
    write_file(
        &root.join("blkio.throttle.write_bps_device"),
        &format!("{device} {write_bps}"),
    )?;
    write_file(
        &root.join("blkio.throttle.read_bps_device"),
        &format!("{device} {read_bps}"),
    )
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text)
        .with_context(|| format!("cannot write `{text}` into {}", path.display()))
}

fn has_io_controller(unified: &Path) -> bool {
    std::fs::read_to_string(unified.join("cgroup.controllers"))
        .is_ok_and(|c| c.split_whitespace().any(|name| name == "io"))
}

/// `MAJOR:MINOR` of the whole disk holding `dir` (the throttle is set per disk, not per
/// partition).
fn whole_disk_of(dir: &Path) -> Result<String> {
    let stat = rustix::fs::stat(dir).with_context(|| format!("cannot stat {}", dir.display()))?;
    let (major, minor) = (
        rustix::fs::major(stat.st_dev),
        rustix::fs::minor(stat.st_dev),
    );
    let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    if !sys.exists() {
        bail!(
            "{} is on device {major}:{minor}, which is not a block device (a network or \
             overlay file system?): it cannot be throttled",
            dir.display()
        );
    }
    if sys.join("partition").exists() {
        let parent = sys
            .canonicalize()?
            .parent()
            .map(|p| p.join("dev"))
            .context("a partition without a disk")?;
        return Ok(std::fs::read_to_string(parent)?.trim().to_string());
    }
    Ok(format!("{major}:{minor}"))
}

/// Parses a throttle `WRITE[:READ]` into bytes per second (READ 0 when absent).
pub fn parse_throttle(text: &str) -> Result<(u64, u64), String> {
    let (write, read) = text.split_once(':').unwrap_or((text, ""));
    let write = parse_bytes(write)?;
    let read = if read.is_empty() {
        0
    } else {
        parse_bytes(read)?
    };
    if write < 1 << 20 || (read != 0 && read < 1 << 20) {
        return Err(format!(
            "{text}: a throttle below 1M (1 MiB/s) would stall the bench"
        ));
    }
    Ok((write, read))
}

/// A byte count with an optional binary suffix.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(split);
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("`{text}` is not a size like 4G, 512M or 1073741824"))?;
    let shift = match suffix.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KIB" => 10,
        "M" | "MIB" => 20,
        "G" | "GIB" => 30,
        "T" | "TIB" => 40,
        _ => return Err(format!("unknown size suffix `{suffix}` (use K, M, G or T)")),
    };
    number
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("`{text}` is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_is_the_cheaper_of_serial_and_overlapped() {
        let disk = DeviceSpeed {
            read_bps: 1e9,
            write_bps: 5e8,
            mixed_read_bps: 6e8,
            mixed_write_bps: 4e8,
        };
        // 4 GB read, 2 GB written: serial 4 + 4 = 8 s, together max(6.67, 5) = 6.67 s.
        assert!((disk.floor_seconds(4_000_000_000, 2_000_000_000) - 6.666_666).abs() < 1e-3);
        // A read alone is at the read speed, not the mixed one.
        assert!((disk.floor_seconds(1_000_000_000, 0) - 1.0).abs() < 1e-9);
        assert_eq!(disk.floor_seconds(0, 0), 0.0);
    }

    #[test]
    fn throttles_are_write_then_read() {
        assert_eq!(parse_throttle("400M"), Ok((400 << 20, 0)));
        assert_eq!(parse_throttle("400M:1G"), Ok((400 << 20, 1 << 30)));
        assert!(parse_throttle("10K").is_err(), "too slow to finish");
        assert!(parse_throttle("400M:x").is_err());
    }

    #[test]
    fn the_disk_of_the_temp_directory_is_found() {
        // Where /var/tmp is a block device's file system, its whole disk is found; on a
        // tmpfs or overlay the error says why.
        match whole_disk_of(Path::new("/var/tmp")) {
            Ok(dev) => {
                let sys = Path::new("/sys/dev/block").join(&dev);
                assert!(sys.exists(), "{dev} is not a block device");
                assert!(!sys.join("partition").exists(), "{dev} is a partition");
            }
            Err(err) => assert!(err.to_string().contains("not a block device"), "{err:#}"),
        }
    }
}
