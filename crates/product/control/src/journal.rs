//! The durable local store: an append-only file of JSON lines, one [`Entry`] per accepted
//! mutating call, each written and `fsync`ed (`File::sync_data`) before the state changes.
//!
//! # Line format
//! `{"seq":7,"unix_ms":1718000000000,"record":{"op":"publish",...},"crc32":"0a1b2c3d"}` and a
//! newline. `seq` counts records from 1 (without a snapshot a line's seq is its line number;
//! after a snapshot at seq `N`, the journal starts again at `N + 1`: see [`crate::snapshot`],
//! which also says how a compaction that a crash interrupted is finished); `crc32` is the CRC-32
//! (IEEE 802.3, zlib's `crc32`) of the line's bytes before `,"crc32":"`, as 8 lowercase hex
//! digits. Each line is still one JSON object (readable by `jq`).
//!
//! # Replay fails loudly
//! [`read_records`] and [`Journal::open`] verify every line. The first bad one is an
//! [`Error::JournalCorrupt`] naming its 1-based line (= its seq), and the control plane does not
//! start:
//! - a checksum that does not match the line's bytes (a flipped byte anywhere: a shape, a digest,
//!   a resident version, a sequence number);
//! - a line that is not a JSON record, or whose `seq` is not the previous one plus 1 (the first
//!   line's: 1, or at most the snapshot's plus 1);
//! - a line without a checksum after a line that had one (a mangled checksum field);
//! - a `commit` or `applied` record, written by the retired Commit / ReportApplied RPCs before
//!   refits became the only commit path (the versions it committed were never refits);
//! - a last line without its newline that cannot be a torn write (below).
//!
//! A record that parses but the state machine refuses (say a world size over
//! [`crate::limits::MAX_WORLD_SIZE`], written by an older control plane) is an [`Error::Replay`]
//! naming its line, from the server's replay.
//!
//! # The one repair: a torn last record
//! A crash during a write can leave the last record without its newline: it was never
//! acknowledged nor applied. Such a tail is taken for a torn write only when it is at most
//! [`MAX_TORN_BYTES`] (what one group commit can leave unsynced) and its bytes are the start of
//! the next record, `{"seq":<last+1>,"unix_ms":`, possibly followed by NUL bytes (file systems
//! that extend a file before its data lands). Anything else is refused as above.
//! [`Journal::open`] copies the tail to `<journal>.torn-<unix_ms>` (synced) before cutting it off,
//! and logs it at error level with its seq and size; [`read_records`] leaves the file alone.
//!
//! # What is not detected
//! The journal alone cannot tell a shorter journal from a complete one:
//! - a cut exactly at a line boundary leaves a valid journal of fewer records;
//! - a cut inside a line leaves a tail that is the start of that line's record, exactly like a
//!   write torn by a crash: it is cut off as above (the lines after it are gone), but its bytes
//!   are kept in the side file and the error-level log names its seq, so an operator who did not
//!   expect a crash can tell.
//!
//! Detecting these needs a record of the journal's length outside the file.
//!
//! # Journals written before checksums
//! A line without a checksum reads exactly like a line whose checksum was stripped (so that an
//! edit of it passes), so a control plane refuses such a journal ([`Unchecked::Refuse`],
//! naming the line) unless it is started with `--accept-unchecked-journal-lines`
//! ([`crate::snapshot::Compaction::accept_unchecked_lines`]). With it, such lines are
//! accepted only at the start of the file (before the first line with one), and each open
//! logs a warning with how many were replayed unverified; what is appended to such a journal
//! carries checksums. Such a line must have exactly the fields `seq`, `unix_ms` and `record`,
//! so a checksum field mangled into another key is not taken for one. Read-only readers
//! ([`load`], [`read_records`], [`parse_records`]: `mx journal`, the harness) accept them with
//! the warning: they act on nothing.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use mx_layout::{strict_json, JsonError};
use serde::{Deserialize, Serialize};

use crate::limits::{MAX_BATCH_BYTES, MAX_JOURNAL_LINE_BYTES};
use crate::snapshot::Snapshot;
use crate::state::{Record, State};
use crate::Error;

/// Whether lines without a checksum (written before lines had one, or stripped) are replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unchecked {
    /// Refuse the journal at the first such line, naming it (a control plane's default).
    Refuse,
    /// Replay them when they lead the file, with a warning.
    Accept,
}

/// Largest incomplete last line taken for a torn write, in bytes: one group-commit batch
/// ([`MAX_BATCH_BYTES`]) plus one line ([`MAX_JOURNAL_LINE_BYTES`]), all that a crash can leave
/// unsynced.
pub const MAX_TORN_BYTES: usize = MAX_BATCH_BYTES + MAX_JOURNAL_LINE_BYTES;

/// What precedes a line's checksum: `,"crc32":"`.
const CRC_KEY: &[u8] = b",\"crc32\":\"";
/// Bytes from the checksum key to the end of the line (newline excluded): key, 8 hex, `"}`.
const CRC_TAIL: usize = CRC_KEY.len() + 8 + 2;

/// One journal line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Sequence number, 1-based, one per line.
    pub seq: u64,
    /// Wall-clock time it was written, milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// The mutating call.
    pub record: Record,
}

/// A line written before lines carried checksums: these fields and no other.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LegacyEntry {
    seq: u64,
    unix_ms: u64,
    record: Record,
}

