//! The schedules of one agent: their records on disk, one task each, and a run.

use super::When;
use crate::replicate::{base::hidden_name, now_ms};
use mover_engine::{
    node::{Exports, point_in_time, write_durably},
    snapshot::{CreateOptions, RepoOptions, create_snapshot, open_repository_with},
};
use snapshots::{Credentials, retention::KeepPolicy};
use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};
use tokio::sync::Notify;
use transport::schedule::{Record, Spec, Status};
use transport::states::ScheduleState;

/// The record format this build writes and reads.
const RECORD_VERSION: u32 = 1;
/// Prune's grace period: a pack marked unused is deleted only a day later. It must be
/// longer than any snapshot run into the repository, this agent's or another's (a
/// snapshot of a large volume over a slow link can take hours): a day of unused data
/// kept is cheaper than a snapshot that lost a chunk.
const PRUNE_GRACE_SECS: u64 = 24 * 3600;

/// The scheduled snapshots of one agent.
pub struct Schedules {
    dir: PathBuf,
    cache_dir: PathBuf,
    exports: Exports,
    records: Mutex<BTreeMap<String, Record>>,
    /// Wakes a schedule's task (its spec changed, it was deleted).
    wake: Mutex<HashMap<String, Arc<Notify>>>,
    /// One run at a time per schedule (the task's, or one asked for by Run).
    running: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Schedules {
    /// Loads the schedules kept under `state_dir` (their tasks start with
    /// [`Schedules::start_all`]).
    pub fn open(state_dir: &Path, exports: Exports) -> std::io::Result<Arc<Schedules>> {
        use std::os::unix::fs::PermissionsExt;
        let dir = state_dir.join("schedules");
        std::fs::create_dir_all(&dir)?;
        // Records hold repository passwords and S3 keys.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        let mut records = BTreeMap::new();
        for e in std::fs::read_dir(&dir)?.flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "pb") {
                continue;
            }
            let bad = |why: String| {
                std::io::Error::other(format!(
                    "schedule record {} is unreadable: {why}; move it away to forget that \
                     schedule",
                    path.display()
                ))
            };
            let bytes = std::fs::read(&path)?;
            let mut r = <Record as prost::Message>::decode(bytes.as_slice())
                .map_err(|e| bad(e.to_string()))?;
            if r.version != RECORD_VERSION {
                return Err(bad(format!(
                    "format version {} (this build reads {RECORD_VERSION})",
                    r.version
                )));
            }
            // A run the agent was killed in left no snapshot (the manifest is the commit
            // point); its next time has passed, so it runs again at once.
            if let Some(s) = r
                .status
                .as_mut()
                .filter(|s| s.schedule_state() == Some(ScheduleState::Running))
            {
                s.state = ScheduleState::Idle.name().into();
            }
            let name = r.spec.as_ref().map(|s| s.name.clone()).unwrap_or_default();
            records.insert(name, r);
        }
        Ok(Arc::new(Schedules {
            cache_dir: state_dir.join("cache"),
            dir,
            exports,
            records: Mutex::new(records),
            wake: Mutex::default(),
            running: Mutex::default(),
        }))
    }

    /// Starts the task of every schedule.
    pub fn start_all(self: &Arc<Self>) {
        let names: Vec<String> = self.lock().keys().cloned().collect();
        for name in names {
            self.start(&name);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Record>> {
        self.records.lock().expect("schedules lock")
    }

    fn path(&self, name: &str) -> PathBuf {
        let h = mover_engine::node::name_hash(name);
        self.dir.join(format!("{h}.pb"))
    }

    fn save(&self, record: &Record) -> std::io::Result<()> {
        let name = &record.spec.as_ref().expect("a record has a spec").name;
        write_durably(&self.path(name), &prost::Message::encode_to_vec(record))
    }

    /// Checks `spec`: its name, export, repository and times.
    pub fn check(&self, spec: &Spec) -> Result<When, String> {
        if spec.name.is_empty() || spec.name.chars().any(char::is_control) {
            return Err("a schedule needs a name without control characters".into());
        }
        self.exports.get(&spec.volume).map_err(|e| e.to_string())?;
        if spec.repository.is_empty() {
            return Err("no repository: give a directory or s3://BUCKET[/PREFIX]".into());
        }
        if spec.access.as_ref().is_none_or(|a| a.password.is_empty()) {
            return Err(
                "no repository password (or key): the agent cannot open the repository".into(),
            );
        }
        When::parse(&spec.schedule)
    }

    /// Creates `spec`'s schedule or replaces its spec; its task runs it from now on.
    pub fn apply(self: &Arc<Self>, spec: Spec) -> Result<Status, ApplyError> {
        let when = self.check(&spec).map_err(ApplyError::Invalid)?;
        let name = spec.name.clone();
        let mut records = self.lock();
        let mut record = records.get(&name).cloned().unwrap_or_else(|| Record {
            version: RECORD_VERSION,
            spec: None,
            status: Some(Status {
                state: ScheduleState::Idle.name().into(),
                ..Default::default()
            }),
        });
        let status = record.status.get_or_insert_default();
        let last = (status.last_time_ms > 0).then_some(status.last_time_ms);
        status.next_run_ms = when.next(now_ms(), last);
        record.spec = Some(spec);
        // Not saved: not applied (the schedule stays as it was, or absent).
        self.save(&record)
            .map_err(|e| ApplyError::Save(format!("cannot save schedule {name:?}: {e}")))?;
        let out = status_of(&record);
        let is_new = !self.wake.lock().expect("wake lock").contains_key(&name);
        records.insert(name.clone(), record);
        drop(records);
        if is_new {
            self.start(&name);
        } else {
            self.notify(&name);
        }
        Ok(out)
    }

    /// The status of `name` (its spec without its access).
    pub fn status(&self, name: &str) -> Option<Status> {
        self.lock().get(name).map(status_of)
    }

    /// Every schedule's status.
    pub fn list(&self) -> Vec<Status> {
        self.lock().values().map(status_of).collect()
    }

    /// Stops `name` and forgets it; its snapshots stay in the repository.
    pub async fn delete(&self, name: &str) -> Result<Option<Status>, String> {
        let record = {
            let mut records = self.lock();
            let Some(record) = records.remove(name) else {
                return Ok(None);
            };
            // Off the disk first: a caller that gives up while a run finishes leaves no
            // record to come back at the next start.
            match std::fs::remove_file(self.path(name)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    records.insert(name.into(), record);
                    return Err(format!("cannot remove schedule {name:?}: {e}"));
                }
            }
            record
        };
        // Its task ends (it is no longer the current one for the name).
        if let Some(n) = self.wake.lock().expect("wake lock").remove(name) {
            n.notify_one();
        }
        // A run in progress finishes first: its snapshot is complete or not there.
        let run = self.run_lock(name);
        let _done = run.lock().await;
        Ok(Some(status_of(&record)))
    }

    fn notify(&self, name: &str) {
        if let Some(n) = self.wake.lock().expect("wake lock").get(name) {
            n.notify_one();
        }
    }

    fn run_lock(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.running
            .lock()
            .expect("running lock")
            .entry(name.into())
            .or_default()
            .clone()
    }

    fn start(self: &Arc<Self>, name: &str) {
        let notify = Arc::new(Notify::new());
        self.wake
            .lock()
            .expect("wake lock")
            .insert(name.into(), notify.clone());
        let (me, name) = (self.clone(), name.to_string());
        tokio::spawn(async move {
            loop {
                let current = me
                    .wake
                    .lock()
                    .expect("wake lock")
                    .get(&name)
                    .is_some_and(|n| Arc::ptr_eq(n, &notify));
                let next = me
                    .lock()
                    .get(&name)
                    .and_then(|r| r.status.as_ref())
                    .map(|s| s.next_run_ms);
                // Deleted, or deleted and made again (that one has a task of its own).
                let (true, Some(next)) = (current, next) else {
                    return;
                };
                let wait = u64::try_from(next - now_ms()).unwrap_or(0);
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_millis(wait)) => {
                        let _ = me.run(&name).await;
                    }
                    _ = notify.notified() => {}
                }
            }
        });
    }

    /// Takes a snapshot now, then forgets and prunes as the schedule says; the record
    /// is updated either way.
    pub async fn run(&self, name: &str) -> Result<Status, String> {
        let lock = self.run_lock(name);
        let _one = lock.lock().await;
        let Some(spec) = self.lock().get(name).and_then(|r| r.spec.clone()) else {
            return Err(format!("no schedule {name:?} on this agent"));
        };
        let when = match When::parse(&spec.schedule) {
            Ok(w) => w,
            Err(e) => {
                // A record this build does not accept: said, and not retried for an hour.
                let e = format!("schedule {name:?}: {e}");
                self.update(name, |s| {
                    s.state = ScheduleState::Failing.name().into();
                    s.last_error = e.clone();
                    s.no_point_in_time = false;
                    s.next_run_ms = now_ms() + 3_600_000;
                });
                return Err(e);
            }
        };
        self.update(name, |s| s.state = ScheduleState::Running.name().into());
        let started = now_ms();
        tracing::info!(schedule = %name, volume = %spec.volume, repository = %spec.repository, "scheduled snapshot");
        let outcome = self.take(&spec).await;
        let ended = now_ms();
        let status = self.update(name, |s| {
            match &outcome {
                Ok(taken) => {
                    s.state = ScheduleState::Idle.name().into();
                    s.last_snapshot = taken.snapshot.clone();
                    s.last_time_ms = started;
                    s.last_duration_ms = u64::try_from(ended - started).unwrap_or(0);
                    s.last_bytes_added = taken.bytes_added;
                    s.runs_ok += 1;
                    s.last_error.clear();
                    s.no_point_in_time = false;
                    s.forgotten += taken.forgotten;
                    s.pruned_packs += taken.pruned_packs;
                    s.consistency = taken.consistency.into();
                }
                Err(e) => {
                    s.state = ScheduleState::Failing.name().into();
                    s.runs_failed += 1;
                    s.last_error = e.message.clone();
                    s.no_point_in_time = e.no_point_in_time;
                }
            }
            // After a failure the next run is at the next time, as for a success: a
            // failing repository is not hammered.
            s.next_run_ms = when.next(ended, Some(started));
        });
        match &outcome {
            Ok(t) => {
                tracing::info!(schedule = %name, snapshot = %t.snapshot, bytes_added = t.bytes_added, "scheduled snapshot taken")
            }
            Err(e) => tracing::warn!(schedule = %name, "scheduled snapshot failed: {e}"),
        }
        // The task sleeps until the next run computed here (a run asked for by hand
        // moves it too).
        self.notify(name);
        status.ok_or_else(|| format!("schedule {name:?} was deleted meanwhile"))
    }

    /// Changes the status of `name` and saves it (a failed save is logged: the next
    /// change saves again).
    fn update(&self, name: &str, f: impl FnOnce(&mut Status)) -> Option<Status> {
        let mut records = self.lock();
        let record = records.get_mut(name)?;
        f(record.status.get_or_insert_default());
        if let Err(e) = self.save(record) {
            tracing::warn!(schedule = %name, "cannot save the schedule's status: {e}");
        }
        Some(status_of(record))
    }

    /// One snapshot of `spec`'s export, then retention and prune.
    async fn take(&self, spec: &Spec) -> Result<Taken, Failure> {
        let export = self.exports.get(&spec.volume).map_err(|e| e.to_string())?;
        let access = spec.access.clone().unwrap_or_default();
        let creds = if access.raw_key {
            Credentials::RawKey(access.password.clone())
        } else {
            Credentials::Password(
                String::from_utf8(access.password.clone())
                    .map_err(|_| "the repository password is not UTF-8".to_string())?,
            )
        };
        let opts = RepoOptions {
            s3_endpoint: Some(access.s3_endpoint.clone()).filter(|s| !s.is_empty()),
            s3_region: Some(access.s3_region.clone()).filter(|s| !s.is_empty()),
            retry_max_secs: 300,
            cache_dir: Some(self.cache_dir.clone()),
            ..Default::default()
        };
        let keys = (!access.s3_access_key_id.is_empty())
            .then_some((access.s3_access_key_id, access.s3_secret_access_key));
        let fail = |what: &str, e: snapshots::RepoError| format!("{what} {}: {e}", spec.repository);
        let repo = open_repository_with(&spec.repository, &opts, &creds, keys)
            .await
            .map_err(|e| fail("cannot open repository", e))?;
        let volume = snapshot_name(spec);
        let pit = point_in_time(&export.path, spec)?;
        // Retention forgets only this schedule's snapshots, not others of the volume
        // (by hand, or another agent's into the same repository).
        let tag = format!("schedule={}", spec.name);
        let create = CreateOptions {
            name: Some(volume.clone()),
            tags: vec![tag.clone(), format!("consistency={}", pit.consistency)],
            ..Default::default()
        };
        let snap = create_snapshot(repo.clone(), &pit.read, &create)
            .await
            .map_err(|e| fail("cannot snapshot into", e))?;
        let consistency = pit.consistency;
        drop(pit);
        if snap.manifest.summary.unreadable > 0 {
            // Saved, but not a run to count as good (nor to forget older ones after).
            return Err(format!(
                "snapshot {} is incomplete: {} entries of {} could not be read (the agent's \
                 log names them)",
                snap.short_id(),
                snap.manifest.summary.unreadable,
                export.path.display()
            )
            .into());
        }
        let mut taken = Taken {
            snapshot: snap.id.clone(),
            bytes_added: snap.manifest.summary.stored_bytes,
            forgotten: 0,
            pruned_packs: 0,
            consistency,
        };
        let keep = spec.keep.unwrap_or_default();
        let policy = KeepPolicy {
            last: keep.last,
            hourly: keep.hourly,
            daily: keep.daily,
            weekly: keep.weekly,
            monthly: keep.monthly,
        };
        if !policy.is_empty() {
            let mine: Vec<_> = repo
                .snapshots()
                .await
                .map_err(|e| fail("cannot list snapshots in", e))?
                .into_iter()
                .filter(|s| s.manifest.volume == volume && s.manifest.tags.contains(&tag))
                .collect();
            for d in snapshots::retention::apply(&mine, &policy) {
                if d.reasons.is_empty() {
                    repo.delete_snapshot(&d.snapshot.id)
                        .await
                        .map_err(|e| fail("cannot forget a snapshot in", e))?;
                    taken.forgotten += 1;
                }
            }
        }
        let runs = self
            .status(&spec.name)
            .map_or(0, |s| s.runs_ok)
            .saturating_add(1);
        if spec.prune_every > 0 && runs.is_multiple_of(u64::from(spec.prune_every)) {
            let report = repo
                .prune(PRUNE_GRACE_SECS)
                .await
                .map_err(|e| fail("cannot prune", e))?;
            taken.pruned_packs = report.deleted_packs as u64;
        }
        Ok(taken)
    }

    /// Prometheus text for every schedule.
    pub fn render(&self) -> String {
        let records = self.lock();
        if records.is_empty() {
            return String::new();
        }
        let series: [Series; 6] = [
            (
                "mover_schedule_runs_ok_total",
                "counter",
                "Scheduled snapshots taken.",
                |s| s.runs_ok as f64,
            ),
            (
                "mover_schedule_runs_failed_total",
                "counter",
                "Scheduled snapshot runs that failed.",
                |s| s.runs_failed as f64,
            ),
            (
                "mover_schedule_last_success_timestamp_seconds",
                "gauge",
                "Start of the last scheduled snapshot taken (0: none yet).",
                |s| s.last_time_ms as f64 / 1000.0,
            ),
            (
                "mover_schedule_last_duration_seconds",
                "gauge",
                "How long the last scheduled snapshot took.",
                |s| s.last_duration_ms as f64 / 1000.0,
            ),
            (
                "mover_schedule_last_bytes_added",
                "gauge",
                "New data the last scheduled snapshot added to its repository.",
                |s| s.last_bytes_added as f64,
            ),
            (
                "mover_schedule_next_run_timestamp_seconds",
                "gauge",
                "When the schedule runs next.",
                |s| s.next_run_ms as f64 / 1000.0,
            ),
        ];
        let mut out = String::new();
        for (metric, kind, help, value) in series {
            out += &format!("# HELP {metric} {help}\n# TYPE {metric} {kind}\n");
            for (name, r) in records.iter() {
                let s = r.status.clone().unwrap_or_default();
                out += &format!(
                    "{metric}{{schedule=\"{}\"}} {}\n",
                    mover_engine::node::label_value(name),
                    value(&s)
                );
            }
        }
        out
    }
}

