//! Hashing a page-cached image: `mover hash` against `b3sum`.

use std::process::Command;

use anyhow::Result;
use serde::Serialize;

use super::{Ctx, Run, RunOutput};
use crate::mover::{self, HashReport};
use crate::process::{ThenSync, Timed, describe, run_timed, warm_cache};
use crate::progress::note;

/// How many times each hashing command runs; the best time counts.
const HASH_RUNS: usize = 3;

/// Hashing at one thread count.
#[derive(Debug, Clone, Serialize)]
pub struct HashResult {
    /// Threads given to both tools.
    pub threads: usize,
    /// `b3sum --num-threads N today.img`.
    pub b3sum: Run,
    /// `mover hash --threads N /dev/loopX`.
    pub mover: Run,
    /// `mover hash --threads N today.img`: the same bytes without the loop device, to tell
    /// hashing cost from device-read cost (for information; no target).
    pub mover_on_image_file: Run,
    /// mover's own measure of its best run (without process start-up).
    pub mover_internal_seconds: f64,
}

/// Times hashing of the page-cached image by b3sum and mover, at 1 and `nproc` threads.
pub fn hash(ctx: &Ctx) -> Result<Vec<HashResult>> {
    note!("hash: warming the page cache");
    warm_cache(&ctx.images.today)?;
    // The kernel drops a block device's page cache when its last opener closes it, so the
    // device stays open here until every hashing run is done; otherwise each mover run
    // would start cold.
    let _keep_cached = warm_cache(ctx.device)?;
    let mut counts = vec![1, ctx.nproc];
    counts.dedup();
    counts
        .into_iter()
        .map(|threads| hash_with_threads(ctx, threads))
        .collect()
}

/// Times b3sum and mover (on the device and on the image file) hashing with `threads`.
fn hash_with_threads(ctx: &Ctx, threads: usize) -> Result<HashResult> {
    let size = ctx.images.manifest.size;
    note!("hash: {threads} thread(s), best of {HASH_RUNS}");
    let mut b3sum = Command::new(&ctx.tools.b3sum);
    b3sum
        .args(["--num-threads", &threads.to_string()])
        .arg(&ctx.images.today);
    let mut cmds = [
        (format!("b3sum --num-threads {threads}"), b3sum),
        (
            format!("mover hash --threads {threads}"),
            mover::hash_command(ctx.mover, ctx.device, threads),
        ),
        (
            format!("mover hash --threads {threads}, image file"),
            mover::hash_command(ctx.mover, &ctx.images.today, threads),
        ),
    ];
    let mut runs = best_of_alternating(&mut cmds)?.into_iter();
    let mut next = || runs.next().expect("one run per command");
    let ((b3sum, _), (mut mover, stdout), (mut on_file, file_stdout)) = (next(), next(), next());
    let (report, value) = mover::parse_report::<HashReport>(&stdout, size)?;
    mover.mover_report = Some(value);
    let (_, value) = mover::parse_report::<HashReport>(&file_stdout, size)?;
    on_file.mover_report = Some(value);
    Ok(HashResult {
        threads,
        b3sum,
        mover,
        mover_on_image_file: on_file,
        mover_internal_seconds: report.duration_secs,
    })
}

/// Runs each `(tool, command)` [`HASH_RUNS`] times, taking turns so a change in background
/// load hits all alike; returns each one's best run and its stdout, in order.
fn best_of_alternating(cmds: &mut [(String, Command)]) -> Result<Vec<RunOutput>> {
    let mut timings: Vec<Vec<Timed>> = cmds.iter().map(|_| Vec::new()).collect();
    for _ in 0..HASH_RUNS {
        for ((_, cmd), runs) in cmds.iter_mut().zip(&mut timings) {
            runs.push(run_timed(cmd, ThenSync::No)?);
        }
    }
    Ok(cmds
        .iter()
        .zip(timings)
        .map(|((tool, cmd), timings)| Run::best(tool, describe(cmd), timings))
        .collect())
}
