//! The binary's side of each command: arguments (clap), printing, progress bars and
//! process setup. Each runner calls one library function of `mover`; no job logic lives
//! here.

pub mod agent;
pub mod copy;
pub mod hydrate;
pub mod replicate;
pub mod schedule;
pub mod snapshot;

use indicatif::{ProgressBar, ProgressStyle};
use mover::Progress;
use std::{io::IsTerminal, sync::Mutex};

/// How results are shown.
#[derive(clap::Args)]
pub struct OutputArgs {
    /// Print one JSON object with the results on stdout instead of text.
    #[arg(long)]
    pub json: bool,
    /// Show no progress. On a terminal it is a bar; elsewhere (a Job's log) a line
    /// when a phase begins, every --progress-every, and when it ends.
    #[arg(long)]
    pub no_progress: bool,
    /// How often a progress line is written when stderr is not a terminal.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = progress_every)]
    pub progress_every: std::time::Duration,
}

fn progress_every(s: &str) -> Result<std::time::Duration, String> {
    mover::node::parse_duration(s)
}

/// Keeps a snapshot's memory to what it holds: glibc would otherwise give each of the
/// walk's threads an arena that keeps freed chunk and pack buffers, and serve those
/// megabyte buffers from arenas that never shrink (measured on /usr/share: 230 MB peak,
/// 129 MB with two arenas and buffers of 1 MiB and more mapped and unmapped whole, for
/// the same time). A restore (`map_big: false`) keeps glibc's own threshold, which
/// rises to the sizes freed: its chunk and read buffers are then reused, where mapping
/// each one anew cost a page fault and a zeroed page per 4 KiB (a third more system
/// time on a 6 GiB tree). Settings made in the environment (`MALLOC_ARENA_MAX`,
/// `MALLOC_MMAP_THRESHOLD_`) win.
#[allow(unsafe_code)] // mallopt(3) has no safe wrapper; see SAFETY.
pub fn bounded_malloc(map_big: bool) {
    let set = |var: &str| std::env::var_os(var).is_some();
    // SAFETY: mallopt only changes allocator parameters; it is called before the
    // snapshot's threads start, and any value is valid for these two parameters.
    unsafe {
        if !set("MALLOC_ARENA_MAX") {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
        if map_big && !set("MALLOC_MMAP_THRESHOLD_") {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        }
    }
}

/// Bytes in binary units, e.g. "1.50 GiB".
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

/// Progress on stderr: a bar on a terminal; elsewhere (a Job's log, a file) a line when
/// a phase begins, every `--progress-every`, and when it ends.
pub struct Bar(Show);

enum Show {
    Nothing,
    Bar(Mutex<ProgressBar>),
    Lines(Mutex<Lines>),
}

/// The state of progress shown as lines.
struct Lines {
    every: std::time::Duration,
    phase: &'static str,
    total: u64,
    done: u64,
    started: std::time::Instant,
    shown: std::time::Instant,
}

impl Lines {
    fn line(&self) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let rate = self.done as f64 / secs;
        let per_sec = format!("{}/s", human(rate as u64));
        if self.total == 0 {
            return format!("{}: {} done, {per_sec}", self.phase, human(self.done));
        }
        let eta = if rate > 0.0 {
            format!(
                ", eta {:.0} s",
                self.total.saturating_sub(self.done) as f64 / rate
            )
        } else {
            String::new()
        };
        format!(
            "{}: {} of {} ({:.0}%), {per_sec}{eta}",
            self.phase,
            human(self.done),
            human(self.total),
            self.done as f64 * 100.0 / self.total as f64
        )
    }

    /// The phase's last line, if one began.
    fn end(&mut self) {
        if !self.phase.is_empty() {
            let secs = self.started.elapsed().as_secs_f64();
            eprintln!(
                "{}: done, {} in {secs:.1} s ({}/s)",
                self.phase,
                human(self.done),
                human((self.done as f64 / secs.max(1e-3)) as u64)
            );
            self.phase = "";
        }
    }
}

impl Bar {
    pub fn new(output: &OutputArgs) -> Self {
        Bar(if output.no_progress {
            Show::Nothing
        } else if std::io::stderr().is_terminal() {
            Show::Bar(Mutex::new(ProgressBar::hidden()))
        } else {
            let now = std::time::Instant::now();
            Show::Lines(Mutex::new(Lines {
                every: output.progress_every,
                phase: "",
                total: 0,
                done: 0,
                started: now,
                shown: now,
            }))
        })
    }

    pub fn done(&self) {
        match &self.0 {
            Show::Bar(bar) => bar.lock().expect("progress bar lock").finish_and_clear(),
            Show::Lines(lines) => lines.lock().expect("progress lock").end(),
            Show::Nothing => {}
        }
    }
}

impl Progress for Bar {
    fn begin(&self, phase: &'static str, total: u64) {
        match &self.0 {
            Show::Bar(bar) => {
                let mut bar = bar.lock().expect("progress bar lock");
                bar.finish_and_clear();
                // A total of 0 means unknown (a tree is copied as it is walked): no bar, no eta.
                let template = if total == 0 {
                    "{prefix:>7} {spinner} {binary_bytes} done {binary_bytes_per_sec} {elapsed}"
                } else {
                    "{prefix:>7} [{bar:40}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}"
                };
                *bar = ProgressBar::new(total).with_style(
                    ProgressStyle::with_template(template)
                        .expect("valid template")
                        .progress_chars("=> "),
                );
                if total == 0 {
                    bar.enable_steady_tick(std::time::Duration::from_millis(200));
                }
                bar.set_prefix(phase);
            }
            Show::Lines(lines) => {
                let mut l = lines.lock().expect("progress lock");
                l.end();
                let now = std::time::Instant::now();
                (l.phase, l.total, l.done, l.started, l.shown) = (phase, total, 0, now, now);
                eprintln!(
                    "{phase}: started{}",
                    if total > 0 {
                        format!(", {} to go", human(total))
                    } else {
                        String::new()
                    }
                );
            }
            Show::Nothing => {}
        }
    }

    fn update(&self, done: u64) {
        match &self.0 {
            Show::Bar(bar) => bar.lock().expect("progress bar lock").set_position(done),
            Show::Lines(lines) => {
                let mut l = lines.lock().expect("progress lock");
                l.done = done;
                if l.shown.elapsed() >= l.every {
                    l.shown = std::time::Instant::now();
                    eprintln!("{}", l.line());
                }
            }
            Show::Nothing => {}
        }
    }
}
