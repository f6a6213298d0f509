//! Content-addressed snapshot repository (packs, index, manifests) on a local
//! directory or S3, per shared/DESIGN.md §4.
//!
//! Not built yet: this crate is reserved by the workspace layout and is filled in by
//! the snapshot-repository issue. It exports nothing, so nothing can depend on it by
//! accident.
