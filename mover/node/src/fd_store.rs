//! The fd store: a small process of its own that keeps the `/dev/fuse` descriptors of
//! the devices an agent serves, so that they outlive the agent. A FUSE connection lives
//! as long as one descriptor of it is open; while the agent is gone (killed, restarted,
//! upgraded) the kernel queues the pods' requests, and the next agent takes the
//! descriptors back, has the kernel send again what was read but never answered, and
//! serves on. The pods see a pause, not an error. systemd's file descriptor store does
//! the same for services; this one runs where systemd may not (a DaemonSet's pod).
//!
//! The protocol: one unix `SOCK_SEQPACKET` socket, one JSON message per packet, a
//! descriptor beside it (SCM_RIGHTS) where one goes along.
//! - On connecting, the agent is sent every descriptor kept (`kept`, with the name and
//!   the metadata it was put with), then `end`.
//! - `put` (with a descriptor) keeps it under a name, replacing one of that name;
//!   `forget` closes the one of a name. Each is answered `ok`.
//!
//! One agent at a time: the store serves a connection until it closes, and a second one
//! waits (an agent started while its predecessor still runs gets the descriptors once
//! that one has exited). Descriptors left without an agent for `orphan_after` are closed:
//! the pods' I/O then fails instead of waiting for ever for an agent that is not coming.

use rustix::{
    event::{PollFd, PollFlags, poll},
    fd::{AsFd, BorrowedFd, OwnedFd},
    net::{
        AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
        SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketType, sockopt::Timeout,
    },
};
use serde::{Deserialize, Serialize};
use std::{
    collections::BTreeMap,
    io,
    mem::MaybeUninit,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// The largest message (a name and its metadata).
const MAX_MESSAGE: usize = 64 << 10;
/// How long a call waits for the store's answer.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Message {
    Put {
        name: String,
        meta: serde_json::Value,
    },
    Forget {
        name: String,
    },
    Kept {
        name: String,
        meta: serde_json::Value,
    },
    End,
    Ok,
}

/// A descriptor the store kept, handed back to the agent.
#[derive(Debug)]
pub struct Kept {
    /// The name it was put under (the device's export).
    pub name: String,
    /// What the agent put beside it.
    pub meta: serde_json::Value,
    /// The store's copy of the descriptor.
    pub fd: OwnedFd,
}

fn send(socket: BorrowedFd, message: &Message, fd: Option<BorrowedFd>) -> io::Result<()> {
    let bytes = serde_json::to_vec(message).map_err(io::Error::other)?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = fd {
        fds = [fd];
        control.push(SendAncillaryMessage::ScmRights(&fds));
    }
    rustix::net::sendmsg(
        socket,
        &[io::IoSlice::new(&bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    Ok(())
}

/// The next message and the descriptor beside it; `None` once the peer has closed.
fn receive(socket: BorrowedFd) -> io::Result<Option<(Message, Option<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        match rustix::net::recvmsg(
            socket,
            &mut [io::IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Err(rustix::io::Errno::INTR) => continue,
            other => break other?,
        }
    };
    let mut fd = None;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            fd = fds.into_iter().next();
        }
    }
    if got.bytes == 0 {
        return Ok(None);
    }
    let message = serde_json::from_slice(&buf[..got.bytes])
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("fd store: {e}")))?;
    Ok(Some((message, fd)))
}

fn seqpacket() -> io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Runs the store on `socket` until killed.
pub fn serve(socket: &Path, orphan_after: Duration) -> io::Result<()> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // A socket file left by a store that died; nothing listens on it.
    let _ = std::fs::remove_file(socket);
    let listener = seqpacket()?;
    rustix::net::bind(&listener, &SocketAddrUnix::new(socket)?).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot listen on {}: {e}", socket.display()),
        )
    })?;
    // Root alone: a descriptor here is a pod's volume.
    std::fs::set_permissions(socket, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    rustix::net::listen(&listener, 8)?;
    tracing::info!(socket = %socket.display(), orphan_after = ?orphan_after, "fd store serving");
    let mut kept: BTreeMap<String, (serde_json::Value, OwnedFd)> = BTreeMap::new();
    let mut alone_since = Instant::now();
    loop {
        let wait = orphan_after.saturating_sub(alone_since.elapsed());
        let mut ready = [PollFd::new(&listener, PollFlags::IN)];
        let timeout = (!kept.is_empty()).then(|| rustix::event::Timespec {
            tv_sec: wait.as_secs() as i64,
            tv_nsec: wait.subsec_nanos() as i64,
        });
        match poll(&mut ready, timeout.as_ref()) {
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
            Ok(0) => {
                tracing::error!(
                    kept = kept.len(),
                    names = ?kept.keys().collect::<Vec<_>>(),
                    "no agent came back within {orphan_after:?}: closing the FUSE \
                     connections kept, so their pods' I/O fails instead of waiting"
                );
                kept.clear();
                continue;
            }
            Ok(_) => {}
        }
        let client = match rustix::net::accept(&listener) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("fd store: accept: {e}");
                continue;
            }
        };
        // The orphan clock starts again only after an agent took what was kept: a
        // connection left in the queue by an agent that gave up waiting does not count.
        let mut took = false;
        match serve_agent(client.as_fd(), &mut kept, &mut took) {
            Ok(()) => tracing::info!(kept = kept.len(), "the agent left the fd store"),
            Err(e) => tracing::warn!(kept = kept.len(), "the agent's connection failed: {e}"),
        }
        if took {
            alone_since = Instant::now();
        }
    }
}

