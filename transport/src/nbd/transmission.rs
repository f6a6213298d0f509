//! The transmission phase: requests are read on one task, each runs as its own task,
//! and every reply goes through a single writer task so replies never interleave.
//!
//! Concurrency is bounded twice: at most [`MAX_IN_FLIGHT`] requests, and at most
//! [`MAX_BUFFERED`] bytes of read and write payloads held in memory. A request keeps
//! its permits until its reply is on the socket, so a client that stops reading
//! replies stops being read from.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::handshake::{BASE_ALLOCATION_ID, MAX_PAYLOAD, Session};
use super::wire::*;
use super::{NbdError, STATE_HOLE, STATE_MISSING, STATE_ZERO};

/// Most requests served at once on one connection.
const MAX_IN_FLIGHT: usize = 64;
/// Most bytes of read and write payloads held at once on one connection.
const MAX_BUFFERED: usize = 256 << 20;
/// Largest oversized write payload read and thrown away to answer EINVAL and carry on;
/// beyond it the client gets a hard disconnect.
const MAX_DISCARD: u32 = 256 << 20;
/// Most extents in one block status reply (the spec's suggested limit).
const MAX_EXTENTS: usize = 1 << 20;

/// One reply, ready for the wire, and what it holds until written.
struct Outgoing {
    head: Vec<u8>,
    body: Vec<u8>,
    _permits: Permits,
}

struct Permits {
    _slot: OwnedSemaphorePermit,
    _bytes: Option<OwnedSemaphorePermit>,
}

/// What a command produced.
enum Done {
    Ok,
    Data(Vec<u8>),
    /// Block status: per selected context (by id), its extents.
    Extents(Vec<(u32, Vec<(u32, u32)>)>),
}

/// A failed command: the NBD error and a message for the client's human.
#[derive(Debug)]
struct Failure {
    errno: u32,
    message: String,
}

fn fail<T>(errno: u32, message: impl Into<String>) -> Result<T, Failure> {
    Err(Failure {
        errno,
        message: message.into(),
    })
}

/// Serves requests from `reader` until NBD_CMD_DISC or the client closes, then waits
/// for the replies of requests in flight.
pub(crate) async fn transmit<R, W>(
    mut reader: R,
    writer: W,
    session: Session,
) -> Result<(), NbdError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let session = Arc::new(session);
    let (tx, rx) = mpsc::channel(MAX_IN_FLIGHT);
    let writer = tokio::spawn(write_replies(writer, rx));
    let read = read_requests(&mut reader, &session, &tx).await;
    drop(tx);
    if let Err(e) = read {
        // A hard disconnect: replies still to come need not reach a client that broke
        // the protocol (and may not be reading). Commands in flight still finish.
        writer.abort();
        return Err(e);
    }
    // Every request in flight holds a sender: the writer ends once they have replied.
    let written = writer
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)));
    Ok(written?)
}

async fn read_requests<R: AsyncRead + Unpin>(
    reader: &mut R,
    session: &Arc<Session>,
    tx: &mpsc::Sender<Outgoing>,
) -> Result<(), NbdError> {
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let bytes = Arc::new(Semaphore::new(MAX_BUFFERED));
    loop {
        let mut head = [0u8; REQUEST_LEN];
        tokio::select! {
            biased;
            // The writer failed (the client stopped reading): its error is the story.
            _ = tx.closed() => return Ok(()),
            r = reader.read_exact(&mut head) => match r {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    tracing::debug!(export = %session.name, "NBD client closed without NBD_CMD_DISC");
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
            }
        }
        let req = Request::decode(&head).map_err(|got| NbdError::BadMagic {
            phase: "request",
            expected: REQUEST_MAGIC.into(),
            got: got.into(),
        })?;
        tracing::trace!(?req, "NBD request");
        if req.kind == CMD_DISC {
            return Ok(());
        }

        let slot = slots.clone().acquire_owned().await.expect("never closed");
        let holds_payload = matches!(req.kind, CMD_READ | CMD_WRITE) && req.len <= MAX_PAYLOAD;
        let bytes = if holds_payload && req.len > 0 {
            Some(
                bytes
                    .clone()
                    .acquire_many_owned(req.len)
                    .await
                    .expect("never closed"),
            )
        } else {
            None
        };
        let payload = if req.kind == CMD_WRITE {
            if req.len > MAX_PAYLOAD {
                if req.len > MAX_DISCARD {
                    return Err(NbdError::TooLarge {
                        what: "write payload",
                        len: req.len.into(),
                    });
                }
                // Thrown away; the command answers EINVAL.
                tokio::io::copy(
                    &mut (&mut *reader).take(req.len.into()),
                    &mut tokio::io::sink(),
                )
                .await?;
                None
            } else {
                let mut data = vec![0u8; req.len as usize];
                reader.read_exact(&mut data).await?;
                Some(data)
            }
        } else {
            None
        };

        let permits = Permits {
            _slot: slot,
            _bytes: bytes,
        };
        let session = session.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            // The command runs in a task of its own so that a volume that panics costs
            // the client an EIO rather than a reply that never comes.
            let s = session.clone();
            let outcome = tokio::spawn(async move { execute(&s, &req, payload).await })
                .await
                .unwrap_or_else(|e| {
                    tracing::error!(export = %session.name, ?req, error = %e, "NBD command panicked");
                    fail(EIO, "the server failed serving this request")
                });
            if let Err(f) = &outcome {
                tracing::debug!(export = %session.name, ?req, errno = f.errno, message = %f.message, "NBD request failed");
            }
            let (head, body) = encode(&session, &req, outcome);
            // A closed channel means the connection is gone; nobody to tell.
            let _ = tx
                .send(Outgoing {
                    head,
                    body,
                    _permits: permits,
                })
                .await;
        });
    }
}

