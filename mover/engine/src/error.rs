//! The engine's errors: what failed, where, and whether a rerun may succeed.

use chunker::ChunkerError;
use std::path::PathBuf;

/// Result alias for the engine.
pub type Result<T, E = CopyError> = std::result::Result<T, E>;

/// Why a copy was refused or failed. Every message says what, where, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// Reading or opening a volume failed.
    #[error(transparent)]
    Volume(#[from] ChunkerError),
    /// The destination cannot hold the source.
    #[error(
        "destination {path} is smaller than the source ({dst_size} < {src_size} bytes); {hint}"
    )]
    DestinationTooSmall {
        /// Destination path.
        path: PathBuf,
        /// Its size.
        dst_size: u64,
        /// The source size.
        src_size: u64,
        /// What to do about it.
        hint: &'static str,
    },
    /// An image file destination larger than the source would keep stale bytes past the end.
    #[error(
        "destination {path} is larger than the source ({dst_size} > {src_size} bytes): the copy \
         would keep stale bytes past the source's end. Shrink it first (truncate -s {src_size} \
         {path}) or remove it"
    )]
    DestinationLarger {
        /// Destination path.
        path: PathBuf,
        /// Its size.
        dst_size: u64,
        /// The source size.
        src_size: u64,
    },
    /// Source and destination are the same storage.
    #[error("source {src} and destination {dst} are the same volume{detail}; nothing was written")]
    SameVolume {
        /// Source path.
        src: PathBuf,
        /// Destination path.
        dst: PathBuf,
        /// How they are the same (e.g. a loop device over the file).
        detail: String,
    },
    /// The destination block device is mounted or held by another user.
    #[error(
        "destination {path} is {detail}; writing under a mounted filesystem corrupts it. \
         Unmount it first, or pass --force if you are sure"
    )]
    DestinationInUse {
        /// Destination path.
        path: PathBuf,
        /// Where it is mounted, or who holds it.
        detail: String,
    },
    /// The destination path cannot be used (a directory, a missing parent, ...).
    #[error("destination {path}: {why}")]
    BadDestination {
        /// Destination path.
        path: PathBuf,
        /// What is wrong and what to do.
        why: String,
    },
    /// The source cannot be used as asked (e.g. it cannot be cloned or frozen).
    #[error("source {path}: {why}")]
    BadSource {
        /// Source path.
        path: PathBuf,
        /// What is wrong and what to do.
        why: String,
    },
    /// The job requires a point in time of the source and none can be taken.
    #[error("source {path}: {}", crate::node::point_in_time::refusal(what))]
    NoPointInTime {
        /// Source path.
        path: PathBuf,
        /// What the source is that no point in time can be taken of it.
        what: String,
    },
    /// A write, punch, sync or rename on the destination failed.
    #[error("{what} {path} at offset {offset} failed: {cause}{hint}")]
    Write {
        /// What was being done ("write to", "sync of", ...).
        what: &'static str,
        /// Destination path.
        path: PathBuf,
        /// Byte offset (0 for whole-file operations).
        offset: u64,
        /// The OS error.
        cause: std::io::Error,
        /// Advice, e.g. for a full disk.
        hint: &'static str,
    },
    /// The destination read back differs from the source.
    #[error(
        "verification failed: {dst} differs from {src} at offset {offset}; the destination is \
         not a valid copy (rerun the copy to repair it)"
    )]
    VerifyFailed {
        /// Source path.
        src: PathBuf,
        /// Destination path.
        dst: PathBuf,
        /// First differing byte offset found (chunk-aligned).
        offset: u64,
    },
    /// A tree's second pass (`--verify`) found entries that differ from the source.
    #[error(
        "verification failed: {differing} entries of {dst} differed from {src} after the copy \
         (a file changing meanwhile, or a storage fault); they were copied again: rerun with \
         --verify to confirm"
    )]
    TreeVerifyFailed {
        /// Source directory.
        src: PathBuf,
        /// Destination directory.
        dst: PathBuf,
        /// Entries found different (and repaired).
        differing: u64,
    },
    /// A peer agent refused or failed a call, or could not be reached.
    #[error("agent {url}: {code}: {message}{}", remote_hint(*code))]
    Remote {
        /// The agent URL (or the file involved).
        url: String,
        /// What kind of failure (unavailable, unauthenticated, refused, ...).
        code: RemoteCode,
        /// The agent's or the transport's message.
        message: String,
        /// The refusal's kind, when the agent named one: what a caller matches.
        refusal: Option<transport::refusal::Refusal>,
    },
    /// A file tree's top directory could not be read, created or finished.
    #[error("{what} {path}: {cause}")]
    Tree {
        /// The directory.
        path: PathBuf,
        /// What was being done ("cannot open the source", ...).
        what: &'static str,
        /// The OS error.
        cause: std::io::Error,
    },
    /// A replication cycle failed in a way the next one cannot mend.
    #[error("relationship {relationship}: {message}")]
    CycleFailed {
        /// The relationship.
        relationship: String,
        /// What went wrong.
        message: String,
        /// The cycle's error was a refusal of bad input.
        refusal: bool,
    },
    /// The state directory (interrupted-copy markers) could not be used.
    #[error(
        "state directory {path}: {cause} (set --state-dir or MOVER_STATE_DIR to a writable directory)"
    )]
    State {
        /// The path.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
}

