//! Progress notes on stderr, stamped with the time since the bench started.

use std::sync::OnceLock;
use std::time::Instant;

/// When the bench started (the first note, at the latest).
static START: OnceLock<Instant> = OnceLock::new();

/// Starts the clock the notes are stamped with.
pub fn start() {
    START.get_or_init(Instant::now);
}

/// Prints `message` on stderr with the elapsed time.
pub fn print_note(message: &str) {
    let elapsed = START.get_or_init(Instant::now).elapsed().as_secs_f64();
    eprintln!("[{elapsed:7.1}s] {message}");
}

/// `note!("fmt", args..)`: a formatted [`print_note`].
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::progress::print_note(&format!($($arg)*))
    };
}
pub(crate) use note;
