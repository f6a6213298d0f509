//! Push: a local source volume into an agent's export.

use super::{
    AgentUrl, Client, RemoteGroups, RemoteOptions, Session, open_session, read_groups,
    status_error, timed, tree, with_retries,
};
use crate::{
    copy::{CopyOptions, CopySummary, Progress},
    error::{CopyError, Result},
};
use chunker::{
    BlockVolume, ChunkId, ChunkKind, GROUP_CHUNKS, MerkleBuilder, PAGE_HASH_LEN, PAGE_SIZE,
    leaf_hash,
};
use std::{path::Path, sync::Arc, time::Instant};
use tokio::sync::mpsc;
use transport::{
    RateLimiter, frames,
    proto::{self, Access, data_frame::Payload},
};

/// Copies the local block volume `src` into the agent export `url`, sending only the
/// pages that differ; retries (continuing where it stopped) on dropped connections.
pub async fn push(
    src: &Path,
    url: &AgentUrl,
    copy: &CopyOptions,
    remote: &RemoteOptions,
    progress: &dyn Progress,
) -> Result<CopySummary> {
    let started = Instant::now();
    let source = Arc::new(BlockVolume::open(src)?);
    let mut sum = with_retries(remote.retries, |n| {
        if n > 1 {
            tracing::info!("attempt {n}: continuing the transfer to {url}");
        }
        attempt(source.clone(), url, copy, remote, progress)
    })
    .await?;
    sum.source = src.into();
    Ok(timed(sum, started))
}

/// Totals kept by the write streams.
#[derive(Default)]
struct Sent {
    wire: u64,
    written: u64,
    zeroed: u64,
    pages: u64,
}

