//! The crate's error type: every variant says what failed, where, and what to do.

use std::path::PathBuf;

/// Result alias for repository operations.
pub type Result<T, E = RepoError> = std::result::Result<T, E>;

/// Why a repository operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RepoError {
    /// An object the operation needs does not exist.
    #[error("{location}: object {key} does not exist")]
    NotFound {
        /// The repository location.
        location: String,
        /// The object key.
        key: String,
    },
    /// The storage backend failed an operation.
    #[error("{location}: {op} {key} failed: {detail}")]
    Backend {
        /// The repository location (path or s3://bucket/prefix, with endpoint).
        location: String,
        /// The operation ("get", "put", "list", "delete").
        op: &'static str,
        /// The object key (or prefix for list).
        key: String,
        /// Whether trying again may succeed (a 5xx, a timeout, a dropped connection).
        retryable: bool,
        /// What the backend said, and what to do.
        detail: String,
    },
    /// A retryable backend error persisted past the retry budget.
    #[error(
        "{source} (gave up after {attempts} attempts over {elapsed_secs:.1}s; check that the storage is reachable and rerun)"
    )]
    RetriesExhausted {
        /// The last error.
        source: Box<RepoError>,
        /// Attempts made.
        attempts: u32,
        /// Time spent trying.
        elapsed_secs: f64,
    },
    /// No repository at the location.
    #[error(
        "{location}: no repository here (no config object); create one with `mover repo init {location}`"
    )]
    NoRepository {
        /// The repository location.
        location: String,
    },
    /// `init` on a location that already holds a repository.
    #[error("{location}: a repository already exists here; nothing was changed")]
    AlreadyExists {
        /// The repository location.
        location: String,
    },
    /// The bucket of an S3 location does not exist.
    #[error(
        "bucket {bucket} does not exist at {endpoint}; create it first (e.g. `aws s3 mb s3://{bucket}`) or fix the bucket name"
    )]
    NoBucket {
        /// The bucket.
        bucket: String,
        /// The endpoint used.
        endpoint: String,
    },
    /// No key of the repository opens with the password or key file given.
    #[error(
        "{location}: the password or key file does not open any key of this repository (wrong password?)"
    )]
    WrongPassword {
        /// The repository location.
        location: String,
    },
    /// No password or key was given.
    #[error(
        "no password or key given: set MOVER_PASSWORD, or pass --password-file FILE or --key-file FILE"
    )]
    NoPassword,
    /// A key file or password file could not be used.
    #[error("key material {path}: {why}")]
    BadKeyFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A persisted object has a format version this build does not read.
    #[error(
        "{key}: format version {found} is not supported (this build reads version {supported}); upgrade mover"
    )]
    UnsupportedVersion {
        /// The object key.
        key: String,
        /// Version found.
        found: u32,
        /// Version this build reads.
        supported: u32,
    },
    /// An object is damaged: it fails authentication or does not parse.
    #[error(
        "{key} is damaged at offset {offset}: {what}; run `mover snapshot verify --read-data` to find the affected snapshots"
    )]
    Corrupt {
        /// The object key.
        key: String,
        /// Byte offset in the object (0 if unknown).
        offset: u64,
        /// What is wrong.
        what: String,
    },
    /// A blob the snapshot refers to is not in the index.
    #[error(
        "blob {id} is not in the repository index (the repository is incomplete; run `mover snapshot verify`)"
    )]
    MissingBlob {
        /// The blob id (hex).
        id: String,
    },
    /// No snapshot with this id (or prefix).
    #[error("{location}: no snapshot {id}; list them with `mover snapshot list`")]
    UnknownSnapshot {
        /// The repository location.
        location: String,
        /// The id or prefix asked for.
        id: String,
    },
    /// An id prefix matches several snapshots.
    #[error("{location}: snapshot id prefix {id} is ambiguous ({count} matches); give more digits")]
    AmbiguousSnapshot {
        /// The repository location.
        location: String,
        /// The prefix.
        id: String,
        /// How many snapshots match.
        count: usize,
    },
    /// Reading a volume failed.
    #[error(transparent)]
    Volume(#[from] chunker::ChunkerError),
    /// A local file operation failed (restore destination, key file, cache).
    #[error("{what} {path} at offset {offset} failed: {cause}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Byte offset (0 for whole-file operations).
        offset: u64,
        /// The OS error.
        cause: std::io::Error,
    },
    /// A destination or argument that cannot be used.
    #[error("{what}: {why}")]
    Refused {
        /// The thing refused (a path, an argument).
        what: String,
        /// Why, and what to do.
        why: String,
    },
    /// Verification found problems.
    #[error("verification failed: {problems} problem(s) found; see the report above")]
    VerifyFailed {
        /// Number of problems.
        problems: usize,
    },
}

impl RepoError {
    /// Whether trying the same operation again may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            RepoError::Backend { retryable, .. } => *retryable,
            RepoError::Io { cause, .. } => matches!(
                cause.kind(),
                std::io::ErrorKind::Interrupted | std::io::ErrorKind::TimedOut
            ),
            _ => false,
        }
    }

    /// Whether the error refuses bad input (nothing was written).
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            RepoError::NoRepository { .. }
                | RepoError::AlreadyExists { .. }
                | RepoError::NoBucket { .. }
                | RepoError::WrongPassword { .. }
                | RepoError::NoPassword
                | RepoError::BadKeyFile { .. }
                | RepoError::UnknownSnapshot { .. }
                | RepoError::AmbiguousSnapshot { .. }
                | RepoError::Refused { .. }
                | RepoError::UnsupportedVersion { .. }
        )
    }

    /// Whether the error reports damaged repository data.
    pub fn is_corruption(&self) -> bool {
        matches!(
            self,
            RepoError::Corrupt { .. }
                | RepoError::MissingBlob { .. }
                | RepoError::VerifyFailed { .. }
        )
    }

    /// Whether this is a missing object (possibly behind a retry wrapper).
    pub fn is_not_found(&self) -> bool {
        matches!(self, RepoError::NotFound { .. })
    }
}
