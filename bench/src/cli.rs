//! Command-line interface of `mover-bench`.

use std::path::PathBuf;

use clap::Parser;

/// Long help: what the bench builds, what it measures and what it needs.
const LONG_ABOUT: &str = "\
Benchmarks the `mover` binary against the usual peers, in one run, on a realistic volume.

The bench builds (and caches in --workdir) three images:
  yesterday.img  an ext4 volume of --size: real files copied from /usr, a database-like file
                 of 8 KiB pages, an incompressible blob, a file later shifted by an insert,
                 free space full of deleted garbage, and holes;
  today.img      yesterday plus a day of changes: ~5% of the database pages rewritten in
                 place, 1 MiB inserted in the middle of the shift file, files added/deleted;
  sparse64.img   a 64 GiB sparse file holding 20 scattered 16 MiB data regions.
today.img is attached read-only to a loop device, which is the source of every mover run.

Measured: wall clock of each child, best of 3 for hashing and of 2 for copies, the tools
taking turns. Copies include a final sync(2) (mover fsyncs) and start with the page cache
dropped (cold); the full and delta copies run again warm: the cache dropped, then the
source (the loop device and today.img) read into it. The targets checked:
  hash        `mover hash --threads N` vs `b3sum --num-threads N` on a page-cached image,
              N = 1 and N = nproc, best of 3: mover throughput >= 0.90x b3sum's
              (mover also hashes today.img itself, to show what the device costs);
  full copy   `mover copy` vs `cp --sparse=always` (and `dd bs=4M conv=sparse` shown):
              mover time <= cp's, cold and warm;
  delta copy  destination holds yesterday's image: `mover copy` vs
              `rsync --inplace --no-whole-file`: mover >= 8x faster cold and warm, and mover's
              bytes_written <= 1.10x the 4 KiB pages that differ between the images;
  memory      mover's peak RSS < 256 MiB on the full copy and on a copy of the 64 GiB
              sparse image (cp --sparse=always timed for reference), and <= 128 MiB
              for the push client of the agent full copy. Peak RSS is the
              child's own wait4 ru_maxrss; the kernel floors it at the bench's own peak.
  agent       (unless --skip-agent) copies over 127.0.0.1 through `mover agent` (started
              by the bench, bearer token) against `rsync --daemon`, both writing into
              WORKDIR/agent:
              full: `mover copy DEVICE agent://127.0.0.1:PORT/full` into an absent export
              file: time <= 1.25x a local `cp --sparse=always DEVICE` (timed in the same
              race, onto the same disk), and rsync to the daemon
              (absent destination) / mover >= 2x; the same copy to a second agent
              requiring mutual TLS (certificates made with openssl): throughput >= 0.85x
              the plain copy's;
              delta: destination holds yesterday's image, copied in untimed by cp
              (for rsync, and for mover shown only) or pushed by mover through the agent
              (judged, as in repeated replication: the agent kept its chunk index): rsync
              --inplace --no-whole-file / mover >= 8x, and mover's wire_bytes < rsync's
              \"Total bytes sent\".
              The CPU column shows the client's CPU seconds and, after a +, the server's.
  snapshot    (unless --skip-snapshot) `mover snapshot` against `restic` 0.14+, each into a
              fresh local-directory repository in WORKDIR/snapshot, backing up the same file
              (yesterday's image, then today's copied over it, untimed), best of 2 rounds
              (1 if the first takes over 90 s):
              first snapshot: restic time / mover time >= 2.5x, and mover's repository
              <= restic's on disk; incremental snapshot: restic / mover >= 3x, and the bytes
              it adds to mover's repository <= those it adds to restic's; restore of
              the latest snapshot to a new file (+ sync): restic / mover >= 3x, each restored
              image checked byte-identical to today's. --only-snapshot runs this phase alone.
              --only-agent runs the agent phase alone.
Every copy is checked byte-identical to its source after it is timed (untimed).

