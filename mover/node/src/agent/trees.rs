//! File-tree exports (an export whose path is a directory): pushes walk the client's tree
//! into the export here; pulls serve the export to a client that walks it.

use super::fencing::Raise;
use super::{Export, service::AgentService, status::ServiceError};
use crate::replicate::journal::{self, AppliedCycle};
use crate::replicate::secondary::CycleTarget;
use mover_engine::tree::{
    self,
    remote::{Pending, RemoteSource, Served, route_answers, serve_calls},
};
use std::{
    collections::HashSet,
    path::PathBuf,
    pin::Pin,
    sync::{Arc, Mutex, atomic::Ordering::Relaxed},
};
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt, wrappers::ReceiverStream};
use tonic::{Request, Status, Streaming};
use transport::auth::Credential;
use transport::proto::{self, tree_answer::Answer, tree_call::Op};

/// What a push sends the client: calls for its tree, then the summary.
pub type CallStream = Pin<Box<dyn Stream<Item = Result<proto::TreeCall, Status>> + Send>>;
/// What a pull sends the client: answers to its calls.
pub type AnswerStream = Pin<Box<dyn Stream<Item = Result<proto::TreeAnswer, Status>> + Send>>;

/// Calls or answers queued for the network per session.
const QUEUE: usize = 64;

/// Marks an export as being pushed into until dropped.
struct Busy {
    set: Arc<Mutex<HashSet<String>>>,
    name: String,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.set.lock().expect("busy lock").remove(&self.name);
    }
}

impl AgentService {
    pub(super) async fn describe_export(
        &self,
        req: Request<proto::DescribeRequest>,
    ) -> Result<proto::DescribeResponse, ServiceError> {
        let caller = req.extensions().get::<transport::auth::Caller>();
        let q = req.get_ref();
        if let Some(c) = caller.filter(|c| c.role != transport::auth::Role::Control) {
            // A peer learns of an export only what it may open: not which others exist.
            if self.exports.get(&q.volume).is_err() {
                return Err(self.refuse(ServiceError::NotFound(format!(
                    "volume {:?} is not exported by this agent",
                    q.volume
                ))));
            }
            if !q.relationship.is_empty() || matches!(c.credential, Credential::Peer(_)) {
                self.check_served(&q.volume, &q.relationship, None, Some(c))?;
            }
        }
        let export = self.export(&q.volume)?;
        Ok(proto::DescribeResponse {
            tree: export.path.is_dir(),
            read_only: export.read_only,
        })
    }

    /// The tree export `name`: a directory (or, for a push, a path not made yet).
    fn tree_export(&self, name: &str, write: bool) -> Result<Export, ServiceError> {
        let export = self.export(name)?;
        if write {
            self.check_writable(name, &export)?;
        }
        match std::fs::metadata(&export.path) {
            Ok(m) if m.is_dir() => Ok(export),
            Ok(_) => Err(self.refuse(ServiceError::FailedPrecondition(format!(
                "volume {name:?} is a block volume ({}), not a file tree: copy a device or \
                 image file to or from it, not a directory",
                export.path.display()
            )))),
            Err(e) if write && e.kind() == std::io::ErrorKind::NotFound => Ok(export),
            Err(e) => Err(ServiceError::FailedPrecondition(format!(
                "volume {name:?} ({}) cannot be read: {e}",
                export.path.display()
            ))),
        }
    }