/// An incomplete last record cut off the journal by [`Journal::open`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    /// The sequence number the record would have had.
    pub seq: u64,
    /// Its length in bytes.
    pub bytes: u64,
    /// Where its bytes were saved (`<journal>.torn-<unix_ms>`).
    pub saved_to: PathBuf,
}

/// The parsed contents of a journal file.
struct Parsed {
    entries: Vec<Entry>,
    /// Byte length of the well-formed prefix (everything but a torn last line).
    good_len: u64,
    /// Lines without a checksum (at the start of the file).
    unverified: usize,
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::JournalIo {
        path: path.to_path_buf(),
        what,
        source,
    }
}

/// The body (the bytes the checksum covers) and the stored checksum of a line that ends with a
/// checksum field; `None` when it does not. `Some(Err)` when the field is there but not hex.
pub(crate) fn split_checksum(line: &[u8]) -> Option<(&[u8], Result<u32, String>)> {
    let n = line.len();
    if n < CRC_TAIL || !line.ends_with(b"\"}") {
        return None;
    }
    let body_end = n - CRC_TAIL;
    if &line[body_end..body_end + CRC_KEY.len()] != CRC_KEY {
        return None;
    }
    let hex = &line[body_end + CRC_KEY.len()..n - 2];
    let lower_hex = hex
        .iter()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b));
    let stored = std::str::from_utf8(hex)
        .ok()
        .filter(|_| lower_hex)
        .and_then(|s| u32::from_str_radix(s, 16).ok())
        .ok_or_else(|| {
            format!(
                "checksum {:?} is not 8 lowercase hex digits",
                String::from_utf8_lossy(hex)
            )
        });
    Some((&line[..body_end], stored))
}

/// Why a record of the retired commit path is refused.
fn retired_reason(op: &str) -> String {
    format!(
        "record `{op}` of the retired {} RPC: versions are committed only by refits now, so a journal from before cannot be replayed (start the control plane on a new journal)",
        if op == "commit" { "Commit" } else { "ReportApplied" }
    )
}

/// Why a line that is not JSON of a record was refused. Parsing is strict: a key repeated in
/// any object of the line (also after unescaping) is refused, naming it.
fn json_reason(line: &[u8], e: &JsonError) -> String {
    if let JsonError::DuplicateKey { key, path } = e {
        return format!("duplicate key {key:?} in the JSON object at {path}");
    }
    retired_op(line).map_or_else(|| e.to_string(), retired_reason)
}

/// Decodes one complete line (newline excluded) expected to hold record `want`. Returns the
/// entry and whether it carried a checksum, or why it is corrupt. `first_checked` is the first
/// earlier line with a checksum.
fn decode_line(
    line: &[u8],
    (lo, want): (u64, u64),
    first_checked: Option<usize>,
    unchecked: Unchecked,
) -> Result<(Entry, bool), String> {
    let (entry, checked) = match split_checksum(line) {
        Some((body, stored)) => {
            let stored = stored?;
            let computed = crc32fast::hash(body);
            if stored != computed {
                return Err(format!(
                    "checksum mismatch in record seq {want}: the line says {stored:08x}, its bytes hash to {computed:08x} (the line changed on disk)"
                ));
            }
            let e: Entry = strict_json::from_slice(line).map_err(|e| json_reason(line, &e))?;
            (e, true)
        }
        None => {
            if let Some(k) = first_checked {
                if let Some(op) = retired_op(line) {
                    return Err(retired_reason(op));
                }
                return Err(format!(
                    "record seq {want} has no checksum, but line {k} had one: its checksum field was damaged"
                ));
            }
            if unchecked == Unchecked::Refuse {
                if let Some(op) = retired_op(line) {
                    return Err(retired_reason(op));
                }
                return Err(format!(
                    "record seq {want} has no checksum: a line written before lines had one, or one whose checksum was stripped (its bytes cannot be verified). Start the control plane with --accept-unchecked-journal-lines only if this journal predates checksums"
                ));
            }
            let e: LegacyEntry =
                strict_json::from_slice(line).map_err(|e| json_reason(line, &e))?;
            let e = Entry {
                seq: e.seq,
                unix_ms: e.unix_ms,
                record: e.record,
            };
            (e, false)
        }
    };
    if lo == want && entry.seq != want {
        return Err(format!(
            "sequence number {} where {want} was expected",
            entry.seq
        ));
    }
    if !(lo..=want).contains(&entry.seq) {
        return Err(format!(
            "sequence number {} where {lo}..={want} was expected (the snapshot ends at seq {})",
            entry.seq,
            want - 1
        ));
    }
    Ok((entry, checked))
}

/// Why an incomplete last line (`tail`, no newline) cannot be a torn write of record
/// `next_seq`; `None` when it can.
fn not_torn(tail: &[u8], next_seq: u64) -> Option<String> {
    if tail.len() > MAX_TORN_BYTES {
        return Some(format!(
            "an incomplete last line of {} bytes, more than a crash can leave unsynced ({MAX_TORN_BYTES})",
            tail.len()
        ));
    }
    // NUL bytes at the end: a file extended before its data landed.
    let data = &tail[..tail.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1)];
    if data.len() > MAX_JOURNAL_LINE_BYTES {
        return Some(format!(
            "an incomplete last line of {} bytes, longer than any record ({MAX_JOURNAL_LINE_BYTES})",
            data.len()
        ));
    }
    let head = format!("{{\"seq\":{next_seq},\"unix_ms\":");
    let n = data.len().min(head.len());
    if data[..n] != head.as_bytes()[..n] {
        let shown = String::from_utf8_lossy(&data[..data.len().min(40)]);
        return Some(format!(
            "an incomplete last line that does not start record seq {next_seq} ({shown:?}): not a write torn by a crash"
        ));
    }
    None
}

