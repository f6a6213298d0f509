//! The cluster's certificate authority for mover, run by the controller on the
//! Kubernetes CSR API: its CA lives in a Secret of the controller's namespace (made on
//! first start), agents ask for certificates with CertificateSigningRequests for signer
//! `replication.mover/agent`, and the leader signs those that come from the agent pod on
//! the node the certificate names (the API server records the requesting token's node
//! in the request's `extra`). The controller makes its own client certificate, with the
//! control role, from the same CA.
//!
//! The CA is rotated in three steps ([`crate::rotation`]), each a change of its Secret:
//! a next CA is trusted beside the current one, then signs in its place (the old one
//! still trusted while every certificate is issued again), then the old one is dropped.
//! What the cluster trusts is published for the agents in ConfigMap [`TRUST_CONFIGMAP`].

use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, SanType};
use std::collections::BTreeMap;
use transport::cluster::{AGENT_CERTIFICATE_LIFETIME as LIFETIME, AGENT_SIGNER as SIGNER};
use transport::tls::TlsPem;

/// The Secret holding the CA (`ca.crt`, `ca.key`) in the controller's namespace; during
/// a rotation also the next CA (`next.crt`, `next.key`) or the retired one
/// (`retired.crt`), both trusted.
pub const CA_SECRET: &str = "mover-ca";
/// The ConfigMap, beside [`CA_SECRET`], where the controller publishes what the agents
/// trust ([`TRUST_KEY`]) and who signs their certificates now ([`SIGNER_KEY`]).
pub const TRUST_CONFIGMAP: &str = "mover-ca-trust";
/// Every CA the cluster trusts (PEM, one after another).
pub const TRUST_KEY: &str = "trust.crt";
/// The CA that signs agents' certificates now (PEM).
pub const SIGNER_KEY: &str = "signer.crt";
/// The Secret's keys.
pub(crate) const CA_CRT: &str = "ca.crt";
pub(crate) const CA_KEY: &str = "ca.key";
pub(crate) const NEXT_CRT: &str = "next.crt";
pub(crate) const NEXT_KEY: &str = "next.key";
pub(crate) const RETIRED_CRT: &str = "retired.crt";
/// The `extra` key under which the API server records a pod-bound token's node.
pub(crate) const NODE_EXTRA: &str = "authentication.kubernetes.io/node-name";

/// The CA, able to sign.
pub struct Authority {
    /// The CA certificate that signs (PEM).
    pub ca_pem: String,
    /// Every CA the cluster trusts (PEM): the one that signs, and during a rotation the
    /// next or the retired one. What agents and peers are given to trust.
    pub trust_pem: String,
    key: KeyPair,
}

/// Why the CA could not be loaded or made.
#[derive(Debug, thiserror::Error)]
#[error("certificate authority in secret {namespace}/{CA_SECRET}: {why}")]
pub struct AuthorityError {
    namespace: String,
    why: String,
}

impl AuthorityError {
    /// `why` about the CA in `namespace`.
    pub fn new(namespace: &str, why: String) -> Self {
        AuthorityError {
            namespace: namespace.into(),
            why,
        }
    }
}

