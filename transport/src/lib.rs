//! gRPC transport between per-node agents (Merkle have/need, streamed chunks,
//! resumable sessions, mTLS, fencing epochs), per shared/DESIGN.md §5.
//!
//! Not built yet: this crate is reserved by the workspace layout and is filled in by
//! the agents issue. It exports nothing, so nothing can depend on it by accident.
