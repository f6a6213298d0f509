//! Option haggling in the fixed newstyle handshake: from the server's greeting to the
//! transmission phase (`NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`), or to the client leaving.
//!
//! Supported: EXPORT_NAME, ABORT, LIST, INFO, GO, STRUCTURED_REPLY, LIST_META_CONTEXT
//! and SET_META_CONTEXT (`base:allocation` only), and STARTTLS where the server has TLS
//! (then required: every other option before it gets `NBD_REP_ERR_TLS_REQD`, the
//! spec's FORCEDTLS mode). Anything else (EXTENDED_HEADERS, ...) gets
//! `NBD_REP_ERR_UNSUP` and the client carries on.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::wire::*;
use super::{NbdError, NbdExports, NbdVolume};

/// What the transmission phase needs from the handshake.
pub(crate) struct Session {
    /// The export the client chose.
    pub volume: Arc<dyn NbdVolume>,
    /// Its name, for logs.
    pub name: String,
    /// NBD_OPT_STRUCTURED_REPLY was negotiated.
    pub structured: bool,
    /// The ids of the metadata contexts selected for this export, in id order.
    pub contexts: Vec<u32>,
}

/// Largest read or write payload, and the maximum in NBD_INFO_BLOCK_SIZE: the size every
/// client keeps to by default (2^25), so no client needs to know it.
pub(crate) const MAX_PAYLOAD: u32 = 32 << 20;

/// Most option data parsed; real options are a name and a few queries.
const MAX_OPTION: u32 = 64 << 10;
/// Beyond this, skipping oversized option data is not worth it: the client is broken or
/// hostile, and it gets a hard disconnect.
const MAX_SKIP: u32 = 16 << 20;

/// The metadata contexts served, with their ids in NBD_REP_META_CONTEXT and block status
/// replies (any value will do; not zero, so they are told apart from LIST's reserved id
/// in a capture): the spec's `base:allocation`, and mover's `mover:present`, whose flag
/// [`super::STATE_MISSING`] marks what a hydrating export does not hold yet.
pub(crate) const CONTEXTS: [(&str, u32); 2] = [
    ("base:allocation", BASE_ALLOCATION_ID),
    ("mover:present", PRESENT_ID),
];
/// The id of `base:allocation`.
pub(crate) const BASE_ALLOCATION_ID: u32 = 1;
/// The id of `mover:present`.
pub(crate) const PRESENT_ID: u32 = 2;

/// TLS on this connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tls {
    /// The server has none: STARTTLS is unsupported.
    Off,
    /// The server requires it and the client has not started it yet.
    Required,
    /// Started: the handshake goes on encrypted.
    Established,
}

/// How option haggling ended.
pub(crate) enum Outcome {
    /// The client chose an export: on to the transmission phase.
    Go(Session),
    /// The client aborted (or closed) before choosing an export.
    Left,
    /// STARTTLS was acknowledged: the caller runs the TLS handshake, then haggles on.
    StartTls,
}

/// Handshake state of one connection.
pub(crate) struct Haggle<'a> {
    exports: &'a dyn NbdExports,
    no_zeroes: bool,
    structured: bool,
    /// The export metadata contexts were last selected for, and their ids.
    meta_export: Option<(String, Vec<u32>)>,
    /// The last export opened (by INFO, GO or a meta context option): opened once for
    /// a connection that asks about it several times, and the INFO and GO answers agree.
    opened: Option<(String, Arc<dyn NbdVolume>)>,
}

/// Sends the server's greeting and reads the client's flags.
pub(crate) async fn greet<'a, S>(
    s: &mut S,
    exports: &'a dyn NbdExports,
) -> Result<Haggle<'a>, NbdError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    send(s, &hello).await?;

    let client = s.read_u32().await?;
    if client & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(NbdError::ClientFlags(client));
    }
    Ok(Haggle {
        exports,
        no_zeroes: client & FLAG_C_NO_ZEROES != 0,
        structured: false,
        meta_export: None,
        opened: None,
    })
}

