//! The agent's certificate from its cluster's signer: a key made on the node (it never
//! leaves it), a certificate request for signer `replication.mover/agent`
//! (`transport::cluster::AGENT_SIGNER`) naming the node, and the
//! certificate the mover controller signs once it has checked that the request comes
//! from the agent pod on that node. The request reaches the cluster through a
//! [`Signer`]: the `mover` binary gives the controller crate's, which speaks the
//! Kubernetes CertificateSigningRequest API, so this crate never depends on kube.
//!
//! The [`Signer`] also tells what the cluster trusts now ([`ClusterTrust`]): during a
//! rotation of the cluster's CA the agent trusts what it is told, and asks for a
//! certificate of the CA that signs now as soon as its own is of another.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;
use transport::cluster::certificate_life;
use transport::tls::TlsPem;

/// A future a [`Signer`] answers with.
pub type SignFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<u8>, String>> + Send + 'a>>;

/// A future a [`Signer`] answers what the cluster trusts with (`None`: not published).
pub type TrustFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Option<ClusterTrust>, String>> + Send + 'a>>;

/// Who signs an agent's certificate request for its cluster.
pub trait Signer: Send + Sync {
    /// Asks for `request` (PKCS#10, PEM) to be signed under the name `name`, waiting up
    /// to `wait`. The answer is the certificate followed by the CAs to trust (PEM); an
    /// error says what to do about it.
    fn sign<'a>(&'a self, name: &'a str, request: String, wait: Duration) -> SignFuture<'a>;
    /// What the cluster trusts now.
    fn trust(&self) -> TrustFuture<'_>;
}

/// What a cluster trusts now, as its controller publishes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterTrust {
    /// Every CA to trust (PEM): during a rotation, two.
    pub trust: Vec<u8>,
    /// The CA that signs agents' certificates now (PEM).
    pub signer: Vec<u8>,
}

/// Why the agent has no certificate.
#[derive(Debug, thiserror::Error)]
#[error("agent certificate for node {node}: {why}")]
pub struct CertificateError {
    node: String,
    why: String,
}

/// The files a certificate is kept in, under STATE_DIR/tls.
fn files(state_dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let dir = state_dir.join("tls");
    (dir.join("tls.crt"), dir.join("tls.key"), dir.join("ca.crt"))
}

/// The kept certificate, if it names `node`, has more than a third of its life left, and
/// is of the CA that signs now (when `trust` tells).
fn kept(state_dir: &Path, node: &str, trust: Option<&ClusterTrust>) -> Option<TlsPem> {
    let (cert, key, ca) = files(state_dir);
    let pem = TlsPem {
        cert: std::fs::read(cert).ok()?,
        key: std::fs::read(key).ok()?,
        ca: std::fs::read(ca).ok()?,
    };
    let (left, all, names) = certificate_life(&pem.cert, node)?;
    let current = trust.is_none_or(|t| transport::tls::issued_by(&pem.cert, &t.signer));
    if !current {
        tracing::info!(%node, "the cluster's CA changed (a rotation): asking for a certificate of the new one");
    }
    (names && left * 3 > all && current).then_some(pem)
}

/// This node's certificate: the kept one while it is fresh and of the CA that signs
/// now, else a new one from `signer`, waiting for it up to `wait`. It trusts what
/// `trust` says the cluster trusts now, else what it was given with its certificate.
pub async fn obtain(
    state_dir: &Path,
    node: &str,
    wait: Duration,
    signer: Option<&dyn Signer>,
    trust: Option<&ClusterTrust>,
) -> Result<TlsPem, CertificateError> {
    let fail = |why: String| CertificateError {
        node: node.into(),
        why,
    };
    let mut pem = match kept(state_dir, node, trust) {
        Some(pem) => pem,
        None => request(state_dir, node, wait, signer).await?,
    };
    if let Some(t) = trust.filter(|t| t.trust != pem.ca) {
        pem.ca = t.trust.clone();
        keep(state_dir, &pem).map_err(|e| {
            fail(format!(
                "cannot keep the cluster's trust in {}: {e}",
                state_dir.join("tls").display()
            ))
        })?;
        let cas = String::from_utf8_lossy(&pem.ca)
            .matches("BEGIN CERTIFICATE")
            .count();
        tracing::info!(%node, cas, "now trusting what the cluster trusts (a CA rotation's step)");
    }
    Ok(pem)
}