/// Writes replies as they come, flushing whenever no other reply is waiting (so small
/// replies share a syscall and none waits for a later one).
async fn write_replies<W: AsyncWrite + Unpin>(
    writer: W,
    mut rx: mpsc::Receiver<Outgoing>,
) -> std::io::Result<()> {
    let mut w = BufWriter::with_capacity(256 << 10, writer);
    while let Some(reply) = rx.recv().await {
        w.write_all(&reply.head).await?;
        w.write_all(&reply.body).await?;
        drop(reply);
        if rx.is_empty() {
            w.flush().await?;
        }
    }
    w.flush().await?;
    // The client may be gone already after NBD_CMD_DISC; the replies are out.
    let _ = w.shutdown().await;
    Ok(())
}

/// Checks a request and calls the volume.
async fn execute(s: &Session, req: &Request, payload: Option<Vec<u8>>) -> Result<Done, Failure> {
    let v = &*s.volume;
    let fua = req.flags & CMD_FLAG_FUA != 0;
    // FUA is valid on every command once SEND_FUA is offered (and always is).
    let allowed = CMD_FLAG_FUA
        | match req.kind {
            CMD_READ if s.structured => CMD_FLAG_DF,
            CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE,
            CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
            _ => 0,
        };
    if req.flags & !allowed != 0 {
        return fail(
            EINVAL,
            format!(
                "command flags {:#x} are not valid for command {}",
                req.flags & !allowed,
                req.kind
            ),
        );
    }
    let (offset, len) = (req.offset, u64::from(req.len));
    match req.kind {
        CMD_READ => {
            max_payload(req)?;
            in_range(v.size(), req, EINVAL)?;
            if len == 0 {
                return Ok(Done::Data(Vec::new()));
            }
            let data = v
                .read(offset, req.len)
                .await
                .map_err(volume_error("read"))?;
            if data.len() != req.len as usize {
                return fail(
                    EIO,
                    format!("the volume read {} bytes of {}", data.len(), req.len),
                );
            }
            Ok(Done::Data(data))
        }
        CMD_WRITE => {
            writable(s)?;
            max_payload(req)?;
            in_range(v.size(), req, ENOSPC)?;
            let data = payload.unwrap_or_default();
            if len > 0 {
                v.write(offset, data.into(), fua)
                    .await
                    .map_err(volume_error("write"))?;
            }
            Ok(Done::Ok)
        }
        CMD_FLUSH => {
            // Writes reply only once the volume has them, so the volume's flush covers
            // every write that completed before this request arrived.
            v.flush().await.map_err(volume_error("flush"))?;
            Ok(Done::Ok)
        }
        CMD_TRIM => {
            writable(s)?;
            in_range(v.size(), req, EINVAL)?;
            if len > 0 {
                v.trim(offset, len, fua)
                    .await
                    .map_err(volume_error("trim"))?;
            }
            Ok(Done::Ok)
        }
        CMD_WRITE_ZEROES => {
            writable(s)?;
            in_range(v.size(), req, ENOSPC)?;
            if len > 0 {
                let may_trim = req.flags & CMD_FLAG_NO_HOLE == 0;
                v.write_zeroes(offset, len, may_trim, fua)
                    .await
                    .map_err(volume_error("write zeroes"))?;
            }
            Ok(Done::Ok)
        }
        CMD_CACHE => {
            in_range(v.size(), req, EINVAL)?;
            if len > 0 {
                v.cache(offset, len).await.map_err(volume_error("cache"))?;
            }
            Ok(Done::Ok)
        }
        CMD_BLOCK_STATUS => {
            if s.contexts.is_empty() {
                return fail(EINVAL, "no metadata context was negotiated");
            }
            in_range(v.size(), req, EINVAL)?;
            if len == 0 {
                return fail(EINVAL, "block status of zero bytes");
            }
            let req_one = req.flags & CMD_FLAG_REQ_ONE != 0;
            let mut all = Vec::with_capacity(s.contexts.len());
            for &id in &s.contexts {
                let (extents, mask) = if id == BASE_ALLOCATION_ID {
                    let e = v.block_status(offset, len).await;
                    (
                        e.map_err(volume_error("block status"))?,
                        STATE_HOLE | STATE_ZERO,
                    )
                } else {
                    let e = v.presence(offset, len).await;
                    (e.map_err(volume_error("block status"))?, STATE_MISSING)
                };
                all.push((id, descriptors(&extents, req.len, req_one, mask)));
            }
            Ok(Done::Extents(all))
        }
        other => fail(EINVAL, format!("unknown command {other}")),
    }
}

