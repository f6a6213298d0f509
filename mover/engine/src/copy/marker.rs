//! Markers of in-place copies under way.
//!
//! A copy onto an existing image or a block device cannot hide behind a temp name, so a
//! small marker file in the state directory says "this destination is being written".
//! It is made durable before the first write and removed only after the final sync (and
//! verification), so an interrupted copy is reported, and finished, by the next run.

use crate::error::{CopyError, Result};
use chunker::durable::{parent_of, sync_dir, write_durably};
use std::{
    fs,
    path::{Path, PathBuf},
};

/// Format version of the marker file.
const MARKER_VERSION: u32 = 1;

/// An in-progress marker; dropping it leaves it in place (the copy did not finish).
#[derive(Debug)]
pub(crate) struct Marker {
    path: PathBuf,
}

impl Marker {
    /// Writes the marker for `dst` durably; returns it and whether one was already there.
    pub fn begin(state_dir: &Path, dst: &Path, src: &Path) -> Result<(Marker, bool)> {
        let dir = state_dir.join("copies");
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |cause| CopyError::State { path, cause }
        };
        fs::create_dir_all(&dir).map_err(err(&dir))?;
        let dst_abs = fs::canonicalize(dst).unwrap_or_else(|_| dst.to_path_buf());
        let name = blake3::hash(dst_abs.as_os_str().as_encoded_bytes()).to_hex();
        let path = dir.join(format!("{}.json", &name[..32]));
        let existed = path.exists();
        let body = serde_json::json!({
            "version": MARKER_VERSION,
            "destination": dst_abs,
            "source": fs::canonicalize(src).unwrap_or_else(|_| src.to_path_buf()),
            "state": "copy in progress: the destination is not a complete copy until this file is gone",
        });
        let text = serde_json::to_string_pretty(&body).map_err(|e| err(&path)(e.into()))?;
        write_durably(&path, text.as_bytes()).map_err(err(&path))?;
        Ok((Marker { path }, existed))
    }

    /// Removes the marker durably: the destination is complete.
    pub fn finish(self) -> Result<()> {
        let err = |cause| CopyError::State {
            path: self.path.clone(),
            cause,
        };
        fs::remove_file(&self.path).map_err(err)?;
        sync_dir(parent_of(&self.path)).map_err(err)
    }
}
