//! Mutual TLS from PEM files: each agent has a certificate and key signed by a CA that
//! every agent trusts; servers require client certificates from that CA.

use std::path::{Path, PathBuf};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

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
    /// Server side: present our certificate and require clients signed by the CA.
    pub fn server(&self) -> Result<ServerTlsConfig, TlsError> {
        install_crypto_provider();
        let id = Identity::from_pem(read("certificate", &self.cert)?, read("key", &self.key)?);
        Ok(ServerTlsConfig::new()
            .identity(id)
            .client_ca_root(Certificate::from_pem(read("CA", &self.ca)?)))
    }

    /// A TLS acceptor for raw streams (NBD over TCP): present our certificate and
    /// require clients signed by the CA, as [`TlsFiles::server`] does for gRPC.
    pub fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, TlsError> {
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
        install_crypto_provider();
        let bad = |what: &'static str, path: &Path, why: String| TlsError {
            what,
            path: path.into(),
            cause: std::io::Error::new(std::io::ErrorKind::InvalidData, why),
        };
        let pem_certs =
            |what: &'static str, path: &Path| -> Result<Vec<CertificateDer<'static>>, TlsError> {
                let bytes = read(what, path)?;
                let certs = CertificateDer::pem_slice_iter(&bytes)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| bad(what, path, e.to_string()))?;
                if certs.is_empty() {
                    return Err(bad(what, path, "no PEM certificate in it".into()));
                }
                Ok(certs)
            };
        let chain = pem_certs("certificate", &self.cert)?;
        let key = PrivateKeyDer::from_pem_slice(&read("key", &self.key)?)
            .map_err(|e| bad("key", &self.key, e.to_string()))?;
        let mut roots = rustls::RootCertStore::empty();
        for ca in pem_certs("CA", &self.ca)? {
            roots
                .add(ca)
                .map_err(|e| bad("CA", &self.ca, e.to_string()))?;
        }
        let verifier = rustls::server::WebPkiClientVerifier::builder(roots.into())
            .build()
            .map_err(|e| bad("CA", &self.ca, e.to_string()))?;
        let config = rustls::ServerConfig::builder()
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .map_err(|e| bad("certificate", &self.cert, e.to_string()))?;
        Ok(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config)))
    }

    /// Client side: trust only the CA, present our certificate, and expect the server
    /// to be named `server_name` in its certificate.
    pub fn client(&self, server_name: &str) -> Result<ClientTlsConfig, TlsError> {
        install_crypto_provider();
        let id = Identity::from_pem(read("certificate", &self.cert)?, read("key", &self.key)?);
        Ok(ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("CA", &self.ca)?))
            .identity(id)
            .domain_name(server_name))
    }
}
