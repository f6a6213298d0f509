//! Accept loops: a Unix socket or a TCP listener, one task per connection, until the
//! shutdown future completes.

use std::{future::Future, io, path::Path, sync::Arc, time::Duration};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};

use super::NbdExports;

/// Serves NBD on a Unix socket at `path` until `shutdown` completes. A socket file left
/// behind by an earlier server is removed first (any other file there is an error), and
/// the socket file is removed again on shutdown. Connections already accepted carry on
/// after shutdown; their failures are logged, not returned.
pub async fn serve_unix(
    path: &Path,
    exports: Arc<dyn NbdExports>,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    remove_stale_socket(path)?;
    let listener = UnixListener::bind(path)?;
    tracing::info!(path = %path.display(), "NBD server listening");
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => spawn(stream, path.display().to_string(), exports.clone(), None),
                Err(e) => accept_failed(e).await,
            },
        }
    }
    drop(listener);
    let _ = std::fs::remove_file(path);
    Ok(())
}

/// Serves NBD on an already bound TCP listener until `shutdown` completes; with `tls`,
/// every client must start TLS first (see [`super::serve_with`]). Connections already
/// accepted carry on after shutdown.
pub async fn serve_tcp(
    listener: TcpListener,
    exports: Arc<dyn NbdExports>,
    tls: Option<crate::tls::LiveTls>,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    tracing::info!(addr = ?listener.local_addr().ok(), tls = tls.is_some(), "NBD server listening");
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    // Replies are small and latency-bound; Nagle would hold them back.
                    let _ = stream.set_nodelay(true);
                    // The certificate current now: it may have been renewed since start.
                    let acceptor = match tls.as_ref().map(|t| t.get().acceptor()).transpose() {
                        Ok(a) => a,
                        Err(e) => {
                            tracing::error!(%peer, "NBD: cannot serve TLS with the current certificate: {e}");
                            continue;
                        }
                    };
                    spawn(stream, peer.to_string(), exports.clone(), acceptor);
                }
                Err(e) => accept_failed(e).await,
            },
        }
    }
    Ok(())
}

fn spawn<S>(
    stream: S,
    peer: String,
    exports: Arc<dyn NbdExports>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        tracing::debug!(%peer, "NBD connection");
        match super::serve_with(stream, exports, tls, super::HANDSHAKE_LIMIT).await {
            Ok(()) => tracing::debug!(%peer, "NBD connection closed"),
            Err(e) if e.is_disconnect() => {
                tracing::debug!(%peer, error = %e, "NBD client went away")
            }
            Err(e) => tracing::warn!(%peer, error = %e, "NBD connection failed"),
        }
    });
}

/// An accept error (out of file descriptors, a connection reset before accept) is not
/// the listener's end: log it and pause, so a persistent one does not spin.
async fn accept_failed(e: io::Error) {
    tracing::warn!(error = %e, "NBD accept failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

fn remove_stale_socket(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}