impl Authority {
    /// The CA from its Secret, made and stored on first use (two replicas starting at
    /// once: the second's create fails and it reads the first's).
    pub async fn load_or_create(
        client: &kube::Client,
        namespace: &str,
    ) -> Result<Self, AuthorityError> {
        let fail = |why: String| AuthorityError::new(namespace, why);
        let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
        for _ in 0..3 {
            if let Some(s) = secrets
                .get_opt(CA_SECRET)
                .await
                .map_err(|e| fail(format!("cannot read it: {e}")))?
            {
                return Authority::from_secret(s, namespace);
            }
            let (ca_pem, key) = new_ca().map_err(|e| fail(e.to_string()))?;
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(CA_SECRET.into()),
                    namespace: Some(namespace.into()),
                    ..Default::default()
                },
                string_data: Some(BTreeMap::from([
                    (CA_CRT.to_string(), ca_pem.clone()),
                    (CA_KEY.to_string(), key.serialize_pem()),
                ])),
                ..Default::default()
            };
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {
                    tracing::info!(secret = %format!("{namespace}/{CA_SECRET}"), "made the cluster's mover CA");
                    let trust_pem = ca_pem.clone();
                    return Ok(Authority {
                        ca_pem,
                        trust_pem,
                        key,
                    });
                }
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                Err(e) => return Err(fail(format!("cannot create it: {e}"))),
            }
        }
        Err(fail("created and deleted concurrently, three times".into()))
    }

    /// The CA of the cluster the kubeconfig (or the pod's ServiceAccount) names, from its
    /// Secret in `namespace`: `mover controller operator-cert` runs outside the controller.
    pub async fn load_from_cluster(namespace: &str) -> Result<Self, AuthorityError> {
        let client = operator_client()
            .await
            .map_err(|why| AuthorityError::new(namespace, why))?;
        Authority::load(&client, namespace).await
    }

    /// The CA from its Secret, for an operator's command: never made here (a new CA
    /// would be trusted by no agent).
    pub async fn load(client: &kube::Client, namespace: &str) -> Result<Self, AuthorityError> {
        let fail = |why: String| AuthorityError::new(namespace, why);
        let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
        let secret = secrets
            .get_opt(CA_SECRET)
            .await
            .map_err(|e| fail(format!("cannot read it: {e}")))?
            .ok_or_else(|| {
                fail("not found: is the mover controller installed in this namespace?".into())
            })?;
        Authority::from_secret(secret, namespace)
    }

    /// The CA held in its Secret `secret` of `namespace`.
    pub(crate) fn from_secret(secret: Secret, namespace: &str) -> Result<Self, AuthorityError> {
        let fail = |why: String| AuthorityError::new(namespace, why);
        let data = secret.data.unwrap_or_default();
        let text = |k: &str| {
            data.get(k)
                .map(|v| String::from_utf8_lossy(&v.0).into_owned())
        };
        let needed = |k: &str| {
            text(k).ok_or_else(|| {
                fail(format!(
                    "it has no {k} (the controller makes a new CA once it is deleted)"
                ))
            })
        };
        let (ca_pem, key_pem) = (needed(CA_CRT)?, needed(CA_KEY)?);
        let key = KeyPair::from_pem(&key_pem).map_err(|e| fail(format!("{CA_KEY}: {e}")))?;
        let mut trust_pem = ca_pem.clone();
        for also in [NEXT_CRT, RETIRED_CRT].into_iter().filter_map(text) {
            if !trust_pem.ends_with('\n') {
                trust_pem.push('\n');
            }
            trust_pem.push_str(&also);
        }
        Ok(Authority {
            ca_pem,
            trust_pem,
            key,
        })
    }

    /// A client certificate for an operator `who`, valid for `life`: it names no mover
    /// role, so agents take it as an operator's own (the control role: status, sync,
    /// promote), as they take the certificates of a CA given in their `[tls]`.
    pub fn operator_identity(
        &self,
        who: &str,
        life: std::time::Duration,
    ) -> Result<TlsPem, rcgen::Error> {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.distinguished_name
            .push(DnType::CommonName, format!("mover operator {who}"));
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.signed(p, life)
    }

    fn issuer(&self) -> Result<rcgen::Issuer<'static, &KeyPair>, rcgen::Error> {
        rcgen::Issuer::from_ca_cert_pem(&self.ca_pem, &self.key)
    }

    /// A fresh client certificate of the control role for this controller process.
    pub fn controller_identity(&self) -> Result<TlsPem, rcgen::Error> {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.distinguished_name
            .push(DnType::CommonName, "mover-controller");
        p.subject_alt_names
            .push(SanType::URI(transport::auth::CONTROLLER_URI.try_into()?));
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.own(p)
    }

    /// A fresh server certificate for this controller's Locator, naming
    /// [`mover_engine::remote::LOCATOR_NAME`] (what peer clusters' agents check).
    pub fn locator_identity(&self) -> Result<TlsPem, rcgen::Error> {
        let mut p = CertificateParams::new(vec![mover_engine::remote::LOCATOR_NAME.to_string()])?;
        p.distinguished_name
            .push(DnType::CommonName, mover_engine::remote::LOCATOR_NAME);
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.own(p)
    }

    /// A certificate of `p` for a key made here, for this process's own use.
    fn own(&self, p: CertificateParams) -> Result<TlsPem, rcgen::Error> {
        self.signed(p, LIFETIME)
    }

    /// A certificate of `p`, valid for `life`, for a key made here.
    fn signed(
        &self,
        mut p: CertificateParams,
        life: std::time::Duration,
    ) -> Result<TlsPem, rcgen::Error> {
        let key = KeyPair::generate()?;
        (p.not_before, p.not_after) = validity(life);
        let cert = p.signed_by(&key, &self.issuer()?)?;
        Ok(TlsPem {
            cert: cert.pem().into_bytes(),
            key: key.serialize_pem().into_bytes(),
            ca: self.trust_pem.clone().into_bytes(),
        })
    }

    /// Checks an agent's request and signs it: the certificate names `node`, as DNS
    /// name and agent URI, for server and client use. Returns the certificate then the
    /// CAs to trust (PEM), or why it is denied.
    pub fn sign_agent(
        &self,
        request_pem: &str,
        node: &str,
        seconds: Option<i32>,
    ) -> Result<String, String> {
        let mut req = rcgen::CertificateSigningRequestParams::from_pem(request_pem)
            .map_err(|e| format!("the request is not a valid, signed PKCS#10 request: {e}"))?;
        let asked: Vec<String> = req
            .params
            .subject_alt_names
            .iter()
            .filter_map(|n| match n {
                SanType::DnsName(d) => Some(d.to_string()),
                _ => None,
            })
            .collect();
        if asked != [node] {
            return Err(format!(
                "it asks for the names {asked:?}, but it comes from the agent on node {node:?}: \
                 an agent's certificate names its own node only"
            ));
        }
        let mut p = CertificateParams::new(vec![node.to_string()]).map_err(|e| e.to_string())?;
        p.distinguished_name.push(DnType::CommonName, node);
        let uri = format!("{}{node}", transport::auth::AGENT_URI_PREFIX);
        p.subject_alt_names.push(SanType::URI(
            uri.as_str()
                .try_into()
                .map_err(|e: rcgen::Error| e.to_string())?,
        ));
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let life = seconds
            .map(|s| std::time::Duration::from_secs(s.max(600) as u64))
            .unwrap_or(LIFETIME)
            .min(LIFETIME);
        (p.not_before, p.not_after) = validity(life);
        req.params = p;
        let issuer = self.issuer().map_err(|e| e.to_string())?;
        let cert = req.signed_by(&issuer).map_err(|e| e.to_string())?;
        Ok(format!("{}{}", cert.pem(), self.trust_pem))
    }
}

