//! Snapshots of the control-plane [`State`], so the journal does not grow forever (issue 17,
//! item 2).
//!
//! # File format
//! `<journal>.snapshot` holds one line, in the journal's line format:
//! `{"format":1,"seq":N,"unix_ms":T,"state":{...},"crc32":"0a1b2c3d"}` and a newline, where
//! `crc32` covers the bytes before `,"crc32":"` (as in [`crate::journal`]), `seq` is the last
//! journal record the state includes and `state` is the whole [`State`]. It is parsed strictly:
//! a repeated key ([`mx_layout::strict_json`]), an unknown field, a missing newline or a
//! checksum that does not match is an [`Error::SnapshotCorrupt`] naming the file, and the
//! control plane does not start.
//!
//! # Compaction
//! [`crate::journal::Journal::compact`] takes a snapshot at the journal's last sequence number
//! `N`: it writes `<journal>.snapshot.tmp`, `fsync`s it, renames it over `<journal>.snapshot`,
//! `fsync`s the directory, then truncates the journal to nothing and `fsync`s it. Sequence numbers
//! go on from `N + 1`. A crash at any point loses nothing:
//! - before the rename: the old snapshot (or none) and the whole journal are as they were; the
//!   temporary file is removed at the next open;
//! - after the rename, before the truncation: the journal still holds records up to `N`, which
//!   the snapshot includes; the next open skips them (after verifying them) and finishes the
//!   truncation;
//! - after the truncation: the snapshot and an empty journal.
//!
//! Replay is the snapshot's state plus the journal's records after `N`.
//!
//! # etcd
//! The journal kept in etcd ([`crate::journal::Journal::open_etcd`]) is compacted the same way
//! by the leader: the same snapshot bytes, in chunks, switched to in one fenced transaction that
//! also deletes the log entries it includes ([`crate::ha::Leadership::install_snapshot`]).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use mx_layout::{strict_json, JsonError};
use serde::{Deserialize, Serialize};

use crate::state::State;
use crate::Error;

/// The snapshot format this build writes and reads.
pub const SNAPSHOT_FORMAT: u32 = 1;

/// Largest snapshot file read, in bytes (16 GiB): a longer one is refused rather than read.
pub const MAX_SNAPSHOT_BYTES: u64 = 16 << 30;

/// When the journal is compacted into a snapshot, how much refit history is kept in full, and
/// how a journal is recovered (unchecked lines, the fleet's testimony).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compaction {
    /// Compact once the journal file holds more than this many bytes (0: never by size).
    pub max_journal_bytes: u64,
    /// Compact once the journal holds more than this many records after the last snapshot (0:
    /// never by count).
    pub max_journal_records: u64,
    /// Refits whose per-worker detail (every engine call and its result) is kept: the last
    /// this many that ended. Older ones keep their summary (id, label, outcome, phases, times,
    /// counts). At least 1 is kept whatever this says.
    pub refit_detail: usize,
    /// Worker ids whose command stream has been closed longer than this are retired (a
    /// journaled `retire`: forgotten by status, admission and default refit sets), unless a
    /// refit holds them. `None` (the default): kept until retired by their process on a clean
    /// exit or by an orchestrator (`RetireWorker`). Measured from when this control plane last
    /// saw each one connected, or from its start.
    pub retire_departed_after: Option<std::time::Duration>,
    /// How long a control plane that recovers an open refit after a restart waits for the
    /// refit's workers to register again, so that what they hold can contradict a damaged
    /// journal before anything is settled ([`crate::testimony`]); it goes on as soon as all
    /// of them did. Default [`DEFAULT_TESTIMONY_WAIT`].
    pub testimony_wait: std::time::Duration,
    /// Replay journal lines without a checksum (written before lines had one) instead of
    /// refusing the journal: only for a journal known to predate checksums, since a line whose
    /// checksum was stripped reads the same ([`crate::journal`]). Default false.
    pub accept_unchecked_lines: bool,
}

/// Default [`Compaction::testimony_wait`]: 10 s (a worker retries a lost control plane at
/// most every 5 s).
pub const DEFAULT_TESTIMONY_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Default [`Compaction::max_journal_bytes`]: 256 MiB.
pub const DEFAULT_MAX_JOURNAL_BYTES: u64 = 256 << 20;
/// Default [`Compaction::max_journal_bytes`] of a journal kept in etcd: 64 MiB (etcd's storage
/// quota is 2 GiB by default, and it keeps deleted keys until it compacts its own history).
pub const DEFAULT_MAX_ETCD_JOURNAL_BYTES: u64 = 64 << 20;
/// Default [`Compaction::max_journal_records`]: one million.
pub const DEFAULT_MAX_JOURNAL_RECORDS: u64 = 1_000_000;
/// Default [`Compaction::refit_detail`].
pub const DEFAULT_REFIT_DETAIL: usize = 8;

