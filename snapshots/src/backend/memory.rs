//! An in-memory backend for unit tests.

use super::{Backend, ObjectInfo, check_key, slice_range};
use crate::error::{RepoError, Result};
use bytes::Bytes;
use std::{collections::BTreeMap, ops::Range, sync::Mutex};

/// Objects in a map in memory; gone when dropped.
#[derive(Debug, Default)]
pub struct MemoryBackend {
    objects: Mutex<BTreeMap<String, Bytes>>,
}

impl MemoryBackend {
    /// An empty backend.
    pub fn new() -> Self {
        Self::default()
    }

    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Bytes>> {
        self.objects.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait::async_trait]
impl Backend for MemoryBackend {
    fn location(&self) -> String {
        "memory:".into()
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        Ok(self
            .map()
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| ObjectInfo {
                key: k.clone(),
                size: v.len() as u64,
            })
            .collect())
    }

    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<Bytes> {
        check_key("memory:", "get", key)?;
        let data = self.map().get(key).cloned();
        match data {
            Some(d) => slice_range("memory:", key, d, range),
            None => Err(RepoError::NotFound {
                location: "memory:".into(),
                key: key.into(),
            }),
        }
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<()> {
        check_key("memory:", "put", key)?;
        self.map().insert(key.into(), data);
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<()> {
        check_key("memory:", "delete", key)?;
        self.map().remove(key);
        Ok(())
    }
}