/// The CA, replaced in place when its Secret changes (a rotation's step): the signer
/// and this controller's own certificates take the current one.
#[derive(Clone)]
pub struct LiveAuthority(std::sync::Arc<std::sync::RwLock<std::sync::Arc<Authority>>>);

impl LiveAuthority {
    /// Starts with `a`.
    pub fn new(a: Authority) -> Self {
        LiveAuthority(std::sync::Arc::new(std::sync::RwLock::new(
            std::sync::Arc::new(a),
        )))
    }

    /// The current CA.
    pub fn get(&self) -> std::sync::Arc<Authority> {
        self.0.read().expect("authority lock").clone()
    }

    /// Takes `a` if it signs or trusts otherwise than the current one; true if taken.
    pub fn set(&self, a: Authority) -> bool {
        let mut current = self.0.write().expect("authority lock");
        if current.ca_pem == a.ca_pem && current.trust_pem == a.trust_pem {
            return false;
        }
        *current = std::sync::Arc::new(a);
        true
    }
}

/// A client of the cluster the kubeconfig (or the pod's ServiceAccount) names, for an
/// operator's command (`operator-cert`, `rotate-ca`).
pub(crate) async fn operator_client() -> Result<kube::Client, String> {
    transport::tls::install_crypto_provider();
    kube::Client::try_default().await.map_err(|e| {
        format!("cannot reach the Kubernetes API server (kubeconfig or in-cluster): {e}")
    })
}