/// Why a schedule was not applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The spec is wrong: what and what to do.
    #[error("{0}")]
    Invalid(String),
    /// The record could not be written (the state directory).
    #[error("{0}")]
    Save(String),
}

/// A metric: name, type, help, and its value from a schedule's status.
type Series = (&'static str, &'static str, &'static str, fn(&Status) -> f64);

/// What one run did.
struct Taken {
    snapshot: String,
    bytes_added: u64,
    forgotten: u64,
    pruned_packs: u64,
    consistency: &'static str,
}

/// A point in time of `source` for schedule `name`: an image file on a file system with
/// reflinks (XFS, Btrfs) is cloned beside itself in an instant, so the snapshot holds
/// the volume as it was then, however long the upload takes; anything else is read
/// live, and the snapshot says it is crash-inconsistent (refused where the spec
/// requires a point in time).
/// Why a scheduled snapshot was not taken: what the status says, and whether it was
/// refused for want of a point in time (the controller says NoPointInTime then).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
struct Failure {
    message: String,
    no_point_in_time: bool,
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure {
            message,
            no_point_in_time: false,
        }
    }
}

fn point_in_time(source: &Path, spec: &Spec) -> Result<point_in_time::Taken, Failure> {
    let reflink = point_in_time::ReflinkClone {
        name: |volume, owner| hidden_name(volume, owner, "snap"),
    };
    let pit = point_in_time::take(&[&reflink], source, &spec.name)
        .map_err(|e| format!("cannot clone {} for a point in time: {e}", source.display()))?;
    if spec.require_point_in_time && !pit.is_point_in_time() {
        return Err(Failure {
            message: format!(
                "{}: {}",
                source.display(),
                point_in_time::refusal(point_in_time::READ_LIVE)
            ),
            no_point_in_time: true,
        });
    }
    Ok(pit)
}

