//! The `mover` library as one name: the crates under `mover/` re-exported, so the binary
//! and the integration tests under `mover/tests` say `mover::…` whatever crate holds it.
//!
//! - `mover-engine` (`mover/engine`): node state, block and tree copies, copies to and
//!   from an agent, snapshots, `mover copy` as one call; its items are at this root.
//! - `mover-node` (`mover/node`): what runs on a node: [`agent`], [`replicate`],
//!   [`hydrate`], [`schedule`].
//! - `mover-controller` (`mover/controller`, cargo feature `controller`): [`controller`],
//!   the one crate that depends on kube.
//!
//! docs/ARCHITECTURE.md draws the crates and what each may use.

pub use mover_engine::*;
pub use mover_node::{agent, fd_store, hydrate, replicate, schedule};

#[cfg(feature = "controller")]
pub use mover_controller as controller;
