//! File trees to and from an agent: `mover copy DIR agent://…/NAME` (push) and
//! `mover copy agent://…/NAME DIR` (pull).
//!
//! The side that writes walks: in a push the agent walks the client's tree (the client
//! answers its calls), in a pull the client walks the agent's. Either way the walk is
//! the local one (skip by size and mtime, patch large files by chunk, temp names and
//! renames, a hidden new tree), so a rerun after a drop finishes the copy, and the
//! client retries on its own (`--retries`).

use super::{AgentUrl, Backoff, RemoteOptions, status_error, with_retries};
use crate::error::RemoteCode;
use crate::{
    CopyError, Progress, TreeOptions, TreeSummary,
    tree::{
        self,
        remote::{Pending, RemoteSource, Served, open_of, route_answers, serve_calls},
    },
};
use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use transport::proto::{self, tree_answer::Answer, tree_call::Op};

/// Calls or answers queued for the network.
const QUEUE: usize = 64;

fn runtime() -> Result<tokio::runtime::Runtime, CopyError> {
    tokio::runtime::Runtime::new().map_err(|e| CopyError::Remote {
        url: "local".into(),
        code: RemoteCode::Runtime,
        message: format!("cannot start the async runtime: {e}"),
        refusal: None,
    })
}

/// Whether the export at `url` is a file tree (else a block volume).
pub fn is_tree(url: &AgentUrl, remote: &RemoteOptions) -> Result<bool, CopyError> {
    runtime()?.block_on(with_retries(remote.retries, |_| async {
        let mut client = remote.connect(url).await?;
        let described = client
            .describe(proto::DescribeRequest {
                volume: url.volume.clone(),
                relationship: remote.relationship.clone().unwrap_or_default(),
            })
            .await
            .map_err(|s| status_error(url, s))?;
        Ok(described.into_inner().tree)
    }))
}

/// Pushes the tree at `src` into the agent's export: the agent walks it and writes.
/// `progress` counts the file data sent.
pub fn push_tree(
    src: &Path,
    url: &AgentUrl,
    options: &TreeOptions,
    remote: &RemoteOptions,
    progress: &dyn Progress,
) -> Result<TreeSummary, CopyError> {
    let src_abs =
        std::fs::canonicalize(src).map_err(tree::tree_error(src, "cannot open the source"))?;
    let sent = Arc::new(AtomicU64::new(0));
    progress.begin("copy", 0);
    let push = with_retries(remote.retries, |_| {
        push_once(&src_abs, url, options, remote, None, sent.clone())
    });
    let mut summary = runtime()?.block_on(async {
        tokio::pin!(push);
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                done = &mut push => break done,
                _ = tick.tick() => progress.update(sent.load(Relaxed)),
            }
        }
    })?;
    summary.source = src.to_path_buf();
    summary.destination = url.to_string().into();
    Ok(summary)
}

/// Pushes the tree at `src` into the agent's export as replication cycle `cycle`
/// (`remote` names the relationship and epoch), retrying as [`push_tree`] does.
/// Returns the agent's summary and the file data sent.
pub async fn push_tree_cycle(
    src: &Path,
    url: &AgentUrl,
    options: &TreeOptions,
    remote: &RemoteOptions,
    cycle: &proto::Cycle,
) -> Result<(TreeSummary, u64), CopyError> {
    let sent = Arc::new(AtomicU64::new(0));
    let summary = with_retries(remote.retries, |_| {
        push_once(src, url, options, remote, Some(cycle), sent.clone())
    })
    .await?;
    Ok((summary, sent.load(Relaxed)))
}