async fn attempt(
    source: Arc<BlockVolume>,
    url: &AgentUrl,
    copy: &CopyOptions,
    remote: &RemoteOptions,
    progress: &dyn Progress,
) -> Result<CopySummary> {
    let chunk = copy.chunk_size;
    let size = source.size();
    let Session {
        mut client,
        key,
        open,
    } = open_session(url, remote, Access::Write, chunk, size).await?;
    let session = open.session.clone();

    // Data streams: each takes frames from a bounded channel, so a slow link slows the
    // reader instead of filling memory.
    let limiter = remote.bwlimit.map(|r| Arc::new(RateLimiter::new(r)));
    let mut senders = Vec::new();
    let mut streams = Vec::new();
    for _ in 0..remote.streams {
        let (tx, rx) = mpsc::channel::<proto::WriteFrame>(8);
        senders.push(tx);
        let mut c = client.clone();
        streams.push(tokio::spawn(async move {
            c.write(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
        }));
    }

    let mut groups = RemoteGroups::new(session.clone());
    let mut reader = read_groups(source.clone(), chunk, key.clone(), size);
    let mut merkle = MerkleBuilder::new(key.clone());
    let mut sent = Sent::default();
    let mut sum = CopySummary {
        destination: url.to_string().into(),
        volume_bytes: size,
        chunk_size: chunk.get(),
        ..Default::default()
    };
    progress.begin("push", size);
    let mut g = 0u64;
    let pass: Result<()> = async {
        while let Some(item) = reader.recv().await {
            let (win, kinds, leaves) = item?;
            leaves.iter().for_each(|l| merkle.push_leaf(*l));
            for (i, r) in win.chunk_ranges(chunk).enumerate() {
                if !win.unread[i] {
                    sum.source_bytes_read += r.len() as u64;
                }
                if kinds[i] == ChunkKind::Zero {
                    sum.zero_bytes_skipped += r.len() as u64;
                }
            }
            let done = win.offset + win.buf.len() as u64;
            let local_group = chunker::Summary::group_hash(&key, &leaves);
            if local_group != groups.get(&mut client, url, g).await? {
                let frames =
                    group_frames(&mut client, url, &session, &key, g, win, &leaves, chunk).await?;
                let tx = &senders[(g % senders.len() as u64) as usize];
                for f in frames {
                    let wire = frames::wire_len(&f);
                    if let Some(l) = &limiter {
                        l.take(wire).await;
                    }
                    sent.wire += wire;
                    match &f.payload {
                        Some(Payload::Zeros(n)) => sent.zeroed += n,
                        _ => {
                            sent.written += f.len;
                            sent.pages += f.len.div_ceil(PAGE_SIZE as u64);
                        }
                    }
                    let frame = proto::WriteFrame {
                        session: session.clone(),
                        epoch: remote.epoch,
                        frame: Some(f),
                    };
                    if tx.send(frame).await.is_err() {
                        return Ok(()); // the stream failed: its error is collected below
                    }
                }
            }
            g += 1;
            progress.update(done);
        }
        Ok(())
    }
    .await;
    drop(senders);
    // A failed stream explains a failed pass better than the pass's own error.
    for s in streams {
        match s.await {
            Ok(Ok(_ack)) => {}
            Ok(Err(status)) => return Err(status_error(url, status)),
            Err(join) => {
                return Err(CopyError::Remote {
                    url: url.to_string(),
                    code: "error".into(),
                    message: join.to_string(),
                });
            }
        }
    }
    pass?;
    let root = merkle.finish(size, chunk);
    let fin = client
        .finish(proto::FinishRequest {
            session,
            verify: copy.verify,
        })
        .await
        .map_err(|s| status_error(url, s))?
        .into_inner();
    if copy.verify {
        if fin.root[..] != root.0[..] {
            return Err(CopyError::VerifyFailed {
                src: source.path().into(),
                dst: url.to_string().into(),
                offset: 0,
            });
        }
        sum.verified = true;
        sum.root = Some(root.to_hex());
    }
    sum.bytes_written = sent.written;
    sum.bytes_zeroed = sent.zeroed;
    sum.pages_written = sent.pages;
    sum.wire_bytes = sent.wire;
    Ok(sum)
}

/// Frames that bring the remote copy of group `g` up to date: the remote leaves tell
/// which chunks differ, the remote page hashes which of their pages.
#[allow(clippy::too_many_arguments)]
async fn group_frames(
    client: &mut Client,
    url: &AgentUrl,
    session: &str,
    key: &chunker::ChunkKey,
    g: u64,
    win: chunker::Window,
    leaves: &[ChunkId],
    chunk: chunker::ChunkSize,
) -> Result<Vec<proto::DataFrame>> {
    let first = g * GROUP_CHUNKS as u64;
    let theirs = tree(client, url, session, 0, first, leaves.len() as u32).await?;
    let ranges: Vec<_> = win.chunk_ranges(chunk).collect();
    let mut onto_zeros = Vec::new();
    let mut onto_data = Vec::new();
    for (i, r) in ranges.iter().enumerate() {
        let their = theirs.get(i).copied();
        if their == Some(leaves[i]) {
            continue;
        }
        if their == Some(leaf_hash(key, &ChunkKind::Zero, r.len() as u64)) {
            onto_zeros.push(i);
        } else {
            onto_data.push(i);
        }
    }
    let their_pages = if onto_data.is_empty() {
        Default::default()
    } else {
        let chunks = onto_data.iter().map(|&i| first + i as u64).collect();
        client
            .pages(proto::PagesRequest {
                session: session.into(),
                chunks,
            })
            .await
            .map_err(|s| status_error(url, s))?
            .into_inner()
            .hashes
    };
    let key = key.clone();
    let data: Vec<(usize, std::ops::Range<usize>)> = ranges.into_iter().enumerate().collect();
    let (buf, offset) = (win.buf, win.offset);
    // Page hashing and compression are CPU work: keep them off the async workers.
    let frames = tokio::task::spawn_blocking(move || {
        let mut frames = Vec::new();
        for &i in &onto_zeros {
            let r = data[i].1.clone();
            frames.extend(frames::chunk_frames(
                &key,
                &buf[r.clone()],
                offset + r.start as u64,
                &[],
            ));
        }
        let mut pages = &their_pages[..];
        for &i in &onto_data {
            let r = data[i].1.clone();
            let n = r.len().div_ceil(PAGE_SIZE) * PAGE_HASH_LEN;
            let (mine, rest) = pages.split_at(n.min(pages.len()));
            pages = rest;
            frames.extend(frames::chunk_frames(
                &key,
                &buf[r.clone()],
                offset + r.start as u64,
                mine,
            ));
        }
        frames
    })
    .await
    .map_err(|e| CopyError::Remote {
        url: url.to_string(),
        code: "error".into(),
        message: e.to_string(),
    })?;
    Ok(frames)
}
