//! Mutual-TLS files for the agent benches, made with the `openssl` CLI: a CA, an agent
//! certificate for `localhost` and 127.0.0.1 (a server, and a client of the agents it
//! pushes cycles to), and a client certificate, all signed by the CA (ECDSA P-256, valid
//! two days).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::process::run_checked;

/// The PEM files of both ends.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The CA certificate both ends trust.
    pub ca: PathBuf,
    /// The agent's certificate.
    pub server_cert: PathBuf,
    /// The agent's private key.
    pub server_key: PathBuf,
    /// The client's certificate.
    pub client_cert: PathBuf,
    /// The client's private key.
    pub client_key: PathBuf,
}

/// The name the server certificate carries, which the client checks.
pub const SERVER_NAME: &str = "localhost";

/// Extensions of the server certificate.
const SERVER_EXT: &str = "subjectAltName=DNS:localhost,IP:127.0.0.1\n\
                          basicConstraints=critical,CA:FALSE\n\
                          keyUsage=critical,digitalSignature\n\
                          extendedKeyUsage=serverAuth,clientAuth\n";
/// Extensions of the client certificate.
const CLIENT_EXT: &str = "subjectAltName=DNS:mover-bench-client\n\
                          basicConstraints=critical,CA:FALSE\n\
                          keyUsage=critical,digitalSignature\n\
                          extendedKeyUsage=clientAuth\n";

/// Makes a CA and a server and a client certificate signed by it in `dir` (which must
/// exist).
pub fn generate(openssl: &Path, dir: &Path) -> Result<TlsFiles> {
    let path = |name: &str| dir.join(name);
    let files = TlsFiles {
        ca: path("ca.pem"),
        server_cert: path("server.pem"),
        server_key: path("server.key"),
        client_cert: path("client.pem"),
        client_key: path("client.key"),
    };
    let ca_key = path("ca.key");
    let mut ca = Command::new(openssl);
    ca.args(["req", "-x509"])
        .args(new_key(&ca_key))
        .args(["-days", "2", "-subj", "/CN=mover-bench CA", "-out"])
        .arg(&files.ca);
    run_checked(&mut ca).context("cannot make the test CA")?;
    let leaves = [
        (
            "server",
            "/CN=localhost",
            SERVER_EXT,
            &files.server_key,
            &files.server_cert,
        ),
        (
            "client",
            "/CN=mover-bench-client",
            CLIENT_EXT,
            &files.client_key,
            &files.client_cert,
        ),
    ];
    for (serial, (name, subject, ext, key, cert)) in (2u32..).zip(leaves) {
        let csr = path(&format!("{name}.csr"));
        let ext_file = path(&format!("{name}.ext"));
        std::fs::write(&ext_file, ext)
            .with_context(|| format!("cannot write {}", ext_file.display()))?;
        let mut req = Command::new(openssl);
        req.args(["req", "-new"])
            .args(new_key(key))
            .args(["-subj", subject, "-out"])
            .arg(&csr);
        run_checked(&mut req).with_context(|| format!("cannot make the {name} key"))?;
        let mut sign = Command::new(openssl);
        sign.args(["x509", "-req", "-in"])
            .arg(&csr)
            .arg("-CA")
            .arg(&files.ca)
            .arg("-CAkey")
            .arg(&ca_key)
            .args(["-set_serial", &serial.to_string(), "-days", "2", "-extfile"])
            .arg(&ext_file)
            .arg("-out")
            .arg(cert);
        run_checked(&mut sign).with_context(|| format!("cannot sign the {name} certificate"))?;
    }
    Ok(files)
}

/// `openssl req` arguments making a new unencrypted P-256 key written to `key`.
fn new_key(key: &Path) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
    ]
    .iter()
    .map(Into::into)
    .collect();
    args.push(key.into());
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_verify_against_the_ca() {
        let Some(openssl) = ["/usr/bin/openssl", "/usr/local/bin/openssl"]
            .iter()
            .map(Path::new)
            .find(|p| p.exists())
        else {
            eprintln!("openssl not installed: skipped");
            return;
        };
        let dir = std::env::temp_dir().join(format!("mover-bench-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = generate(openssl, &dir).unwrap();
        let mut verify = Command::new(openssl);
        verify
            .args(["verify", "-CAfile"])
            .arg(&files.ca)
            .arg(&files.server_cert)
            .arg(&files.client_cert);
        let out = run_checked(&mut verify);
        let mut text = Command::new(openssl);
        text.args(["x509", "-noout", "-text", "-in"])
            .arg(&files.server_cert);
        let server = run_checked(&mut text);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(String::from_utf8_lossy(&out.unwrap()).contains("client.pem: OK"));
        let server = String::from_utf8_lossy(&server.unwrap()).into_owned();
        assert!(
            server.contains("DNS:localhost, IP Address:127.0.0.1"),
            "{server}"
        );
    }
}
