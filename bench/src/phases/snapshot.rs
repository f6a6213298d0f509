//! Snapshots into a local-directory repository on the same disk: `mover snapshot` against
//! `restic backup`, for the first snapshot of yesterday's image, the incremental snapshot of
//! today's, and the restore of the latest snapshot to a new file.
//!
//! Both tools back up the same file, WORKDIR/snapshot/snapvol.img, which holds yesterday's
//! image and then today's (copied in by cp, untimed): mover by the volume name `snapvol`,
//! restic by the path, so each sees "the same volume, changed" and picks its parent.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use super::{Ctx, Run, RunOutput};
use crate::diff;
use crate::image;
use crate::process::{self, ThenSync, describe, drop_caches, run_timed};
use crate::progress::note;

/// Subdirectory of the workdir holding the repositories, caches, volume and restores.
const SNAPSHOT_DIR: &str = "snapshot";
/// At most this many rounds run; the best time of each step counts.
const SNAPSHOT_RUNS: usize = 2;
/// A further round starts only if the last one took less than this (at 4G a round takes
/// about as long, and the phase should stay near three minutes).
const ROUND_BUDGET: Duration = Duration::from_secs(90);
/// The repositories' password (both tools stretch it; the cost is part of their times).
const PASSWORD: &str = "mover-bench";
/// mover's name for the volume.
const VOLUME_NAME: &str = "snapvol";

/// The snapshot comparison.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotPhase {
    /// First snapshot of yesterday's image into a fresh repository.
    pub first: SnapshotStep,
    /// Next snapshot of the same volume, now holding today's image.
    pub incremental: SnapshotStep,
    /// Restore of the latest snapshot (today's) to a new file, plus sync.
    pub restore: SnapshotStep,
    /// Rounds run (a second only when the first took under 90 s).
    pub rounds: usize,
}

/// One step, timed for both tools.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotStep {
    /// `restic`.
    pub restic: Run,
    /// `mover snapshot`.
    pub mover: Run,
    /// Bytes the restic repository occupies on disk after the step (best run's round).
    pub restic_repo_bytes: u64,
    /// Bytes the mover repository occupies on disk after the step.
    pub mover_repo_bytes: u64,
}

/// Where the phase works.
struct Paths {
    dir: PathBuf,
    volume: PathBuf,
    mover_repo: PathBuf,
    mover_cache: PathBuf,
    restic_repo: PathBuf,
    restic_cache: PathBuf,
    mover_restore: PathBuf,
    restic_restore: PathBuf,
}

impl Paths {
    fn new(workdir: &Path) -> Self {
        let dir = workdir.join(SNAPSHOT_DIR);
        Self {
            volume: dir.join("snapvol.img"),
            mover_repo: dir.join("mover-repo"),
            mover_cache: dir.join("mover-cache"),
            restic_repo: dir.join("restic-repo"),
            restic_cache: dir.join("restic-cache"),
            mover_restore: dir.join("mover-restore.img"),
            restic_restore: dir.join("restic-restore"),
            dir,
        }
    }

    /// Where `restic restore --target` puts the volume: the target plus its absolute path.
    fn restic_restored_volume(&self) -> PathBuf {
        let relative = self.volume.strip_prefix("/").unwrap_or(&self.volume);
        self.restic_restore.join(relative)
    }
}

/// The runs of one step for one tool, and the repository size after each.
#[derive(Default)]
struct Series {
    runs: Vec<(RunOutput, u64)>,
}

impl Series {
    /// The fastest run (all times listed, worst exactness kept) and the repository size
    /// after it.
    fn best(self) -> (Run, Vec<u8>, u64) {
        let all: Vec<f64> = self.runs.iter().map(|((r, _), _)| r.seconds).collect();
        let worst = self
            .runs
            .iter()
            .filter_map(|((r, _), _)| r.differing_pages_after)
            .max();
        let ((mut run, stdout), repo) = self
            .runs
            .into_iter()
            .min_by(|((a, _), _), ((b, _), _)| a.seconds.total_cmp(&b.seconds))
            .expect("at least one run");
        run.all_seconds = all;
        run.differing_pages_after = worst;
        (run, stdout, repo)
    }
}

