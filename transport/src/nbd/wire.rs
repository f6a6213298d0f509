//! The protocol's numbers and the fixed-size messages, encoded and decoded without I/O:
//! magics, flags, option and command codes, the request header, the reply headers
//! (simple, structured chunk, option reply) and the mapping of `io::Error` to NBD errors.
//! Everything is big-endian on the wire.

use std::io;

/// `NBDMAGIC`: the first 8 bytes a server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: sent by the server after `NBDMAGIC`, and by the client before each option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of an option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a (compact) request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Transmission flags.
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_SEND_DF: u16 = 1 << 7;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const FLAG_SEND_CACHE: u16 = 1 << 10;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

// Option replies.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

// Information types of NBD_REP_INFO.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;

// Structured reply flags and types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

// Errors.
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Length of a request header.
pub const REQUEST_LEN: usize = 28;

/// Longest string the spec lets one side send the other (names, error messages).
pub const MAX_STRING: usize = 4096;

/// A request header (the compact form; extended headers are not negotiated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Command flags (`CMD_FLAG_*`).
    pub flags: u16,
    /// Command (`CMD_*`).
    pub kind: u16,
    /// Opaque; echoed in every reply to this request.
    pub cookie: u64,
    /// Byte offset into the export.
    pub offset: u64,
    /// Length of the effect (and of the payload, for a write).
    pub len: u32,
}

impl Request {
    /// Decodes a header; `Err` carries the magic when it is not [`REQUEST_MAGIC`].
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Result<Request, u32> {
        let magic = be32(&b[0..4]);
        if magic != REQUEST_MAGIC {
            return Err(magic);
        }
        Ok(Request {
            flags: be16(&b[4..6]),
            kind: be16(&b[6..8]),
            cookie: be64(&b[8..16]),
            offset: be64(&b[16..24]),
            len: be32(&b[24..28]),
        })
    }

    /// Encodes a header (what a client sends; for tests).
    #[cfg(test)]
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }
}

