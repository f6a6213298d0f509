//! Rotating the cluster's mover CA (`mover controller rotate-ca`), so that certificates
//! signed before (an agent's, an operator's, one that leaked) stop being accepted.
//!
//! Three steps, each one change of the CA's Secret ([`CA_SECRET`]); the controller reads
//! it again within [`CA_CHECK_EVERY`], publishes what the cluster trusts in ConfigMap
//! [`TRUST_CONFIGMAP`], and the agents follow that ConfigMap:
//! 1. **begin**: a next CA is made and trusted beside the current one. Nothing is signed
//!    by it yet, so nothing changes for a peer that does not trust it yet: give each
//!    peer cluster the two CAs (its class secret's `ca.crt`) now.
//! 2. **issue**: the next CA signs in place of the current one, which is retired but
//!    still trusted; every agent asks for a certificate of the new CA at its next look,
//!    and the controller makes its own again.
//! 3. **finish**: once every agent holds a certificate of the new CA, the retired CA is
//!    dropped: nothing it signed is accepted any more. Give the peers the new CA alone.
//!
//! No step stops replication: a connection made before a step keeps its certificates,
//! and each new one is made with certificates and trust that both sides accept.

use crate::issuer::{
    Authority, CA_CRT, CA_KEY, CA_SECRET, NEXT_CRT, NEXT_KEY, RETIRED_CRT, SIGNER_KEY,
    TRUST_CONFIGMAP, TRUST_KEY,
};
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use std::collections::BTreeMap;
use std::time::Duration;
use transport::cluster::AGENT_TRUST_EVERY;

/// How often the controller reads the CA's Secret again: a step reaches it this soon.
pub const CA_CHECK_EVERY: Duration = Duration::from_secs(5);
/// How long a step waits for the controller to publish a trust.
const PUBLISH_WAIT: Duration = Duration::from_secs(60);
/// The label selector of the agent pods (as `mover controller run` has it by default).
pub const AGENT_SELECTOR: &str = "app.kubernetes.io/name=mover-agent";
/// The annotation of [`TRUST_CONFIGMAP`] saying when its trust was published (RFC 3339).
const PUBLISHED_AT: &str = "replication.mover/published-at";

/// Where a rotation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// One CA, trusted and signing.
    Steady,
    /// A next CA is trusted beside the one that signs (after `begin`).
    Trusting,
    /// The new CA signs; the retired one is still trusted (after `issue`).
    Reissuing,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Step::Steady => "steady: one CA (`rotate-ca begin` starts a rotation)",
            Step::Trusting => {
                "begun: the next CA is trusted beside the current one (next: give the \
                 peers the two CAs, then `rotate-ca issue`)"
            }
            Step::Reissuing => {
                "issuing: the new CA signs, the retired one is still trusted (next: \
                 `rotate-ca finish` once every agent holds a certificate of the new CA)"
            }
        })
    }
}

/// Why a step was not taken.
#[derive(Debug, thiserror::Error)]
#[error("CA rotation (secret {namespace}/{CA_SECRET}): {why}")]
pub struct RotationError {
    namespace: String,
    why: String,
}

/// The step a Secret of the CA is at.
pub fn step_of(data: &BTreeMap<String, ByteString>) -> Step {
    if data.contains_key(NEXT_CRT) {
        Step::Trusting
    } else if data.contains_key(RETIRED_CRT) {
        Step::Reissuing
    } else {
        Step::Steady
    }
}

/// What `rotate-ca status` shows.
#[derive(Debug)]
pub struct Report {
    /// The step.
    pub step: Step,
    /// Whether the controller published the Secret's trust for the agents.
    pub published: bool,
    /// Each node running an agent, and whether a certificate of the CA that signs now
    /// was issued to it.
    pub agents: Vec<(String, bool)>,
    /// Every CA the cluster trusts (PEM): what peer clusters' class secrets hold.
    pub trust_pem: String,
}

impl Report {
    /// The nodes whose agent holds no certificate of the CA that signs now.
    pub fn behind(&self) -> Vec<&str> {
        self.agents
            .iter()
            .filter(|(_, done)| !done)
            .map(|(n, _)| n.as_str())
            .collect()
    }
}

/// One rotation's steps on a cluster, through the kubeconfig's credentials (an
/// operator's: the controller itself only reads the CA).
pub struct Rotation {
    client: kube::Client,
    namespace: String,
    agent_namespace: String,
}

impl Rotation {
    /// The CA of the controller in `namespace`, its agents in `agent_namespace`.
    pub fn new(client: kube::Client, namespace: &str, agent_namespace: &str) -> Self {
        Rotation {
            client,
            namespace: namespace.into(),
            agent_namespace: agent_namespace.into(),
        }
    }