/// Answers options on `s` until the client chooses an export, leaves, or starts TLS.
pub(crate) async fn haggle<S>(s: &mut S, h: &mut Haggle<'_>, tls: Tls) -> Result<Outcome, NbdError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        let mut head = [0u8; 16];
        match s.read_exact(&mut head).await {
            Ok(_) => {}
            // Between options is the one place a client may just hang up.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(Outcome::Left),
            Err(e) => return Err(e.into()),
        }
        let magic = be64(&head[0..8]);
        if magic != IHAVEOPT {
            return Err(NbdError::BadMagic {
                phase: "option",
                expected: IHAVEOPT,
                got: magic,
            });
        }
        let option = be32(&head[8..12]);
        let len = be32(&head[12..16]);
        tracing::trace!(option, len, "NBD option");
        if len > MAX_OPTION {
            // EXPORT_NAME has no error reply; past MAX_SKIP, reading on is a waste.
            if option == OPT_EXPORT_NAME || len > MAX_SKIP {
                return Err(NbdError::TooLarge {
                    what: "option data",
                    len: len.into(),
                });
            }
            tokio::io::copy(&mut (&mut *s).take(len.into()), &mut tokio::io::sink()).await?;
            let msg = format!("option data of {len} bytes is more than {MAX_OPTION}");
            send(s, &option_reply(option, REP_ERR_TOO_BIG, msg.as_bytes())).await?;
            continue;
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).await?;

        if tls == Tls::Required && !matches!(option, OPT_STARTTLS | OPT_ABORT) {
            // EXPORT_NAME has no error reply: the spec's answer is to close.
            if option == OPT_EXPORT_NAME {
                return Err(NbdError::TlsRequired);
            }
            let msg = "this server requires TLS: connect with nbds:// and a client certificate";
            send(s, &option_reply(option, REP_ERR_TLS_REQD, msg.as_bytes())).await?;
            continue;
        }
        let reply = match option {
            OPT_EXPORT_NAME => {
                let (session, reply) = h.export_name(&data)?;
                send(s, &reply).await?;
                return Ok(Outcome::Go(session));
            }
            OPT_ABORT => {
                // The client may already be gone: it need not wait for this ack.
                let _ = send(s, &option_reply(option, REP_ACK, &[])).await;
                return Ok(Outcome::Left);
            }
            OPT_STARTTLS if tls == Tls::Required => {
                if !data.is_empty() {
                    invalid(option, "NBD_OPT_STARTTLS takes no data")
                } else {
                    send(s, &option_reply(option, REP_ACK, &[])).await?;
                    return Ok(Outcome::StartTls);
                }
            }
            OPT_STARTTLS if tls == Tls::Established => {
                invalid(option, "TLS is already negotiated on this connection")
            }
            OPT_LIST => h.list(&data),
            OPT_INFO | OPT_GO => match h.info(option, &data) {
                Ok((reply, session)) => {
                    send(s, &reply).await?;
                    if option == OPT_GO {
                        return Ok(Outcome::Go(session));
                    }
                    continue;
                }
                Err(reply) => reply,
            },
            OPT_STRUCTURED_REPLY => h.structured_reply(&data),
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => h.meta_context(option, &data),
            _ => {
                let msg = match option {
                    OPT_STARTTLS => "this server does not offer TLS".to_owned(),
                    OPT_EXTENDED_HEADERS => "this server does not offer extended headers".into(),
                    _ => format!("option {option} is not supported by this server"),
                };
                tracing::debug!(option, "NBD option not supported");
                option_reply(option, REP_ERR_UNSUP, msg.as_bytes())
            }
        };
        send(s, &reply).await?;
    }
}