/// Times both tools' first snapshot, incremental snapshot and restore, round-robin, each
/// round from fresh repositories; removes everything it made afterwards.
pub fn snapshot(ctx: &Ctx) -> Result<SnapshotPhase> {
    let restic = ctx
        .tools
        .restic
        .as_deref()
        .context("the snapshot phase needs `restic` (apt install restic)")?;
    let paths = Paths::new(ctx.workdir);
    remove_dir_if_present(&paths.dir)?;
    std::fs::create_dir_all(&paths.dir)
        .with_context(|| format!("cannot create {}", paths.dir.display()))?;
    let outcome = rounds(ctx, restic, &paths);
    remove_dir_if_present(&paths.dir)?;
    outcome
}

/// The rounds, then the best of each step.
fn rounds(ctx: &Ctx, restic: &Path, paths: &Paths) -> Result<SnapshotPhase> {
    // [first, incremental, restore] x [restic, mover].
    let mut series: [[Series; 2]; 3] = Default::default();
    let mut rounds = 0;
    while rounds < SNAPSHOT_RUNS {
        let started = Instant::now();
        rounds += 1;
        for dir in [
            &paths.mover_repo,
            &paths.mover_cache,
            &paths.restic_repo,
            &paths.restic_cache,
        ] {
            remove_dir_if_present(dir)?;
        }
        process::run_checked(&mut mover_cmd(ctx, paths, "repo", &["init"]))
            .context("cannot create the mover repository")?;
        process::run_checked(&mut restic_cmd(restic, paths, &["init"]))
            .context("cannot create the restic repository")?;

        for (step, source) in [(0, &ctx.images.yesterday), (1, &ctx.images.today)] {
            copy_volume(ctx, source, &paths.volume)?;
            let what = if step == 0 { "first" } else { "incremental" };
            let mut backup = restic_cmd(restic, paths, &["backup", "--quiet"]);
            backup.arg(&paths.volume);
            let run = time(&format!("snapshot {what}: restic backup"), backup, None)?;
            series[step][0].runs.push((run, du(&paths.restic_repo)?));
            let mut create = mover_cmd(ctx, paths, "snapshot", &["create"]);
            create.arg(&paths.volume).args(["--name", VOLUME_NAME]);
            let run = time(
                &format!("snapshot {what}: mover snapshot create"),
                create,
                None,
            )?;
            series[step][1].runs.push((run, du(&paths.mover_repo)?));
        }

        remove_dir_if_present(&paths.restic_restore)?;
        let mut restore = restic_cmd(restic, paths, &["restore", "latest", "--target"]);
        restore.arg(&paths.restic_restore);
        let check = (ctx.images.today.as_path(), paths.restic_restored_volume());
        let run = time("snapshot restore: restic restore", restore, Some(check))?;
        series[2][0].runs.push((run, du(&paths.restic_repo)?));
        remove_dir_if_present(&paths.restic_restore)?;

        image::remove_if_present(&paths.mover_restore)?;
        let mut restore = mover_cmd(ctx, paths, "snapshot", &["restore"]);
        restore.arg("latest").arg(&paths.mover_restore);
        let check = (ctx.images.today.as_path(), paths.mover_restore.clone());
        let run = time(
            "snapshot restore: mover snapshot restore",
            restore,
            Some(check),
        )?;
        series[2][1].runs.push((run, du(&paths.mover_repo)?));
        image::remove_if_present(&paths.mover_restore)?;
        if started.elapsed() >= ROUND_BUDGET {
            note!("snapshot: that round took over {ROUND_BUDGET:?}, so it is the only one");
            break;
        }
    }
    let [first, incremental, restore] = series.map(|[restic, mover]| step(restic, mover));
    Ok(SnapshotPhase {
        first: first?,
        incremental: incremental?,
        restore: restore?,
        rounds,
    })
}

/// The best of each tool's runs of a step; mover's `--json` report kept.
fn step(restic: Series, mover: Series) -> Result<SnapshotStep> {
    let (restic, _, restic_repo_bytes) = restic.best();
    let (mut mover, stdout, mover_repo_bytes) = mover.best();
    let text = String::from_utf8_lossy(&stdout);
    let value: serde_json::Value = serde_json::from_str(text.trim())
        .with_context(|| format!("mover --json printed something else than JSON: {text:?}"))?;
    mover.mover_report = Some(value);
    Ok(SnapshotStep {
        restic,
        mover,
        restic_repo_bytes,
        mover_repo_bytes,
    })
}