impl Default for Compaction {
    fn default() -> Compaction {
        Compaction {
            max_journal_bytes: DEFAULT_MAX_JOURNAL_BYTES,
            max_journal_records: DEFAULT_MAX_JOURNAL_RECORDS,
            refit_detail: DEFAULT_REFIT_DETAIL,
            retire_departed_after: None,
            testimony_wait: DEFAULT_TESTIMONY_WAIT,
            accept_unchecked_lines: false,
        }
    }
}

impl Compaction {
    /// How a control plane replays lines without a checksum
    /// ([`Compaction::accept_unchecked_lines`]).
    pub fn unchecked(&self) -> crate::journal::Unchecked {
        if self.accept_unchecked_lines {
            crate::journal::Unchecked::Accept
        } else {
            crate::journal::Unchecked::Refuse
        }
    }

    /// True when a journal of `bytes` bytes holding `records` records after its snapshot is due
    /// for compaction.
    pub fn due(&self, bytes: u64, records: u64) -> bool {
        records > 0
            && ((self.max_journal_bytes > 0 && bytes > self.max_journal_bytes)
                || (self.max_journal_records > 0 && records > self.max_journal_records))
    }
}

/// A snapshot as read back.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// The last journal record the state includes.
    pub seq: u64,
    /// When it was taken, milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// The state after record `seq`.
    pub state: State,
    /// Size of the snapshot file in bytes.
    pub bytes: u64,
}

/// The snapshot line, as parsed (these fields and no other).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotLine {
    format: u32,
    seq: u64,
    unix_ms: u64,
    state: State,
}

/// Where the snapshot of the journal at `journal` lives: `<journal>.snapshot`.
pub fn snapshot_path(journal: &Path) -> PathBuf {
    let mut name = journal
        .file_name()
        .map_or_else(|| "journal".into(), std::ffi::OsStr::to_os_string);
    name.push(".snapshot");
    journal.with_file_name(name)
}

/// The temporary file a snapshot is written to before its rename: `<journal>.snapshot.tmp`.
pub fn temp_path(journal: &Path) -> PathBuf {
    let mut p = snapshot_path(journal).into_os_string();
    p.push(".tmp");
    PathBuf::from(p)
}

fn corrupt(path: &Path, reason: impl Into<String>) -> Error {
    Error::SnapshotCorrupt {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::JournalIo {
        path: path.to_path_buf(),
        what,
        source,
    }
}

/// Encodes `state` after journal record `seq` as a snapshot file's bytes (one checksummed line).
///
/// # Errors
/// [`Error::JournalIo`] (`encode snapshot`) when the state cannot be serialized.
pub fn encode(journal: &Path, seq: u64, unix_ms: u64, state: &State) -> Result<Vec<u8>, Error> {
    #[derive(Serialize)]
    struct LineRef<'a> {
        format: u32,
        seq: u64,
        unix_ms: u64,
        state: &'a State,
    }
    let mut buf = serde_json::to_vec(&LineRef {
        format: SNAPSHOT_FORMAT,
        seq,
        unix_ms,
        state,
    })
    .map_err(|e| io_err(journal, "encode snapshot")(std::io::Error::other(e)))?;
    // A struct serializes as one object: drop its closing brace to add the checksum.
    if buf.pop() != Some(b'}') {
        return Err(io_err(journal, "encode snapshot")(std::io::Error::other(
            "a snapshot did not encode as an object",
        )));
    }
    let crc = crc32fast::hash(&buf);
    buf.extend_from_slice(format!(",\"crc32\":\"{crc:08x}\"}}\n").as_bytes());
    Ok(buf)
}

/// Decodes a snapshot file's `bytes` (`path` names it in errors).
///
/// # Errors
/// [`Error::SnapshotCorrupt`] naming the file and what is wrong: no newline at the end (a file
/// cut short), more than one line, a missing or mismatched checksum, JSON that is not a snapshot
/// (a repeated key, an unknown or missing field, with its line and column), or a format other
/// than [`SNAPSHOT_FORMAT`].
pub fn decode(path: &Path, bytes: &[u8]) -> Result<Snapshot, Error> {
    let Some(line) = bytes.strip_suffix(b"\n") else {
        return Err(corrupt(
            path,
            format!(
                "{} bytes without the final newline: the file was cut short",
                bytes.len()
            ),
        ));
    };
    if let Some(i) = line.iter().position(|&b| b == b'\n') {
        return Err(corrupt(
            path,
            format!("a newline at byte {i}: a snapshot is one line"),
        ));
    }
    let Some((body, stored)) = crate::journal::split_checksum(line) else {
        return Err(corrupt(path, "no checksum field at the end of the line"));
    };
    let stored = stored.map_err(|r| corrupt(path, r))?;
    let computed = crc32fast::hash(body);
    if stored != computed {
        return Err(corrupt(
            path,
            format!(
                "checksum mismatch: the file says {stored:08x}, its bytes hash to {computed:08x} (the file changed on disk)"
            ),
        ));
    }
    // Strict parse of the snapshot without its checksum field (checked above).
    let mut body_obj = Vec::with_capacity(body.len() + 1);
    body_obj.extend_from_slice(body);
    body_obj.push(b'}');
    let s: SnapshotLine =
        strict_json::from_slice(&body_obj).map_err(|e| corrupt(path, json_reason(&e)))?;
    if s.format != SNAPSHOT_FORMAT {
        return Err(corrupt(
            path,
            format!(
                "field `format`: {} is not a snapshot format this build reads ({SNAPSHOT_FORMAT})",
                s.format
            ),
        ));
    }
    Ok(Snapshot {
        seq: s.seq,
        unix_ms: s.unix_ms,
        state: s.state,
        bytes: bytes.len() as u64,
    })
}

