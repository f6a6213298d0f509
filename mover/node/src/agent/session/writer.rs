//! The writer threads of a WRITE session: every stream's frames are applied by one
//! thread, in arrival order, and made durable by another.

use super::Session;
use crate::agent::{
    metrics::Metrics,
    status::{ServiceError, internal},
};
use chunker::direct::DirectWriter;
use mover_engine::copy::zero_range;
use std::sync::{Arc, Mutex, atomic::Ordering::Relaxed};
use transport::{
    frames::{self, Content},
    proto,
};

/// Bytes written between two fsyncs of a destination: what may have to be re-sent after
/// a crash of the receiving machine (a killed process loses nothing: its writes are in
/// the page cache).
const SYNC_EVERY: u64 = 256 << 20;

/// What a Write stream hands the session's writer.
pub(in crate::agent) enum Job {
    /// Apply this frame.
    Frame(proto::DataFrame),
    /// Make everything applied so far durable, then answer (a stream's end).
    Flush(tokio::sync::oneshot::Sender<Result<(), ServiceError>>),
}

/// The thread that applies a WRITE session's frames, from all its streams, in arrival
/// order; a second thread makes them durable every [`SYNC_EVERY`] bytes without holding
/// up the writes.
pub(in crate::agent) struct SessionWriter {
    pub(in crate::agent) tx: tokio::sync::mpsc::Sender<Job>,
}

impl SessionWriter {
    pub(in crate::agent) fn start(
        s: &Session,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<SessionWriter> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Job>(16);
        let (file, path) = (DirectWriter::new(&s.file)?, s.path.clone());
        let sync_file = s.file.try_clone()?;
        let (kick, kicks) = std::sync::mpsc::sync_channel::<()>(1);
        let sync_failed: Arc<Mutex<Option<String>>> = Arc::default();
        let failed = sync_failed.clone();
        let superseded = s.superseded.clone();
        let pages = s.pages.clone();
        // A cycle's frames are staged in its journal, not written (see replicate::journal).
        let journal = s.cycle.as_ref().map(|c| c.journal.clone());
        std::thread::spawn(move || {
            while kicks.recv().is_ok() {
                if let Err(e) = sync_file.sync_data() {
                    *failed.lock().expect("sync error lock") = Some(e.to_string());
                }
            }
        });
        std::thread::spawn(move || {
            let mut unsynced = 0u64;
            // The first failure fails every later flush: the stream that hit it, and any
            // other, learn that their data may not have been applied.
            let mut failure: Option<ServiceError> = None;
            while let Some(job) = rx.blocking_recv() {
                if failure.is_none() && superseded.load(Relaxed) {
                    failure = Some(ServiceError::Aborted(
                        "this session was replaced by a newer one on the same volume; its \
                         remaining writes were dropped"
                            .into(),
                    ));
                }
                match job {
                    Job::Frame(data) if failure.is_none() => {
                        let at = data.offset;
                        let mut staged = journal.as_ref().map(|j| j.lock().expect("journal lock"));
                        let applied = match (
                            frames::content(&data),
                            staged.as_mut().and_then(|j| j.as_mut()),
                        ) {
                            (Err(e), _) => Err(ServiceError::InvalidArgument(e)),
                            (Ok(Content::Bytes(b)), Some(j)) => j.data(at, &b).map_err(internal),
                            (Ok(Content::Zeros(n)), Some(j)) => j.zeros(at, n).map_err(internal),
                            (Ok(Content::Bytes(b)), None) => {
                                let write = || file.write_all_at(&b, at);
                                match &pages {
                                    Some(p) => p.write(at, &b, write),
                                    None => write(),
                                }
                                .map_err(internal)
                            }
                            (Ok(Content::Zeros(n)), None) => {
                                let zero = || zero_range(file.file(), &path, at, n);
                                match &pages {
                                    Some(p) => p.write_zeros(at, n, zero),
                                    None => zero(),
                                }
                                .map_err(internal)
                            }
                        };
                        if let Err(e) = applied {
                            failure = Some(e);
                            continue;
                        }
                        metrics.bytes_received.fetch_add(data.len, Relaxed);
                        unsynced += data.len;
                        if unsynced >= SYNC_EVERY {
                            unsynced = 0;
                            let _ = kick.try_send(()); // a sync under way covers this too
                        }
                    }
                    Job::Frame(_) => {}
                    Job::Flush(done) => {
                        let r = match (
                            &failure,
                            sync_failed.lock().expect("sync error lock").clone(),
                        ) {
                            (Some(f), _) => Err(f.clone()),
                            (None, Some(e)) => Err(ServiceError::Internal(e)),
                            (None, None) => file.file().sync_data().map_err(internal),
                        };
                        let _ = done.send(r);
                    }
                }
            }
        });
        Ok(SessionWriter { tx })
    }
}
