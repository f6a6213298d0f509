//! Who may read an agent's or the controller's /metrics under Kubernetes: a scraper's
//! bearer token reviewed by the API server (TokenReview), then its user asked about (a
//! SubjectAccessReview for `get` on the non-resource URL `/metrics`), as kube-rbac-proxy
//! does. `transport::scrape_access::Gate` keeps the verdicts; the agent reaches this
//! code through the `mover` binary, so only this crate depends on kube. The agent's and
//! the controller's ServiceAccounts may create both reviews (what ClusterRole
//! system:auth-delegator grants, and no more).

use k8s_openapi::api::{
    authentication::v1::{TokenReview, TokenReviewSpec},
    authorization::v1::{NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec},
};
use kube::api::{Api, PostParams};
use tokio::sync::OnceCell;
use transport::scrape_access::{ReviewFuture, Reviewer, Verdict};

/// Scrapers' tokens, reviewed by the API server of the cluster this process runs in.
pub struct ClusterReviewer;

impl Reviewer for ClusterReviewer {
    fn review<'a>(&'a self, token: &'a str) -> ReviewFuture<'a> {
        Box::pin(async move {
            Ok(match review(token).await? {
                None => Verdict::Unauthenticated,
                Some(Err(user)) => Verdict::Forbidden(user),
                Some(Ok(())) => Verdict::Allowed,
            })
        })
    }
}

/// Whether the holder of `token` may get /metrics: `Ok(None)` when the API server does
/// not know the token, `Ok(Some(Err(user)))` when `user` may not, `Ok(Some(Ok(())))`
/// when allowed; `Err`: the API server could not be asked.
pub async fn review(token: &str) -> Result<Option<Result<(), String>>, String> {
    static CLIENT: OnceCell<kube::Client> = OnceCell::const_new();
    let client = CLIENT
        .get_or_try_init(|| async {
            transport::tls::install_crypto_provider();
            kube::Client::try_default().await.map_err(|e| {
                format!("no Kubernetes credentials to review a scraper's token with: {e}")
            })
        })
        .await?
        .clone();
    let reviewed = Api::<TokenReview>::all(client.clone())
        .create(
            &PostParams::default(),
            &TokenReview {
                spec: TokenReviewSpec {
                    token: Some(token.into()),
                    audiences: None,
                },
                ..Default::default()
            },
        )
        .await
        .map_err(|e| format!("TokenReview: {e}"))?;
    let status = reviewed.status.unwrap_or_default();
    let Some(user) = status.user.filter(|_| status.authenticated == Some(true)) else {
        return Ok(None);
    };
    let name = user.username.clone().unwrap_or_default();
    let asked = Api::<SubjectAccessReview>::all(client)
        .create(
            &PostParams::default(),
            &SubjectAccessReview {
                spec: SubjectAccessReviewSpec {
                    user: user.username,
                    uid: user.uid,
                    groups: user.groups,
                    extra: user.extra,
                    non_resource_attributes: Some(NonResourceAttributes {
                        path: Some("/metrics".into()),
                        verb: Some("get".into()),
                    }),
                    resource_attributes: None,
                },
                ..Default::default()
            },
        )
        .await
        .map_err(|e| format!("SubjectAccessReview: {e}"))?;
    Ok(Some(if asked.status.is_some_and(|s| s.allowed) {
        Ok(())
    } else {
        Err(name)
    }))
}