fn writable(s: &Session) -> Result<(), Failure> {
    if s.volume.read_only() {
        return fail(EPERM, format!("export {:?} is read-only", s.name));
    }
    Ok(())
}

fn max_payload(req: &Request) -> Result<(), Failure> {
    if req.len > MAX_PAYLOAD {
        return fail(
            EINVAL,
            format!(
                "{} bytes is more than the maximum payload {MAX_PAYLOAD}",
                req.len
            ),
        );
    }
    Ok(())
}

/// The request lies within the export, or fails with `errno`.
fn in_range(size: u64, req: &Request, errno: u32) -> Result<(), Failure> {
    match req.offset.checked_add(req.len.into()) {
        Some(end) if end <= size => Ok(()),
        _ => fail(
            errno,
            format!(
                "{} bytes at offset {} are beyond the end of the export ({size} bytes)",
                req.len, req.offset
            ),
        ),
    }
}

/// Turns a volume's `io::Error` into the client's error, logging it: a volume failing is
/// news, unlike a client asking for something wrong.
fn volume_error(op: &'static str) -> impl Fn(std::io::Error) -> Failure {
    move |e| {
        tracing::warn!(op, error = %e, "NBD volume failed");
        Failure {
            errno: errno_of(&e),
            message: format!("{op}: {e}"),
        }
    }
}

/// A volume's extents as block status descriptors for a request of `len` bytes: cut at
/// the request's end (so every length fits in 32 bits), neighbours of equal flags merged,
/// only the first one for REQ_ONE, and never empty.
fn descriptors(extents: &[(u64, u32)], len: u32, req_one: bool, mask: u32) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    let mut covered = 0u64;
    for &(extent, flags) in extents {
        let left = u64::from(len) - covered;
        if extent == 0 || left == 0 {
            break;
        }
        let take = extent.min(left) as u32;
        let flags = flags & mask;
        covered += u64::from(take);
        if let Some((l, f)) = out.last_mut()
            && *f == flags
        {
            *l += take;
        } else if out.len() < MAX_EXTENTS {
            out.push((take, flags));
        } else {
            break;
        }
    }
    if out.is_empty() {
        // A volume that said nothing: "allocated, contents unknown" is always true.
        out.push((len, 0));
    }
    if req_one {
        out.truncate(1);
    }
    out
}

