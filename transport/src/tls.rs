//! TLS from PEM files or memory: each agent has a certificate and key signed by its
//! cluster's CA; servers check client certificates against that CA (optional where peer
//! clusters' agents prove themselves with a token instead).

use std::path::{Path, PathBuf};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// Paths of the PEM files for one side of a mutual-TLS connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// This side's certificate chain.
    pub cert: PathBuf,
    /// This side's private key.
    pub key: PathBuf,
    /// The CA that signs the peers' certificates.
    pub ca: PathBuf,
}

/// A TLS file that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read TLS {what} {path}: {cause}")]
pub struct TlsError {
    what: &'static str,
    path: PathBuf,
    cause: std::io::Error,
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|cause| TlsError {
        what,
        path: path.into(),
        cause,
    })
}

/// Selects rustls' ring crypto for the process (call it before any TLS client or server
/// starts: the Kubernetes client too). Other dependencies (the S3 client) bring
/// aws-lc-rs too, and rustls refuses to guess between two providers. AES-128-GCM is
/// offered first: a volume's every byte is encrypted and decrypted on both agents, and
/// it needs 10 AES rounds a block to AES-256's 14, at a strength no attack comes near.
pub fn install_crypto_provider() {
    use rustls::CipherSuite::TLS13_AES_128_GCM_SHA256;
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != TLS13_AES_128_GCM_SHA256);
    // Fails only if a provider is already installed, which is just as good.
    let _ = provider.install_default();
}

impl TlsFiles {
    /// Reads the three files.
    pub fn load(&self) -> Result<TlsPem, TlsError> {
        Ok(TlsPem {
            cert: read("certificate", &self.cert)?,
            key: read("key", &self.key)?,
            ca: read("CA", &self.ca)?,
        })
    }

    /// A TLS acceptor for raw streams (NBD over TCP): see [`TlsPem::acceptor`].
    pub fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, TlsError> {
        self.load()?.acceptor()
    }
}

/// The PEM contents of one side's TLS files, in memory: a certificate the agent obtained
/// from its cluster's signer, or one the controller made itself.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsPem {
    /// This side's certificate chain.
    pub cert: Vec<u8>,
    /// This side's private key.
    pub key: Vec<u8>,
    /// The CA that signs the peers' certificates.
    pub ca: Vec<u8>,
}

impl std::fmt::Debug for TlsPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.write_str("TlsPem { .. }")
    }
}

impl TlsPem {
    /// A TLS acceptor for raw streams (NBD over TCP): present our certificate and
    /// require clients signed by the CA.
    pub fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, TlsError> {
        Ok(tokio_rustls::TlsAcceptor::from(
            self.server_config(false, Vec::new())?,
        ))
    }

    /// A TLS acceptor for gRPC (HTTP/2 by ALPN): present our certificate; check client
    /// certificates against the CA. With `client_auth_optional`, a client may present
    /// none (it must then show a bearer token: a peer cluster's agents, whose
    /// certificates another CA signs). Servers accept connections with it themselves
    /// ([`incoming`]), so that a renewed certificate reaches new ones ([`LiveTls`]).
    pub fn grpc_acceptor(
        &self,
        client_auth_optional: bool,
    ) -> Result<tokio_rustls::TlsAcceptor, TlsError> {
        let config = self.server_config(client_auth_optional, vec![b"h2".to_vec()])?;
        Ok(tokio_rustls::TlsAcceptor::from(config))
    }

    fn server_config(
        &self,
        client_auth_optional: bool,
        alpn: Vec<Vec<u8>>,
    ) -> Result<std::sync::Arc<rustls::ServerConfig>, TlsError> {
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
        install_crypto_provider();
        let bad = |what: &'static str, why: String| TlsError {
            what,
            path: "(in memory)".into(),
            cause: std::io::Error::new(std::io::ErrorKind::InvalidData, why),
        };
        let pem_certs =
            |what: &'static str, bytes: &[u8]| -> Result<Vec<CertificateDer<'static>>, TlsError> {
                let certs = CertificateDer::pem_slice_iter(bytes)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| bad(what, e.to_string()))?;
                if certs.is_empty() {
                    return Err(bad(what, "no PEM certificate in it".into()));
                }
                Ok(certs)
            };
        let chain = pem_certs("certificate", &self.cert)?;
        let key =
            PrivateKeyDer::from_pem_slice(&self.key).map_err(|e| bad("key", e.to_string()))?;
        let mut roots = rustls::RootCertStore::empty();
        for ca in pem_certs("CA", &self.ca)? {
            roots.add(ca).map_err(|e| bad("CA", e.to_string()))?;
        }
        let mut verifier = rustls::server::WebPkiClientVerifier::builder(roots.into());
        if client_auth_optional {
            verifier = verifier.allow_unauthenticated();
        }
        let verifier = verifier.build().map_err(|e| bad("CA", e.to_string()))?;
        let mut config = rustls::ServerConfig::builder()
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .map_err(|e| bad("certificate", e.to_string()))?;
        config.alpn_protocols = alpn;
        Ok(std::sync::Arc::new(config))
    }

    /// Client side: trust only the CA, present our certificate, and expect the server
    /// to be named `server_name` in its certificate.
    pub fn client(&self, server_name: &str) -> ClientTlsConfig {
        client_trusting(&self.ca, server_name).identity(Identity::from_pem(&self.cert, &self.key))
    }
}

