//! Why a connection ended badly.

use std::io;

/// Why serving one NBD connection failed. Failures of a volume are not here: those are
/// told to the client as NBD errors and the connection goes on.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    /// Reading from or writing to the socket failed (including the client vanishing).
    #[error("NBD connection: {0}")]
    Io(#[from] io::Error),
    /// The client sent a wrong magic number: it does not speak (this) NBD.
    #[error("NBD client sent magic {got:#x} where {expected:#x} belongs ({phase})")]
    BadMagic {
        /// Where in the protocol.
        phase: &'static str,
        /// The magic the protocol wants there.
        expected: u64,
        /// What came instead.
        got: u64,
    },
    /// The client set handshake flags the server did not offer; the spec says to close.
    #[error("NBD client set unknown handshake flags {0:#x}")]
    ClientFlags(u32),
    /// An option or request announced more data than the server is willing to read.
    #[error("NBD client announced {len} bytes of {what}, more than the server accepts")]
    TooLarge {
        /// Which payload.
        what: &'static str,
        /// Its announced length.
        len: u64,
    },
    /// The client did not finish the handshake in time (a stuck or idle client holds
    /// nothing for long).
    #[error("NBD client did not finish the handshake within {0:?}")]
    HandshakeTimeout(std::time::Duration),
    /// The client asked for an export without starting TLS on a server that requires it.
    #[error("NBD client chose an export without TLS, which this server requires")]
    TlsRequired,
    /// The TLS handshake after NBD_OPT_STARTTLS failed (no or an untrusted certificate).
    #[error("NBD TLS handshake: {0}")]
    Tls(#[source] io::Error),
    /// `NBD_OPT_EXPORT_NAME` named an export that cannot be served; that option has no
    /// error reply, so the spec says to close.
    #[error("NBD export {name:?} cannot be served: {reason}")]
    ExportRefused {
        /// The export name the client asked for.
        name: String,
        /// What [`super::NbdExports::open`] said.
        reason: String,
    },
}

impl NbdError {
    /// The client went away (closed, reset) rather than misbehaving: not worth a warning.
    pub fn is_disconnect(&self) -> bool {
        match self {
            NbdError::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            ),
            _ => false,
        }
    }
}
