//! `mover agent` and `mover controller`: bind the listeners, wait for a signal, and
//! run the library's server.

use anyhow::Context;

/// `mover agent`: serves until SIGINT or SIGTERM.
pub fn run_agent(config_path: &std::path::Path) -> anyhow::Result<()> {
    let config = mover::agent::AgentConfig::load(config_path)?;
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let metrics = match config.metrics_listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen for metrics on {addr}"))?,
            ),
            None => None,
        };
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term.recv() => {},
            }
            tracing::info!("shutting down: finishing calls in flight");
        };
        mover::agent::serve(config, listener, metrics, shutdown).await?;
        Ok(())
    })
}

/// `mover controller ...`.
#[cfg(feature = "controller")]
pub fn run_controller(cmd: crate::ControllerCommand) -> anyhow::Result<()> {
    match cmd {
        crate::ControllerCommand::Crds { group, out } => {
            for path in mover::controller::write_crds(&group, &out)
                .with_context(|| format!("cannot write the CRDs into {}", out.display()))?
            {
                println!("{}", path.display());
            }
            Ok(())
        }
        crate::ControllerCommand::Run(options) => {
            let runtime =
                tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
            runtime.block_on(mover::controller::run(*options))?;
            Ok(())
        }
    }
}