/// A certificate that may be renewed while it is in use: servers present the current
/// one to each new connection, clients to each new connection they make. Connections
/// already made keep theirs (a renewal comes well before the old one expires).
#[derive(Clone)]
pub struct LiveTls(std::sync::Arc<std::sync::RwLock<std::sync::Arc<TlsPem>>>);

impl LiveTls {
    /// Starts with `pem`.
    pub fn new(pem: TlsPem) -> LiveTls {
        LiveTls(std::sync::Arc::new(std::sync::RwLock::new(
            std::sync::Arc::new(pem),
        )))
    }

    /// The current certificate.
    pub fn get(&self) -> std::sync::Arc<TlsPem> {
        self.0.read().expect("tls lock").clone()
    }

    /// Replaces the certificate; false if `pem` is the current one already.
    pub fn set(&self, pem: TlsPem) -> bool {
        let mut current = self.0.write().expect("tls lock");
        if **current == pem {
            return false;
        }
        *current = std::sync::Arc::new(pem);
        true
    }
}

impl std::fmt::Debug for LiveTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LiveTls { .. }")
    }
}

/// The TLS connections made to `listener`, each with the certificate `live` holds when
/// it arrives; a handshake runs beside the others and gets at most 10 s.
pub fn incoming(
    listener: tokio::net::TcpListener,
    live: LiveTls,
    client_auth_optional: bool,
) -> tokio_stream::wrappers::ReceiverStream<
    std::io::Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let mut cached: Option<(std::sync::Arc<TlsPem>, tokio_rustls::TlsAcceptor)> = None;
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("cannot accept a connection: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            // Small replies must not wait for Nagle's algorithm and the peer's delayed ACK.
            let _ = tcp.set_nodelay(true);
            let pem = live.get();
            let acceptor = match &cached {
                Some((p, a)) if std::sync::Arc::ptr_eq(p, &pem) => a.clone(),
                _ => match pem.grpc_acceptor(client_auth_optional) {
                    Ok(a) => {
                        cached = Some((pem, a.clone()));
                        a
                    }
                    Err(e) => {
                        tracing::error!("cannot serve TLS with the current certificate: {e}");
                        continue;
                    }
                },
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let handshake = acceptor.accept(tcp);
                match tokio::time::timeout(std::time::Duration::from_secs(10), handshake).await {
                    Ok(Ok(tls)) => {
                        let _ = tx.send(Ok(tls)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, "TLS handshake failed: {e}"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Client side without a certificate of our own (a bearer token authenticates us):
/// trust only `ca` and expect the server to be named `server_name` in its certificate.
pub fn client_trusting(ca: &[u8], server_name: &str) -> ClientTlsConfig {
    install_crypto_provider();
    ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name(server_name)
}

/// What a certificate says of itself: its subject alternative names and validity.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    /// DNS names.
    pub dns: Vec<String>,
    /// URI names (a mover role: see [`crate::auth`]).
    pub uris: Vec<String>,
    /// Valid from (Unix seconds).
    pub not_before: i64,
    /// Valid until (Unix seconds).
    pub not_after: i64,
    /// Its issuer's name (DER).
    pub issuer: Vec<u8>,
    /// Its own name (DER): a CA's is the issuer of what it signs.
    pub subject: Vec<u8>,
}

impl Facts {
    /// Of a DER certificate (`None`: not one).
    pub fn of_der(der: &[u8]) -> Option<Facts> {
        use x509_parser::prelude::*;
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let mut facts = Facts {
            not_before: cert.validity().not_before.timestamp(),
            not_after: cert.validity().not_after.timestamp(),
            issuer: cert.issuer().as_raw().to_vec(),
            subject: cert.subject().as_raw().to_vec(),
            ..Facts::default()
        };
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for n in &san.value.general_names {
                match n {
                    GeneralName::DNSName(d) => facts.dns.push(d.to_string()),
                    GeneralName::URI(u) => facts.uris.push(u.to_string()),
                    _ => {}
                }
            }
        }
        Some(facts)
    }

    /// Of the first certificate of a PEM chain.
    pub fn of_pem(pem: &[u8]) -> Option<Facts> {
        let (_, block) = x509_parser::pem::parse_x509_pem(pem).ok()?;
        Facts::of_der(&block.contents)
    }
}

/// Whether the first certificate of `cert` (PEM) names the CA `ca` (PEM) as its issuer.
/// mover's CAs are named after their keys, so a rotated CA is told from the one before.
pub fn issued_by(cert: &[u8], ca: &[u8]) -> bool {
    match (Facts::of_pem(cert), Facts::of_pem(ca)) {
        (Some(c), Some(a)) => c.issuer == a.subject,
        _ => false,
    }
}

/// `e` and every error under it, looking inside `io::Error`s too (their `source()`
/// skips the error they wrap, where rustls puts its own).
fn causes<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |cur| match cur.downcast_ref::<std::io::Error>() {
        Some(io) => io
            .get_ref()
            .map(|inner| inner as &(dyn std::error::Error + 'static)),
        None => cur.source(),
    })
}

/// Whether `e` is this side refusing the TLS peer's certificate (another CA's, or not
/// naming the peer): a retry meets the same certificate.
pub fn is_certificate_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    causes(e).any(|c| {
        matches!(
            c.downcast_ref::<rustls::Error>(),
            Some(rustls::Error::InvalidCertificate(_))
        )
    })
}

/// Whether `e` is a plaintext HTTP/2 client reading a TLS server's answer: the TLS
/// record, read as an HTTP/2 frame, has an impossible size.
pub fn is_plaintext_to_tls(e: &(dyn std::error::Error + 'static)) -> bool {
    causes(e).any(|c| {
        c.downcast_ref::<h2::Error>().and_then(h2::Error::reason)
            == Some(h2::Reason::FRAME_SIZE_ERROR)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plaintext client meets a server that answers in TLS: the error says so by its
    /// type, whatever its words.
    #[tokio::test]
    async fn a_plaintext_client_of_a_tls_server_is_told_by_type() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            // A TLS alert record, as a TLS server answers a client hello it cannot
            // parse; read as an HTTP/2 frame header its length is 1.4 MB.
            conn.write_all(&[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x46])
                .await
                .unwrap();
            let mut sink = vec![0; 4096];
            while conn.read(&mut sink).await.is_ok_and(|n| n > 0) {}
        });
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = crate::control::replication_client::ReplicationClient::new(channel);
        let s = client
            .get(crate::control::NameRequest { name: "r".into() })
            .await
            .unwrap_err();
        assert!(is_plaintext_to_tls(&s), "{s:?}");
        assert!(!is_certificate_refused(&s), "{s:?}");
        assert!(!is_plaintext_to_tls(&tonic::Status::internal(
            "frame with invalid size"
        )));
    }

    /// A server whose certificate another CA signed: refused by type.
    #[tokio::test]
    async fn a_certificate_of_another_ca_is_refused_by_type() {
        install_crypto_provider();
        let self_signed = |name: &str| {
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = rcgen::CertificateParams::new(vec![name.to_string()])
                .unwrap()
                .self_signed(&key)
                .unwrap();
            (cert.pem().into_bytes(), key.serialize_pem().into_bytes())
        };
        let (cert, key) = self_signed("agent");
        let (other_ca, _) = self_signed("other");
        let acceptor = TlsPem {
            cert: cert.clone(),
            key,
            ca: cert,
        }
        .acceptor()
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (conn, _) = listener.accept().await.unwrap();
            let _ = acceptor.accept(conn).await;
        });
        let e = tonic::transport::Channel::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(client_trusting(&other_ca, "agent"))
            .unwrap()
            .connect()
            .await
            .unwrap_err();
        assert!(is_certificate_refused(&e), "{e:?}");
        assert!(!is_plaintext_to_tls(&e), "{e:?}");
    }
}
