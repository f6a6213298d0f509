//! Scheduled snapshots (docs/ARCHITECTURE.md): an agent snapshots one of its
//! exports into a repository at set times, forgets old snapshots by a retention policy
//! and prunes at a cadence. A schedule is kept in the agent's state directory as a
//! `schedule.proto` Record (its repository password and keys included: the directory
//! is root's only) and runs as one task ([`Schedules`]).

mod runner;
mod when;

pub use runner::{ApplyError, Schedules};
pub use when::When;