    /// As [`Rotation::new`], on the cluster the kubeconfig (or the pod's ServiceAccount)
    /// names.
    pub async fn of_cluster(namespace: &str, agent_namespace: &str) -> Result<Self, RotationError> {
        let client = crate::issuer::operator_client()
            .await
            .map_err(|why| RotationError {
                namespace: namespace.into(),
                why,
            })?;
        Ok(Rotation::new(client, namespace, agent_namespace))
    }

    fn fail(&self, why: impl Into<String>) -> RotationError {
        RotationError {
            namespace: self.namespace.clone(),
            why: why.into(),
        }
    }

    async fn secret(&self) -> Result<Secret, RotationError> {
        Api::<Secret>::namespaced(self.client.clone(), &self.namespace)
            .get_opt(CA_SECRET)
            .await
            .map_err(|e| self.fail(format!("cannot read it: {e}")))?
            .ok_or_else(|| self.fail("not found: is the mover controller installed here?"))
    }

    /// Writes `secret` back; refused if it changed since it was read (another step).
    async fn write(&self, secret: &Secret) -> Result<Authority, RotationError> {
        let written = Api::<Secret>::namespaced(self.client.clone(), &self.namespace)
            .replace(CA_SECRET, &PostParams::default(), secret)
            .await
            .map_err(|e| match e {
                kube::Error::Api(e) if e.code == 409 => {
                    self.fail("it changed while this step ran (another rotate-ca?): run it again")
                }
                e => self.fail(format!("cannot write it: {e}")),
            })?;
        Authority::from_secret(written, &self.namespace).map_err(|e| self.fail(e.to_string()))
    }

    fn expect(&self, data: &BTreeMap<String, ByteString>, want: Step) -> Result<(), RotationError> {
        let at = step_of(data);
        if at == want {
            return Ok(());
        }
        Err(self.fail(format!(
            "this step needs the rotation {want:?}, but it is {at}"
        )))
    }

    /// Step 1: makes the next CA and trusts it beside the current one. Returns the trust
    /// (both CAs, PEM) for the peers.
    pub async fn begin(&self) -> Result<String, RotationError> {
        let mut secret = self.secret().await?;
        let data = secret.data.get_or_insert_with(BTreeMap::new);
        self.expect(data, Step::Steady)?;
        begin(data).map_err(|e| self.fail(e.to_string()))?;
        Ok(self.write(&secret).await?.trust_pem)
    }

    /// Step 2: the next CA signs; the current one is retired (still trusted). Waits
    /// until the controller has published the trust of step 1 and the agents have had
    /// two looks at it. Returns the trust (both CAs, PEM).
    pub async fn issue(&self) -> Result<String, RotationError> {
        let mut secret = self.secret().await?;
        let data = secret.data.get_or_insert_with(BTreeMap::new);
        self.expect(data, Step::Trusting)?;
        let trusting = Authority::from_secret(
            Secret {
                data: Some(data.clone()),
                ..Default::default()
            },
            &self.namespace,
        )
        .map_err(|e| self.fail(e.to_string()))?;
        self.published(&trusting.trust_pem, PUBLISH_WAIT).await?;
        issue(data).map_err(|e| self.fail(e))?;
        Ok(self.write(&secret).await?.trust_pem)
    }

    /// Step 3: drops the retired CA. Refused while an agent holds no certificate of the
    /// new one (it would be cut off), unless `force`. Waits until the controller has
    /// published the new trust and the agents have had two looks at it. Returns the
    /// trust (the new CA).
    pub async fn finish(&self, force: bool) -> Result<String, RotationError> {
        let mut secret = self.secret().await?;
        let data = secret.data.get_or_insert_with(BTreeMap::new);
        self.expect(data, Step::Reissuing)?;
        let report = self.status().await?;
        let behind = report.behind();
        if !behind.is_empty() && !force {
            return Err(self.fail(format!(
                "no certificate of the new CA was issued yet to the agents on {behind:?}: \
                 they would be cut off. Agents ask within {AGENT_TRUST_EVERY:?} of the \
                 issue step; look at their logs and `kubectl get csr`, or drop the retired \
                 CA anyway with --force"
            )));
        }
        finish(data);
        let trust = self.write(&secret).await?.trust_pem;
        // Returns once the agents have dropped the retired CA, not only the Secret.
        self.published(&trust, PUBLISH_WAIT).await?;
        Ok(trust)
    }