fn json_reason(e: &JsonError) -> String {
    match e {
        JsonError::DuplicateKey { key, path } => {
            format!("duplicate key {key:?} in the JSON object at {path}")
        }
        other => other.to_string(),
    }
}

/// Reads the snapshot of the journal at `journal`, if there is one (the temporary file of an
/// interrupted compaction is not read).
///
/// # Errors
/// [`Error::JournalIo`] when it cannot be read; [`Error::SnapshotCorrupt`] as [`decode`], or
/// when it is larger than [`MAX_SNAPSHOT_BYTES`].
pub fn read(journal: &Path) -> Result<Option<Snapshot>, Error> {
    let path = snapshot_path(journal);
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path, "stat snapshot")(e)),
    };
    if meta.len() > MAX_SNAPSHOT_BYTES {
        return Err(corrupt(
            &path,
            format!(
                "{} bytes, over the limit of {MAX_SNAPSHOT_BYTES}",
                meta.len()
            ),
        ));
    }
    let bytes = std::fs::read(&path).map_err(io_err(&path, "read snapshot"))?;
    decode(&path, &bytes).map(Some)
}

/// Removes the temporary file an interrupted compaction left (it was never renamed, so nothing
/// depends on it). Returns whether there was one.
///
/// # Errors
/// [`Error::JournalIo`] when it exists and cannot be removed.
pub fn remove_temp(journal: &Path) -> Result<bool, Error> {
    let tmp = temp_path(journal);
    match std::fs::remove_file(&tmp) {
        Ok(()) => {
            tracing::warn!(path = %tmp.display(), "removed the temporary snapshot of a compaction interrupted before its rename");
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_err(&tmp, "remove temporary snapshot")(e)),
    }
}

/// Writes snapshot `bytes` for the journal at `journal` atomically: the temporary file, `fsync`,
/// rename over the snapshot, `fsync` of the directory. After an error the previous snapshot (if
/// any) is still in place.
///
/// # Errors
/// [`Error::JournalIo`] naming the step that failed.
pub fn write_atomic(journal: &Path, bytes: &[u8]) -> Result<(), Error> {
    let tmp = temp_path(journal);
    let dest = snapshot_path(journal);
    let written = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(&tmp, "write temporary snapshot")(e));
    }
    std::fs::rename(&tmp, &dest).map_err(io_err(&dest, "rename snapshot into place"))?;
    sync_dir(&dest)
}

/// `fsync`s the directory holding `path`, so a rename or creation in it is durable.
///
/// # Errors
/// [`Error::JournalIo`] (`fsync directory`).
pub(crate) fn sync_dir(path: &Path) -> Result<(), Error> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(path, "fsync directory"))
}

/// Serde for a map keyed by `(label, slot)` (JSON object keys are strings): a list of
/// `[label, slot, value]`, ascending; a key listed twice is refused.
pub(crate) mod pair_map {
    use super::*;
    use serde::de::Error as _;
    use serde::{Deserializer, Serializer};

    /// Serializes as a list of `[label, slot, value]`.
    pub(crate) fn serialize<S: Serializer>(
        m: &BTreeMap<(String, u32), u32>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.iter().map(|((l, slot), v)| (l, slot, v)))
    }

    /// Deserializes a list of `[label, slot, value]`, refusing a repeated `(label, slot)`.
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<(String, u32), u32>, D::Error> {
        let list: Vec<(String, u32, u32)> = Vec::deserialize(d)?;
        let mut m = BTreeMap::new();
        for (label, slot, v) in list {
            if m.insert((label.clone(), slot), v).is_some() {
                return Err(D::Error::custom(format!(
                    "({label:?}, slot {slot}) listed twice"
                )));
            }
        }
        Ok(m)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // reason: tests fail loudly on purpose
#[path = "snapshot_tests.rs"]
mod tests;