impl CopyError {
    /// Whether rerunning the same command may succeed without the user changing anything.
    pub fn is_retryable(&self) -> bool {
        match self {
            CopyError::Volume(e) => e.is_retryable(),
            CopyError::Remote { code, .. } => {
                matches!(code, RemoteCode::Unavailable | RemoteCode::Timeout)
            }
            CopyError::Write { cause, .. } => matches!(
                cause.kind(),
                std::io::ErrorKind::Interrupted | std::io::ErrorKind::TimedOut
            ),
            _ => false,
        }
    }

    /// Whether the error is a refusal of bad input, made before anything was written.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            CopyError::DestinationTooSmall { .. }
                | CopyError::DestinationLarger { .. }
                | CopyError::SameVolume { .. }
                | CopyError::DestinationInUse { .. }
                | CopyError::BadDestination { .. }
                | CopyError::BadSource { .. }
                | CopyError::NoPointInTime { .. }
                | CopyError::CycleFailed { refusal: true, .. }
        ) || matches!(
            self,
            CopyError::Volume(ChunkerError::Open { .. } | ChunkerError::NotABlockVolume { .. })
        ) || matches!(self, CopyError::Remote { code, .. }
                if !matches!(code, RemoteCode::Unavailable | RemoteCode::Timeout | RemoteCode::Error
                    | RemoteCode::Protocol | RemoteCode::StaleBase))
    }
}

/// What kind of failure a [`CopyError::Remote`] is: the agent's answer (a gRPC status
/// code, mapped by `remote::status_error`) or what failed on this side before or after
/// the call. It prints as the word every message and `--json` output has always used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteCode {
    /// The agent rejected the token or the client certificate.
    Unauthenticated,
    /// The agent refused the call to this client.
    PermissionDenied,
    /// The agent has no such volume, relationship or session.
    NotFound,
    /// What the call would create exists already.
    Exists,
    /// The agent refused the call as things are (e.g. a stale epoch).
    Refused,
    /// The agent could not be reached, or the call was cut off: retryable.
    Unavailable,
    /// The call took too long: retryable.
    Timeout,
    /// The agent found the request malformed or out of range.
    BadRequest,
    /// Any other failure of the agent, or of this side's transfer task.
    Error,
    /// The agent answered something this side cannot use.
    Protocol,
    /// The secondary differs in a chunk a cycle did not read (it trusted the previous
    /// cycle's index): the cycle must be pushed again comparing every chunk.
    StaleBase,
    /// The token could not be read or used.
    Token,
    /// The TLS files could not be loaded or used.
    Tls,
    /// The agent's URL makes no endpoint.
    Url,
    /// The async runtime could not be started.
    Runtime,
    /// The agent's answer could not be decoded.
    BadAnswer,
}