/// Parses journal `bytes` whose first record has a sequence number in `1..=first_max` (1 without
/// a snapshot; the snapshot's seq + 1 with one, or lower when a crash interrupted a compaction
/// before it truncated the journal); each next one is the previous plus 1.
fn parse(path: &Path, bytes: &[u8], first_max: u64, unchecked: Unchecked) -> Result<Parsed, Error> {
    let mut entries: Vec<Entry> = Vec::new();
    let mut pos = 0usize;
    let mut line_no = 0usize;
    let mut first_checked = None;
    let mut unverified = 0usize;
    while pos < bytes.len() {
        line_no += 1;
        let rest = &bytes[pos..];
        let corrupt = |reason: String| Error::JournalCorrupt {
            path: path.to_path_buf(),
            line: line_no,
            reason,
        };
        let (lo, want) = match entries.last().map(|e| e.seq.checked_add(1)) {
            Some(Some(next)) => (next, next),
            Some(None) => {
                return Err(corrupt(
                    "the previous sequence number is the largest".into(),
                ))
            }
            None => (1, first_max.max(1)),
        };
        let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
            if let Some(reason) = not_torn(rest, want) {
                return Err(corrupt(reason));
            }
            break;
        };
        let (entry, checked) =
            decode_line(&rest[..nl], (lo, want), first_checked, unchecked).map_err(corrupt)?;
        if checked {
            first_checked.get_or_insert(line_no);
        } else {
            unverified += 1;
        }
        entries.push(entry);
        pos += nl + 1;
    }
    if unverified > 0 {
        tracing::warn!(
            path = %path.display(),
            lines = unverified,
            "journal lines 1..={unverified} carry no checksum (written before lines had one): replayed unverified"
        );
    }
    Ok(Parsed {
        entries,
        good_len: pos as u64,
        unverified,
    })
}

/// The `op` of a line's record when it is one of the retired commit path (`commit`, `applied`).
fn retired_op(line: &[u8]) -> Option<&'static str> {
    let v: serde_json::Value = serde_json::from_slice(line).ok()?;
    match v.get("record")?.get("op")?.as_str()? {
        "commit" => Some("commit"),
        "applied" => Some("applied"),
        _ => None,
    }
}

/// What a journal holds on disk: its snapshot, if any, and the records after it.
#[derive(Debug)]
pub struct Loaded {
    /// The snapshot ([`crate::snapshot`]): the state after its `seq`.
    pub snapshot: Option<Snapshot>,
    /// The journal's records after the snapshot, in order.
    pub entries: Vec<Entry>,
    /// Lines at the start of the journal file that the snapshot already includes (left by a
    /// compaction that a crash interrupted before it truncated the journal), verified and
    /// skipped.
    pub skipped: usize,
}

impl Loaded {
    /// The sequence number of the last record (snapshot included); 0 for an empty journal.
    pub fn last_seq(&self) -> u64 {
        self.entries
            .last()
            .map(|e| e.seq)
            .or(self.snapshot.as_ref().map(|s| s.seq))
            .unwrap_or(0)
    }

    /// Replays the records onto the snapshot's state (or a fresh one), as the control plane
    /// does when it starts.
    ///
    /// # Errors
    /// [`Error::Replay`] naming the 1-based line (of the journal at `path`) whose record the
    /// state machine refuses.
    pub fn replay(self, path: &Path) -> Result<State, Error> {
        let state = self.snapshot.map(|s| s.state).unwrap_or_default();
        replay_onto(path, state, self.entries, self.skipped)
    }
}

/// Splits parsed entries into those the snapshot at `base` includes and those after it.
fn after_snapshot(entries: Vec<Entry>, base: u64) -> (Vec<Entry>, usize) {
    let skipped = entries.iter().take_while(|e| e.seq <= base).count();
    (entries.into_iter().skip(skipped).collect(), skipped)
}

/// The snapshot of the journal at `path` and the largest sequence number its first line may
/// have (the snapshot's seq + 1; 1 without a snapshot).
fn snapshot_and_first(path: &Path) -> Result<(Option<Snapshot>, u64), Error> {
    let snapshot = crate::snapshot::read(path)?;
    let first_max = match &snapshot {
        None => 1,
        Some(s) => s.seq.checked_add(1).ok_or_else(|| Error::SnapshotCorrupt {
            path: crate::snapshot::snapshot_path(path),
            reason: format!("field `seq`: {} leaves no next sequence number", s.seq),
        })?,
    };
    Ok((snapshot, first_max))
}

/// Reads and verifies the journal at `path` and its snapshot, without changing either (for
/// `mx journal`, the harness and replay). A missing journal reads as empty; a torn last record
/// (see the module docs) is left out with a warning.
///
/// # Errors
/// [`Error::JournalIo`] when a file cannot be read; [`Error::SnapshotCorrupt`] for a bad
/// snapshot; [`Error::JournalCorrupt`] naming the 1-based line of the first bad line.
pub fn load(path: &Path) -> Result<Loaded, Error> {
    let (snapshot, first_max) = snapshot_and_first(path)?;
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(io_err(path, "read")(e)),
    };
    let parsed = parse(path, &bytes, first_max, Unchecked::Accept)?;
    if parsed.good_len < bytes.len() as u64 {
        tracing::warn!(
            path = %path.display(),
            bytes = bytes.len() as u64 - parsed.good_len,
            "the journal ends in an incomplete record (a write torn by a crash, never acknowledged): left out"
        );
    }
    let (entries, skipped) = after_snapshot(parsed.entries, first_max - 1);
    Ok(Loaded {
        snapshot,
        entries,
        skipped,
    })
}

