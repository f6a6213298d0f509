//! PVCs whose `spec.dataSourceRef` names a HydrationSource: made usable at once by
//! mover's own class ([`populator`]: a volume its node's agent fills while the pod uses
//! it), or filled before they are bound for other classes ([`prime`]: a prime PVC, a
//! restore Job, the PV handed over). Here: what both share.

use crate::agents::AgentError;
use crate::context::Context;
use crate::crd::SecretRef;

pub mod populator;
pub mod prime;
pub mod reclaim;
pub mod sources;

/// How soon a PVC or PV waiting for something outside the controller is looked at again.
const WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The annotation the scheduler sets on a WaitForFirstConsumer PVC.
pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";

/// Why a PVC could not be populated (yet).
#[derive(Debug, thiserror::Error)]
pub enum PopulateError {
    /// The API server refused or failed a call.
    #[error("{what}: {source}")]
    Kube {
        /// What was asked.
        what: String,
        /// Its answer.
        source: kube::Error,
    },
    /// The agent refused or failed.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// Something only the user can fix.
    #[error("{0}")]
    Invalid(String),
}

/// The annotation on a secret that lists the namespaces whose HydrationSources may
/// use it (comma-separated, or `*`).
pub const FOR_NAMESPACES: &str = "replication.mover/for-namespaces";

/// The data of the secret `r` names, for a HydrationSource in namespace `user`: only if
/// the secret says that namespace may use it. The secret lies in the controller's own
/// namespace, where users cannot look, so naming it must not be enough to use it.
pub(super) async fn source_secret(
    ctx: &Context,
    r: &SecretRef,
    user: &str,
    wanted: &str,
) -> Result<std::collections::BTreeMap<String, Vec<u8>>, String> {
    let secret = crate::context::secret(ctx, &r.namespace, &r.name, wanted).await?;
    let allowed = secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(FOR_NAMESPACES))
        .is_some_and(|list| {
            list.split(',')
                .map(str::trim)
                .any(|n| n == user || n == "*")
        });
    if !allowed {
        return Err(format!(
            "secret {}/{} is not for HydrationSources of namespace {user}: its administrator \
             lets a namespace use it with the annotation {FOR_NAMESPACES}: {user}",
            r.namespace, r.name
        ));
    }
    Ok(crate::context::data_of(secret))
}

/// The data of the repository secret `r` names (for namespace `user`) and which of its
/// keys holds the repository's: `password`, or `key` (a raw key).
pub(super) async fn repository_secret(
    ctx: &Context,
    r: &SecretRef,
    user: &str,
) -> Result<(std::collections::BTreeMap<String, Vec<u8>>, &'static str), String> {
    let wanted = "`password` (or `key`, a raw key) and, for S3, `AWS_ACCESS_KEY_ID` and \
                  `AWS_SECRET_ACCESS_KEY`";
    let data = source_secret(ctx, r, user, wanted).await?;
    let key = match (data.contains_key("password"), data.contains_key("key")) {
        (true, _) => "password",
        (false, true) => "key",
        _ => {
            return Err(format!(
                "secret {}/{} has no `password`: it needs {wanted}",
                r.namespace, r.name
            ));
        }
    };
    Ok((data, key))
}