/// Hands `kept` to one agent (`took` once it has all of it) and takes its puts and
/// forgets until it goes.
fn serve_agent(
    client: BorrowedFd,
    kept: &mut BTreeMap<String, (serde_json::Value, OwnedFd)>,
    took: &mut bool,
) -> io::Result<()> {
    tracing::info!(kept = kept.len(), "an agent took the fd store");
    for (name, (meta, fd)) in kept.iter() {
        let message = Message::Kept {
            name: name.clone(),
            meta: meta.clone(),
        };
        send(client, &message, Some(fd.as_fd()))?;
    }
    send(client, &Message::End, None)?;
    *took = true;
    while let Some((message, fd)) = receive(client)? {
        match (message, fd) {
            (Message::Put { name, meta }, Some(fd)) => {
                tracing::info!(name, "kept");
                kept.insert(name, (meta, fd));
            }
            (Message::Forget { name }, None) => {
                tracing::info!(name, "forgotten");
                kept.remove(&name);
            }
            (other, fd) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unexpected {other:?} (with a descriptor: {})", fd.is_some()),
                ));
            }
        }
        send(client, &Message::Ok, None)?;
    }
    Ok(())
}

/// An agent's connection to the store. What it put is remembered, so that a store
/// started again (its pod restarted) is given it all again: a thread watches the
/// connection and reconnects when the store hangs up.
pub struct FdStore {
    socket: PathBuf,
    state: Mutex<Held>,
}

/// The connection, and what the store should hold: by name, the metadata and the
/// descriptor (the agent's own copy).
struct Held {
    conn: Arc<OwnedFd>,
    entries: BTreeMap<String, (serde_json::Value, Arc<OwnedFd>)>,
}

/// How long a reconnection waits between attempts, at most.
const RECONNECT_BACKOFF: Duration = Duration::from_secs(5);

impl FdStore {
    /// Connects to the store at `socket` and takes what it kept. Waits up to `wait` for
    /// the store to answer: it may be starting, or still serving an agent that is
    /// exiting.
    pub fn connect(socket: &Path, wait: Duration) -> io::Result<(Arc<FdStore>, Vec<Kept>)> {
        let (conn, kept) = open(socket, wait)?;
        tracing::info!(socket = %socket.display(), kept = kept.len(), "took the fd store");
        let store = Arc::new(FdStore {
            socket: socket.to_path_buf(),
            state: Mutex::new(Held {
                conn: Arc::new(conn),
                entries: BTreeMap::new(),
            }),
        });
        let watched = Arc::downgrade(&store);
        std::thread::Builder::new()
            .name("fd-store".into())
            .spawn(move || watch(watched))?;
        Ok((store, kept))
    }

    /// Keeps `fd` under `name` (a copy: the caller's stays open).
    pub fn put(&self, name: &str, meta: serde_json::Value, fd: &Arc<OwnedFd>) -> io::Result<()> {
        let mut held = self.state.lock().expect("fd store lock");
        held.entries
            .insert(name.to_string(), (meta.clone(), fd.clone()));
        let name = name.to_string();
        self.call(&held.conn, &Message::Put { name, meta }, Some(fd.as_fd()))
    }

    /// Records that the store holds `fd` under `name` already (one it handed back).
    pub fn remember(&self, name: &str, meta: serde_json::Value, fd: &Arc<OwnedFd>) {
        let mut held = self.state.lock().expect("fd store lock");
        held.entries.insert(name.to_string(), (meta, fd.clone()));
    }

