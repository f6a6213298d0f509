//! What a failure means to whoever ran the job: the one classification of the engine's
//! and the repository's errors, which the binary turns into exit codes.

use crate::{CopyError, EndpointError};
use snapshots::RepoError;
use std::error::Error;

/// The kind of a failed job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Bad input or usage, refused before anything was written.
    Refused,
    /// Data read back or found did not match: a copy's verification, a damaged
    /// repository.
    Damaged,
    /// Failed part way: running the same job again resumes.
    Failed,
}

/// The outcome of `err`, looking through its causes: the first cause mover knows that
/// is a refusal or damage decides; anything else failed part way.
pub fn outcome_of(err: &(dyn Error + 'static)) -> Outcome {
    let mut cause = Some(err);
    while let Some(e) = cause {
        if let Some(decided) = decisive(e) {
            return decided;
        }
        cause = e.source();
    }
    Outcome::Failed
}

/// Refused or Damaged when `e` itself says so.
fn decisive(e: &(dyn Error + 'static)) -> Option<Outcome> {
    if let Some(e) = e.downcast_ref::<EndpointError>() {
        // `Copy` is transparent: its source skips the copy error itself.
        return match e {
            EndpointError::Copy(c) => of_copy(c),
            e => e.is_refusal().then_some(Outcome::Refused),
        };
    }
    if let Some(e) = e.downcast_ref::<CopyError>() {
        return of_copy(e);
    }
    if let Some(e) = e.downcast_ref::<RepoError>() {
        return if e.is_corruption() {
            Some(Outcome::Damaged)
        } else {
            e.is_refusal().then_some(Outcome::Refused)
        };
    }
    None
}

fn of_copy(e: &CopyError) -> Option<Outcome> {
    match e {
        CopyError::VerifyFailed { .. } | CopyError::TreeVerifyFailed { .. } => {
            Some(Outcome::Damaged)
        }
        e if e.is_refusal() => Some(Outcome::Refused),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_damage_and_failures_are_told_apart_through_their_causes() {
        let refused = CopyError::BadSource {
            path: "/dev/nothing".into(),
            why: "no such device".into(),
        };
        assert_eq!(outcome_of(&refused), Outcome::Refused);
        let wrapped = EndpointError::Copy(CopyError::VerifyFailed {
            src: "/dev/loop0".into(),
            dst: "/dev/loop1".into(),
            offset: 4096,
        });
        assert_eq!(outcome_of(&wrapped), Outcome::Damaged);
        // Behind context, as the binary sees it.
        let corrupt = anyhow::Error::new(RepoError::Corrupt {
            key: "data/00/00ab".into(),
            offset: 0,
            what: "bad tag".into(),
        })
        .context("snapshot create");
        assert_eq!(outcome_of(&*corrupt), Outcome::Damaged);
        let io = anyhow::Error::new(std::io::Error::other("disk gone")).context("copy");
        assert_eq!(outcome_of(&*io), Outcome::Failed);
    }
}