/// `mover GROUP SUB REPO --json --cache-dir …` with the password in the environment.
fn mover_cmd(ctx: &Ctx, paths: &Paths, group: &str, sub: &[&str]) -> Command {
    let mut cmd = Command::new(ctx.mover);
    cmd.arg(group)
        .args(sub)
        .arg(&paths.mover_repo)
        .arg("--cache-dir")
        .arg(&paths.mover_cache)
        .env("MOVER_PASSWORD", PASSWORD);
    if group == "snapshot" {
        cmd.arg("--json");
    }
    cmd
}

/// `restic --repo … --cache-dir … ARGS` with the password in the environment.
fn restic_cmd(restic: &Path, paths: &Paths, args: &[&str]) -> Command {
    let mut cmd = Command::new(restic);
    cmd.arg("--repo")
        .arg(&paths.restic_repo)
        .arg("--cache-dir")
        .arg(&paths.restic_cache)
        .args(args)
        .env("RESTIC_PASSWORD", PASSWORD);
    cmd
}

/// Makes the volume a sparse copy of `source` (untimed; cp rewrites it in place, so the
/// file keeps its path and inode as a volume would).
fn copy_volume(ctx: &Ctx, source: &Path, volume: &Path) -> Result<()> {
    let mut cp = Command::new(&ctx.tools.cp);
    cp.arg("--sparse=always").arg(source).arg(volume);
    process::run_checked(&mut cp).context("cannot copy the image to the snapshot volume")?;
    Ok(())
}

/// Drops the page cache, times `cmd` plus a sync, and when `check` is given compares the
/// restored file with its source (untimed).
fn time(what: &str, mut cmd: Command, check: Option<(&Path, PathBuf)>) -> Result<RunOutput> {
    drop_caches()?;
    note!("{what}");
    let timed = run_timed(&mut cmd, ThenSync::Yes)?;
    let tool = what.rsplit(": ").next().unwrap_or(what);
    let (mut run, stdout) = Run::best(tool, describe(&cmd), vec![timed]);
    if let Some((source, restored)) = check {
        let diff = diff::compare(source, &restored)
            .with_context(|| format!("cannot check the image restored by {tool}"))?;
        if diff.differing_pages != 0 {
            note!(
                "WARNING: after {tool}, {} pages of {} differ from {}",
                diff.differing_pages,
                restored.display(),
                source.display()
            );
        }
        run.differing_pages_after = Some(diff.differing_pages);
        run.destination_allocated_bytes = Some(std::fs::metadata(&restored)?.blocks() * 512);
    }
    Ok((run, stdout))
}

/// Bytes allocated on disk by the files under `dir` (like `du -s`, no hard-link dedup).
fn du(dir: &Path) -> Result<u64> {
    let meta =
        std::fs::symlink_metadata(dir).with_context(|| format!("cannot stat {}", dir.display()))?;
    let mut total = meta.blocks() * 512;
    if meta.is_dir() {
        for entry in
            std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?
        {
            total += du(&entry?.path())?;
        }
    }
    Ok(total)
}

/// Deletes the directory tree `dir` unless it does not exist.
fn remove_dir_if_present(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
            Err(err).with_context(|| format!("cannot delete {}", dir.display()))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restic_restores_under_the_absolute_path() {
        let paths = Paths::new(Path::new("/var/tmp/w"));
        assert_eq!(
            paths.restic_restored_volume(),
            Path::new("/var/tmp/w/snapshot/restic-restore/var/tmp/w/snapshot/snapvol.img")
        );
    }

    #[test]
    fn du_counts_nested_files() {
        let dir = std::env::temp_dir().join(format!("bench-du-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("a")).unwrap();
        std::fs::write(dir.join("a/f"), vec![1u8; 8192]).unwrap();
        assert!(du(&dir).unwrap() >= 8192);
        remove_dir_if_present(&dir).unwrap();
        assert!(!dir.exists());
    }
}
