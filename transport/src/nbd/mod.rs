//! The NBD protocol, server side (<https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md>):
//! fixed newstyle handshake, structured replies, the `base:allocation` meta context, and
//! the transmission phase. What a volume *is* (a plain export, a hydrating one) lives in
//! the `mover` crate behind [`NbdVolume`]; this module is only the wire.
//!
//! - [`serve_connection`]: one client over any byte stream, handshake to disconnect.
//! - [`serve_unix`], [`serve_tcp`]: accept loops with a shutdown future.
//! - Inside: `wire` (numbers and fixed-size messages), `handshake` (option haggling),
//!   `transmission` (concurrent requests, one reply writer), `listen` (accept loops).
//!
//! What clients get: fixed newstyle with NO_ZEROES; NBD_OPT_GO/INFO with export and
//! block size information; structured replies; `base:allocation` and `mover:present`; READ, WRITE (FUA),
//! FLUSH, TRIM, WRITE_ZEROES (NO_HOLE), CACHE, BLOCK_STATUS (REQ_ONE), DF, and
//! CAN_MULTI_CONN; over TCP, TLS (required, with client certificates: STARTTLS, the
//! spec's FORCEDTLS). Not offered: extended headers, fast zero, resize. A client has
//! [`HANDSHAKE_LIMIT`] to finish the handshake.

use std::{io, sync::Arc};

use tokio::io::{AsyncRead, AsyncWrite, BufReader};

mod error;
mod handshake;
mod listen;
mod transmission;
mod wire;

pub use error::NbdError;
pub use listen::{serve_tcp, serve_unix};

/// Serves one client on `stream` (a socket, or anything that reads and writes): the
/// handshake, then requests until the client disconnects. After NBD_CMD_DISC (or the
/// client closing) it returns once every request in flight has been answered; a protocol
/// violation ends it at once with an error. `Ok` also when the client left during the
/// handshake.
pub async fn serve_connection<S>(stream: S, exports: Arc<dyn NbdExports>) -> Result<(), NbdError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    serve_with(stream, exports, None, HANDSHAKE_LIMIT).await
}

/// How long a client may take from connecting to choosing an export (qemu-nbd's
/// default): a client that connects and says nothing holds nothing for long.
pub const HANDSHAKE_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves one client like [`serve_connection`]; with `tls`, the client must start TLS
/// (NBD_OPT_STARTTLS) before anything else, and the whole handshake must end within
/// `limit`.
pub async fn serve_with<S>(
    stream: S,
    exports: Arc<dyn NbdExports>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    limit: std::time::Duration,
) -> Result<(), NbdError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    use handshake::{Outcome, Tls};
    let deadline = tokio::time::Instant::now() + limit;
    // One buffer for the whole connection: handshake bytes read ahead are not lost when
    // the stream is split for the transmission phase.
    let mut plain = BufReader::with_capacity(256 << 10, stream);
    let mode = if tls.is_some() {
        Tls::Required
    } else {
        Tls::Off
    };
    let (mut h, outcome) = within(deadline, limit, async {
        let mut h = handshake::greet(&mut plain, &*exports).await?;
        let outcome = handshake::haggle(&mut plain, &mut h, mode).await?;
        Ok((h, outcome))
    })
    .await?;
    match (outcome, tls) {
        (Outcome::Left, _) => Ok(()),
        (Outcome::Go(session), _) => transmit(plain, session).await,
        (Outcome::StartTls, Some(acceptor)) => {
            // The client waits for STARTTLS's reply before its TLS hello: nothing of
            // its can be in the buffer.
            if !plain.buffer().is_empty() {
                return Err(NbdError::Tls(io::Error::other(
                    "the client sent data before the TLS handshake",
                )));
            }
            let encrypted = within(deadline, limit, async {
                acceptor
                    .accept(plain.into_inner())
                    .await
                    .map_err(NbdError::Tls)
            })
            .await?;
            let mut encrypted = BufReader::with_capacity(256 << 10, encrypted);
            let outcome = within(
                deadline,
                limit,
                handshake::haggle(&mut encrypted, &mut h, Tls::Established),
            )
            .await?;
            match outcome {
                Outcome::Go(session) => transmit(encrypted, session).await,
                _ => Ok(()),
            }
        }
        (Outcome::StartTls, None) => unreachable!("STARTTLS is refused without TLS"),
    }
}