/// An option reply: header and `data`.
pub fn option_reply(option: u32, reply: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&reply.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// A simple reply header (the data of a successful read follows it).
pub fn simple_reply(error: u32, cookie: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// Appends a structured reply chunk header announcing `len` bytes of payload.
pub fn chunk_header(out: &mut Vec<u8>, flags: u16, kind: u16, cookie: u64, len: u32) {
    out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// A final `NBD_REPLY_TYPE_ERROR` chunk with a message for a human (cut to the spec's
/// string limit on a character boundary).
pub fn error_chunk(cookie: u64, error: u32, message: &str) -> Vec<u8> {
    let message = truncate(message, MAX_STRING);
    let mut b = Vec::with_capacity(20 + 6 + message.len());
    chunk_header(
        &mut b,
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        cookie,
        6 + message.len() as u32,
    );
    b.extend_from_slice(&error.to_be_bytes());
    b.extend_from_slice(&(message.len() as u16).to_be_bytes());
    b.extend_from_slice(message.as_bytes());
    b
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The NBD error a client is told for a volume's `io::Error`: the OS code when the
/// protocol defines it, EIO otherwise (clients treat unknown values as EINVAL, which
/// would be a lie about an I/O failure).
pub fn errno_of(e: &io::Error) -> u32 {
    match e.raw_os_error() {
        Some(1) => EPERM,
        Some(12) => ENOMEM,
        Some(22) => EINVAL,
        // EDQUOT and EFBIG are out of space too, says the spec.
        Some(28 | 122 | 27) => ENOSPC,
        Some(75) => EOVERFLOW,
        Some(95) => ENOTSUP,
        Some(108) => ESHUTDOWN,
        Some(_) => EIO,
        // Errors built from a kind alone: the few that have an obvious code.
        None => match e.kind() {
            io::ErrorKind::PermissionDenied => EPERM,
            io::ErrorKind::InvalidInput => EINVAL,
            io::ErrorKind::OutOfMemory => ENOMEM,
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => ENOSPC,
            io::ErrorKind::FileTooLarge => ENOSPC,
            io::ErrorKind::Unsupported => ENOTSUP,
            _ => EIO,
        },
    }
}

/// Reads a big-endian u16 from the first two bytes.
pub fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

/// Reads a big-endian u32 from the first four bytes.
pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Reads a big-endian u64 from the first eight bytes.
pub fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_matches_the_spec_layout() {
        let r = Request {
            flags: CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
            kind: CMD_WRITE_ZEROES,
            cookie: 0x0102_0304_0506_0708,
            offset: 0x1122_3344_5566_7788,
            len: 0x99aa_bbcc,
        };
        let b = r.encode();
        assert_eq!(
            b,
            [
                0x25, 0x60, 0x95, 0x13, // magic
                0x00, 0x03, // flags
                0x00, 0x06, // type
                1, 2, 3, 4, 5, 6, 7, 8, // cookie
                0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // offset
                0x99, 0xaa, 0xbb, 0xcc, // length
            ]
        );
        assert_eq!(Request::decode(&b), Ok(r));
    }

    #[test]
    fn request_with_a_wrong_magic_is_refused() {
        let mut b = Request {
            flags: 0,
            kind: CMD_READ,
            cookie: 1,
            offset: 0,
            len: 512,
        }
        .encode();
        // The extended-header magic (not negotiated) is just a wrong magic to us.
        b[0..4].copy_from_slice(&0x21e4_1c71u32.to_be_bytes());
        assert_eq!(Request::decode(&b), Err(0x21e4_1c71));
    }

    #[test]
    fn replies_are_laid_out_as_the_spec_says() {
        assert_eq!(
            simple_reply(EPERM, 7),
            [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 7]
        );
        assert_eq!(
            option_reply(OPT_GO, REP_ERR_UNKNOWN, b"no"),
            [
                0, 3, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, // magic
                0, 0, 0, 7, // option
                0x80, 0, 0, 6, // reply type
                0, 0, 0, 2, // length
                b'n', b'o'
            ][..]
        );
        let e = error_chunk(9, EINVAL, "bad");
        assert_eq!(
            e,
            [
                0x66, 0x8e, 0x33, 0xef, // magic
                0, 1, // DONE
                0x80, 0x01, // NBD_REPLY_TYPE_ERROR
                0, 0, 0, 0, 0, 0, 0, 9, // cookie
                0, 0, 0, 9, // length: 4 + 2 + 3
                0, 0, 0, 22, // EINVAL
                0, 3, b'b', b'a', b'd'
            ]
        );
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let s = "é".repeat(3000); // 6000 bytes
        let t = truncate(&s, MAX_STRING);
        assert_eq!(t.len(), 4096);
        assert!(error_chunk(1, EIO, &s).len() == 20 + 6 + 4096);
        assert_eq!(truncate("abc", 2), "ab");
        assert_eq!(truncate("aé", 2), "a");
    }

    #[test]
    fn io_errors_map_to_the_protocols_errors() {
        let os = io::Error::from_raw_os_error;
        assert_eq!(errno_of(&os(1)), EPERM);
        assert_eq!(errno_of(&os(5)), EIO);
        assert_eq!(errno_of(&os(28)), ENOSPC);
        assert_eq!(errno_of(&os(122)), ENOSPC); // EDQUOT
        assert_eq!(errno_of(&os(75)), EOVERFLOW);
        assert_eq!(errno_of(&os(95)), ENOTSUP);
        assert_eq!(errno_of(&os(108)), ESHUTDOWN);
        assert_eq!(errno_of(&os(2)), EIO); // ENOENT: not an NBD error
        assert_eq!(errno_of(&io::Error::other("x")), EIO);
        assert_eq!(
            errno_of(&io::Error::from(io::ErrorKind::PermissionDenied)),
            EPERM
        );
    }
}
