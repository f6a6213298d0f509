//! Copies to and from a peer agent: `mover copy SRC agent://host:port/NAME` (push) and
//! `mover copy agent://host:port/NAME DST` (pull).
//!
//! Both sides hash their volume into a Merkle summary; the client compares group hashes,
//! then the chunk leaves of differing groups, then the 4 KiB page hashes of differing
//! chunks, and ships only the pages that differ, over several parallel gRPC streams.
//! A transfer cut short (a dropped connection, either side killed) is resumed by the
//! client's retry or a rerun: the comparison finds what is still missing, so at most the
//! data in flight at the cut is sent again.

mod connect;
mod groups;
mod locate;
mod pull;
mod push;
mod status;
mod tree;
mod units;
mod url;

pub use connect::Client;
pub use connect::{
    Compress, ConnectOptions, ControlClient, HydrateClient, RemoteOptions, ScheduleClient,
    parse_rate,
};
pub(crate) use connect::{Session, open_session};
pub use groups::KnownChunks;
pub(crate) use groups::{Group, RemoteGroups, read_groups, tree};
pub use locate::{CLUSTER_SCHEME, LOCATOR_NAME, locate};
pub use pull::pull;
pub use push::{CyclePush, push, push_cycle};
pub use status::error_chain;
pub(crate) use status::{Backoff, timed, with_retries};
pub use status::{status_error, tls_hint};
pub use tree::{is_tree, pull_tree, push_tree, push_tree_cycle};
pub use url::AgentUrl;
