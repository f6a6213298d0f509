//! File trees across the network: the side that writes walks both trees (the same walk
//! as a local copy) and asks the other side, its source, for listings and file contents
//! over one bidirectional gRPC stream of calls and answers.
//!
//! - [`RemoteSource`]: a `TreeSource` whose every question is a call on the stream.
//!   The walk's threads block on their own calls; one task routes answers back by id.
//! - [`Served`]: answers calls from a local directory, never reaching outside it
//!   (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`).
//!
//! In a push the agent walks and the client serves; in a pull, the other way round.

mod client;
mod serve;
mod wire;

pub use client::{Pending, RemoteSource, route_answers};
pub use serve::{Served, serve_calls};
pub use wire::{open_of, options_of};