/// A new certificate for `node` from `signer`, kept in `state_dir`.
async fn request(
    state_dir: &Path,
    node: &str,
    wait: Duration,
    signer: Option<&dyn Signer>,
) -> Result<TlsPem, CertificateError> {
    let fail = |why: String| CertificateError {
        node: node.into(),
        why,
    };
    let Some(signer) = signer else {
        return Err(fail(
            "this mover was built without Kubernetes support (the controller feature): \
             give [tls] cert, key and ca files"
                .into(),
        ));
    };
    let key = rcgen::KeyPair::generate().map_err(|e| fail(e.to_string()))?;
    let mut params =
        rcgen::CertificateParams::new(vec![node.to_string()]).map_err(|e| fail(e.to_string()))?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, node);
    let uri = format!("{}{node}", transport::auth::AGENT_URI_PREFIX);
    params.subject_alt_names.push(rcgen::SanType::URI(
        uri.as_str()
            .try_into()
            .map_err(|e: rcgen::Error| fail(e.to_string()))?,
    ));
    let request = params
        .serialize_request(&key)
        .and_then(|r| r.pem())
        .map_err(|e| fail(e.to_string()))?;
    let fingerprint = blake3::hash(key.public_key_raw()).to_hex();
    let name = format!("mover-agent-{node}-{}", &fingerprint[..10]);
    let chain = signer.sign(&name, request, wait).await.map_err(fail)?;
    let pem = split_chain(&chain, key.serialize_pem().into_bytes()).ok_or_else(|| {
        fail(format!(
            "CertificateSigningRequest {name}: the signer's answer holds no certificate and CA"
        ))
    })?;
    keep(state_dir, &pem).map_err(|e| {
        fail(format!(
            "cannot keep it in {}: {e}",
            state_dir.join("tls").display()
        ))
    })?;
    tracing::info!(csr = %name, "certificate obtained");
    Ok(pem)
}

/// The signer's answer (the certificate, then the CA) with our key.
fn split_chain(chain: &[u8], key: Vec<u8>) -> Option<TlsPem> {
    let text = String::from_utf8_lossy(chain);
    const END: &str = "-----END CERTIFICATE-----";
    let cut = text.find(END)? + END.len();
    let (cert, ca) = text.split_at(cut);
    let ca = ca.trim_start();
    (!ca.is_empty()).then(|| TlsPem {
        cert: format!("{cert}\n").into_bytes(),
        key,
        ca: ca.as_bytes().to_vec(),
    })
}

/// Keeps the certificate durably, the key readable by root only.
fn keep(state_dir: &Path, pem: &TlsPem) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let (cert, key, ca) = files(state_dir);
    std::fs::create_dir_all(state_dir.join("tls"))?;
    for (path, bytes) in [(&key, &pem.key), (&ca, &pem.ca), (&cert, &pem.cert)] {
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        std::io::Write::write_all(&mut f, bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signers_answer_splits_into_certificate_and_ca_and_its_life_is_read() {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec!["node-1".to_string()]).unwrap();
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(2120, 1, 1);
        let issuer = rcgen::Issuer::from_ca_cert_der(ca.der(), &ca_key).unwrap();
        let leaf = p.signed_by(&key, &issuer).unwrap();
        let chain = format!("{}{}", leaf.pem(), ca.pem());
        let pem = split_chain(chain.as_bytes(), b"k".to_vec()).unwrap();
        assert_eq!(pem.ca, ca.pem().into_bytes());
        let (left, all, names) = certificate_life(&pem.cert, "node-1").unwrap();
        assert!(names && left > 0 && left * 3 > all);
        assert!(!certificate_life(&pem.cert, "node-2").unwrap().2);
        assert!(split_chain(leaf.pem().as_bytes(), Vec::new()).is_none());
    }
}
