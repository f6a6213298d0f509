//! A repository in an S3 bucket (AWS or any S3-compatible server).

use super::{Backend, ObjectInfo, check_key};
use crate::error::{RepoError, Result};
use aws_sdk_s3::{
    Client,
    config::{Credentials, Region, retry::RetryConfig, timeout::TimeoutConfig},
    error::{DisplayErrorContext, ProvideErrorMetadata, SdkError},
    primitives::ByteStream,
};
use bytes::Bytes;
use std::{ops::Range, time::Duration};

/// Where and how to reach a bucket.
#[derive(Clone, Debug, Default)]
pub struct S3Options {
    /// The bucket.
    pub bucket: String,
    /// Key prefix inside the bucket ("" for the whole bucket), without slashes at the ends.
    pub prefix: String,
    /// Endpoint URL of an S3-compatible server (e.g. `http://127.0.0.1:9000`);
    /// `None` for AWS.
    pub endpoint: Option<String>,
    /// Region [default: `AWS_REGION`, else `us-east-1`].
    pub region: Option<String>,
    /// Address buckets as `endpoint/bucket` rather than `bucket.endpoint` (needed by
    /// most self-hosted servers; on by default when an endpoint is set).
    pub path_style: bool,
    /// Access key id; `None` uses the standard AWS credential chain
    /// (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, profiles, web identity, IMDS).
    pub access_key_id: Option<String>,
    /// Secret access key, with `access_key_id`.
    pub secret_access_key: Option<String>,
}

/// Objects in an S3 bucket under a prefix. Retries are left to [`super::RetryBackend`].
#[derive(Debug, Clone)]
pub struct S3Backend {
    client: Client,
    bucket: String,
    prefix: String,
    location: String,
    endpoint: String,
}

impl S3Backend {
    /// Builds a client for `opts` (no request is made yet).
    pub async fn new(opts: &S3Options) -> Self {
        let region = opts
            .region
            .clone()
            .or_else(|| std::env::var("AWS_REGION").ok())
            .or_else(|| std::env::var("AWS_DEFAULT_REGION").ok())
            .unwrap_or_else(|| "us-east-1".into());
        let mut loader =
            aws_config::defaults(aws_config::BehaviorVersion::latest()).region(Region::new(region));
        if let (Some(id), Some(secret)) = (&opts.access_key_id, &opts.secret_access_key) {
            loader = loader.credentials_provider(Credentials::new(id, secret, None, None, "mover"));
        }
        let sdk = loader.load().await;
        let mut conf = aws_sdk_s3::config::Builder::from(&sdk)
            .force_path_style(opts.path_style)
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(10))
                    .build(),
            )
            .request_checksum_calculation(
                aws_sdk_s3::config::RequestChecksumCalculation::WhenRequired,
            )
            .response_checksum_validation(
                aws_sdk_s3::config::ResponseChecksumValidation::WhenRequired,
            );
        if let Some(ep) = &opts.endpoint {
            conf = conf.endpoint_url(ep);
        }
        let endpoint = opts.endpoint.clone().unwrap_or_else(|| "AWS S3".into());
        let prefix = opts.prefix.trim_matches('/').to_string();
        let location = match prefix.is_empty() {
            true => format!("s3://{} (at {endpoint})", opts.bucket),
            false => format!("s3://{}/{prefix} (at {endpoint})", opts.bucket),
        };
        S3Backend {
            client: Client::from_conf(conf.build()),
            bucket: opts.bucket.clone(),
            prefix,
            location,
            endpoint,
        }
    }

    fn full(&self, key: &str) -> String {
        match self.prefix.is_empty() {
            true => key.into(),
            false => format!("{}/{key}", self.prefix),
        }
    }

    /// [`RepoError::NoBucket`] if the bucket does not exist.
    async fn missing_bucket(&self) -> Option<RepoError> {
        match self.client.head_bucket().bucket(&self.bucket).send().await {
            Err(SdkError::ServiceError(se)) if se.raw().status().as_u16() == 404 => {
                Some(RepoError::NoBucket {
                    bucket: self.bucket.clone(),
                    endpoint: self.endpoint.clone(),
                })
            }
            _ => None,
        }
    }

    fn map_err<E>(
        &self,
        op: &'static str,
        key: &str,
        e: SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
    ) -> RepoError
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let backend = |retryable: bool, detail: String| RepoError::Backend {
            location: self.location.clone(),
            op,
            key: key.into(),
            retryable,
            detail,
        };
        match &e {
            SdkError::ServiceError(se) => {
                let status = se.raw().status().as_u16();
                let code = se.err().code().unwrap_or("").to_string();
                let msg = se.err().message().unwrap_or("").to_string();
                if code == "NoSuchBucket" {
                    return RepoError::NoBucket {
                        bucket: self.bucket.clone(),
                        endpoint: self.endpoint.clone(),
                    };
                }
                if code == "NoSuchKey" || (status == 404 && op == "get") {
                    return RepoError::NotFound {
                        location: self.location.clone(),
                        key: key.into(),
                    };
                }
                let hint = match (status, code.as_str()) {
                    (403, _) | (_, "InvalidAccessKeyId" | "SignatureDoesNotMatch") => {
                        "; check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and the bucket policy"
                    }
                    (301 | 400, "PermanentRedirect" | "AuthorizationHeaderMalformed") => {
                        "; check the region (--s3-region / AWS_REGION)"
                    }
                    _ => "",
                };
                backend(
                    status >= 500
                        || status == 429
                        || code == "SlowDown"
                        || code == "RequestTimeout",
                    format!("HTTP {status} {code}: {msg}{hint}"),
                )
            }
            SdkError::DispatchFailure(_)
            | SdkError::TimeoutError(_)
            | SdkError::ResponseError(_) => backend(
                true,
                format!(
                    "cannot reach {}: {} (check --s3-endpoint / MOVER_S3_ENDPOINT and the network)",
                    self.endpoint,
                    DisplayErrorContext(&e)
                ),
            ),
            _ => backend(false, DisplayErrorContext(&e).to_string()),
        }
    }
}

