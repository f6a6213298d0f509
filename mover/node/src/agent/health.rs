//! /healthz: whether the agent can do its work, for the DaemonSet's liveness probe. It
//! fails when the state directory cannot be written, a relationship's cycle is wedged,
//! the gRPC server does not answer, or the certificate is about to expire: the agent
//! renews it well before (at two thirds of its life, [`super::renew_certificate`]), so
//! this fails only when renewing has failed for long.

use axum::http::StatusCode;
use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};
use transport::tls::LiveTls;

/// How long each check may take before it counts as failed.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// What /healthz looks at.
pub(super) struct Health {
    pub state_dir: PathBuf,
    /// The gRPC server's address.
    pub grpc: SocketAddr,
    pub tls: Option<LiveTls>,
    /// The name the certificate carries.
    pub node: Option<String>,
    pub runners: Arc<crate::replicate::Runners>,
}

impl Health {
    /// 200 "ok", or 503 with one line per failed check.
    pub async fn check(&self) -> (StatusCode, String) {
        let (state, grpc) = tokio::join!(self.state_dir_writable(), self.grpc_answers());
        let mut failed: Vec<String> = [state, grpc].into_iter().flatten().collect();
        let stuck = self.runners.stuck(2 * crate::replicate::runner::STALL);
        if !stuck.is_empty() {
            failed.push(format!(
                "relationship cycles made no progress and did not end for over {}s: {}",
                2 * crate::replicate::runner::STALL.as_secs(),
                stuck.join(", ")
            ));
        }
        if let Some(pem) = &self.tls
            && let Some((left, all, _)) = transport::cluster::certificate_life(&pem.get().cert, "")
            && left * 10 < all
        {
            failed.push(format!(
                "the agent's certificate expires in {left}s and renewing it has failed \
                 since a third of its life was left (see the log): a restart asks again"
            ));
        }
        if failed.is_empty() {
            (StatusCode::OK, "ok\n".into())
        } else {
            for f in &failed {
                tracing::warn!("unhealthy: {f}");
            }
            (StatusCode::SERVICE_UNAVAILABLE, failed.join("\n") + "\n")
        }
    }

    /// A file written and synced in the state directory, then removed.
    async fn state_dir_writable(&self) -> Option<String> {
        let dir = self.state_dir.clone();
        let probe = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            let path = dir.join(".healthz");
            let mut f = std::fs::File::create(&path)?;
            std::io::Write::write_all(&mut f, b"ok")?;
            f.sync_all()?;
            std::fs::remove_file(&path)
        });
        match tokio::time::timeout(CHECK_TIMEOUT, probe).await {
            Ok(Ok(Ok(()))) => None,
            Ok(Ok(Err(e))) => Some(format!(
                "the state directory {} is not writable: {e}",
                self.state_dir.display()
            )),
            Ok(Err(e)) => Some(format!("the state directory check failed: {e}")),
            Err(_) => Some(format!(
                "a write to the state directory {} took over {}s",
                self.state_dir.display(),
                CHECK_TIMEOUT.as_secs()
            )),
        }
    }

    /// A gRPC call to the agent's own server, answered with any status.
    async fn grpc_answers(&self) -> Option<String> {
        let mut addr = self.grpc;
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let mut remote = mover_engine::remote::RemoteOptions::default();
        remote.connect.tls_pem = self.tls.clone();
        remote.connect.tls_server_name = self.node.clone().or_else(|| {
            self.tls.as_ref().and_then(|p| {
                transport::tls::Facts::of_pem(&p.get().cert)?
                    .dns
                    .into_iter()
                    .next()
            })
        });
        let url = mover_engine::remote::AgentUrl {
            host: addr.ip().to_string(),
            port: addr.port(),
            volume: "-".into(),
            tls_name: None,
        };
        let call = async {
            let mut client = remote.connect(&url).await.map_err(|e| e.to_string())?;
            // Any answer (a refusal included) says the server serves calls.
            let _ = client
                .describe(transport::proto::DescribeRequest {
                    volume: String::new(),
                    relationship: String::new(),
                })
                .await;
            Ok::<(), String>(())
        };
        match tokio::time::timeout(CHECK_TIMEOUT, call).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("the gRPC server at {addr} does not answer: {e}")),
            Err(_) => Some(format!(
                "the gRPC server at {addr} did not answer within {}s",
                CHECK_TIMEOUT.as_secs()
            )),
        }
    }
}