    /// Closes the store's copy of `name`'s descriptor.
    pub fn forget(&self, name: &str) -> io::Result<()> {
        let mut held = self.state.lock().expect("fd store lock");
        held.entries.remove(name);
        let name = name.to_string();
        self.call(&held.conn, &Message::Forget { name }, None)
    }

    fn call(&self, conn: &OwnedFd, message: &Message, fd: Option<BorrowedFd>) -> io::Result<()> {
        call(conn.as_fd(), message, fd).map_err(|e| {
            // A late answer would be read as the next call's: the connection is ended
            // instead, and the watcher makes a new one and puts everything back.
            let _ = rustix::net::shutdown(conn, rustix::net::Shutdown::Both);
            io::Error::new(
                e.kind(),
                format!("fd store at {}: {e}", self.socket.display()),
            )
        })
    }
}

/// Sends `message` (with `fd`) and waits for the store's `ok`.
fn call(conn: BorrowedFd, message: &Message, fd: Option<BorrowedFd>) -> io::Result<()> {
    send(conn, message, fd)?;
    match receive(conn)? {
        Some((Message::Ok, _)) => Ok(()),
        other => Err(io::Error::other(format!("expected ok, got {other:?}"))),
    }
}

/// Waits for the store to hang up, then connects again and puts back everything the
/// agent holds, until the agent's [`FdStore`] is gone.
fn watch(store: std::sync::Weak<FdStore>) {
    loop {
        let Some(conn) = store
            .upgrade()
            .map(|s| s.state.lock().expect("fd store lock").conn.clone())
        else {
            return;
        };
        // A second at a time: the connection must close soon after the agent's FdStore
        // goes, or the store would wait for this agent for ever.
        let mut hung_up = [PollFd::new(&*conn, PollFlags::RDHUP)];
        let second = rustix::event::Timespec {
            tv_sec: 1,
            tv_nsec: 0,
        };
        match poll(&mut hung_up, Some(&second)) {
            Err(rustix::io::Errno::INTR) | Ok(0) => continue,
            Err(e) => {
                tracing::warn!("cannot watch the fd store's connection: {e}");
                return;
            }
            Ok(_) => {}
        }
        let gone = PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR;
        if !hung_up[0].revents().intersects(gone) {
            continue;
        }
        tracing::warn!(
            "the fd store went away: until it is back and has the devices' connections \
             again, a restart of this agent would end their pods' I/O"
        );
        let mut delay = Duration::from_secs(1);
        loop {
            let Some(s) = store.upgrade() else { return };
            match s.reconnect() {
                Ok(n) => {
                    tracing::info!(
                        devices = n,
                        "the fd store is back and holds the devices' connections again"
                    );
                    break;
                }
                Err(e) => tracing::debug!("the fd store is not back yet: {e}"),
            }
            drop(s);
            std::thread::sleep(delay);
            delay = (delay * 2).min(RECONNECT_BACKOFF);
        }
    }
}

impl FdStore {
    /// A new connection to the store, given everything the agent holds; how many.
    fn reconnect(&self) -> io::Result<usize> {
        let (fresh, handed) = open(&self.socket, Duration::from_secs(5))?;
        let mut held = self.state.lock().expect("fd store lock");
        // A store that only lost the connection still holds what was put: what this
        // agent no longer holds (detached meanwhile) goes, or a later agent would adopt it.
        for k in handed {
            if !held.entries.contains_key(&k.name) {
                call(fresh.as_fd(), &Message::Forget { name: k.name }, None)?;
            }
        }
        for (name, (meta, fd)) in &held.entries {
            let message = Message::Put {
                name: name.clone(),
                meta: meta.clone(),
            };
            call(fresh.as_fd(), &message, Some(fd.as_fd()))?;
        }
        held.conn = Arc::new(fresh);
        Ok(held.entries.len())
    }
}