#[async_trait::async_trait]
impl Backend for S3Backend {
    fn location(&self) -> String {
        self.location.clone()
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let full = self.full(prefix);
        let strip = match self.prefix.is_empty() {
            true => 0,
            false => self.prefix.len() + 1,
        };
        let mut pages = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(&full)
            .into_paginator()
            .send();
        let mut out = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.map_err("list", prefix, e))?;
            for obj in page.contents() {
                if let Some(k) = obj.key()
                    && k.len() > strip
                {
                    out.push(ObjectInfo {
                        key: k[strip..].to_string(),
                        size: obj.size().unwrap_or(0).max(0) as u64,
                    });
                }
            }
        }
        Ok(out)
    }

    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<Bytes> {
        check_key(&self.location, "get", key)?;
        let mut req = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(self.full(key));
        if let Some(r) = &range {
            if r.end <= r.start {
                return Ok(Bytes::new());
            }
            req = req.range(format!("bytes={}-{}", r.start, r.end - 1));
        }
        let resp = match req.send().await.map_err(|e| self.map_err("get", key, e)) {
            Ok(r) => r,
            // Some servers answer NoSuchKey for a missing bucket: tell the two apart.
            Err(e) if e.is_not_found() => return Err(self.missing_bucket().await.unwrap_or(e)),
            Err(e) => return Err(e),
        };
        let data = resp.body.collect().await.map_err(|e| RepoError::Backend {
            location: self.location.clone(),
            op: "get",
            key: key.into(),
            retryable: true,
            detail: format!("reading the response failed: {e}"),
        })?;
        Ok(data.into_bytes())
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<()> {
        check_key(&self.location, "put", key)?;
        self.client
            .put_object()
            .bucket(&self.bucket)
            .key(self.full(key))
            .body(ByteStream::from(data))
            .send()
            .await
            .map_err(|e| self.map_err("put", key, e))?;
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<()> {
        check_key(&self.location, "delete", key)?;
        self.client
            .delete_object()
            .bucket(&self.bucket)
            .key(self.full(key))
            .send()
            .await
            .map_err(|e| self.map_err("delete", key, e))?;
        Ok(())
    }
}