/// The state the journal at `path` (and its snapshot) replays to, without changing either.
///
/// # Errors
/// As [`load`] and [`Loaded::replay`].
pub fn load_state(path: &Path) -> Result<State, Error> {
    load(path)?.replay(path)
}

/// Reads and verifies the entries of the journal at `path` after its snapshot (every entry when
/// there is none), as [`load`] does.
///
/// # Errors
/// As [`load`].
pub fn read_records(path: &Path) -> Result<Vec<Entry>, Error> {
    load(path).map(|l| l.entries)
}

/// Parses and verifies journal `bytes` as [`read_records`] does a file's (`path` only names them
/// in errors): every line checked, a torn last record left out.
///
/// # Errors
/// [`Error::JournalCorrupt`] naming the 1-based line of the first bad line.
pub fn parse_records(path: &Path, bytes: &[u8]) -> Result<Vec<Entry>, Error> {
    parse(path, bytes, 1, Unchecked::Accept).map(|p| p.entries)
}

/// [`parse_records`] for the journal that follows a snapshot at `snapshot_seq`: returns the
/// entries after it (the first line may repeat records the snapshot includes, as a compaction
/// interrupted before its truncation leaves them).
///
/// # Errors
/// [`Error::JournalCorrupt`] naming the 1-based line of the first bad line.
pub fn parse_records_after(
    path: &Path,
    bytes: &[u8],
    snapshot_seq: u64,
) -> Result<Vec<Entry>, Error> {
    let first_max = snapshot_seq.saturating_add(1);
    parse(path, bytes, first_max, Unchecked::Accept)
        .map(|p| after_snapshot(p.entries, first_max - 1).0)
}

/// Replays `entries` into a fresh [`State`], as the control plane does when it starts.
///
/// # Errors
/// [`Error::Replay`] naming the 1-based line (of the journal at `path`) whose record the state
/// machine refuses.
pub fn replay(path: &Path, entries: impl IntoIterator<Item = Entry>) -> Result<State, Error> {
    replay_onto(path, State::new(), entries, 0)
}

/// Replays `entries`, the journal's lines after its first `skipped`, onto `state`.
fn replay_onto(
    path: &Path,
    mut state: State,
    entries: impl IntoIterator<Item = Entry>,
    skipped: usize,
) -> Result<State, Error> {
    for (i, e) in entries.into_iter().enumerate() {
        state.apply(e.record).map_err(|source| Error::Replay {
            path: path.to_path_buf(),
            line: skipped + i + 1,
            source: Box::new(source),
        })?;
    }
    Ok(state)
}

/// Saves a torn tail (the bytes after `parsed`'s well-formed prefix) beside the journal and cuts
/// it off `file`; `next_seq` is the record it would have been.
fn cut_torn(
    path: &Path,
    file: &mut File,
    bytes: &[u8],
    parsed: &Parsed,
    next_seq: u64,
) -> Result<Option<TornTail>, Error> {
    let good = usize::try_from(parsed.good_len).unwrap_or(bytes.len());
    let Some(tail) = bytes.get(good..).filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    let saved_to = save_torn(path, tail)?;
    tracing::error!(
        path = %path.display(),
        seq = next_seq,
        bytes = tail.len(),
        saved_to = %saved_to.display(),
        "the journal ends in an incomplete record seq {next_seq} ({} bytes, no newline): a write torn by a crash, never acknowledged; cut off and kept in {}. If no crash happened, the journal was shortened (records from seq {next_seq} on are gone)",
        tail.len(),
        saved_to.display()
    );
    file.set_len(parsed.good_len)
        .map_err(io_err(path, "truncate torn line"))?;
    file.sync_data().map_err(io_err(path, "fsync"))?;
    Ok(Some(TornTail {
        seq: next_seq,
        bytes: tail.len() as u64,
        saved_to,
    }))
}

/// Saves a torn tail beside the journal, as `<journal>.torn-<unix_ms>` (a numbered suffix when
/// that exists), synced with its directory entry. Returns its path.
fn save_torn(path: &Path, tail: &[u8]) -> Result<PathBuf, Error> {
    let name = path
        .file_name()
        .map_or_else(|| "journal".into(), |n| n.to_string_lossy().into_owned());
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    for n in 0u32.. {
        let side = path.with_file_name(match n {
            0 => format!("{name}.torn-{ms}"),
            n => format!("{name}.torn-{ms}-{n}"),
        });
        let mut f = match OpenOptions::new().write(true).create_new(true).open(&side) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => continue,
            Err(e) => return Err(io_err(path, "create the torn-record side file")(e)),
        };
        f.write_all(tail)
            .and_then(|()| f.sync_all())
            .map_err(io_err(path, "write the torn-record side file"))?;
        sync_parent(&side)?;
        return Ok(side);
    }
    Err(io_err(path, "create the torn-record side file")(
        std::io::Error::from(std::io::ErrorKind::AlreadyExists),
    ))
}