    /// Where the rotation is, and which agents hold a certificate of the CA that signs.
    pub async fn status(&self) -> Result<Report, RotationError> {
        let secret = self.secret().await?;
        let step = step_of(secret.data.as_ref().unwrap_or(&BTreeMap::new()));
        let ca = Authority::from_secret(secret, &self.namespace)
            .map_err(|e| self.fail(e.to_string()))?;
        let published = self
            .published_trust()
            .await?
            .is_some_and(|(t, _)| t == ca.trust_pem);
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.agent_namespace);
        let nodes: std::collections::BTreeSet<String> = pods
            .list(&ListParams::default().labels(AGENT_SELECTOR))
            .await
            .map_err(|e| self.fail(format!("cannot list the agent pods: {e}")))?
            .items
            .into_iter()
            .filter_map(|p| p.spec?.node_name)
            .collect();
        let csrs: Api<CertificateSigningRequest> = Api::all(self.client.clone());
        let signer = transport::cluster::AGENT_SIGNER;
        let issued = csrs
            .list(&ListParams::default().fields(&format!("spec.signerName={signer}")))
            .await
            .map_err(|e| self.fail(format!("cannot list the agents' certificate requests: {e}")))?
            .items;
        let agents = nodes
            .into_iter()
            .map(|node| {
                let done = issued.iter().any(|c| {
                    let of_node = c
                        .spec
                        .extra
                        .as_ref()
                        .and_then(|e| e.get(crate::issuer::NODE_EXTRA))
                        .is_some_and(|n| n.first() == Some(&node));
                    let cert = c.status.as_ref().and_then(|s| s.certificate.as_ref());
                    of_node
                        && cert.is_some_and(|pem| {
                            transport::tls::issued_by(&pem.0, ca.ca_pem.as_bytes())
                        })
                });
                (node, done)
            })
            .collect();
        Ok(Report {
            step,
            published,
            agents,
            trust_pem: ca.trust_pem,
        })
    }

    /// The published trust and when it was published, if it is.
    async fn published_trust(&self) -> Result<Option<(String, Option<String>)>, RotationError> {
        let maps: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.agent_namespace);
        let map = maps
            .get_opt(TRUST_CONFIGMAP)
            .await
            .map_err(|e| self.fail(format!("cannot read ConfigMap {TRUST_CONFIGMAP}: {e}")))?;
        Ok(map.and_then(|m| {
            let at = m
                .metadata
                .annotations
                .and_then(|a| a.get(PUBLISHED_AT).cloned());
            Some((m.data?.get(TRUST_KEY)?.clone(), at))
        }))
    }

    /// Waits (up to `wait`) until the controller has published `trust`, then until the
    /// agents have had two looks at it.
    async fn published(&self, trust: &str, wait: Duration) -> Result<(), RotationError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some((t, at)) = self.published_trust().await?
                && t == trust
            {
                let at = at.and_then(|a| a.parse::<k8s_openapi::jiff::Timestamp>().ok());
                let since = at
                    .map(|a| k8s_openapi::jiff::Timestamp::now().duration_since(a))
                    .and_then(|d| Duration::try_from(d).ok())
                    .unwrap_or_default();
                let settle = AGENT_TRUST_EVERY * 2;
                if since < settle {
                    tokio::time::sleep(settle - since).await;
                }
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(self.fail(format!(
                    "the controller has not published the Secret's trust in ConfigMap \
                     {TRUST_CONFIGMAP} within {wait:?}: is it running (kubectl -n {} get \
                     pods)? Run this step again once it is (`rotate-ca status` shows where \
                     the rotation is)",
                    self.namespace
                )));
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

/// Step 1 on the Secret's data: a next CA beside the current one.
fn begin(data: &mut BTreeMap<String, ByteString>) -> Result<(), rcgen::Error> {
    let (pem, key) = crate::issuer::new_ca()?;
    data.insert(NEXT_CRT.into(), ByteString(pem.into_bytes()));
    data.insert(
        NEXT_KEY.into(),
        ByteString(key.serialize_pem().into_bytes()),
    );
    Ok(())
}

/// Step 2 on the Secret's data: the next CA signs, the current one is retired.
fn issue(data: &mut BTreeMap<String, ByteString>) -> Result<(), String> {
    let (Some(next), Some(next_key), Some(old)) = (
        data.remove(NEXT_CRT),
        data.remove(NEXT_KEY),
        data.get(CA_CRT).cloned(),
    ) else {
        return Err(format!("it lacks {NEXT_CRT}, {NEXT_KEY} or {CA_CRT}"));
    };
    data.insert(RETIRED_CRT.into(), old);
    data.insert(CA_CRT.into(), next);
    data.insert(CA_KEY.into(), next_key);
    Ok(())
}

/// Step 3 on the Secret's data: the retired CA is dropped.
fn finish(data: &mut BTreeMap<String, ByteString>) {
    data.remove(RETIRED_CRT);
}

/// Publishes what `ca` trusts and who signs in ConfigMap [`TRUST_CONFIGMAP`] of
/// `namespace` (the agents'), unless it holds that already. True if it was written.
pub async fn publish_trust(
    client: &kube::Client,
    namespace: &str,
    ca: &Authority,
) -> Result<bool, kube::Error> {
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let data = BTreeMap::from([
        (TRUST_KEY.to_string(), ca.trust_pem.clone()),
        (SIGNER_KEY.to_string(), ca.ca_pem.clone()),
    ]);
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let annotations = BTreeMap::from([(PUBLISHED_AT.to_string(), now)]);
    match maps.get_opt(TRUST_CONFIGMAP).await? {
        Some(m) if m.data.as_ref() == Some(&data) => Ok(false),
        Some(_) => {
            let patch = serde_json::json!({
                "metadata": { "annotations": annotations },
                "data": data,
            });
            maps.patch(
                TRUST_CONFIGMAP,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
            Ok(true)
        }
        None => {
            let map = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(TRUST_CONFIGMAP.into()),
                    namespace: Some(namespace.into()),
                    annotations: Some(annotations),
                    ..Default::default()
                },
                data: Some(data),
                ..Default::default()
            };
            maps.create(&PostParams::default(), &map).await?;
            Ok(true)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn authority(data: &BTreeMap<String, ByteString>) -> Authority {
        let secret = Secret {
            data: Some(data.clone()),
            ..Default::default()
        };
        Authority::from_secret(secret, "mover-system").unwrap()
    }

    /// An agent's certificate request for `node`, and its answer from `ca`: (the
    /// certificate, the CAs it is told to trust).
    fn agent_certificate(ca: &Authority, node: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let request = rcgen::CertificateParams::new(vec![node.to_string()])
            .unwrap()
            .serialize_request(&key)
            .unwrap()
            .pem()
            .unwrap();
        let chain = ca.sign_agent(&request, node, None).unwrap();
        let end = chain.find("-----END CERTIFICATE-----").unwrap() + 25;
        (
            chain[..end].to_string(),
            chain[end..].trim_start().to_string(),
        )
    }

    #[test]
    fn a_rotation_trusts_both_cas_while_certificates_are_issued_again_then_the_new_one_alone() {
        let mut data = BTreeMap::new();
        let (pem, key) = crate::issuer::new_ca().unwrap();
        data.insert(CA_CRT.to_string(), ByteString(pem.into_bytes()));
        data.insert(
            CA_KEY.to_string(),
            ByteString(key.serialize_pem().into_bytes()),
        );
        let old = authority(&data);
        let (before, trusted) = agent_certificate(&old, "node-1");
        assert_eq!(trusted, old.ca_pem, "one CA at first");
        let count = |pem: &str| pem.matches("BEGIN CERTIFICATE").count();

        begin(&mut data).unwrap();
        let begun = authority(&data);
        assert_eq!(begun.ca_pem, old.ca_pem, "the current CA still signs");
        assert_eq!(count(&begun.trust_pem), 2);
        let (cert, trusted) = agent_certificate(&begun, "node-1");
        assert!(transport::tls::issued_by(
            cert.as_bytes(),
            old.ca_pem.as_bytes()
        ));
        assert_eq!(trusted, begun.trust_pem, "agents are told to trust both");

        issue(&mut data).unwrap();
        let issuing = authority(&data);
        assert_ne!(issuing.ca_pem, old.ca_pem, "the next CA signs");
        assert_eq!(step_of(&data), Step::Reissuing);
        assert_eq!(count(&issuing.trust_pem), 2);
        assert!(
            issuing.trust_pem.contains(&old.ca_pem),
            "the retired CA still trusted"
        );
        let (after, _) = agent_certificate(&issuing, "node-1");
        assert!(transport::tls::issued_by(
            after.as_bytes(),
            issuing.ca_pem.as_bytes()
        ));
        assert!(!transport::tls::issued_by(
            before.as_bytes(),
            issuing.ca_pem.as_bytes()
        ));
        assert!(issue(&mut data).is_err(), "no next CA to issue with twice");

        finish(&mut data);
        let done = authority(&data);
        assert_eq!(step_of(&data), Step::Steady);
        assert_eq!(done.trust_pem, issuing.ca_pem, "the new CA alone");
        assert!(!done.trust_pem.contains(&old.ca_pem));
    }

    #[test]
    fn the_step_is_read_from_the_secrets_keys() {
        let pem = |s: &str| ByteString(s.as_bytes().to_vec());
        let mut data = BTreeMap::from([(CA_CRT.to_string(), pem("a")), (CA_KEY.into(), pem("k"))]);
        assert_eq!(step_of(&data), Step::Steady);
        data.insert(NEXT_CRT.into(), pem("b"));
        assert_eq!(step_of(&data), Step::Trusting);
        data.remove(NEXT_CRT);
        data.insert(RETIRED_CRT.into(), pem("a"));
        assert_eq!(step_of(&data), Step::Reissuing);
    }
}