/// `f`, unless `deadline` passes first.
async fn within<T>(
    deadline: tokio::time::Instant,
    limit: std::time::Duration,
    f: impl std::future::Future<Output = Result<T, NbdError>>,
) -> Result<T, NbdError> {
    tokio::time::timeout_at(deadline, f)
        .await
        .map_err(|_| NbdError::HandshakeTimeout(limit))?
}

async fn transmit<S>(stream: BufReader<S>, session: handshake::Session) -> Result<(), NbdError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    tracing::debug!(
        export = %session.name,
        structured = session.structured,
        contexts = ?session.contexts,
        "NBD transmission phase"
    );
    let (reader, writer) = tokio::io::split(stream);
    transmission::transmit(reader, writer, session).await
}

/// One served volume. The server checks every request against [`NbdVolume::size`] and
/// [`NbdVolume::read_only`] before calling in, and calls concurrently (several requests
/// of one or several connections in flight at once). Errors are `std::io::Error`s; their
/// OS error code (EIO, EPERM, ENOSPC, EINVAL, ...) is what the client is told.
#[tonic::async_trait]
pub trait NbdVolume: Send + Sync {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// The local device or image file holding every byte, when nothing remains to
    /// arrive: a kernel device may then go straight to it. None by default.
    fn local_file(&self) -> Option<std::path::PathBuf> {
        None
    }
    /// Writes, trims and write-zeroes are refused with EPERM.
    fn read_only(&self) -> bool;
    /// The block size clients should prefer (NBD_INFO_BLOCK_SIZE): a hydrating export's
    /// region size, 4096 for a plain one.
    fn preferred_block(&self) -> u32;
    /// Reads `len` bytes at `offset`.
    async fn read(&self, offset: u64, len: u32) -> io::Result<Vec<u8>>;
    /// Writes `data` at `offset`; durable before returning when `fua`. The bytes are
    /// handed over (not borrowed), so a write done on another thread needs no copy of
    /// them (up to 1 MiB a request, on the agent's CPU).
    async fn write(&self, offset: u64, data: bytes::Bytes, fua: bool) -> io::Result<()>;
    /// Makes every completed write durable.
    async fn flush(&self) -> io::Result<()>;
    /// Discards a range (it may read back as zeros or as what was there).
    async fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()>;
    /// Writes zeros over a range (`may_trim`: punching a hole is fine).
    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_trim: bool,
        fua: bool,
    ) -> io::Result<()>;
    /// The allocation of `[offset, offset + len)` as consecutive extents starting at
    /// `offset`: (length, [`STATE_HOLE`] | [`STATE_ZERO`] flags). They may cover only a
    /// prefix of the range, never less than one byte.
    async fn block_status(&self, offset: u64, len: u64) -> io::Result<Vec<(u64, u32)>>;
    /// Brings a range close (NBD_CMD_CACHE): a hydrating export fetches it now.
    async fn cache(&self, offset: u64, len: u64) -> io::Result<()>;
    /// `mover:present`: which of `[offset, offset + len)` is here, as extents like
    /// [`NbdVolume::block_status`]'s with [`STATE_MISSING`] on what is not (a hydrating
    /// export's regions still to come). By default everything is here.
    async fn presence(&self, _offset: u64, len: u64) -> io::Result<Vec<(u64, u32)>> {
        Ok(vec![(len, 0)])
    }
}

/// `base:allocation`: the extent is not allocated.
pub const STATE_HOLE: u32 = 1;
/// `base:allocation`: the extent reads as zeros.
pub const STATE_ZERO: u32 = 2;
/// `mover:present`: the extent is not here yet (a read of it is fetched first).
pub const STATE_MISSING: u32 = 1;

/// The volumes a server offers, by export name.
pub trait NbdExports: Send + Sync {
    /// (name, description) of every export, for NBD_OPT_LIST.
    fn list(&self) -> Vec<(String, String)>;
    /// Opens an export for one connection; `Err` says why it cannot be served (the client
    /// gets NBD_REP_ERR_UNKNOWN with that message).
    fn open(&self, name: &str) -> Result<Arc<dyn NbdVolume>, String>;
}