/// Where a journal's lines go: a local file (one machine), or an append-once log in etcd
/// written by the leader of the control-plane replicas ([`crate::ha`]).
enum Store {
    File(File),
    Etcd {
        leadership: std::sync::Arc<crate::ha::Leadership>,
        prefix: String,
        /// Where manifests and snapshots go instead of etcd ([`crate::blobs`]).
        blobs: Option<crate::blobs::BlobStore>,
        /// The runtime the etcd calls run on (the journal thread is not one of its threads).
        rt: tokio::runtime::Handle,
        /// The next log entry's sequence number (an entry holds one or more whole lines).
        next_entry: u64,
    },
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Store::File(file) => write!(f, "File({file:?})"),
            Store::Etcd {
                leadership,
                prefix,
                next_entry,
                ..
            } => write!(f, "Etcd({leadership:?}, {prefix}, next entry {next_entry})"),
        }
    }
}

/// An open journal, positioned to append.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: Store,
    next_seq: u64,
    bytes: u64,
    torn: Option<TornTail>,
    unverified: usize,
    /// The sequence number of the snapshot the journal follows (0: none).
    base: u64,
}

/// What [`Journal::compact`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compacted {
    /// The snapshot's sequence number (the journal's last record).
    pub seq: u64,
    /// Size of the snapshot file in bytes.
    pub snapshot_bytes: u64,
    /// Size of the journal before it was truncated, in bytes.
    pub journal_bytes: u64,
}

/// Why [`Journal::compact`] failed, and what that leaves.
#[derive(Debug)]
pub enum CompactFailure {
    /// Before the snapshot was renamed into place: nothing changed (the journal is whole and
    /// goes on; the previous snapshot, if any, stands).
    Snapshot(Error),
    /// Truncating the journal after the snapshot was in place failed: the file may or may not
    /// be truncated on disk, so nothing more may be appended (both states replay correctly at
    /// the next open).
    Truncate(Error),
}

impl std::fmt::Display for CompactFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CompactFailure::Snapshot(e) => write!(f, "snapshot not taken: {e}"),
            CompactFailure::Truncate(e) => write!(f, "journal not truncated: {e}"),
        }
    }
}

impl Journal {
    /// Opens (creating if needed) the journal at `path`, verifies it and returns it with its
    /// entries after its snapshot (every entry when there is none: use [`Journal::recover`] for
    /// the snapshot too). A torn last record (see the module docs) is saved beside the journal
    /// and cut off, so the next append starts on a fresh line ([`Journal::torn`] says so).
    ///
    /// # Errors
    /// As [`Journal::recover`].
    pub fn open(path: &Path) -> Result<(Journal, Vec<Entry>), Error> {
        Journal::recover(path).map(|(j, l)| (j, l.entries))
    }

    /// Opens (creating if needed) the journal at `path` and its snapshot, verifies both and
    /// returns the journal with what it holds. Finishes a compaction a crash interrupted
    /// ([`crate::snapshot`]): removes a temporary snapshot never renamed, and truncates a
    /// journal whose records the snapshot all includes. A torn last record is cut off as
    /// [`Journal::open`] says.
    ///
    /// # Errors
    /// [`Error::JournalIo`] on I/O failures or when another process holds the journal's lock;
    /// [`Error::SnapshotCorrupt`] for a bad snapshot; [`Error::JournalCorrupt`] naming a bad
    /// line (nothing is cut then).
    pub fn recover(path: &Path) -> Result<(Journal, Loaded), Error> {
        Journal::recover_with(path, Unchecked::Refuse)
    }