/// From a minute ago (clocks differ a little) for `life`.
fn validity(life: std::time::Duration) -> (time::OffsetDateTime, time::OffsetDateTime) {
    let now = time::OffsetDateTime::now_utc();
    (now - time::Duration::minutes(1), now + life)
}

/// A new CA: ECDSA P-256, ten years.
pub(crate) fn new_ca() -> Result<(String, KeyPair), rcgen::Error> {
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    // Named apart from other clusters' mover CAs, so a wrong one is told as such.
    let id = blake3::hash(key.public_key_raw()).to_hex();
    p.distinguished_name
        .push(DnType::CommonName, format!("mover CA {}", &id[..12]));
    p.is_ca = IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    (p.not_before, p.not_after) = validity(std::time::Duration::from_secs(10 * 365 * 24 * 3600));
    let cert = p.self_signed(&key)?;
    Ok((cert.pem(), key))
}

/// What to do with one request: `Ok(node)` to sign for, or why it is denied.
fn judge(csr: &CertificateSigningRequest, agent_user: &str) -> Result<String, String> {
    let spec = &csr.spec;
    if spec.username.as_deref() != Some(agent_user) {
        return Err(format!(
            "it was made by {:?}, not by the agents' ServiceAccount {agent_user:?}",
            spec.username.as_deref().unwrap_or("nobody")
        ));
    }
    let nodes = spec
        .extra
        .as_ref()
        .and_then(|e| e.get(NODE_EXTRA))
        .cloned()
        .unwrap_or_default();
    match nodes.as_slice() {
        [node] if !node.is_empty() => Ok(node.clone()),
        _ => Err(format!(
            "its token is not bound to a pod on a node (no {NODE_EXTRA} in the request's \
             extra): the agent must use its pod's projected ServiceAccount token"
        )),
    }
}

fn condition(ty: &str, reason: &str, message: &str) -> CertificateSigningRequestCondition {
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    CertificateSigningRequestCondition {
        type_: ty.into(),
        status: "True".into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_update_time: Some(now.clone()),
        last_transition_time: Some(now),
    }
}