impl RemoteCode {
    /// The word messages print for this code.
    fn as_str(self) -> &'static str {
        match self {
            RemoteCode::Unauthenticated => "unauthenticated",
            RemoteCode::PermissionDenied => "permission denied",
            RemoteCode::NotFound => "not found",
            RemoteCode::Exists => "exists",
            RemoteCode::Refused => "refused",
            RemoteCode::Unavailable => "unavailable",
            RemoteCode::Timeout => "timeout",
            RemoteCode::BadRequest => "bad request",
            RemoteCode::Error => "error",
            RemoteCode::Protocol => "protocol",
            RemoteCode::StaleBase => "stale base",
            RemoteCode::Token => "token",
            RemoteCode::Tls => "tls",
            RemoteCode::Url => "url",
            RemoteCode::Runtime => "runtime",
            RemoteCode::BadAnswer => "bad answer",
        }
    }
}

impl std::fmt::Display for RemoteCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to do about a remote failure of kind `code`.
fn remote_hint(code: RemoteCode) -> &'static str {
    match code {
        RemoteCode::Unauthenticated => {
            " (check --token-file / MOVER_TOKEN, or the TLS certificates)"
        }
        RemoteCode::Unavailable => {
            " (is the agent running and reachable? rerunning continues the transfer)"
        }
        RemoteCode::Tls => " (check --tls-ca, --tls-cert and --tls-key)",
        _ => "",
    }
}

/// Builds a [`CopyError::Write`] for `path`, adding advice for the errors a user can act on.
pub(crate) fn write_error(
    what: &'static str,
    path: &std::path::Path,
    offset: u64,
    cause: std::io::Error,
) -> CopyError {
    let hint = match cause.kind() {
        std::io::ErrorKind::StorageFull => {
            ": the destination is full. Free space (or use a larger destination) and rerun: \
             the copy resumes and rewrites nothing already equal"
        }
        std::io::ErrorKind::ReadOnlyFilesystem => ": the destination is read-only",
        _ => "",
    };
    CopyError::Write {
        what,
        path: path.to_path_buf(),
        offset,
        cause,
        hint,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_codes_print_as_the_words_messages_always_used() {
        let words = [
            (RemoteCode::Unauthenticated, "unauthenticated"),
            (RemoteCode::PermissionDenied, "permission denied"),
            (RemoteCode::NotFound, "not found"),
            (RemoteCode::Exists, "exists"),
            (RemoteCode::Refused, "refused"),
            (RemoteCode::Unavailable, "unavailable"),
            (RemoteCode::Timeout, "timeout"),
            (RemoteCode::BadRequest, "bad request"),
            (RemoteCode::Error, "error"),
            (RemoteCode::Protocol, "protocol"),
            (RemoteCode::StaleBase, "stale base"),
            (RemoteCode::Token, "token"),
            (RemoteCode::Tls, "tls"),
            (RemoteCode::Url, "url"),
            (RemoteCode::Runtime, "runtime"),
            (RemoteCode::BadAnswer, "bad answer"),
        ];
        for (code, word) in words {
            assert_eq!(code.to_string(), word);
        }
        let e = |code| CopyError::Remote {
            url: "agent://b:7070/v".into(),
            code,
            message: "m".into(),
            refusal: None,
        };
        assert_eq!(
            e(RemoteCode::Unavailable).to_string(),
            "agent agent://b:7070/v: unavailable: m (is the agent running and reachable? \
             rerunning continues the transfer)"
        );
        assert_eq!(
            e(RemoteCode::Unauthenticated).to_string(),
            "agent agent://b:7070/v: unauthenticated: m (check --token-file / MOVER_TOKEN, or \
             the TLS certificates)"
        );
        assert_eq!(
            e(RemoteCode::Tls).to_string(),
            "agent agent://b:7070/v: tls: m (check --tls-ca, --tls-cert and --tls-key)"
        );
        assert_eq!(
            e(RemoteCode::StaleBase).to_string(),
            "agent agent://b:7070/v: stale base: m"
        );
        // Retryable and refusal as the words were: only unavailable and timeout retry;
        // everything but those, error, protocol and stale base is a refusal.
        for (code, word) in words {
            assert_eq!(
                e(code).is_retryable(),
                matches!(word, "unavailable" | "timeout"),
                "{word}"
            );
            assert_eq!(
                e(code).is_refusal(),
                !matches!(
                    word,
                    "unavailable" | "timeout" | "error" | "protocol" | "stale base"
                ),
                "{word}"
            );
        }
    }
}