impl Haggle<'_> {
    /// NBD_OPT_EXPORT_NAME: the old way in, with no error reply.
    fn export_name(&mut self, data: &[u8]) -> Result<(Session, Vec<u8>), NbdError> {
        let name = String::from_utf8_lossy(data).into_owned();
        let volume = self.open(&name).map_err(|reason| NbdError::ExportRefused {
            name: name.clone(),
            reason,
        })?;
        let mut reply = Vec::with_capacity(10 + 124);
        reply.extend_from_slice(&volume.size().to_be_bytes());
        reply.extend_from_slice(&self.transmission_flags(&*volume).to_be_bytes());
        if !self.no_zeroes {
            reply.extend_from_slice(&[0u8; 124]);
        }
        Ok((self.session(name, volume), reply))
    }

    /// NBD_OPT_LIST: every export, then ACK.
    fn list(&self, data: &[u8]) -> Vec<u8> {
        if !data.is_empty() {
            return invalid(OPT_LIST, "NBD_OPT_LIST takes no data");
        }
        let mut out = Vec::new();
        for (name, description) in self.exports.list() {
            let mut d = Vec::with_capacity(4 + name.len() + description.len());
            d.extend_from_slice(&(name.len() as u32).to_be_bytes());
            d.extend_from_slice(name.as_bytes());
            d.extend_from_slice(truncate(&description, MAX_STRING).as_bytes());
            out.extend(option_reply(OPT_LIST, REP_SERVER, &d));
        }
        out.extend(option_reply(OPT_LIST, REP_ACK, &[]));
        out
    }

    /// NBD_OPT_INFO and NBD_OPT_GO: the export's details then ACK, or an error reply.
    fn info(&mut self, option: u32, data: &[u8]) -> Result<(Vec<u8>, Session), Vec<u8>> {
        let mut c = Cursor(data);
        let parsed = (|| {
            let name_len = c.u32()? as usize;
            let name = c.str(name_len)?;
            let n = c.u16()?;
            let requests = (0..n).map(|_| c.u16()).collect::<Option<Vec<u16>>>()?;
            c.0.is_empty().then_some((name, requests))
        })();
        let Some((name, requests)) = parsed else {
            return Err(invalid(option, "malformed NBD_OPT_INFO/NBD_OPT_GO data"));
        };
        let volume = self
            .open(name)
            .map_err(|why| option_reply(option, REP_ERR_UNKNOWN, why.as_bytes()))?;

        let mut out = Vec::new();
        let mut export = Vec::with_capacity(12);
        export.extend_from_slice(&INFO_EXPORT.to_be_bytes());
        export.extend_from_slice(&volume.size().to_be_bytes());
        export.extend_from_slice(&self.transmission_flags(&*volume).to_be_bytes());
        out.extend(option_reply(option, REP_INFO, &export));

        // Sent whether asked or not: the minimum is a hint a client that did not ask
        // may ignore, since every request is served at any alignment anyway.
        let (minimum, preferred) = block_sizes(&*volume);
        let mut sizes = Vec::with_capacity(14);
        sizes.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        sizes.extend_from_slice(&minimum.to_be_bytes());
        sizes.extend_from_slice(&preferred.to_be_bytes());
        sizes.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
        out.extend(option_reply(option, REP_INFO, &sizes));

        if requests.contains(&INFO_NAME) {
            let mut d = INFO_NAME.to_be_bytes().to_vec();
            d.extend_from_slice(name.as_bytes());
            out.extend(option_reply(option, REP_INFO, &d));
        }
        if requests.contains(&INFO_DESCRIPTION) {
            let description = self.exports.list().into_iter().find(|(n, _)| n == name);
            if let Some((_, description)) = description.filter(|(_, d)| !d.is_empty()) {
                let mut d = INFO_DESCRIPTION.to_be_bytes().to_vec();
                d.extend_from_slice(truncate(&description, MAX_STRING).as_bytes());
                out.extend(option_reply(option, REP_INFO, &d));
            }
        }
        out.extend(option_reply(option, REP_ACK, &[]));
        Ok((out, self.session(name.to_owned(), volume)))
    }

    /// NBD_OPT_STRUCTURED_REPLY.
    fn structured_reply(&mut self, data: &[u8]) -> Vec<u8> {
        let option = OPT_STRUCTURED_REPLY;
        if !data.is_empty() {
            return invalid(option, "NBD_OPT_STRUCTURED_REPLY takes no data");
        }
        if self.structured {
            return invalid(option, "structured replies are already negotiated");
        }
        self.structured = true;
        option_reply(option, REP_ACK, &[])
    }

    /// NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT.
    fn meta_context(&mut self, option: u32, data: &[u8]) -> Vec<u8> {
        let set = option == OPT_SET_META_CONTEXT;
        if set {
            // A SET replaces the selection, even when it fails.
            self.meta_export = None;
            if !self.structured {
                return invalid(option, "negotiate structured replies first");
            }
        }
        let mut c = Cursor(data);
        let parsed = (|| {
            let name_len = c.u32()? as usize;
            let name = c.str(name_len)?;
            let n = c.u32()?;
            let mut queries = Vec::new();
            for _ in 0..n {
                let len = c.u32()? as usize;
                queries.push(c.str(len)?);
            }
            c.0.is_empty().then_some((name, queries))
        })();
        let Some((name, queries)) = parsed else {
            return invalid(option, "malformed meta context option data");
        };
        if let Err(why) = self.open(name) {
            return option_reply(option, REP_ERR_UNKNOWN, why.as_bytes());
        }
        // SET selects only full names; LIST also answers a namespace's wildcard
        // ("base:") and an empty query list. Unknown names are ignored, as the spec says.
        let matched: Vec<(&str, u32)> = CONTEXTS
            .into_iter()
            .filter(|(context, _)| {
                let namespace = &context[..=context.find(':').unwrap_or(0)];
                if set {
                    queries.contains(context)
                } else {
                    queries.is_empty() || queries.iter().any(|q| q == context || *q == namespace)
                }
            })
            .collect();
        let mut out = Vec::new();
        for (context, id) in &matched {
            // LIST's id is reserved and should be zero.
            let id = if set { *id } else { 0 };
            let mut d = id.to_be_bytes().to_vec();
            d.extend_from_slice(context.as_bytes());
            out.extend(option_reply(option, REP_META_CONTEXT, &d));
        }
        if set && !matched.is_empty() {
            let ids = matched.iter().map(|(_, id)| *id).collect();
            self.meta_export = Some((name.to_owned(), ids));
        }
        out.extend(option_reply(option, REP_ACK, &[]));
        out
    }

    /// Opens `name`, reusing the last export opened when it is the same.
    fn open(&mut self, name: &str) -> Result<Arc<dyn NbdVolume>, String> {
        if let Some((n, v)) = &self.opened
            && n == name
        {
            return Ok(v.clone());
        }
        let v = self.exports.open(name)?;
        self.opened = Some((name.to_owned(), v.clone()));
        Ok(v)
    }

    fn transmission_flags(&self, volume: &dyn NbdVolume) -> u16 {
        transmission_flags(volume.read_only(), self.structured)
    }

    fn session(&self, name: String, volume: Arc<dyn NbdVolume>) -> Session {
        // Block status is only allowed for the export the contexts were selected on.
        let contexts = match &self.meta_export {
            Some((export, ids)) if *export == name => ids.clone(),
            _ => Vec::new(),
        };
        Session {
            volume,
            name,
            structured: self.structured,
            contexts,
        }
    }
}