/// The volume name of a schedule's snapshots in the repository.
fn snapshot_name(spec: &Spec) -> String {
    if spec.snapshot_name.is_empty() {
        spec.name.clone()
    } else {
        spec.snapshot_name.clone()
    }
}

/// A record's status with its spec, the access left out.
fn status_of(r: &Record) -> Status {
    let mut s = r.status.clone().unwrap_or_default();
    s.spec = r.spec.clone().map(|mut spec| {
        spec.access = None;
        spec
    });
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_read_is_tagged_or_refused_as_the_spec_says() {
        // A device, not an image file: nothing to clone, only a live read is possible.
        let image = Path::new("/dev/zero");
        let mut spec = Spec {
            name: "nightly".into(),
            ..Default::default()
        };
        let pit = point_in_time(image, &spec).unwrap();
        assert_eq!(
            (pit.read.as_path(), pit.consistency),
            (image, point_in_time::CRASH_INCONSISTENT)
        );
        spec.require_point_in_time = true;
        let e = point_in_time(image, &spec).err().unwrap();
        assert!(e.no_point_in_time);
        let e = e.message;
        assert!(
            e.contains(point_in_time::NO_POINT_IN_TIME) && e.contains("volumeSnapshotClassName"),
            "{e}"
        );
    }
}