Prints a table of figures, ratios and PASS/FAIL, and writes every figure as JSON.
Every phase first measures the disk under --workdir with O_DIRECT (reads of today.img,
writes of a scratch file, each alone and both at once, ~8 s): each job's floor is the least
time its bytes take on that disk, or its CPU work, whichever is longer, shown as /floor;
every judged mover job must stay within 1.3x of its floor. The CPU work is hashing at
b3sum's speed on every CPU; for snapshots (measured before their phase, page-cached
today.img) also compressing at `zstd -2 -T<nproc>`'s (mover's level for a volume) and
sealing at `openssl speed -evp chacha20-poly1305 -multi <nproc>`'s: the first snapshot
hashes and compresses the volume and seals what it stores; the incremental compresses
the changed pages; the restore decrypts the repository. zstd and openssl are then needed.
--throttle W[:R] runs the same bench on a disk made slow (the block cgroup's throttle on
the workdir's disk, lifted at the end): a result that holds only on fast disks shows.

Exit status: 0 all targets met, 2 some target missed, 1 error.

Needs root (loop devices, mount, drop_caches), cp, dd, rsync, b3sum, mkfs.ext4, losetup,
mount, openssl (unless --skip-agent), restic (unless --skip-snapshot), and about 3x --size
of free space in --workdir (the snapshot phase needs another ~2x while it runs).
Takes ~13 minutes at 4G, plus ~5 for the agent phase and ~3 for the snapshots.
If interrupted, the next run unmounts and detaches what the previous one left behind.";

/// Benchmark `mover` against cp, dd, rsync and b3sum on loop devices.
#[derive(Debug, Parser)]
#[command(name = "mover-bench", version, about, long_about = LONG_ABOUT)]
pub struct Args {
    /// Size of the benchmark volume (binary suffixes K, M, G, T: 4G is 4 GiB).
    #[arg(long, default_value = "4G", value_parser = parse_size)]
    pub size: u64,

    /// Directory holding the images, the copies and the results.
    #[arg(long, default_value = "/var/tmp/mover-bench")]
    pub workdir: PathBuf,

    /// The `mover` binary to benchmark [default: `mover` next to this executable].
    #[arg(long, value_name = "PATH")]
    pub mover: Option<PathBuf>,

    /// Where to write the JSON results [default: WORKDIR/results.json].
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,

    /// Also write an HTML page with SVG charts into DIR: each phase's I/O over time
    /// per tool, every ratio against its target, every run's peak memory.
    #[arg(long, value_name = "DIR")]
    pub report: Option<PathBuf>,

    /// Keep the images in WORKDIR after the run so `--skip-build` can reuse them.
    #[arg(long)]
    pub keep: bool,

    /// Reuse the images cached in WORKDIR by an earlier run with `--keep`.
    #[arg(long)]
    pub skip_build: bool,

    /// Skip the copies over the network (mover's agent against an rsync daemon).
    #[arg(long)]
    pub skip_agent: bool,

    /// Skip the snapshots (mover snapshot against restic).
    #[arg(long, conflicts_with = "only_snapshot")]
    pub skip_snapshot: bool,

    /// Run only the snapshot phase (no hashing, no copies, no agent).
    #[arg(long)]
    pub only_snapshot: bool,

    /// Run only the agent phase (no hashing, no local copies, no snapshots); its local
    /// cp reference is timed within the phase either way.
    #[arg(long, conflicts_with_all = ["only_snapshot", "skip_agent"])]
    pub only_agent: bool,

    /// Throttle the workdir's disk for the timed runs, as on a slow day: `WRITE[:READ]` in
    /// bytes per second with binary suffixes (`400M` = 400 MiB/s writes, reads unlimited;
    /// `400M:900M` limits reads too). Uses the block cgroup (v1 blkio or v2 io.max) and
    /// lifts it at the end.
    #[arg(long, value_name = "WRITE[:READ]", value_parser = crate::floor::parse_throttle)]
    pub throttle: Option<(u64, u64)>,
}

/// Smallest volume that holds the ext4 metadata plus every kind of content.
pub const MIN_SIZE: u64 = 256 << 20;

/// Parses a byte size such as `4G`, `512M`, `1536K` or `4294967296` (binary multiples).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let size = crate::floor::parse_bytes(text)?;
    if size < MIN_SIZE {
        return Err(format!(
            "{text} is too small: the volume needs at least 256M"
        ));
    }
    if size % 4096 != 0 {
        return Err(format!("{text} is not a multiple of 4 KiB"));
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_use_binary_multiples() {
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert_eq!(parse_size("1073741824"), Ok(1 << 30));
    }

    #[test]
    fn bad_sizes_are_refused() {
        assert!(parse_size("4X").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("1M").is_err(), "below the minimum");
        assert!(parse_size("268435457").is_err(), "not page aligned");
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Args::command().debug_assert();
    }
}