    /// [`Journal::recover`], replaying lines without a checksum as `unchecked` says.
    ///
    /// # Errors
    /// As [`Journal::recover`].
    pub fn recover_with(path: &Path, unchecked: Unchecked) -> Result<(Journal, Loaded), Error> {
        let existed = path.exists();
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .map_err(io_err(path, "open"))?;
        if !existed {
            sync_parent(path)?;
        }
        // One control plane per journal: a second writer would interleave sequence numbers.
        if let Err(e) = file.try_lock() {
            return Err(Error::JournalIo {
                path: path.to_path_buf(),
                what: "lock (another control plane is using this journal)",
                source: match e {
                    std::fs::TryLockError::Error(io) => io,
                    std::fs::TryLockError::WouldBlock => {
                        std::io::Error::from(std::io::ErrorKind::WouldBlock)
                    }
                },
            });
        }
        crate::snapshot::remove_temp(path)?;
        let (snapshot, first_max) = snapshot_and_first(path)?;
        let base = first_max - 1;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io_err(path, "read"))?;
        let parsed = parse(path, &bytes, first_max, unchecked)?;
        let last = parsed.entries.last().map_or(base, |e| e.seq).max(base);
        let next_seq = last.checked_add(1).ok_or_else(|| Error::JournalCorrupt {
            path: path.to_path_buf(),
            line: parsed.entries.len(),
            reason: "the last sequence number leaves no next one".into(),
        })?;
        let torn = cut_torn(path, &mut file, &bytes, &parsed, next_seq)?;
        let mut size = parsed.good_len;
        let unverified = parsed.unverified;
        let (entries, mut skipped) = after_snapshot(parsed.entries, base);
        if skipped > 0 && entries.is_empty() {
            // A compaction renamed its snapshot, then the process died before truncating.
            tracing::warn!(
                path = %path.display(),
                records = skipped,
                snapshot_seq = base,
                "every journal record is in the snapshot (a compaction interrupted before its truncation): truncating the journal"
            );
            file.set_len(0)
                .and_then(|()| file.sync_data())
                .map_err(io_err(path, "truncate after snapshot"))?;
            size = 0;
            skipped = 0;
        }
        let journal = Journal {
            path: path.to_path_buf(),
            file: Store::File(file),
            next_seq,
            bytes: size,
            torn,
            unverified,
            base,
        };
        let loaded = Loaded {
            snapshot,
            entries,
            skipped,
        };
        Ok((journal, loaded))
    }

    /// Opens the journal kept in etcd under `prefix` by the leader `leadership`: reads and
    /// verifies it as [`load_etcd`] does and returns it with what it holds. `rt` runs the etcd
    /// calls of [`Journal::write_synced`] and [`Journal::install_snapshot`].
    ///
    /// # Errors
    /// As [`load_etcd`].
    pub async fn open_etcd(
        cfg: &crate::ha::EtcdConfig,
        leadership: std::sync::Arc<crate::ha::Leadership>,
        prefix: &str,
        rt: tokio::runtime::Handle,
        unchecked: Unchecked,
    ) -> Result<(Journal, Loaded), Error> {
        let r = read_etcd(cfg, prefix, unchecked).await?;
        let journal = Journal {
            path: r.path,
            file: Store::Etcd {
                leadership,
                prefix: prefix.to_string(),
                blobs: cfg.blobs.clone(),
                rt,
                next_entry: r.next_entry,
            },
            next_seq: r.next_seq,
            bytes: r.bytes,
            torn: None,
            unverified: r.unverified,
            base: r.base,
        };
        Ok((journal, r.loaded))
    }

    /// Appends `record` as one line and syncs it to disk before returning.
    ///
    /// # Errors
    /// As [`Journal::encode`] and [`Journal::write_synced`] (the state must then not change).
    pub fn append(&mut self, record: &Record) -> Result<u64, Error> {
        let offloaded = match &self.file {
            Store::Etcd {
                blobs: Some(b), rt, ..
            } => rt.block_on(b.offload(record))?,
            _ => None,
        };
        let mut buf = Vec::new();
        let seq = self.encode(offloaded.as_ref().unwrap_or(record), &mut buf)?;
        self.write_synced(&buf)?;
        Ok(seq)
    }

    /// Encodes `record` as the next line, checksum and newline included (taking the next
    /// sequence number), onto `buf`, without writing it: a group commit encodes every record of
    /// a batch, then writes and syncs them all at once with [`Journal::write_synced`]. Returns
    /// the record's sequence number.
    ///
    /// # Errors
    /// [`Error::JournalIo`] (`encode`) when the record cannot be serialized;
    /// [`Error::Config`] naming the object when a manifest cannot be stored in the blob store
    /// of a journal in etcd; [`Error::InvalidField`] (`record`) when its line would exceed
    /// [`MAX_JOURNAL_LINE_BYTES`]. The sequence number is not consumed and `buf` is unchanged
    /// then.
    pub fn encode(&mut self, record: &Record, buf: &mut Vec<u8>) -> Result<u64, Error> {
        // A journal in etcd with a blob store holds manifests by reference: the caller stores
        // them first ([`crate::blobs::BlobStore::offload`]), never under the state lock.
        if let (
            Store::Etcd { blobs: Some(_), .. },
            Record::Publish { label, .. } | Record::Peer { label, .. },
        ) = (&self.file, record)
        {
            return Err(Error::InvalidField {
                field: "record".into(),
                reason: format!(
                    "a manifest of {label} journaled whole into a journal whose manifests go to a blob store"
                ),
            });
        }
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        #[derive(Serialize)]
        struct EntryRef<'a> {
            seq: u64,
            unix_ms: u64,
            record: &'a Record,
        }
        let start = buf.len();
        let encoded = serde_json::to_writer(
            &mut *buf,
            &EntryRef {
                seq: self.next_seq,
                unix_ms,
                record,
            },
        );
        // A struct serializes as one object: drop its closing brace to add the checksum.
        if let Err(e) = encoded
            .map_err(std::io::Error::other)
            .and_then(|()| match buf.pop() {
                Some(b'}') => Ok(()),
                _ => Err(std::io::Error::other(
                    "an entry did not encode as an object",
                )),
            })
        {
            buf.truncate(start);
            return Err(Error::JournalIo {
                path: self.path.clone(),
                what: "encode",
                source: e,
            });
        }
        let crc = crc32fast::hash(&buf[start..]);
        buf.extend_from_slice(CRC_KEY);
        buf.extend_from_slice(format!("{crc:08x}\"}}\n").as_bytes());
        let line = buf.len() - start;
        if line > MAX_JOURNAL_LINE_BYTES {
            buf.truncate(start);
            return Err(Error::InvalidField {
                field: "record".into(),
                reason: format!(
                    "its journal line would be {line} bytes, over the limit of {MAX_JOURNAL_LINE_BYTES}"
                ),
            });
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        Ok(seq)
    }

    /// Writes lines made by [`Journal::encode`] and syncs them to disk (one `fdatasync` for the
    /// whole batch) before returning.
    ///
    /// # Errors
    /// [`Error::JournalIo`] when writing or syncing fails. The file may then hold part of the
    /// batch (a torn last line is cut off at the next open); the caller must not act on any
    /// record of the batch.
    pub fn write_synced(&mut self, lines: &[u8]) -> Result<(), Error> {
        if lines.is_empty() {
            return Ok(());
        }
        match &mut self.file {
            Store::File(file) => {
                file.write_all(lines).map_err(io_err(&self.path, "write"))?;
                file.sync_data().map_err(io_err(&self.path, "fsync"))?;
            }
            Store::Etcd {
                leadership,
                prefix,
                rt,
                next_entry,
                ..
            } => {
                // Whole lines per entry, each entry at most one etcd request.
                for chunk in whole_lines(lines, crate::ha::MAX_ENTRY_BYTES) {
                    rt.block_on(leadership.append(prefix, *next_entry, chunk.to_vec()))?;
                    *next_entry += 1;
                }
            }
        }
        self.bytes += lines.len() as u64;
        Ok(())
    }

    /// Takes a snapshot of `state`, which must be the state after every record appended so far,
    /// and truncates the journal ([`crate::snapshot`] says in what order and why a crash at any
    /// point loses nothing). Sequence numbers go on from the snapshot's.
    ///
    /// # Errors
    /// [`CompactFailure::Snapshot`] when the snapshot could not be written (nothing changed;
    /// in etcd, the journal goes on whole or from the snapshot, as its head says);
    /// [`CompactFailure::Truncate`] when the journal could not be truncated after it.
    pub fn compact(&mut self, state: &State) -> Result<Compacted, CompactFailure> {
        let seq = self.len();
        let bytes = crate::snapshot::encode(&self.path, seq, crate::refit::now_ms(), state)
            .map_err(CompactFailure::Snapshot)?;
        self.install_snapshot(seq, &bytes)
    }

    /// [`Journal::compact`] with the snapshot already encoded ([`crate::snapshot::encode`]) at
    /// `seq`, which must be the journal's last sequence number ([`Journal::len`]).
    ///
    /// # Errors
    /// As [`Journal::compact`]; [`CompactFailure::Snapshot`] also when `seq` is not the last.
    pub fn install_snapshot(
        &mut self,
        seq: u64,
        snapshot: &[u8],
    ) -> Result<Compacted, CompactFailure> {
        if seq != self.next_seq - 1 {
            return Err(CompactFailure::Snapshot(Error::InvalidField {
                field: "seq".into(),
                reason: format!(
                    "a snapshot at seq {seq}, but the journal's last record is {}",
                    self.next_seq - 1
                ),
            }));
        }
        let file = match &mut self.file {
            Store::File(file) => file,
            Store::Etcd {
                leadership,
                prefix,
                blobs,
                rt,
                next_entry,
            } => {
                // One fenced transaction switches to the snapshot and deletes what it holds;
                // whether or not a failed one applied, the log goes on from `next_entry`.
                rt.block_on(async {
                    let stored = match blobs {
                        Some(b) => Some(b.put("snapshots", snapshot.to_vec()).await?),
                        None => None,
                    };
                    let body = match &stored {
                        Some(r) => crate::ha::SnapshotBody::Blob(r),
                        None => crate::ha::SnapshotBody::Bytes(snapshot),
                    };
                    leadership
                        .install_snapshot(prefix, seq, *next_entry, body)
                        .await
                })
                .map_err(CompactFailure::Snapshot)?;
                let journal_bytes = self.bytes;
                self.bytes = 0;
                self.base = seq;
                return Ok(Compacted {
                    seq,
                    snapshot_bytes: snapshot.len() as u64,
                    journal_bytes,
                });
            }
        };
        crate::snapshot::write_atomic(&self.path, snapshot).map_err(CompactFailure::Snapshot)?;
        let journal_bytes = self.bytes;
        file.set_len(0)
            .and_then(|()| file.sync_data())
            .map_err(|e| {
                CompactFailure::Truncate(io_err(&self.path, "truncate after snapshot")(e))
            })?;
        self.bytes = 0;
        self.base = seq;
        Ok(Compacted {
            seq,
            snapshot_bytes: snapshot.len() as u64,
            journal_bytes,
        })
    }

    /// The sequence number of the snapshot the journal follows (0: none).
    pub fn snapshot_seq(&self) -> u64 {
        self.base
    }

    /// Records in the journal after its snapshot (every record when there is none).
    pub fn records_since_snapshot(&self) -> u64 {
        self.next_seq - 1 - self.base
    }

    /// The blob store manifests go to, for a journal in etcd that has one.
    pub fn blobs(&self) -> Option<&crate::blobs::BlobStore> {
        match &self.file {
            Store::Etcd { blobs, .. } => blobs.as_ref(),
            Store::File(_) => None,
        }
    }

    /// True for a journal kept in etcd.
    pub fn in_etcd(&self) -> bool {
        matches!(self.file, Store::Etcd { .. })
    }

    /// True when [`Journal::compact`] can compact this journal (a file, or a log in etcd).
    pub fn compactable(&self) -> bool {
        matches!(self.file, Store::File(_) | Store::Etcd { .. })
    }

    /// Path of the journal file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The sequence number of the last record (the number of records ever appended, those a
    /// snapshot compacted included).
    pub fn len(&self) -> u64 {
        self.next_seq - 1
    }

    /// True when the journal has no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size of the journal in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.bytes
    }

    /// The torn last record [`Journal::open`] cut off, if it did.
    pub fn torn(&self) -> Option<&TornTail> {
        self.torn.as_ref()
    }

    /// How many lines at the start were written before lines carried checksums (replayed
    /// unverified).
    pub fn unverified_lines(&self) -> usize {
        self.unverified
    }
}