/// The reply to `req` as (header and small payload, bulk data).
fn encode(s: &Session, req: &Request, outcome: Result<Done, Failure>) -> (Vec<u8>, Vec<u8>) {
    let cookie = req.cookie;
    if !s.structured {
        return match outcome {
            Ok(Done::Data(data)) => (simple_reply(0, cookie).to_vec(), data),
            Ok(_) => (simple_reply(0, cookie).to_vec(), Vec::new()),
            Err(f) => (simple_reply(f.errno, cookie).to_vec(), Vec::new()),
        };
    }
    let mut head = Vec::new();
    match outcome {
        Err(f) => head = error_chunk(cookie, f.errno, &f.message),
        Ok(Done::Ok) => chunk_header(&mut head, REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0),
        Ok(Done::Data(data)) if data.is_empty() => {
            chunk_header(&mut head, REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0)
        }
        Ok(Done::Data(data)) if is_zero(&data) => {
            // All zeros: 12 bytes say what `len` bytes would.
            let kind = REPLY_TYPE_OFFSET_HOLE;
            chunk_header(&mut head, REPLY_FLAG_DONE, kind, cookie, 12);
            head.extend_from_slice(&req.offset.to_be_bytes());
            head.extend_from_slice(&req.len.to_be_bytes());
        }
        Ok(Done::Data(data)) => {
            let len = 8 + data.len() as u32;
            let kind = REPLY_TYPE_OFFSET_DATA;
            chunk_header(&mut head, REPLY_FLAG_DONE, kind, cookie, len);
            head.extend_from_slice(&req.offset.to_be_bytes());
            return (head, data);
        }
        Ok(Done::Extents(all)) => {
            // One chunk per context; the last one ends the reply.
            let last = all.len().saturating_sub(1);
            for (i, (id, extents)) in all.into_iter().enumerate() {
                let len = 4 + 8 * extents.len() as u32;
                let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
                chunk_header(&mut head, flags, REPLY_TYPE_BLOCK_STATUS, cookie, len);
                head.extend_from_slice(&id.to_be_bytes());
                for (l, f) in extents {
                    head.extend_from_slice(&l.to_be_bytes());
                    head.extend_from_slice(&f.to_be_bytes());
                }
            }
        }
    }
    (head, Vec::new())
}

fn is_zero(data: &[u8]) -> bool {
    let (words, rest) = data.as_chunks::<16>();
    words.iter().all(|w| u128::from_ne_bytes(*w) == 0) && rest.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u32 = STATE_HOLE | STATE_ZERO;

    #[test]
    fn descriptors_are_cut_at_the_request_end_and_merged() {
        // A 5 GiB hole does not fit in 32 bits: cut to the request.
        assert_eq!(
            descriptors(&[(5 << 30, STATE_HOLE | STATE_ZERO)], 1 << 20, false, BASE),
            vec![(1 << 20, 3)]
        );
        assert_eq!(
            descriptors(
                &[(4096, 0), (4096, 0), (8192, 3), (1 << 40, 0)],
                20000,
                false,
                BASE
            ),
            vec![(8192, 0), (8192, 3), (20000 - 16384, 0)]
        );
        // Unknown flag bits are reserved: not passed on.
        assert_eq!(
            descriptors(&[(512, 0xff)], 512, false, BASE),
            vec![(512, 3)]
        );
    }

    #[test]
    fn req_one_gives_one_descriptor_within_the_request() {
        assert_eq!(
            descriptors(&[(4096, 3), (4096, 0)], 8192, true, BASE),
            vec![(4096, 3)]
        );
        assert_eq!(
            descriptors(&[(1 << 33, 0)], 512, true, BASE),
            vec![(512, 0)]
        );
    }

    #[test]
    fn a_volume_saying_nothing_gets_one_allocated_extent() {
        assert_eq!(descriptors(&[], 4096, false, BASE), vec![(4096, 0)]);
        assert_eq!(descriptors(&[(0, 3)], 4096, true, BASE), vec![(4096, 0)]);
    }

    #[test]
    fn zero_detection_looks_at_every_byte() {
        assert!(is_zero(&[0; 4096 + 7]));
        for i in [0, 15, 16, 4000, 4102] {
            let mut d = vec![0u8; 4096 + 7];
            d[i] = 1;
            assert!(!is_zero(&d), "byte {i}");
        }
    }

    #[test]
    fn ranges_past_the_end_or_overflowing_fail() {
        let req = |offset, len| Request {
            flags: 0,
            kind: CMD_READ,
            cookie: 0,
            offset,
            len,
        };
        assert!(in_range(4096, &req(0, 4096), EINVAL).is_ok());
        assert_eq!(
            in_range(4096, &req(1, 4096), EINVAL).unwrap_err().errno,
            EINVAL
        );
        assert_eq!(
            in_range(4096, &req(u64::MAX, 2), ENOSPC).unwrap_err().errno,
            ENOSPC
        );
    }
}