/// One attempt of a push; `sent` accumulates the file data sent over all attempts.
async fn push_once(
    src: &Path,
    url: &AgentUrl,
    options: &TreeOptions,
    remote: &RemoteOptions,
    cycle: Option<&proto::Cycle>,
    sent: Arc<AtomicU64>,
) -> Result<TreeSummary, CopyError> {
    let mut served = Served::open(src, remote.bwlimit)
        .map_err(tree::tree_error(src, "cannot open the source"))?;
    served.sent = sent;
    let mut client = remote.connect(url).await?;
    let (tx, rx) = mpsc::channel(QUEUE);
    let open = proto::TreeOpen {
        cycle: cycle.cloned(),
        ..open_of(
            &url.volume,
            remote.relationship_for(url),
            remote.epoch,
            None,
            options,
        )
    };
    _ = tx
        .send(proto::TreeAnswer {
            id: 0,
            answer: Some(Answer::Open(open)),
        })
        .await;
    let calls = client
        .tree_push(ReceiverStream::new(rx))
        .await
        .map_err(|s| status_error(url, s))?
        .into_inner();
    match serve_calls(Arc::new(served), calls, tx).await {
        Ok(Some(json)) => serde_json::from_slice(&json).map_err(|e| CopyError::Remote {
            url: url.to_string(),
            code: RemoteCode::BadAnswer,
            message: format!("the agent's summary is not readable: {e}"),
            refusal: None,
        }),
        Ok(None) => Err(CopyError::Remote {
            url: url.to_string(),
            code: RemoteCode::Unavailable,
            message: "the agent ended the push without a summary".into(),
            refusal: None,
        }),
        Err(status) => Err(status_error(url, status)),
    }
}

/// Pulls the agent's tree export into `dst`: this side walks and writes.
pub fn pull_tree(
    url: &AgentUrl,
    dst: &Path,
    options: &TreeOptions,
    remote: &RemoteOptions,
    progress: &dyn Progress,
) -> Result<TreeSummary, CopyError> {
    // The walk blocks on its calls, so it runs outside the runtime: retried here, with
    // the same policy as `with_retries`.
    let rt = runtime()?;
    let mut backoff = Backoff::new(remote.retries);
    for n in 1.. {
        match pull_once(&rt, url, dst, options, remote, progress) {
            Err(e) => match backoff.after(n, &e) {
                Some(wait) => std::thread::sleep(wait),
                None => return Err(e),
            },
            done => return done,
        }
    }
    unreachable!("the loop returns")
}

fn pull_once(
    rt: &tokio::runtime::Runtime,
    url: &AgentUrl,
    dst: &Path,
    options: &TreeOptions,
    remote: &RemoteOptions,
    progress: &dyn Progress,
) -> Result<TreeSummary, CopyError> {
    let (tx, rx) = mpsc::channel(QUEUE);
    let open = open_of(
        &url.volume,
        remote.relationship_for(url),
        remote.epoch,
        remote.bwlimit,
        options,
    );
    tx.try_send(proto::TreeCall {
        id: 0,
        op: Some(Op::Open(open)),
        xattrs: false,
    })
    .expect("an empty queue has room");
    let answers = rt.block_on(async {
        let mut client = remote.connect(url).await?;
        let answers = client
            .tree_pull(ReceiverStream::new(rx))
            .await
            .map_err(|s| status_error(url, s))?;
        Ok::<_, CopyError>(answers.into_inner())
    })?;
    let pending = Arc::new(Pending::default());
    let router = rt.spawn(route_answers(pending.clone(), answers));
    let source = RemoteSource::new(
        url.to_string().into(),
        Box::new(move |call| tx.blocking_send(call).is_ok()),
        pending,
    );
    let result = tree::copy_remote_tree(&source, dst, options, progress);
    if let Some(why) = source.lost() {
        return Err(CopyError::Remote {
            url: url.to_string(),
            code: RemoteCode::Unavailable,
            message: format!("{why}; a rerun finishes the copy"),
            refusal: None,
        });
    }
    // Close our half and let the agent close its own: a clean end, not a reset.
    drop(source);
    rt.block_on(async { _ = tokio::time::timeout(Duration::from_secs(5), router).await });
    let mut summary = result?;
    summary.destination = dst.to_path_buf();
    Ok(summary)
}
