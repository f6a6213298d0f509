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
    /// Never draw a progress bar (it is drawn only when stderr is a terminal).
    #[arg(long)]
    pub no_progress: bool,
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

/// A progress bar on stderr, drawn only on a terminal.
pub struct Bar(Option<Mutex<ProgressBar>>);

impl Bar {
    pub fn new(output: &OutputArgs) -> Self {
        let show = !output.no_progress && std::io::stderr().is_terminal();
        Bar(show.then(|| Mutex::new(ProgressBar::hidden())))
    }

    pub fn done(&self) {
        if let Some(bar) = &self.0 {
            bar.lock().expect("progress bar lock").finish_and_clear();
        }
    }
}

impl Progress for Bar {
    fn begin(&self, phase: &'static str, total: u64) {
        if let Some(bar) = &self.0 {
            let mut bar = bar.lock().expect("progress bar lock");
            bar.finish_and_clear();
            // A total of 0 means unknown (a tree is copied as it is walked): no bar, no eta.
            let template = if total == 0 {
                "{prefix:>7} {spinner} {binary_bytes} written {binary_bytes_per_sec} {elapsed}"
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
    }

    fn update(&self, done: u64) {
        if let Some(bar) = &self.0 {
            bar.lock().expect("progress bar lock").set_position(done);
        }
    }
}