/// The transmission flags of an export. FLUSH, FUA and CACHE are always offered (on a
/// read-only export they are no-ops for the volume); MULTI_CONN because a volume's flush
/// covers every connection's writes; DF because a read is always one content chunk.
pub(crate) fn transmission_flags(read_only: bool, structured: bool) -> u16 {
    let mut flags =
        FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA | FLAG_SEND_CACHE | FLAG_CAN_MULTI_CONN;
    if read_only {
        flags |= FLAG_READ_ONLY;
    } else {
        flags |= FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES;
    }
    // The spec forbids DF without structured replies.
    if structured {
        flags |= FLAG_SEND_DF;
    }
    flags
}

/// (minimum, preferred) block size of a volume for NBD_INFO_BLOCK_SIZE.
fn block_sizes(volume: &dyn NbdVolume) -> (u32, u32) {
    // 512 keeps clients off sub-sector I/O; an export whose size is not a multiple of
    // it says 1, or its tail would be out of every client's reach.
    let minimum = if volume.size().is_multiple_of(512) {
        512
    } else {
        1
    };
    // The spec wants a power of two in [max(minimum, 512), maximum payload].
    let p = volume.preferred_block().clamp(512, MAX_PAYLOAD);
    let preferred = 1 << (31 - p.leading_zeros());
    (minimum, preferred)
}

/// An `NBD_REP_ERR_INVALID` reply with a message.
fn invalid(option: u32, message: &str) -> Vec<u8> {
    option_reply(option, REP_ERR_INVALID, message.as_bytes())
}

/// Writes a whole reply and pushes it out.
async fn send<S: AsyncWrite + Unpin>(s: &mut S, bytes: &[u8]) -> std::io::Result<()> {
    s.write_all(bytes).await?;
    s.flush().await
}

/// Reads big-endian fields off option data; `None` when it runs short.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(be16)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(be32)
    }

    /// A string of `n` bytes; not UTF-8 is malformed.
    fn str(&mut self, n: usize) -> Option<&'a str> {
        std::str::from_utf8(self.take(n)?).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_reads_fields_and_stops_short() {
        let mut c = Cursor(&[0, 0, 0, 2, b'h', b'i', 0, 1, 0]);
        assert_eq!(c.u32(), Some(2));
        assert_eq!(c.str(2), Some("hi"));
        assert_eq!(c.u16(), Some(1));
        assert_eq!(c.u16(), None);
        assert_eq!(Cursor(&[0xff, 0xfe]).str(2), None);
    }

    #[test]
    fn flags_follow_read_only_and_structured_replies() {
        let rw = transmission_flags(false, false);
        assert_eq!(rw & FLAG_READ_ONLY, 0);
        assert_ne!(rw & FLAG_SEND_TRIM, 0);
        assert_eq!(rw & FLAG_SEND_DF, 0);
        assert_ne!(rw & FLAG_CAN_MULTI_CONN, 0);
        let ro = transmission_flags(true, true);
        assert_ne!(ro & FLAG_READ_ONLY, 0);
        assert_eq!(ro & (FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES), 0);
        assert_ne!(ro & FLAG_SEND_DF, 0);
    }
}
