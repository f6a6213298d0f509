//! Object storage seen by the repository: a small async trait and its implementations.
//!
//! Keys are `/`-separated relative names (`config`, `packs/ab/ab12…`). Every
//! implementation passes the same conformance suite (snapshots/tests/backend.rs).

mod fault;
mod local;
mod memory;
mod retry;
mod s3;

pub use fault::{Fault, FaultBackend, OpCounts};
pub use local::LocalBackend;
pub use memory::MemoryBackend;
pub use retry::{RetryBackend, RetryPolicy};
pub use s3::{S3Backend, S3Options};

use crate::error::{RepoError, Result};
use bytes::Bytes;
use std::{fmt, ops::Range};

/// One object found by [`Backend::list`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Its key (relative to the repository root).
    pub key: String,
    /// Its size in bytes.
    pub size: u64,
}

/// Where a repository's objects live. Used as `Arc<dyn Backend>`; wrappers (retry,
/// fault injection) wrap another backend.
#[async_trait::async_trait]
pub trait Backend: Send + Sync + fmt::Debug {
    /// A human-readable location for messages, e.g. `/srv/repo` or `s3://b/p (endpoint …)`.
    fn location(&self) -> String;

    /// Every object whose key starts with `prefix`, in no particular order.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>>;

    /// The object's bytes, or the bytes of `range` in it. A range must start inside the
    /// object; an end past the object's end is clamped. A missing object is
    /// [`RepoError::NotFound`].
    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<Bytes>;

    /// Stores an object, replacing any object with that key. When this returns the
    /// object is durable, and readers see either the old or the whole new object.
    async fn put(&self, key: &str, data: Bytes) -> Result<()>;

    /// Removes an object. Removing a missing object succeeds.
    async fn delete(&self, key: &str) -> Result<()>;
}

/// Checks that a key is a relative `/`-separated name without `.`/`..` parts.
pub(crate) fn check_key(location: &str, op: &'static str, key: &str) -> Result<()> {
    let bad = key.is_empty()
        || key.starts_with('/')
        || key
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == ".." || p.starts_with(".tmp."));
    if bad {
        return Err(RepoError::Backend {
            location: location.into(),
            op,
            key: key.into(),
            retryable: false,
            detail: "invalid object key (a bug in mover)".into(),
        });
    }
    Ok(())
}

/// Applies the [`Backend::get`] range rules to a whole object held in memory.
pub(crate) fn slice_range(
    location: &str,
    key: &str,
    data: Bytes,
    range: Option<Range<u64>>,
) -> Result<Bytes> {
    let Some(r) = range else { return Ok(data) };
    let len = data.len() as u64;
    if r.start >= len && !(r.start == 0 && len == 0) || r.end < r.start {
        return Err(range_error(location, key, &r, len));
    }
    Ok(data.slice(r.start as usize..r.end.min(len) as usize))
}

/// The error for a range that does not start inside the object.
pub(crate) fn range_error(location: &str, key: &str, r: &Range<u64>, len: u64) -> RepoError {
    RepoError::Backend {
        location: location.into(),
        op: "get",
        key: key.into(),
        retryable: false,
        detail: format!(
            "range {}..{} is outside the object ({len} bytes); the object is truncated or the index is wrong",
            r.start, r.end
        ),
    }
}