/// A journal in etcd as read: what it holds, and where its writer goes on.
struct EtcdRead {
    path: PathBuf,
    loaded: Loaded,
    next_entry: u64,
    next_seq: u64,
    bytes: u64,
    unverified: usize,
    base: u64,
}

/// Reads and verifies the journal kept in etcd under `prefix` without writing anything (for
/// `mx-lab validate --ha` and tools): its snapshot, if it has one, and every log entry after it (as
/// [`Journal::recover`] does a file; there is no torn tail, an entry is written whole or not at
/// all), manifests journaled by reference read back from `cfg.blobs` and verified.
///
/// # Errors
/// [`Error::Config`] when etcd or the blob store cannot be reached, or the journal holds
/// references and `cfg.blobs` is `None`; [`Error::SnapshotCorrupt`] for a bad snapshot;
/// [`Error::JournalCorrupt`] naming a bad line (or a manifest that cannot be read back);
/// [`Error::InvalidField`] for a gap in the log or a log that does not start where its
/// snapshot says.
pub async fn load_etcd(cfg: &crate::ha::EtcdConfig, prefix: &str) -> Result<Loaded, Error> {
    read_etcd(cfg, prefix, Unchecked::Accept)
        .await
        .map(|r| r.loaded)
}

async fn read_etcd(
    cfg: &crate::ha::EtcdConfig,
    prefix: &str,
    unchecked: Unchecked,
) -> Result<EtcdRead, Error> {
    let log = crate::ha::read_journal(cfg, prefix).await?;
    let path = PathBuf::from(format!("etcd:{prefix}"));
    let blobs = cfg.blobs.clone();
    let no_store = |what: &str| {
        Error::Config {
        what: format!("journal {}", path.display()),
        reason: format!(
            "it holds {what} in a blob store, and this replica has none (mx control --manifest-store)"
        ),
    }
    };
    let snapshot = match &log.snapshot {
        None => None,
        Some((head, bytes)) => {
            let fetched;
            let bytes = match (&head.blob, &blobs) {
                (None, _) => bytes,
                (Some(r), Some(b)) => {
                    fetched = b.get("snapshots", r).await?;
                    &fetched
                }
                (Some(_), None) => return Err(no_store("its snapshot")),
            };
            let s = crate::snapshot::decode(&path, bytes)?;
            if s.seq != head.seq {
                return Err(Error::SnapshotCorrupt {
                    path,
                    reason: format!(
                        "the head names seq {}, the snapshot holds seq {}",
                        head.seq, s.seq
                    ),
                });
            }
            Some(s)
        }
    };
    let base = snapshot.as_ref().map_or(0, |s| s.seq);
    let next_entry = log
        .entries
        .last()
        .map(|(entry, _)| entry + 1)
        .or(log.snapshot.as_ref().map(|(h, _)| h.first_entry))
        .unwrap_or(1);
    let bytes: Vec<u8> = log.entries.into_iter().flat_map(|(_, b)| b).collect();
    let parsed = parse(&path, &bytes, base + 1, unchecked)?;
    if parsed.good_len != bytes.len() as u64 {
        return Err(Error::JournalCorrupt {
            path,
            line: parsed.entries.len() + 1,
            reason: "an entry ends inside a line (entries hold whole lines)".into(),
        });
    }
    let next_seq = parsed.entries.last().map_or(base, |e| e.seq).max(base) + 1;
    let unverified = parsed.unverified;
    let (read, skipped) = after_snapshot(parsed.entries, base);
    // Manifests journaled by reference are read back (and verified) before replay.
    let mut entries = Vec::with_capacity(read.len());
    for (i, mut e) in read.into_iter().enumerate() {
        if matches!(e.record, Record::PublishRef { .. } | Record::PeerRef { .. }) {
            let b = blobs.as_ref().ok_or_else(|| no_store("manifests"))?;
            e.record = b
                .resolve(e.record)
                .await
                .map_err(|err| Error::JournalCorrupt {
                    path: path.clone(),
                    line: skipped + i + 1,
                    reason: err.to_string(),
                })?;
        }
        entries.push(e);
    }
    Ok(EtcdRead {
        path,
        loaded: Loaded {
            snapshot,
            entries,
            skipped,
        },
        next_entry,
        next_seq,
        bytes: parsed.good_len,
        unverified,
        base,
    })
}

