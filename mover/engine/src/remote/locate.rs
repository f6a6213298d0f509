//! A relationship's peer volume: an `agent://` URL as it is, or one a peer cluster's
//! Locator gives for `cluster://HOST:PORT` (see `proto/locate.proto`).

use super::{AgentUrl, RemoteOptions, status_error};
use crate::error::{CopyError, RemoteCode};
use transport::locate::{LocateRequest, locator_client::LocatorClient};

/// The scheme of a peer cluster's Locator.
pub const CLUSTER_SCHEME: &str = "cluster://";
/// The name a Locator's certificate carries.
pub const LOCATOR_NAME: &str = "mover-locator";

/// The volume `peer` names for `relationship`: an agent URL as it is; for
/// `cluster://HOST:PORT`, the agent and volume that cluster's Locator answers now
/// (asked with `remote`'s token and CA).
pub async fn locate(
    peer: &str,
    relationship: &str,
    remote: &RemoteOptions,
) -> Result<AgentUrl, CopyError> {
    let bad = |why: String| CopyError::BadDestination {
        path: peer.into(),
        why,
    };
    let Some(authority) = peer.strip_prefix(CLUSTER_SCHEME) else {
        return AgentUrl::parse(peer).ok_or_else(|| {
            bad("expected agent://HOST:PORT/VOLUME or cluster://HOST:PORT".into())
        })?;
    };
    let locator = AgentUrl::parse(&format!(
        "agent://{LOCATOR_NAME}@{}/-",
        authority.trim_end_matches('/')
    ))
    .ok_or_else(|| bad("expected cluster://HOST:PORT".into()))?
    .map_err(|e| bad(e.to_string()))?;
    let (channel, auth) = remote.channel(&locator).await?;
    let answer = LocatorClient::with_interceptor(channel, auth)
        .locate(LocateRequest {
            relationship: relationship.into(),
        })
        .await
        .map_err(|s| status_error(&locator, s))?
        .into_inner();
    AgentUrl::parse(&answer.volume).ok_or_else(|| CopyError::Remote {
        url: peer.into(),
        code: RemoteCode::Url,
        message: format!("the locator answered {:?}, not an agent URL", answer.volume),
        refusal: None,
    })?
}
