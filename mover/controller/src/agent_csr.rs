//! The agent's side of its certificate: its request sent to the cluster's
//! CertificateSigningRequest API for signer [`AGENT_SIGNER`], and the answer awaited.
//! The agent (`mover-node`) makes the key and the request and keeps the answer; it reaches
//! this code through the `mover` binary, so only this crate depends on kube.

use crate::issuer::{SIGNER_KEY, TRUST_CONFIGMAP, TRUST_KEY};
use k8s_openapi::{
    ByteString,
    api::certificates::v1::{CertificateSigningRequest, CertificateSigningRequestSpec},
    api::core::v1::ConfigMap,
};
use kube::api::{Api, GetParams, ObjectMeta, PostParams};
use std::time::Duration;
use transport::cluster::{AGENT_CERTIFICATE_LIFETIME, AGENT_SIGNER};

/// Sends `request` (PKCS#10, PEM) as CertificateSigningRequest `name` and waits up to
/// `wait` for the controller to sign it: the answer is the certificate, then the CA.
pub async fn sign(name: &str, request: String, wait: Duration) -> Result<Vec<u8>, String> {
    // rustls will not pick between the two crypto providers the dependencies bring.
    transport::tls::install_crypto_provider();
    let client = kube::Client::try_default().await.map_err(|e| {
        format!(
            "no Kubernetes credentials ({e}): the agent pod needs its ServiceAccount token \
             (automountServiceAccountToken), or KUBECONFIG outside a pod"
        )
    })?;
    let api: Api<CertificateSigningRequest> = Api::all(client);
    let csr = CertificateSigningRequest {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: CertificateSigningRequestSpec {
            request: ByteString(request.into_bytes()),
            signer_name: AGENT_SIGNER.into(),
            expiration_seconds: Some(AGENT_CERTIFICATE_LIFETIME.as_secs() as i32),
            usages: Some(vec![
                "digital signature".into(),
                "server auth".into(),
                "client auth".into(),
            ]),
            ..Default::default()
        },
        status: None,
    };
    api.create(&PostParams::default(), &csr)
        .await
        .map_err(|e| format!("cannot create CertificateSigningRequest {name}: {e}"))?;
    tracing::info!(csr = %name, signer = AGENT_SIGNER, "asked the cluster's signer for a certificate");
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let got = api.get(name).await;
        if let Ok(csr) = &got
            && let Some(status) = &csr.status
        {
            for c in status.conditions.iter().flatten() {
                if c.type_ == "Denied" || c.type_ == "Failed" {
                    return Err(format!(
                        "CertificateSigningRequest {name} was {}: {}",
                        c.type_.to_lowercase(),
                        c.message.as_deref().unwrap_or("no reason given")
                    ));
                }
            }
            if let Some(cert) = status.certificate.as_ref().filter(|c| !c.0.is_empty()) {
                return Ok(cert.0.clone());
            }
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "CertificateSigningRequest {name} is not signed after {}s: is the mover \
                 controller running (it signs {AGENT_SIGNER})? `kubectl get csr {name}` shows it",
                wait.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What the cluster trusts now, as its controller publishes it for the agents in
/// ConfigMap [`TRUST_CONFIGMAP`] of the agent's namespace: (every CA to trust, the CA
/// that signs now), both PEM; `None` before the controller published it.
pub async fn trust() -> Result<Option<(Vec<u8>, Vec<u8>)>, String> {
    static CLIENT: tokio::sync::OnceCell<kube::Client> = tokio::sync::OnceCell::const_new();
    let client = CLIENT
        .get_or_try_init(|| async {
            transport::tls::install_crypto_provider();
            kube::Client::try_default()
                .await
                .map_err(|e| format!("no Kubernetes credentials: {e}"))
        })
        .await?
        .clone();
    let namespace = client.default_namespace().to_string();
    let maps: Api<ConfigMap> = Api::namespaced(client, &namespace);
    // Served from the API server's watch cache (resourceVersion 0): no etcd read.
    let map = match maps.get_with(TRUST_CONFIGMAP, &GetParams::any()).await {
        Ok(m) => Some(m),
        Err(kube::Error::Api(e)) if e.code == 404 => None,
        Err(e) => {
            return Err(format!(
                "cannot read ConfigMap {namespace}/{TRUST_CONFIGMAP}: {e}"
            ));
        }
    };
    Ok(map.and_then(|m| {
        let data = m.data?;
        Some((
            data.get(TRUST_KEY)?.clone().into_bytes(),
            data.get(SIGNER_KEY)?.clone().into_bytes(),
        ))
    }))
}
