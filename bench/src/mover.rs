//! Driving the `mover` binary and reading its `--json` reports.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::tls::{self, TlsFiles};

/// The fields of `mover copy --json` the bench uses (the whole object is kept verbatim in
/// the results).
#[derive(Debug, Clone, Deserialize)]
pub struct CopyReport {
    /// Logical size of the volume copied.
    pub volume_bytes: u64,
    /// Bytes read from the destination (to find what differs).
    pub destination_bytes_read: u64,
    /// Bytes written to the destination.
    pub bytes_written: u64,
    /// Bytes zeroed (punched or zero-filled) in the destination.
    pub bytes_zeroed: u64,
    /// Pages written to the destination.
    pub pages_written: u64,
    /// Copies to or from an agent: bytes of volume data (compressed frames) on the network.
    #[serde(default)]
    pub wire_bytes: u64,
}

/// The fields of `mover hash --json` the bench uses.
#[derive(Debug, Clone, Deserialize)]
pub struct HashReport {
    /// Logical size of the volume hashed.
    pub volume_bytes: u64,
    /// mover's own measure of the hashing time.
    pub duration_secs: f64,
}

/// `mover copy SRC DST --json --no-progress`.
pub fn copy_command(mover: &Path, source: &Path, destination: &Path) -> Command {
    let mut cmd = Command::new(mover);
    cmd.arg("copy")
        .arg(source)
        .arg(destination)
        .args(["--json", "--no-progress"]);
    cmd
}

/// How `mover copy` authenticates to an agent.
#[derive(Debug, Clone, Copy)]
pub struct AgentAuth<'a> {
    /// File holding the bearer token.
    pub token_file: &'a Path,
    /// Mutual TLS, when the agent serves it.
    pub tls: Option<&'a TlsFiles>,
}

/// `mover copy SRC agent://127.0.0.1:PORT/EXPORT --json --no-progress` with the token file
/// and, for mutual TLS, the CA, the client's certificate and key, and the server name.
pub fn agent_copy_command(
    mover: &Path,
    source: &Path,
    port: u16,
    export: &str,
    auth: AgentAuth,
) -> Command {
    let mut cmd = copy_command(
        mover,
        source,
        Path::new(&format!("agent://127.0.0.1:{port}/{export}")),
    );
    cmd.arg("--token-file").arg(auth.token_file);
    if let Some(tls) = auth.tls {
        cmd.arg("--tls-ca")
            .arg(&tls.ca)
            .arg("--tls-cert")
            .arg(&tls.client_cert)
            .arg("--tls-key")
            .arg(&tls.client_key)
            .args(["--tls-server-name", tls::SERVER_NAME]);
    }
    cmd
}

/// `mover hash VOLUME --threads N --json`.
pub fn hash_command(mover: &Path, volume: &Path, threads: usize) -> Command {
    let mut cmd = Command::new(mover);
    cmd.arg("hash")
        .arg(volume)
        .args(["--threads", &threads.to_string(), "--json"]);
    cmd
}

/// Parses the one JSON object mover printed, returning the typed fields and the whole
/// object; checks it describes a volume of `volume_bytes`.
pub fn parse_report<T>(stdout: &[u8], volume_bytes: u64) -> Result<(T, serde_json::Value)>
where
    T: DeserializeOwned + VolumeBytes,
{
    let text = String::from_utf8_lossy(stdout);
    let value: serde_json::Value = serde_json::from_str(text.trim()).with_context(|| {
        format!("mover --json printed something else than one JSON object: {text:?}")
    })?;
    let report: T = serde_json::from_value(value.clone())
        .with_context(|| format!("mover's JSON report lacks an expected field: {text}"))?;
    if report.volume_bytes() != volume_bytes {
        bail!(
            "mover reports a volume of {} bytes, expected {volume_bytes}",
            report.volume_bytes()
        );
    }
    Ok((report, value))
}

/// Reports that state the size of the volume they cover.
pub trait VolumeBytes {
    /// Logical size of the volume.
    fn volume_bytes(&self) -> u64;
}

impl VolumeBytes for CopyReport {
    fn volume_bytes(&self) -> u64 {
        self.volume_bytes
    }
}

impl VolumeBytes for HashReport {
    fn volume_bytes(&self) -> u64 {
        self.volume_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COPY: &str = r#"{"source": "/dev/loop0", "destination": "/d", "volume_bytes": 8192,
        "chunk_size": 1048576, "source_bytes_read": 8192, "destination_bytes_read": 0,
        "bytes_written": 4096, "bytes_zeroed": 0, "zero_bytes_skipped": 4096,
        "pages_written": 1, "duration_secs": 0.5, "throughput_bytes_per_sec": 16384.0,
        "verified": false, "root": "ab", "wire_bytes": 1234}"#;

    #[test]
    fn parses_copy_reports_and_keeps_every_field() {
        let (report, value) = parse_report::<CopyReport>(COPY.as_bytes(), 8192).unwrap();
        assert_eq!(report.bytes_written, 4096);
        assert_eq!(report.wire_bytes, 1234);
        assert_eq!(value["root"], "ab");
    }

    #[test]
    fn refuses_a_report_for_another_volume_or_garbage() {
        assert!(parse_report::<CopyReport>(COPY.as_bytes(), 4096).is_err());
        assert!(parse_report::<HashReport>(b"copied!", 4096).is_err());
    }
}