    pub(super) async fn push_tree(
        &self,
        req: Request<Streaming<proto::TreeAnswer>>,
    ) -> Result<CallStream, ServiceError> {
        let peer = req
            .remote_addr()
            .map_or_else(|| "a peer".into(), |a| a.to_string());
        let caller = req.extensions().get::<transport::auth::Caller>().cloned();
        let mut incoming = req.into_inner();
        let open = self
            .first_open(
                &mut incoming,
                "push",
                |first: proto::TreeAnswer| match first.answer {
                    Some(Answer::Open(open)) => Some(open),
                    _ => None,
                },
            )
            .await?;
        let write = Some(open.cycle.is_some());
        self.check_served(&open.volume, &open.relationship, write, caller.as_ref())?;
        let export = self.tree_export(&open.volume, true)?;
        if open.relationship.is_empty() {
            return Err(self.refuse(ServiceError::InvalidArgument(
                "a relationship id is required".into(),
            )));
        }
        self.check_epoch(
            &open.relationship,
            open.epoch,
            caller.as_ref(),
            Raise::ByOne,
        )?;
        let busy = self.claim(&open.volume)?;
        // A replication cycle: the tree changes in place, so until the walk is done it
        // equals no cycle (a promote then needs --force).
        let cycle = match &open.cycle {
            Some(c) => {
                let target = CycleTarget {
                    relationship: &open.relationship,
                    volume: &open.volume,
                    epoch: open.epoch,
                    chunk_size: 0,
                };
                self.admit_cycle(&target, c)?;
                let dir = journal::cycles_dir(self.state_dir(), &open.relationship);
                std::fs::create_dir_all(&dir)
                    .and_then(|()| journal::forget_applied(&dir))
                    .map_err(|e| ServiceError::Internal(format!("{}: {e}", dir.display())))?;
                let applied =
                    AppliedCycle::of_cycle(&open.relationship, c, open.epoch, String::new());
                Some((dir, applied))
            }
            None => None,
        };
        self.metrics.sessions_opened.fetch_add(1, Relaxed);
        self.metrics.sessions_active.fetch_add(1, Relaxed);
        let metrics = self.metrics.clone();
        let (tx, rx) = mpsc::channel(QUEUE);
        let pending = Arc::new(Pending::default());
        tokio::spawn(route_answers(pending.clone(), incoming));
        let calls = tx.clone();
        let source = RemoteSource::new(
            PathBuf::from(format!("{peer}:{}", open.volume)),
            Box::new(move |call| calls.blocking_send(Ok(call)).is_ok()),
            pending,
        );
        let (dst, options) = (export.path.clone(), tree::remote::options_of(&open));
        tokio::task::spawn_blocking(move || {
            let mut result = tree::copy_remote_tree(&source, &dst, &options, &());
            if let (Ok(_), Some((dir, applied))) = (&result, &cycle)
                && let Err(e) = journal::record_applied(dir, applied)
            {
                result = Err(mover_engine::CopyError::Tree {
                    path: dir.clone(),
                    what: "cannot record the applied cycle",
                    cause: e,
                });
            }
            drop(source);
            drop(busy);
            metrics.sessions_active.fetch_sub(1, Relaxed);
            if let Ok(summary) = &result {
                metrics
                    .bytes_received
                    .fetch_add(summary.bytes_written, Relaxed);
            }
            let last: Result<proto::TreeCall, Status> = match result {
                Ok(summary) => match serde_json::to_vec(&summary) {
                    Ok(json) => Ok(proto::TreeCall {
                        id: 0,
                        op: Some(Op::Done(json.into())),
                        xattrs: false,
                    }),
                    Err(e) => Err(ServiceError::Internal(e.to_string()).into()),
                },
                Err(e) => Err(ServiceError::FailedPrecondition(e.to_string()).into()),
            };
            _ = tx.blocking_send(last);
        });
        Ok(Box::pin(ReceiverStream::new(rx)))
    }

    /// The open message a tree stream must begin with; `opened` finds it in the first
    /// message.
    async fn first_open<T>(
        &self,
        incoming: &mut (impl Stream<Item = Result<T, Status>> + Unpin),
        what: &str,
        opened: impl FnOnce(T) -> Option<proto::TreeOpen>,
    ) -> Result<proto::TreeOpen, ServiceError> {
        match incoming
            .next()
            .await
            .transpose()
            .map_err(ServiceError::Stream)?
        {
            Some(first) => opened(first),
            None => None,
        }
        .ok_or_else(|| {
            self.refuse(ServiceError::InvalidArgument(format!(
                "a tree {what} must begin with its open message"
            )))
        })
    }

    /// One push per export at a time: two walks would race on the same names.
    fn claim(&self, name: &str) -> Result<Busy, ServiceError> {
        let mut set = self.trees_busy.lock().expect("busy lock");
        if !set.insert(name.to_string()) {
            return Err(self.refuse(ServiceError::FailedPrecondition(format!(
                "volume {name:?} is being written by another push; retry when it is done"
            ))));
        }
        Ok(Busy {
            set: self.trees_busy.clone(),
            name: name.to_string(),
        })
    }

    pub(super) async fn pull_tree(
        &self,
        req: Request<Streaming<proto::TreeCall>>,
    ) -> Result<AnswerStream, ServiceError> {
        let caller = req.extensions().get::<transport::auth::Caller>().cloned();
        let mut incoming = req.into_inner();
        let open = self
            .first_open(
                &mut incoming,
                "pull",
                |first: proto::TreeCall| match first.op {
                    Some(Op::Open(open)) => Some(open),
                    _ => None,
                },
            )
            .await?;
        self.check_served(&open.volume, &open.relationship, None, caller.as_ref())?;
        let export = self.tree_export(&open.volume, false)?;
        let bwlimit = (open.bwlimit > 0).then_some(open.bwlimit);
        let served = Served::open(&export.path, bwlimit).map_err(|e| {
            ServiceError::FailedPrecondition(format!("{}: {e}", export.path.display()))
        })?;
        self.metrics.sessions_opened.fetch_add(1, Relaxed);
        self.metrics.sessions_active.fetch_add(1, Relaxed);
        let (tx, rx) = mpsc::channel(QUEUE);
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let served = Arc::new(served);
            if let Err(e) = serve_calls(served.clone(), incoming, tx).await {
                tracing::warn!("tree pull ended: {}", e.message());
            }
            metrics.sessions_active.fetch_sub(1, Relaxed);
            metrics
                .bytes_sent
                .fetch_add(served.sent.load(Relaxed), Relaxed);
        });
        Ok(Box::pin(ReceiverStream::new(rx).map(Ok)))
    }
}
