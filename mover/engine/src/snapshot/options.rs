//! Where a repository is and how to open it: shared by the CLI (clap `flatten`) and
//! library callers.

use snapshots::{
    Backend, Credentials, LocalBackend, RepoError, Repository, RetryBackend, RetryPolicy,
    S3Backend, S3Options,
};
use std::{path::PathBuf, sync::Arc, time::Duration};

/// How to reach and open a repository.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct RepoOptions {
    /// Endpoint URL of an S3-compatible server for s3:// repositories
    /// (e.g. http://minio:9000) [default: AWS].
    #[arg(long, value_name = "URL", env = "MOVER_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,
    /// Region of s3:// repositories [default: AWS_REGION, else us-east-1].
    #[arg(long, value_name = "REGION", env = "MOVER_S3_REGION")]
    pub s3_region: Option<String>,
    /// Address the bucket virtual-host style (bucket.endpoint) instead of path style.
    #[arg(long)]
    pub s3_virtual_host: bool,
    /// Read the repository password from this file (first line). The password can also
    /// be given in MOVER_PASSWORD.
    #[arg(long, value_name = "FILE", env = "MOVER_PASSWORD_FILE")]
    pub password_file: Option<PathBuf>,
    /// Use a raw key file (at least 32 bytes, e.g. `head -c 32 /dev/urandom`) instead
    /// of a password.
    #[arg(
        long,
        value_name = "FILE",
        env = "MOVER_KEY_FILE",
        conflicts_with = "password_file"
    )]
    pub key_file: Option<PathBuf>,
    /// Give up on an unreachable or failing repository after this many seconds of
    /// retries (transient errors are retried with exponential backoff).
    #[arg(
        long,
        value_name = "SECS",
        env = "MOVER_RETRY_MAX_SECS",
        default_value_t = 120
    )]
    pub retry_max_secs: u64,
    /// Where copies of the repository index are kept between runs, and the page hashes
    /// of each block volume's last snapshot (8 KiB per MiB of volume: an incremental
    /// snapshot then finds a changed chunk's new pages without reading its old copy
    /// back from the repository) [default: /var/cache/mover as root, else
    /// $XDG_CACHE_HOME/mover]. Losing it costs speed, never data.
    #[arg(long, value_name = "DIR", env = "MOVER_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Keep no local cache: the index is read from the repository each run, and an
    /// incremental snapshot reads the old copy of every changed chunk.
    #[arg(long)]
    pub no_cache: bool,
}

impl RepoOptions {
    /// The backend for `repo` (a path, or `s3://bucket[/prefix]`), wrapped in retries.
    pub async fn backend(&self, repo: &str) -> Result<Arc<dyn Backend>, RepoError> {
        self.backend_with_keys(repo, None).await
    }

    /// [`RepoOptions::backend`] with S3 keys (access key id, secret) given, instead of
    /// the standard credential chain.
    pub async fn backend_with_keys(
        &self,
        repo: &str,
        keys: Option<(String, String)>,
    ) -> Result<Arc<dyn Backend>, RepoError> {
        let (access_key_id, secret_access_key) = keys.unzip();
        let inner: Arc<dyn Backend> = if let Some(rest) = repo.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(RepoError::Refused {
                    what: repo.into(),
                    why: "no bucket named; write s3://BUCKET or s3://BUCKET/PREFIX".into(),
                });
            }
            Arc::new(
                S3Backend::new(&S3Options {
                    bucket: bucket.into(),
                    prefix: prefix.into(),
                    endpoint: self.s3_endpoint.clone(),
                    region: self.s3_region.clone(),
                    path_style: !self.s3_virtual_host,
                    access_key_id,
                    secret_access_key,
                })
                .await,
            )
        } else if repo.contains("://") {
            return Err(RepoError::Refused {
                what: repo.into(),
                why: "unknown repository scheme; use a directory path or s3://BUCKET/PREFIX".into(),
            });
        } else {
            Arc::new(LocalBackend::new(repo))
        };
        let max = Duration::from_secs(self.retry_max_secs);
        Ok(Arc::new(RetryBackend::new(
            inner,
            RetryPolicy {
                max_elapsed: max,
                max_delay: Duration::from_secs(10)
                    .min(max / 4)
                    .max(Duration::from_millis(100)),
                ..RetryPolicy::default()
            },
        )))
    }

    /// The index cache directory in effect, `None` with `--no-cache`.
    pub fn cache_dir(&self) -> Option<PathBuf> {
        if self.no_cache {
            return None;
        }
        if let Some(d) = &self.cache_dir {
            return Some(d.clone());
        }
        if rustix::process::geteuid().is_root() {
            return Some(PathBuf::from("/var/cache/mover"));
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        Some(base.join("mover"))
    }

    /// The credentials: a key file, a password file, or MOVER_PASSWORD.
    pub fn credentials(&self) -> Result<Credentials, RepoError> {
        if let Some(path) = &self.key_file {
            let k = std::fs::read(path).map_err(|e| RepoError::BadKeyFile {
                path: path.clone(),
                why: format!("cannot read it: {e}"),
            })?;
            if k.len() < 32 {
                return Err(RepoError::BadKeyFile {
                    path: path.clone(),
                    why: format!(
                        "holds {} bytes; a key needs at least 32 (make one with `head -c 32 /dev/urandom > FILE`)",
                        k.len()
                    ),
                });
            }
            return Ok(Credentials::RawKey(k));
        }
        if let Some(path) = &self.password_file {
            let s = std::fs::read_to_string(path).map_err(|e| RepoError::BadKeyFile {
                path: path.clone(),
                why: format!("cannot read it: {e}"),
            })?;
            let pw = s.lines().next().unwrap_or("").to_string();
            if pw.is_empty() {
                return Err(RepoError::BadKeyFile {
                    path: path.clone(),
                    why: "is empty".into(),
                });
            }
            return Ok(Credentials::Password(pw));
        }
        match std::env::var("MOVER_PASSWORD") {
            Ok(pw) if !pw.is_empty() => Ok(Credentials::Password(pw)),
            _ => Err(RepoError::NoPassword),
        }
    }
}

/// Opens the repository at `repo` with `opts`.
pub async fn open_repository(repo: &str, opts: &RepoOptions) -> Result<Arc<Repository>, RepoError> {
    let creds = opts.credentials()?;
    open_repository_with(repo, opts, &creds, None).await
}

/// Opens the repository at `repo` with credentials and S3 keys given (an agent's
/// scheduled snapshots), the rest from `opts`.
pub async fn open_repository_with(
    repo: &str,
    opts: &RepoOptions,
    creds: &Credentials,
    s3_keys: Option<(String, String)>,
) -> Result<Arc<Repository>, RepoError> {
    let backend = opts.backend_with_keys(repo, s3_keys).await?;
    let repo = Repository::open(backend, creds).await?;
    Ok(Arc::new(repo.with_cache_dir(opts.cache_dir())))
}
