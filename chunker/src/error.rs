use std::path::PathBuf;

/// Result alias for this crate.
pub type Result<T, E = ChunkerError> = std::result::Result<T, E>;

/// Errors from reading and chunking volumes. Each names the path (and offset) it is about.
#[derive(Debug, thiserror::Error)]
pub enum ChunkerError {
    /// The volume could not be opened or inspected.
    #[error("cannot open {path}: {cause}")]
    Open {
        /// The volume's path.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
    /// The path exists but is not something that holds a block volume.
    #[error("{path} is {what}, not a block device or an image file")]
    NotABlockVolume {
        /// The path.
        path: PathBuf,
        /// What it is instead ("a directory", "a socket", ...).
        what: &'static str,
    },
    /// A read failed part way.
    #[error("read of {path} at offset {offset} failed: {cause}")]
    Read {
        /// The volume's path.
        path: PathBuf,
        /// Byte offset of the failed read.
        offset: u64,
        /// The OS error.
        cause: std::io::Error,
    },
    /// The volume got shorter while it was being read.
    #[error(
        "{path} ended at offset {offset}, before its size {size}: was it truncated while being read?"
    )]
    ShortRead {
        /// The volume's path.
        path: PathBuf,
        /// Where reading stopped.
        offset: u64,
        /// The size it had when opened.
        size: u64,
    },
    /// A chunk size or byte size given by the user is not acceptable.
    #[error("invalid size {given:?}: {why}")]
    InvalidSize {
        /// What was given.
        given: String,
        /// Why it is refused and what is accepted.
        why: String,
    },
}

impl ChunkerError {
    /// Whether retrying the same operation may succeed (a transient I/O error), as
    /// opposed to a permanent one (bad input, a missing file).
    pub fn is_retryable(&self) -> bool {
        use std::io::ErrorKind::*;
        match self {
            ChunkerError::Read { cause, .. } => {
                matches!(cause.kind(), Interrupted | WouldBlock | TimedOut)
            }
            _ => false,
        }
    }
}
