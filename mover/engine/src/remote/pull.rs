//! Pull: an agent's export into a local volume.

use super::{
    AgentUrl, Client, Compress, RemoteGroups, RemoteOptions, Session, open_session, read_groups,
    status_error, timed, tree, with_retries,
};
use crate::{
    copy::{
        CopyOptions, CopySummary, Origin, Progress, finish_destination, prepare_destination,
        read_back_root, zero_range,
    },
    error::{CopyError, RemoteCode, Result, write_error},
};
use chunker::{BlockVolume, GROUP_CHUNKS, PAGE_SIZE, Window, direct::DirectWriter, page_hashes};
use std::{path::Path, sync::Arc, time::Instant};
use tokio_stream::StreamExt;
use transport::{
    frames::{self, Content},
    proto::{self, Access},
};

/// Copies the agent export `url` into the local `dst` (created if missing), fetching only
/// the pages that differ; retries (continuing where it stopped) on dropped connections.
pub async fn pull(
    url: &AgentUrl,
    dst: &Path,
    copy: &CopyOptions,
    remote: &RemoteOptions,
    progress: &dyn Progress,
) -> Result<CopySummary> {
    let started = Instant::now();
    let sum = with_retries(remote.retries, |_| {
        attempt(url, dst, copy, remote, progress)
    })
    .await?;
    Ok(timed(sum, started))
}

async fn attempt(
    url: &AgentUrl,
    dst: &Path,
    copy: &CopyOptions,
    remote: &RemoteOptions,
    progress: &dyn Progress,
) -> Result<CopySummary> {
    let chunk = copy.chunk_size;
    let Session {
        mut client,
        key,
        open,
    } = open_session(url, remote, Access::Read, chunk, 0, None).await?;
    let size = open.size;
    let shown = std::path::PathBuf::from(url.to_string());
    let (dst_owned, copy_owned) = (dst.to_path_buf(), copy.clone());
    let dest = tokio::task::spawn_blocking(move || {
        prepare_destination(
            Origin {
                size,
                volume: None,
                name: &shown,
            },
            &dst_owned,
            &copy_owned,
        )
    })
    .await
    .expect("prepare does not panic")?;
    // A second handle on the destination, for the reader thread and the writes.
    let rw = std::fs::OpenOptions::new().read(true).write(true).clone();
    let local = Arc::new(BlockVolume::open_with(dest.volume.path(), &rw)?.limited_to_at_most(size));
    let writer =
        DirectWriter::new(local.file()).map_err(|e| write_error("open of", local.path(), 0, e))?;
    let mut sum = CopySummary {
        source: url.to_string().into(),
        destination: dst.into(),
        volume_bytes: size,
        chunk_size: chunk.get(),
        resumed: dest.resumed,
        ..Default::default()
    };
    let mut groups = RemoteGroups::new(open.session.clone());
    let mut reader = read_groups(local.clone(), chunk, key.clone(), size, None, None);
    progress.begin("pull", size);
    let mut g = 0u64;
    while let Some(item) = reader.recv().await {
        let super::Group {
            win,
            zero,
            leaves,
            bytes_read,
            ..
        } = item?;
        sum.destination_bytes_read += bytes_read;
        if chunker::Summary::group_hash(&key, &leaves) != groups.get(&mut client, url, g).await? {
            fetch_group(
                &mut client,
                url,
                &open.session,
                &key,
                g,
                &win,
                &zero,
                &leaves,
                chunk,
                &local,
                &writer,
                remote.compress,
                &mut sum,
            )
            .await?;
        }
        g += 1;
        progress.update(win.offset + win.buf.len() as u64);
    }
    let file = dest.volume.file();
    file.sync_all()
        .map_err(|e| write_error("sync of", dest.volume.path(), 0, e))?;
    let remote_root = client
        .finish(proto::FinishRequest {
            session: open.session.clone(),
            verify: false,
            ..Default::default()
        })
        .await
        .map_err(|s| status_error(url, s))?
        .into_inner()
        .root;
    if copy.verify {
        let v = BlockVolume::open(dest.volume.path())?.limited_to_at_most(size);
        let mine = read_back_root(&v, &key, chunk, progress)?;
        if mine.0[..] != remote_root[..] {
            return Err(CopyError::VerifyFailed {
                src: url.to_string().into(),
                dst: dst.into(),
                offset: 0,
            });
        }
        sum.verified = true;
        sum.root = Some(mine.to_hex());
    }
    finish_destination(dest)?;
    Ok(sum)
}

/// Fetches and applies the differing pages of group `g`.
#[allow(clippy::too_many_arguments)]
async fn fetch_group(
    client: &mut Client,
    url: &AgentUrl,
    session: &str,
    key: &chunker::ChunkKey,
    g: u64,
    win: &Window,
    zero: &[bool],
    leaves: &[chunker::ChunkId],
    chunk: chunker::ChunkSize,
    local: &BlockVolume,
    writer: &DirectWriter,
    compress: Compress,
    sum: &mut CopySummary,
) -> Result<()> {
    let first = g * GROUP_CHUNKS as u64;
    let theirs = tree(client, url, session, 0, first, leaves.len() as u32).await?;
    let mut onto_zeros = Vec::new();
    let mut onto_data = Vec::new();
    let mut my_pages = Vec::new();
    for (i, r) in win.chunk_ranges(chunk).enumerate() {
        if theirs.get(i) == Some(&leaves[i]) {
            continue;
        }
        if zero[i] {
            onto_zeros.push(first + i as u64);
        } else {
            onto_data.push(first + i as u64);
            page_hashes(key, &win.buf[r], &mut my_pages);
        }
    }
    // Whole chunks come raw unless compression was asked for (a pull cannot see
    // whether the link is the bottleneck); page deltas come compressed unless refused.
    let raw_whole = compress != Compress::Always;
    let raw_deltas = !compress.deltas();
    for (chunks, pages, raw) in [
        (onto_zeros, Vec::new(), raw_whole),
        (onto_data, my_pages, raw_deltas),
    ] {
        if chunks.is_empty() {
            continue;
        }
        let mut stream = client
            .read(proto::ReadRequest {
                session: session.into(),
                chunks,
                page_hashes: pages.into(),
                raw,
            })
            .await
            .map_err(|s| status_error(url, s))?
            .into_inner();
        while let Some(frame) = stream.next().await {
            let frame = frame.map_err(|s| status_error(url, s))?;
            sum.wire_bytes += frames::wire_len(&frame);
            let content = frames::content(&frame).map_err(|m| CopyError::Remote {
                url: url.to_string(),
                code: RemoteCode::Protocol,
                message: m,
                refusal: None,
            })?;
            if frame
                .offset
                .checked_add(frame.len)
                .is_none_or(|e| e > local.size())
            {
                return Err(CopyError::Remote {
                    url: url.to_string(),
                    code: RemoteCode::Protocol,
                    message: format!("frame at offset {} is past the end", frame.offset),
                    refusal: None,
                });
            }
            match content {
                Content::Bytes(b) => {
                    writer
                        .write_all_at(&b, frame.offset)
                        .map_err(|e| write_error("write to", local.path(), frame.offset, e))?;
                    sum.bytes_written += b.len() as u64;
                    sum.pages_written += (b.len() as u64).div_ceil(PAGE_SIZE as u64);
                }
                Content::Zeros(n) => {
                    zero_range(local.file(), local.path(), frame.offset, n)?;
                    sum.bytes_zeroed += n;
                }
            }
        }
    }
    Ok(())
}