/// Connects to the store at `socket` and receives what it kept, waiting up to `wait`.
fn open(socket: &Path, wait: Duration) -> io::Result<(OwnedFd, Vec<Kept>)> {
    let started = Instant::now();
    let unreachable = |e: &dyn std::fmt::Display| {
        io::Error::new(
            io::ErrorKind::NotConnected,
            format!(
                "no fd store answers at {} after {wait:?} ({e}): run `mover fd-store` \
                 there (deploy/base/fd-store.yaml), or remove fd_store from agent.toml \
                 (devices then do not outlive the agent)",
                socket.display()
            ),
        )
    };
    let conn = loop {
        let conn = seqpacket()?;
        match rustix::net::connect(&conn, &SocketAddrUnix::new(socket)?) {
            Ok(()) => break conn,
            Err(e) if started.elapsed() >= wait => return Err(unreachable(&e)),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    // Short waits while another agent may hold the store, to say so and give up in time.
    let poll = wait
        .min(Duration::from_secs(1))
        .max(Duration::from_millis(10));
    rustix::net::sockopt::set_socket_timeout(&conn, Timeout::Recv, Some(poll))?;
    let mut kept = Vec::new();
    let mut warned = false;
    loop {
        match receive(conn.as_fd()) {
            Ok(Some((Message::Kept { name, meta }, Some(fd)))) => {
                kept.push(Kept { name, meta, fd })
            }
            Ok(Some((Message::End, None))) => break,
            Ok(Some((other, _))) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("fd store: unexpected {other:?}"),
                ));
            }
            Ok(None) => return Err(unreachable(&"it closed the connection")),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && started.elapsed() < wait => {
                if !warned {
                    tracing::warn!(
                        socket = %socket.display(),
                        "waiting for the fd store: another agent holds it (a \
                         predecessor still exiting?)"
                    );
                    warned = true;
                }
            }
            Err(e) => return Err(unreachable(&e)),
        }
    }
    rustix::net::sockopt::set_socket_timeout(&conn, Timeout::Recv, Some(ANSWER_WAIT))?;
    rustix::net::sockopt::set_socket_timeout(&conn, Timeout::Send, Some(ANSWER_WAIT))?;
    Ok((conn, kept))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// A store serving on a socket in a fresh directory (kept with it).
    fn serving(orphan_after: Duration) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("store.sock");
        let s = socket.clone();
        std::thread::spawn(move || serve(&s, orphan_after));
        (dir, socket)
    }

    /// A pipe: its read end, and its write end as a descriptor to put in the store.
    fn pipe() -> (std::io::PipeReader, Arc<OwnedFd>) {
        let (reader, writer) = std::io::pipe().unwrap();
        (reader, Arc::new(OwnedFd::from(writer)))
    }

    /// A pipe's write end put in the store by one "agent" is handed to the next, still
    /// the same pipe; a forgotten one is closed by the store.
    #[test]
    fn descriptors_outlive_the_agent_that_put_them() {
        let (_dir, socket) = serving(Duration::from_secs(60));
        let (mut kept_reader, kept_writer) = pipe();
        let (mut gone_reader, gone_writer) = pipe();
        {
            let (store, kept) = FdStore::connect(&socket, Duration::from_secs(10)).unwrap();
            assert!(kept.is_empty());
            let meta = serde_json::json!({"device": "/dev/loop7"});
            store.put("a", meta, &kept_writer).unwrap();
            store
                .put("b", serde_json::Value::Null, &gone_writer)
                .unwrap();
            store.forget("b").unwrap();
        }
        drop((kept_writer, gone_writer));
        // The store closed b's copy, so its reader sees the end.
        let mut rest = Vec::new();
        gone_reader.read_to_end(&mut rest).unwrap();
        let (_store, kept) = FdStore::connect(&socket, Duration::from_secs(10)).unwrap();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].name, "a");
        assert_eq!(kept[0].meta["device"], "/dev/loop7");
        let mut writer = std::fs::File::from(kept.into_iter().next().unwrap().fd);
        writer.write_all(b"still the same pipe").unwrap();
        drop(writer);
        // The store still holds a copy: read only what was written.
        let mut got = [0u8; 19];
        kept_reader.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"still the same pipe");
    }

    /// A second agent waits while the first holds the store, and gets in once it goes.
    #[test]
    fn one_agent_at_a_time() {
        let (_dir, socket) = serving(Duration::from_secs(60));
        let (first, _) = FdStore::connect(&socket, Duration::from_secs(10)).unwrap();
        let refused = FdStore::connect(&socket, Duration::from_millis(300));
        assert!(refused.is_err(), "two agents held the store at once");
        let s = socket.clone();
        let second =
            std::thread::spawn(move || FdStore::connect(&s, Duration::from_secs(20)).is_ok());
        std::thread::sleep(Duration::from_millis(300));
        drop(first);
        assert!(
            second.join().unwrap(),
            "the second agent never got the store"
        );
    }

    /// Descriptors no agent comes back for are closed after `orphan_after`.
    #[test]
    fn orphans_are_closed() {
        let (_dir, socket) = serving(Duration::from_millis(500));
        let (mut reader, writer) = pipe();
        {
            let (store, _) = FdStore::connect(&socket, Duration::from_secs(10)).unwrap();
            store.put("a", serde_json::Value::Null, &writer).unwrap();
        }
        drop(writer);
        let started = Instant::now();
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).unwrap();
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "closed before the orphan time"
        );
    }
}
