//! `mover copy SRC DST` as one library call: the kinds of the two endpoints (a block
//! volume, a file tree, an agent's export) choose the job.

use crate::{
    CopyError, CopyOptions, CopySummary, Progress, TreeOptions, TreeSummary, copy_block, copy_tree,
    remote::{self, AgentUrl, RemoteOptions},
};
use std::path::Path;

/// What a copy did: a block volume's summary or a file tree's.
#[derive(Debug)]
pub enum Copied {
    /// A block volume (device or image file) was copied.
    Block(CopySummary),
    /// A file tree was copied.
    Tree(TreeSummary),
}

/// Why a copy between two endpoints did not happen or failed.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// An endpoint kind this build does not handle.
    #[error(
        "{0}: not supported by this build; copy endpoints are local devices, image files, or agent://HOST:PORT/VOLUME"
    )]
    Unsupported(String),
    /// Options that do not go together; nothing was written.
    #[error("{0}")]
    Refused(String),
    /// The async runtime a copy with an agent needs could not start.
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    /// The copy itself failed or was refused.
    #[error(transparent)]
    Copy(#[from] CopyError),
}

impl EndpointError {
    /// Whether it is a refusal of bad input, made before anything was written.
    pub fn is_refusal(&self) -> bool {
        match self {
            EndpointError::Unsupported(_) | EndpointError::Refused(_) => true,
            EndpointError::Runtime(_) => false,
            EndpointError::Copy(e) => e.is_refusal(),
        }
    }
}

/// Copies `src` onto `dst`, each a block device, an image file, a directory or an
/// agent's export (`agent://HOST:PORT/NAME`): a directory (or an agent's tree export)
/// is copied as a file tree with `tree`, anything else as a block volume with `options`;
/// `remote` reaches the agent. A tree's `verify` and `state_dir` come from `options`.
pub fn copy_endpoints(
    src: &Path,
    dst: &Path,
    options: &CopyOptions,
    tree: &TreeOptions,
    remote: &RemoteOptions,
    progress: &dyn Progress,
) -> Result<Copied, EndpointError> {
    let url = |p: &Path| AgentUrl::parse(&p.to_string_lossy()).transpose();
    let (from, to) = (url(src)?, url(dst)?);
    if tree.replica && (from.is_some() || to.is_some()) {
        return Err(EndpointError::Refused(
            "--replica is for local DIR to DIR copies only (no record is kept of an \
             agent's tree yet); drop --replica to copy with an agent"
                .into(),
        ));
    }
    let tree = TreeOptions {
        verify: options.verify,
        state_dir: Some(options.state_dir()),
        ..tree.clone()
    };
    if std::fs::metadata(src).is_ok_and(|m| m.is_dir()) {
        return Ok(Copied::Tree(match &to {
            Some(to) => remote::push_tree(src, to, &tree, remote, progress)?,
            None if dst.to_string_lossy().contains("://") => {
                return Err(EndpointError::Unsupported(dst.display().to_string()));
            }
            None => copy_tree(src, dst, &tree, progress)?,
        }));
    }
    if let (Some(from), None) = (&from, &to)
        && remote::is_tree(from, remote)?
    {
        return Ok(Copied::Tree(remote::pull_tree(
            from, dst, &tree, remote, progress,
        )?));
    }
    for p in [src, dst] {
        let s = p.to_string_lossy();
        if s.contains("://") && !s.starts_with("agent://") {
            return Err(EndpointError::Unsupported(s.into_owned()));
        }
    }
    let runtime = || tokio::runtime::Runtime::new().map_err(EndpointError::Runtime);
    Ok(Copied::Block(match (from, to) {
        (None, None) => copy_block(src, dst, options, progress)?,
        (None, Some(to)) => {
            runtime()?.block_on(remote::push(src, &to, options, remote, progress))?
        }
        (Some(from), None) => {
            runtime()?.block_on(remote::pull(&from, dst, options, remote, progress))?
        }
        (Some(_), Some(_)) => {
            return Err(EndpointError::Unsupported(
                "agent-to-agent copies: run the copy on one of the two nodes".into(),
            ));
        }
    }))
}
