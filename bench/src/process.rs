//! Running child processes: checked helpers, and timed runs that record the child's own
//! peak memory.

use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// What a timed child run produced.
#[derive(Debug)]
pub struct Timed {
    /// Wall clock from spawn to reap, plus the trailing `sync(2)` when one was asked for.
    pub elapsed: Duration,
    /// The part of `elapsed` spent in the trailing `sync(2)`.
    pub sync: Duration,
    /// The child's peak resident set size (`ru_maxrss`), in bytes.
    pub max_rss_bytes: u64,
    /// CPU time (user + system) of the child and the descendants it waited for.
    pub cpu: Duration,
    /// Everything the child wrote on stdout.
    pub stdout: Vec<u8>,
    /// The I/O of the child and its descendants while it ran: (seconds since the
    /// start, bytes read and written so far, `rchar + wchar` of `/proc/PID/io`).
    pub io_samples: Vec<(f64, u64)>,
}

/// Whether a timed run ends with a `sync(2)` that counts in its time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThenSync {
    /// Stop the clock when the child is reaped.
    No,
    /// Flush all dirty data to disk before stopping the clock (copies: mover fsyncs).
    Yes,
}

/// The command line of `cmd`, for messages and the JSON results.
pub fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(OsStr::to_string_lossy)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd` to completion and returns its stdout; a non-zero exit is an error that quotes
/// the child's stderr.
pub fn run_checked(cmd: &mut Command) -> Result<Vec<u8>> {
    let what = describe(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot start `{what}`"))?;
    ensure_success(&what, out.status, &out.stderr)?;
    Ok(out.stdout)
}

/// Runs `cmd`, timing it from spawn to reap (and through a `sync(2)` if `then_sync`), and
/// records its peak RSS.
pub fn run_timed(cmd: &mut Command, then_sync: ThenSync) -> Result<Timed> {
    let what = describe(cmd);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start `{what}`"))?;
    let sampler = IoSampler::start(child.id(), start);
    let stderr = child.stderr.take().context("child stderr is not piped")?;
    let stderr_reader = std::thread::spawn(move || read_all(stderr));
    let mut stdout = Vec::new();
    let read = child
        .stdout
        .take()
        .context("child stdout is not piped")?
        .read_to_end(&mut stdout);
    // The child's counters stay readable until it is reaped: take the last sample of
    // an exited, unreaped child, so that I/O of its last moments is not lost.
    wait_exited(child.id()).with_context(|| format!("cannot wait for `{what}`"))?;
    let ran = start.elapsed();
    let io_samples = sampler.finish(ran);
    let (status, usage) =
        wait_with_usage(child.id()).with_context(|| format!("cannot wait for `{what}`"))?;
    let stderr = stderr_reader.join().unwrap_or_default();
    read.with_context(|| format!("cannot read the output of `{what}`"))?;
    ensure_success(&what, status, &stderr)?;
    let sync = match then_sync {
        ThenSync::No => Duration::ZERO,
        ThenSync::Yes => timed_sync(),
    };
    Ok(Timed {
        elapsed: ran + sync,
        sync,
        max_rss_bytes: usage.max_rss_bytes,
        cpu: usage.cpu,
        stdout,
        io_samples,
    })
}

/// How often a timed run's I/O is sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(200);

/// Samples the I/O of a process tree from a thread of its own.
struct IoSampler {
    /// Dropped to stop the thread at once (not after its current wait: the trailing
    /// sync of a timed run must not start late, with writeback done meanwhile).
    stop: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<Vec<(f64, u64)>>,
}

impl IoSampler {
    fn start(pid: u32, start: Instant) -> IoSampler {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            // Each process's last counters: one that exits keeps what it did.
            let mut seen = std::collections::HashMap::<u32, u64>::new();
            let mut samples = vec![(0.0, 0)];
            let mut sample = |samples: &mut Vec<(f64, u64)>| {
                for p in descendants(pid) {
                    if let Some(n) = process_io_chars(p) {
                        seen.insert(p, n);
                    }
                }
                samples.push((start.elapsed().as_secs_f64(), seen.values().sum()));
            };
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(SAMPLE_EVERY)
            {
                sample(&mut samples);
            }
            sample(&mut samples);
            samples
        });
        IoSampler { stop, thread }
    }

    /// The samples, the last one taken now and placed at `end` (when the child exited;
    /// call this before reaping it, while its counters can still be read).
    fn finish(self, end: Duration) -> Vec<(f64, u64)> {
        drop(self.stop);
        let mut samples = self.thread.join().unwrap_or_default();
        let last = samples.pop().map_or(0, |s| s.1);
        samples.retain(|s| s.0 <= end.as_secs_f64());
        samples.push((end.as_secs_f64(), last));
        samples
    }
}

/// `pid` and every live process below it.
fn descendants(pid: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
                continue;
            };
            // The parent is the second field after the command name's `)`.
            let ppid = stat
                .rfind(')')
                .and_then(|i| stat[i + 2..].split(' ').nth(1))
                .and_then(|f| f.parse::<u32>().ok());
            if let Some(pp) = ppid {
                parent_of.push((p, pp));
            }
        }
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        out.extend(
            parent_of
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    out
}

/// `rchar + wchar` of `/proc/PID/io`: bytes the process read and wrote through system
/// calls (files, pipes, sockets; page-cache hits count).
fn process_io_chars(pid: u32) -> Option<u64> {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    let field = |name: &str| -> Option<u64> {
        io.lines()
            .find_map(|line| line.strip_prefix(name))?
            .trim()
            .parse()
            .ok()
    };
    Some(field("rchar:")? + field("wchar:")?)
}

/// Flushes all dirty data (`sync(2)`) and returns how long that took.
pub fn timed_sync() -> Duration {
    let start = Instant::now();
    rustix::fs::sync();
    start.elapsed()
}

/// Flushes dirty data, then drops the page cache, dentries and inodes so the next timed run
/// reads from disk.
pub fn drop_caches() -> Result<()> {
    rustix::fs::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .context("cannot drop the page cache via /proc/sys/vm/drop_caches")
}

/// Reads `path` to its end so its pages are cached; returns it still open.
pub fn warm_cache(path: &Path) -> Result<File> {
    let mut file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    while file
        .read(&mut buf)
        .with_context(|| format!("cannot read {}", path.display()))?
        != 0
    {}
    Ok(file)
}

/// The bench's own peak RSS (`VmHWM`), in bytes, or 0 if unknown.
///
/// Every child's `ru_maxrss` starts from it: std spawns with vfork+exec, and at exec the
/// kernel folds the high-water mark of the mm being left (the bench's) into the child's
/// figure. A child's peak RSS equal to this floor therefore means "at most this".
pub fn own_peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kib| kib * 1024)
}

/// CPU time (user + system) used so far by the live process `pid`, its threads, and the
/// children it has reaped, from `/proc/PID/stat`; `None` if unknown.
pub fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: fields are counted after its `)`.
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split(' ').collect();
    // utime, stime, cutime and cstime are fields 14 to 17 (1-based), 12 to 15 here.
    let ticks: u64 = fields
        .get(11..15)?
        .iter()
        .map(|f| f.parse::<u64>().ok())
        .sum::<Option<u64>>()?;
    let per_sec = clock_ticks_per_second()?;
    Some(Duration::from_secs_f64(ticks as f64 / per_sec as f64))
}

/// Bytes the live process `pid` (with its threads and the children it has reaped) made
/// the kernel fetch from storage so far (`read_bytes` of `/proc/PID/io`: page-cache hits
/// do not count); `None` if unknown.
pub fn process_read_bytes(pid: u32) -> Option<u64> {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    io.lines()
        .find_map(|line| line.strip_prefix("read_bytes:"))?
        .trim()
        .parse()
        .ok()
}

/// The unit of `/proc/PID/stat` times (`sysconf(_SC_CLK_TCK)`).
#[allow(unsafe_code)] // See the SAFETY comment.
fn clock_ticks_per_second() -> Option<u64> {
    // SAFETY: sysconf takes an integer and reads no memory of ours.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|&t| t > 0)
}

/// Turns a failed exit into an error carrying the end of the child's stderr.
fn ensure_success(what: &str, status: ExitStatus, stderr: &[u8]) -> Result<()> {
    if status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(stderr);
    let tail: Vec<&str> = stderr.trim_end().lines().rev().take(10).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    bail!("`{what}` failed ({status}):\n{}", tail.join("\n"))
}

/// Reads `reader` to its end, keeping whatever arrived before an error.
fn read_all(mut reader: impl Read) -> Vec<u8> {
    let mut buf = Vec::new();
    let _ = reader.read_to_end(&mut buf);
    buf
}

/// What `wait4(2)` says a reaped child used.
#[derive(Debug, Clone, Copy)]
struct Usage {
    /// Peak resident set size, in bytes.
    max_rss_bytes: u64,
    /// User plus system CPU time.
    cpu: Duration,
}

/// Waits until child `pid` has exited, leaving it unreaped (`waitid` with `WNOWAIT`).
#[allow(unsafe_code)] // See the SAFETY comment.
fn wait_exited(pid: u32) -> io::Result<()> {
    let id = libc::id_t::from(pid);
    loop {
        // SAFETY: `info` is a live, writable local; WNOWAIT leaves the child unreaped,
        // so the later wait4 still reaps it and collects its status and usage.
        // `siginfo_t` is plain C data, for which all-zero bytes are valid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let done =
            unsafe { libc::waitid(libc::P_PID, id, &mut info, libc::WEXITED | libc::WNOWAIT) };
        if done == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Reaps the child `pid` and returns its exit status, peak RSS and CPU time.
///
/// `std::process::Child::wait` throws the child's `rusage` away, and
/// `getrusage(RUSAGE_CHILDREN)` reports the maximum over *every* child reaped so far (an
/// earlier `cp` or `rsync` would mask mover's figure), so this calls `wait4(2)` directly.
#[allow(unsafe_code)] // See the SAFETY comments.
fn wait_with_usage(pid: u32) -> io::Result<(ExitStatus, Usage)> {
    let pid = libc::pid_t::try_from(pid).map_err(io::Error::other)?;
    let mut status: libc::c_int = 0;
    // SAFETY: `rusage` is a C struct of integers, for which all-zero bytes are a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: both pointers refer to live, writable locals of the types wait4 expects,
        // and `pid` is our own not-yet-reaped child, so no other process can be reaped.
        let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if reaped == pid {
            break;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    // Linux reports ru_maxrss in KiB.
    let max_rss_kib = u64::try_from(usage.ru_maxrss).unwrap_or(0);
    let usage = Usage {
        max_rss_bytes: max_rss_kib * 1024,
        cpu: timeval(usage.ru_utime) + timeval(usage.ru_stime),
    };
    Ok((ExitStatus::from_raw(status), usage))
}

/// A `timeval` as a duration (negative fields, which the kernel never reports, count as 0).
fn timeval(tv: libc::timeval) -> Duration {
    let secs = u64::try_from(tv.tv_sec).unwrap_or(0);
    let micros = u32::try_from(tv.tv_usec).unwrap_or(0);
    Duration::from_secs(secs) + Duration::from_micros(u64::from(micros))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timed_run_captures_stdout_and_peak_rss() {
        let timed = run_timed(Command::new("sh").args(["-c", "echo hi"]), ThenSync::No).unwrap();
        assert_eq!(timed.stdout, b"hi\n");
        assert!(timed.max_rss_bytes > 0);
        assert_eq!(timed.sync, Duration::ZERO);
        assert!(timed.cpu < Duration::from_secs(1), "{:?}", timed.cpu);
    }

    #[test]
    fn io_samples_follow_the_childs_io_over_time() {
        // Five writes of 10 MiB, 150 ms apart: the samples must rise in steps to at
        // least 50 MiB, never fall, and end when the child was reaped.
        let script = "import os, time\n\
                      f = os.open('/dev/null', os.O_WRONLY)\n\
                      for _ in range(5):\n    os.write(f, bytes(10 << 20)); time.sleep(0.15)\n";
        let timed = run_timed(Command::new("python3").args(["-c", script]), ThenSync::No).unwrap();
        let s = &timed.io_samples;
        assert!(s.len() >= 4, "{s:?}");
        assert!(
            s.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1),
            "{s:?}"
        );
        assert!(s.last().unwrap().1 >= 50 << 20, "{s:?}");
        assert!((s.last().unwrap().0 - timed.elapsed.as_secs_f64()).abs() < 1e-6);
        // Some sample was taken part way: the I/O is seen over time, not only at the end.
        assert!(s.iter().any(|&(_, b)| b > 0 && b < 50 << 20), "{s:?}");
    }

    #[test]
    fn peak_rss_is_the_childs_own() {
        // A child touching 64 MiB must report at least that, and a later small child must
        // not inherit the figure (which getrusage(RUSAGE_CHILDREN) would do).
        let mut dd = Command::new("dd");
        dd.args([
            "if=/dev/zero",
            "of=/dev/null",
            "bs=64M",
            "count=1",
            "status=none",
        ]);
        let big = run_timed(&mut dd, ThenSync::No).unwrap();
        let small = run_timed(&mut Command::new("true"), ThenSync::No).unwrap();
        assert!(big.max_rss_bytes >= 64 << 20, "{}", big.max_rss_bytes);
        // A child's figure starts from this process's own peak (its memory when the
        // child was spawned), which other tests running in this process raise.
        let own_peak = own_peak_rss();
        assert!(
            small.max_rss_bytes < own_peak + (16 << 20),
            "{} (this process's peak: {own_peak})",
            small.max_rss_bytes
        );
    }

    #[test]
    fn cpu_time_is_counted() {
        let busy = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done";
        let timed = run_timed(Command::new("sh").args(["-c", busy]), ThenSync::No).unwrap();
        assert!(timed.cpu >= Duration::from_millis(50), "{:?}", timed.cpu);
        assert!(timed.cpu <= timed.elapsed + Duration::from_millis(20));
        // The reaped child's time is folded into ours (cutime), to clock-tick precision.
        let own = process_cpu(std::process::id()).unwrap();
        assert!(own + Duration::from_millis(20) >= timed.cpu, "{own:?}");
        assert!(process_cpu(u32::MAX).is_none());
        assert!(process_read_bytes(std::process::id()).is_some());
        assert!(process_read_bytes(u32::MAX).is_none());
    }

    #[test]
    fn own_peak_rss_is_known() {
        assert!(own_peak_rss() > 0);
    }

    #[test]
    fn failures_quote_stderr() {
        let err = run_checked(Command::new("sh").args(["-c", "echo boom >&2; exit 3"]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("boom"), "{err}");
        let err = run_timed(
            Command::new("sh").args(["-c", "echo bang >&2; exit 4"]),
            ThenSync::No,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("bang"), "{err}");
    }
}