/// `lines` cut after a newline into pieces of at most `max` bytes where the lines allow (a
/// single longer line is one piece of its own).
fn whole_lines(lines: &[u8], max: usize) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < lines.len() {
        let window = &lines[start..lines.len().min(start.saturating_add(max))];
        let end = match window.iter().rposition(|b| *b == b'\n') {
            Some(i) if start + window.len() < lines.len() => start + i + 1,
            _ if start + window.len() == lines.len() => lines.len(),
            // One line longer than `max`: up to its newline.
            _ => lines[start..]
                .iter()
                .position(|b| *b == b'\n')
                .map_or(lines.len(), |i| start + i + 1),
        };
        out.push(&lines[start..end]);
        start = end;
    }
    out
}

/// Makes a newly created journal file's directory entry durable.
fn sync_parent(path: &Path) -> Result<(), Error> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    // Directories can be opened read-only and fsynced on Unix; elsewhere this is best effort.
    match File::open(dir) {
        Ok(d) => d.sync_all().or_else(|e| {
            if cfg!(unix) {
                Err(io_err(path, "fsync directory")(e))
            } else {
                Ok(())
            }
        }),
        Err(e) if cfg!(unix) => Err(io_err(path, "open directory")(e)),
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose
#[path = "journal_tests.rs"]
mod tests;