/// Signs agents' requests for as long as it runs (the leader runs it).
pub async fn sign_requests(client: kube::Client, authority: LiveAuthority, agent_user: String) {
    use futures::StreamExt;
    let api: Api<CertificateSigningRequest> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.signerName={SIGNER}"));
    let mut events = std::pin::pin!(
        watcher(api.clone(), config)
            .default_backoff()
            .applied_objects()
    );
    while let Some(ev) = events.next().await {
        let Ok(csr) = ev else { continue };
        let decided = csr.status.as_ref().is_some_and(|s| {
            s.certificate.is_some()
                || s.conditions
                    .iter()
                    .flatten()
                    .any(|c| c.type_ == "Denied" || c.type_ == "Failed")
        });
        if decided {
            continue;
        }
        let name = kube::ResourceExt::name_any(&csr);
        let verdict = judge(&csr, &agent_user).and_then(|node| {
            let pem = String::from_utf8_lossy(&csr.spec.request.0).into_owned();
            authority
                .get()
                .sign_agent(&pem, &node, csr.spec.expiration_seconds)
                .map(|chain| (node, chain))
        });
        let mut answer = csr.clone();
        let status = answer.status.get_or_insert_with(Default::default);
        let approved = status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Approved");
        match verdict {
            Err(why) => {
                tracing::warn!(csr = %name, "denied an agent certificate request: {why}");
                status
                    .conditions
                    .get_or_insert_with(Vec::new)
                    .push(condition("Denied", "MoverSignerDenied", &why));
                if let Err(e) = api
                    .replace_subresource("approval", &name, &PostParams::default(), &answer)
                    .await
                {
                    tracing::warn!(csr = %name, "cannot deny: {e}");
                }
            }
            Ok((node, chain)) => {
                if !approved {
                    status
                        .conditions
                        .get_or_insert_with(Vec::new)
                        .push(condition(
                            "Approved",
                            "MoverSignerApproved",
                            &format!(
                                "the agent pod on node {node} asked for its node's certificate"
                            ),
                        ));
                    match api
                        .replace_subresource("approval", &name, &PostParams::default(), &answer)
                        .await
                    {
                        Ok(a) => answer = a,
                        Err(e) => {
                            tracing::warn!(csr = %name, "cannot approve: {e}");
                            continue;
                        }
                    }
                }
                answer
                    .status
                    .get_or_insert_with(Default::default)
                    .certificate = Some(k8s_openapi::ByteString(chain.into_bytes()));
                match api
                    .replace_status(&name, &PostParams::default(), &answer)
                    .await
                {
                    Ok(_) => tracing::info!(csr = %name, %node, "signed an agent's certificate"),
                    // The request changed since this event: most often the approval's own
                    // event, arriving after this signer already signed. The next event
                    // decides (a signed request is skipped), so this is no failure.
                    Err(kube::Error::Api(e)) if e.code == 409 => {
                        tracing::debug!(csr = %name, "changed since this event: the next one decides")
                    }
                    Err(e) => tracing::warn!(csr = %name, "cannot sign: {e}"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agents_request_is_signed_for_its_own_node_only() {
        let (ca_pem, key) = new_ca().unwrap();
        let trust_pem = ca_pem.clone();
        let authority = Authority {
            ca_pem,
            trust_pem,
            key,
        };
        let request = |names: Vec<String>| {
            let key = KeyPair::generate().unwrap();
            CertificateParams::new(names)
                .unwrap()
                .serialize_request(&key)
                .unwrap()
                .pem()
                .unwrap()
        };
        let chain = authority
            .sign_agent(&request(vec!["node-1".into()]), "node-1", Some(3600))
            .unwrap();
        let leaf = chain
            .split_inclusive("-----END CERTIFICATE-----")
            .next()
            .unwrap();
        let der = rustls_pemfile_der(leaf);
        let caller = transport::auth::certificate_caller(&der);
        assert_eq!(caller.role, transport::auth::Role::Replication);
        assert_eq!(caller.who, "the certificate of agent node-1");
        let (left, _, names) =
            transport::cluster::certificate_life(leaf.as_bytes(), "node-1").unwrap();
        assert!(names && left <= 3600 && left > 3500, "{left}");
        let e = authority
            .sign_agent(&request(vec!["node-2".into()]), "node-1", None)
            .unwrap_err();
        assert!(e.contains("names its own node only"), "{e}");
        let me = authority.controller_identity().unwrap();
        let der = rustls_pemfile_der(std::str::from_utf8(&me.cert).unwrap());
        assert_eq!(
            transport::auth::certificate_caller(&der).role,
            transport::auth::Role::Control
        );
    }

    #[test]
    fn an_operators_certificate_has_the_control_role_and_a_short_life() {
        let (ca_pem, key) = new_ca().unwrap();
        let trust_pem = ca_pem.clone();
        let ca = Authority {
            ca_pem,
            trust_pem,
            key,
        };
        let life = std::time::Duration::from_secs(3600);
        let pem = ca.operator_identity("alice", life).unwrap();
        let der = rustls_pemfile_der(std::str::from_utf8(&pem.cert).unwrap());
        let caller = transport::auth::certificate_caller(&der);
        assert_eq!(
            caller.role,
            transport::auth::Role::Control,
            "{}",
            caller.who
        );
        let facts = transport::tls::Facts::of_der(&der).unwrap();
        let lived = facts.not_after - facts.not_before;
        assert!(
            (3600..=3660).contains(&lived),
            "valid for an hour: {lived} s"
        );
        assert_eq!(pem.ca, ca.ca_pem.as_bytes(), "the CA agents trust");
    }

    fn rustls_pemfile_der(pem: &str) -> Vec<u8> {
        x509_parser::pem::parse_x509_pem(pem.as_bytes())
            .unwrap()
            .1
            .contents
    }
}
