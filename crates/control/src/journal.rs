//! The durable local store: an append-only file of JSON lines, one [`Entry`] per accepted
//! mutating call, each written and `fsync`ed (`File::sync_data`) before the state changes.
//!
//! # Line format
//! `{"seq":7,"unix_ms":1718000000000,"record":{"op":"publish",...},"crc32":"0a1b2c3d"}` and a
//! newline. `seq` counts lines from 1 (so a line's seq is its line number); `crc32` is the CRC-32
//! (IEEE 802.3, zlib's `crc32`) of the line's bytes before `,"crc32":"`, as 8 lowercase hex
//! digits. Each line is still one JSON object (readable by `jq`).
//!
//! # Replay fails loudly
//! [`read_records`] and [`Journal::open`] verify every line. The first bad one is an
//! [`Error::JournalCorrupt`] naming its 1-based line (= its seq), and the control plane does not
//! start:
//! - a checksum that does not match the line's bytes (a flipped byte anywhere: a shape, a digest,
//!   a resident version, a sequence number);
//! - a line that is not a JSON record, or whose `seq` is not the previous one plus 1;
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
//! Lines without a checksum are accepted only at the start of the file (before the first line
//! with one), and each open logs a warning with how many were replayed unverified; what is
//! appended to such a journal carries checksums. Such a line must have exactly the fields `seq`,
//! `unix_ms` and `record`, so a checksum field mangled into another key is not taken for one.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use mx_layout::{strict_json, JsonError};
use serde::{Deserialize, Serialize};

use crate::limits::{MAX_BATCH_BYTES, MAX_JOURNAL_LINE_BYTES};
use crate::state::{Record, State};
use crate::Error;

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
fn split_checksum(line: &[u8]) -> Option<(&[u8], Result<u32, String>)> {
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
    want: u64,
    first_checked: Option<usize>,
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
    if entry.seq != want {
        return Err(format!(
            "sequence number {} where {want} was expected",
            entry.seq
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

fn parse(path: &Path, bytes: &[u8]) -> Result<Parsed, Error> {
    let mut entries = Vec::new();
    let mut pos = 0usize;
    let mut line_no = 0usize;
    let mut first_checked = None;
    let mut unverified = 0usize;
    while pos < bytes.len() {
        line_no += 1;
        let want = entries.len() as u64 + 1;
        let rest = &bytes[pos..];
        let corrupt = |reason: String| Error::JournalCorrupt {
            path: path.to_path_buf(),
            line: line_no,
            reason,
        };
        let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
            if let Some(reason) = not_torn(rest, want) {
                return Err(corrupt(reason));
            }
            break;
        };
        let (entry, checked) = decode_line(&rest[..nl], want, first_checked).map_err(corrupt)?;
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

/// Reads and verifies every entry of the journal at `path` (for `mx journal` and for replay). A
/// missing file reads as empty; a torn last record (see the module docs) is left out with a
/// warning, and the file is not changed.
///
/// # Errors
/// [`Error::JournalIo`] when the file cannot be read; [`Error::JournalCorrupt`] naming the
/// 1-based line of the first bad line.
pub fn read_records(path: &Path) -> Result<Vec<Entry>, Error> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(path, "read")(e)),
    };
    let parsed = parse(path, &bytes)?;
    if parsed.good_len < bytes.len() as u64 {
        tracing::warn!(
            path = %path.display(),
            seq = parsed.entries.len() + 1,
            bytes = bytes.len() as u64 - parsed.good_len,
            "the journal ends in an incomplete record (a write torn by a crash, never acknowledged): left out"
        );
    }
    Ok(parsed.entries)
}

/// Parses and verifies journal `bytes` as [`read_records`] does a file's (`path` only names them
/// in errors): every line checked, a torn last record left out.
///
/// # Errors
/// [`Error::JournalCorrupt`] naming the 1-based line of the first bad line.
pub fn parse_records(path: &Path, bytes: &[u8]) -> Result<Vec<Entry>, Error> {
    parse(path, bytes).map(|p| p.entries)
}

/// Replays `entries` into a fresh [`State`], as the control plane does when it starts.
///
/// # Errors
/// [`Error::Replay`] naming the 1-based line (of the journal at `path`) whose record the state
/// machine refuses.
pub fn replay(path: &Path, entries: impl IntoIterator<Item = Entry>) -> Result<State, Error> {
    let mut state = State::new();
    for (i, e) in entries.into_iter().enumerate() {
        state.apply(e.record).map_err(|source| Error::Replay {
            path: path.to_path_buf(),
            line: i + 1,
            source: Box::new(source),
        })?;
    }
    Ok(state)
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
}

impl Journal {
    /// Opens (creating if needed) the journal at `path`, verifies it and returns it with its
    /// existing entries. A torn last record (see the module docs) is saved beside the journal
    /// and cut off, so the next append starts on a fresh line ([`Journal::torn`] says so).
    ///
    /// # Errors
    /// [`Error::JournalIo`] on I/O failures or when another process holds the journal's lock;
    /// [`Error::JournalCorrupt`] naming a bad line (nothing is cut then).
    pub fn open(path: &Path) -> Result<(Journal, Vec<Entry>), Error> {
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
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io_err(path, "read"))?;
        let parsed = parse(path, &bytes)?;
        let good = usize::try_from(parsed.good_len).unwrap_or(bytes.len());
        let next_seq = parsed.entries.len() as u64 + 1;
        let mut torn = None;
        if let Some(tail) = bytes.get(good..).filter(|t| !t.is_empty()) {
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
            torn = Some(TornTail {
                seq: next_seq,
                bytes: tail.len() as u64,
                saved_to,
            });
        }
        let journal = Journal {
            path: path.to_path_buf(),
            file: Store::File(file),
            next_seq,
            bytes: parsed.good_len,
            torn,
            unverified: parsed.unverified,
        };
        Ok((journal, parsed.entries))
    }

    /// Opens the journal kept in etcd under `prefix` by the leader `leadership`: reads and
    /// verifies every entry (as [`Journal::open`] does a file; there is no torn tail, an entry
    /// is written whole or not at all) and returns it with its records. `rt` runs the etcd
    /// calls of [`Journal::write_synced`].
    ///
    /// # Errors
    /// [`Error::Config`] when etcd cannot be reached; [`Error::JournalCorrupt`] naming a bad
    /// line; [`Error::InvalidField`] for a gap in the log.
    pub async fn open_etcd(
        cfg: &crate::ha::EtcdConfig,
        leadership: std::sync::Arc<crate::ha::Leadership>,
        prefix: &str,
        rt: tokio::runtime::Handle,
    ) -> Result<(Journal, Vec<Entry>), Error> {
        let log = crate::ha::read_log(cfg, prefix).await?;
        let next_entry = log.last().map_or(1, |(seq, _)| seq + 1);
        let bytes: Vec<u8> = log.into_iter().flat_map(|(_, b)| b).collect();
        let path = PathBuf::from(format!("etcd:{prefix}"));
        let parsed = parse(&path, &bytes)?;
        if parsed.good_len != bytes.len() as u64 {
            return Err(Error::JournalCorrupt {
                path,
                line: parsed.entries.len() + 1,
                reason: "an entry ends inside a line (entries hold whole lines)".into(),
            });
        }
        let journal = Journal {
            path,
            file: Store::Etcd {
                leadership,
                prefix: prefix.to_string(),
                rt,
                next_entry,
            },
            next_seq: parsed.entries.len() as u64 + 1,
            bytes: parsed.good_len,
            torn: None,
            unverified: parsed.unverified,
        };
        Ok((journal, parsed.entries))
    }

    /// Appends `record` as one line and syncs it to disk before returning.
    ///
    /// # Errors
    /// As [`Journal::encode`] and [`Journal::write_synced`] (the state must then not change).
    pub fn append(&mut self, record: &Record) -> Result<u64, Error> {
        let mut buf = Vec::new();
        let seq = self.encode(record, &mut buf)?;
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
    /// [`Error::InvalidField`] (`record`) when its line would exceed
    /// [`MAX_JOURNAL_LINE_BYTES`]. The sequence number is not consumed and `buf` is unchanged
    /// then.
    pub fn encode(&mut self, record: &Record, buf: &mut Vec<u8>) -> Result<u64, Error> {
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

    /// Path of the journal file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of entries in the journal.
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

/// Makes a newly created journal file's directory entry durable.
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
mod tests {
    use super::*;
    use mx_layout::{LayoutSpec, Scheme, SourceManifest, TensorSpec};

    #[test]
    fn batches_are_cut_into_whole_lines() {
        let lines = b"aaaa\nbb\ncccccccc\nd\n";
        let cut = whole_lines(lines, 8);
        assert_eq!(cut, vec![&b"aaaa\nbb\n"[..], b"cccccccc\n", b"d\n"]);
        assert_eq!(cut.concat(), lines);
        assert_eq!(whole_lines(lines, 100), vec![&lines[..]]);
        assert!(whole_lines(b"", 8).is_empty());
    }

    #[test]
    fn a_second_control_plane_cannot_open_a_journal_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let (first, _) = Journal::open(&path).unwrap();
        let err = Journal::open(&path).map(|_| ()).unwrap_err();
        assert!(
            matches!(err, Error::JournalIo { what, .. } if what.starts_with("lock")),
            "{err}"
        );
        drop(first);
        assert!(
            Journal::open(&path).is_ok(),
            "the lock is released with the journal"
        );
    }

    fn reg(id: &str) -> Record {
        Record::Register {
            worker_id: id.into(),
            instance: "i".into(),
            ranks: vec![0],
            layout: LayoutSpec {
                scheme: Scheme::VllmTp,
                world_size: 1,
            },
            engine: None,
            resident_version: None,
        }
    }

    #[test]
    fn torn_tail_is_cut_and_corrupt_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let (mut j, e) = Journal::open(&path).unwrap();
        assert!(e.is_empty());
        j.append(&reg("a")).unwrap();
        j.append(&reg("b")).unwrap();
        drop(j);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"seq\":3,\"unix_ms\":1,\"rec").unwrap();
        drop(f);
        assert_eq!(read_records(&path).unwrap().len(), 2);
        let (mut j, e) = Journal::open(&path).unwrap();
        assert_eq!(e.len(), 2);
        assert_eq!(e[1].record, reg("b"));
        j.append(&reg("c")).unwrap();
        drop(j);
        let all = read_records(&path).unwrap();
        assert_eq!(all.len(), 3);
        assert_eq!(all[2].seq, 3);
        assert_eq!(all[2].record, reg("c"));

        // A garbled line in the middle is an error naming line 2.
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines: Vec<&str> = text.lines().collect();
        lines[1] = "{not json";
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        let err = read_records(&path).unwrap_err();
        assert!(
            matches!(err, Error::JournalCorrupt { line: 2, .. }),
            "{err}"
        );
        assert!(Journal::open(&path).is_err());
    }

    #[test]
    fn records_of_the_retired_commit_path_are_refused_naming_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let (mut j, _) = Journal::open(&path).unwrap();
        j.append(&reg("a")).unwrap();
        drop(j);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(
            b"{\"seq\":2,\"unix_ms\":1,\"record\":{\"op\":\"commit\",\"label\":\"v\",\"worker_ids\":[\"a\"]}}\n",
        )
        .unwrap();
        drop(f);
        let err = read_records(&path).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, Error::JournalCorrupt { line: 2, .. })
                && msg.contains("`commit`")
                && msg.contains("retired Commit RPC")
                && msg.contains("new journal"),
            "{msg}"
        );
        assert!(Journal::open(&path).is_err());
    }

    fn corrupt_line(err: &Error) -> (usize, &str) {
        match err {
            Error::JournalCorrupt { line, reason, .. } => (*line, reason.as_str()),
            other => panic!("expected JournalCorrupt, got {other}"),
        }
    }

    /// A journal of 3 records: a declaration (shape [8, 4]), a publish (a shard digest) and a
    /// registration (a resident version).
    fn three_records(path: &Path) -> Vec<u8> {
        let (specs, mut m) = smollm2_manifest(4, 16);
        m.shards.truncate(1);
        m.pieces.clear();
        m.shards[0].digest = mx_layout::Digest([0x11; 32]);
        let (mut j, _) = Journal::open(path).unwrap();
        j.append(&Record::Declare {
            label: "v".into(),
            trainer_layout: m.layout,
            tensors: vec![TensorSpec {
                shape: vec![8, 4],
                ..specs[1].clone()
            }],
        })
        .unwrap();
        j.append(&Record::Publish {
            label: "v".into(),
            manifest: m,
        })
        .unwrap();
        let Record::Register {
            worker_id,
            instance,
            ranks,
            layout,
            engine,
            ..
        } = reg("w")
        else {
            unreachable!()
        };
        j.append(&Record::Register {
            worker_id,
            instance,
            ranks,
            layout,
            engine,
            resident_version: Some(format!("mx:{}", "7".repeat(64))),
        })
        .unwrap();
        drop(j);
        std::fs::read(path).unwrap()
    }

    /// `bytes` with the first `from` after `at` replaced by `to` (same length).
    fn flipped(bytes: &[u8], at: &str, from: u8, to: u8) -> Vec<u8> {
        let start = bytes
            .windows(at.len())
            .position(|w| w == at.as_bytes())
            .unwrap_or_else(|| panic!("{at} not in the journal"));
        let i = start + bytes[start..].iter().position(|&b| b == from).unwrap();
        let mut out = bytes.to_vec();
        out[i] = to;
        out
    }

    #[test]
    fn a_flipped_byte_inside_a_value_is_refused_naming_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let good = three_records(&path);
        assert_eq!(read_records(&path).unwrap().len(), 3);
        // Each flip keeps the line valid JSON of a valid record: only the checksum sees it.
        for (at, from, to, line) in [
            ("\"shape\":[", b'8', b'9', 1),
            ("\"digest\":\"", b'1', b'3', 2),
            ("\"resident_version\":\"mx:", b'7', b'6', 3),
            ("\"seq\":2,", b'2', b'4', 2),
        ] {
            let bad = flipped(&good, at, from, to);
            std::fs::write(&path, &bad).unwrap();
            let err = read_records(&path).unwrap_err();
            let (l, reason) = corrupt_line(&err);
            assert_eq!(l, line, "{err}");
            assert!(
                reason.starts_with(&format!("checksum mismatch in record seq {line}: ")),
                "{reason}"
            );
            let err = Journal::open(&path).map(|_| ()).unwrap_err();
            assert_eq!(corrupt_line(&err).0, line);
            // Refused, not repaired: the file is as it was.
            assert_eq!(std::fs::read(&path).unwrap(), bad);
        }
        // A flip inside the checksum itself, and one that renames its key.
        let bad = flipped(&good, "\"crc32\":\"", b'"', b'\'');
        std::fs::write(&path, &bad).unwrap();
        let err = read_records(&path).unwrap_err();
        assert_eq!(corrupt_line(&err).0, 1, "{err}");
        let bad = flipped(&good, "\"crc32\":\"", b'3', b'4');
        std::fs::write(&path, &bad).unwrap();
        let err = read_records(&path).unwrap_err();
        assert_eq!(corrupt_line(&err).0, 1, "{err}");
    }

    #[test]
    fn a_torn_last_record_is_cut_and_kept_beside_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let good = three_records(&path);
        let lines: Vec<usize> = good
            .iter()
            .enumerate()
            .filter(|(_, &b)| b == b'\n')
            .map(|(i, _)| i + 1)
            .collect();
        // The crash cut the last record (seq 3) 40 bytes in.
        let cut = lines[1] + 40;
        std::fs::write(&path, &good[..cut]).unwrap();
        assert_eq!(read_records(&path).unwrap().len(), 2);
        assert_eq!(std::fs::read(&path).unwrap().len(), cut, "read-only");
        let (mut j, entries) = Journal::open(&path).unwrap();
        assert_eq!(entries.len(), 2);
        let torn = j.torn().unwrap().clone();
        assert_eq!((torn.seq, torn.bytes), (3, 40));
        let name = torn.saved_to.file_name().unwrap().to_string_lossy();
        assert!(name.starts_with("j.jsonl.torn-"), "{name}");
        assert_eq!(std::fs::read(&torn.saved_to).unwrap(), &good[lines[1]..cut]);
        assert_eq!(j.size_bytes(), lines[1] as u64);
        assert_eq!(std::fs::read(&path).unwrap(), &good[..lines[1]]);
        // The next record takes seq 3 on a fresh line.
        assert_eq!(j.append(&reg("x")).unwrap(), 3);
        drop(j);
        assert_eq!(read_records(&path).unwrap()[2].record, reg("x"));

        // A torn write whose end the file system filled with NULs is a torn write too.
        let mut tail = good[..lines[1] + 5].to_vec();
        tail.extend([0u8; 300]);
        std::fs::write(&path, &tail).unwrap();
        let (j, entries) = Journal::open(&path).unwrap();
        assert_eq!((entries.len(), j.torn().unwrap().bytes), (2, 305));
    }

    #[test]
    fn an_incomplete_line_that_is_not_a_torn_write_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let good = three_records(&path);
        let nl: Vec<usize> = good
            .iter()
            .enumerate()
            .filter(|(_, &b)| b == b'\n')
            .map(|(i, _)| i)
            .collect();
        let refused = |bytes: &[u8], line: usize, says: &str| {
            std::fs::write(&path, bytes).unwrap();
            let err = Journal::open(&path).map(|_| ()).unwrap_err();
            let (l, reason) = corrupt_line(&err);
            assert_eq!(l, line, "{err}");
            assert!(reason.contains(says), "{reason}");
            assert_eq!(std::fs::read(&path).unwrap(), bytes, "nothing is cut");
        };
        // A last line without its newline that is not record 3.
        let mut b = good[..nl[2]].to_vec();
        b[nl[1] + 8] = b'4';
        refused(&b, 3, "does not start record seq 3");
        // A line in the middle lost its newline: two lines run together, the checksum of the
        // second covers both.
        let mut b = good.clone();
        b[nl[0]] = b' ';
        refused(&b, 1, "checksum mismatch in record seq 1");
        // A line in the middle garbled.
        let mut b = good.clone();
        b[nl[0] + 1..nl[0] + 8].copy_from_slice(b"garbage");
        refused(&b, 2, "checksum mismatch in record seq 2");
        // A line in the middle cut short (its checksum gone).
        let mut b = good[..nl[0] + 30].to_vec();
        b.push(b'\n');
        b.extend_from_slice(&good[nl[1] + 1..]);
        refused(&b, 2, "no checksum, but line 1 had one");
        // Junk after the last good line.
        let mut b = good.clone();
        b.extend_from_slice(b"\x7fELF\x02\x01");
        refused(&b, 4, "does not start record seq 4");
    }

    #[test]
    fn a_journal_from_before_checksums_replays_and_what_follows_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let old = concat!(
            r#"{"seq":1,"unix_ms":5,"record":{"op":"register","worker_id":"a","instance":"i","ranks":[0],"layout":{"scheme":"VllmTp","world_size":1}}}"#,
            "\n",
            r#"{"seq":2,"unix_ms":6,"record":{"op":"register","worker_id":"b","instance":"i","ranks":[0],"layout":{"scheme":"VllmTp","world_size":1}}}"#,
            "\n"
        );
        std::fs::write(&path, old).unwrap();
        let (mut j, entries) = Journal::open(&path).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(j.unverified_lines(), 2);
        j.append(&reg("c")).unwrap();
        drop(j);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.lines().nth(2).unwrap().contains(",\"crc32\":\""));
        let (j, entries) = Journal::open(&path).unwrap();
        assert_eq!((entries.len(), j.unverified_lines()), (3, 2));
        drop(j);
        // An unchecked line after a checked one is a damaged line.
        let mut text = text;
        text.push_str(
            &old.lines()
                .next()
                .unwrap()
                .replace("\"seq\":1", "\"seq\":4"),
        );
        text.push('\n');
        std::fs::write(&path, &text).unwrap();
        let err = read_records(&path).unwrap_err();
        assert_eq!(
            corrupt_line(&err),
            (
                4,
                "record seq 4 has no checksum, but line 3 had one: its checksum field was damaged"
            )
        );
        // A legacy line with a field it never had (a checksum key mangled) is refused too.
        let mangled = old.replacen("\"unix_ms\":5,", "\"unix_ms\":5,\"crc33\":\"00000000\",", 1);
        std::fs::write(&path, mangled).unwrap();
        let err = read_records(&path).unwrap_err();
        let (line, reason) = corrupt_line(&err);
        assert_eq!(line, 1);
        assert!(reason.contains("unknown field `crc33`"), "{reason}");
    }

    #[test]
    fn a_repeated_key_in_a_record_is_refused_naming_it() {
        let p = Path::new("j.jsonl");
        let good = r#"{"seq":1,"unix_ms":5,"record":{"op":"register","worker_id":"a","instance":"i","ranks":[0],"layout":{"scheme":"VllmTp","world_size":1}}}"#;
        assert_eq!(
            parse_records(p, format!("{good}\n").as_bytes())
                .unwrap()
                .len(),
            1
        );
        // Repeated as spelled, and repeated after unescaping (serde would keep one silently).
        for (from, to, key, at) in [
            (
                "\"instance\":\"i\",",
                "\"instance\":\"i\",\"instance\":\"j\",",
                "instance",
                "$.record",
            ),
            (
                "\"world_size\":1",
                "\"world_size\":1,\"world_siz\\u0065\":2",
                "world_size",
                "$.record.layout",
            ),
            (
                "\"unix_ms\":5,",
                "\"unix_ms\":5,\"unix_ms\":6,",
                "unix_ms",
                "$",
            ),
        ] {
            let line = good.replacen(from, to, 1);
            assert_ne!(line, good);
            let err = parse_records(p, format!("{line}\n").as_bytes()).unwrap_err();
            let (n, reason) = corrupt_line(&err);
            assert_eq!(n, 1);
            assert_eq!(
                reason,
                format!("duplicate key {key:?} in the JSON object at {at}")
            );
        }
        // With a valid checksum too.
        let mut buf = Vec::new();
        let body = good.strip_suffix('}').unwrap().replacen(
            "\"ranks\":[0]",
            "\"ranks\":[0],\"ranks\":[1]",
            1,
        );
        buf.extend_from_slice(body.as_bytes());
        let crc = crc32fast::hash(&buf);
        buf.extend_from_slice(format!(",\"crc32\":\"{crc:08x}\"}}\n").as_bytes());
        let err = parse_records(p, &buf).unwrap_err();
        assert_eq!(
            corrupt_line(&err).1,
            "duplicate key \"ranks\" in the JSON object at $.record"
        );
    }

    #[test]
    fn replay_names_the_refused_line() {
        let p = Path::new("j.jsonl");
        let text = concat!(
            r#"{"seq":1,"unix_ms":1,"record":{"op":"stage","label":"nope","worker_ids":["w"]}}"#,
            "\n"
        );
        let entries = parse_records(p, text.as_bytes()).unwrap();
        match replay(p, entries) {
            Err(Error::Replay { line, .. }) => assert_eq!(line, 1),
            other => panic!("expected a replay error, got {:?}", other.map(|_| ())),
        }
    }

    /// A SmolLM2-135M-shaped FSDP slot-0 manifest of `fsdp` slots: 272 BF16 tensors (dim-0
    /// chunks), two TP pieces per shard, and `md` bytes of agent metadata.
    pub(crate) fn smollm2_manifest(fsdp: u32, md: usize) -> (Vec<TensorSpec>, SourceManifest) {
        use mx_layout::{DType, DestPiece, Digest, MemDevice, ShardEntry, TensorBox};
        let mut specs = vec![TensorSpec {
            name: "model.embed_tokens.weight".into(),
            dtype: DType::BF16,
            shape: vec![49152, 576],
        }];
        for l in 0..30 {
            for (n, s) in [
                ("self_attn.q_proj.weight", vec![576, 576]),
                ("self_attn.k_proj.weight", vec![192, 576]),
                ("self_attn.v_proj.weight", vec![192, 576]),
                ("self_attn.o_proj.weight", vec![576, 576]),
                ("mlp.gate_proj.weight", vec![1536, 576]),
                ("mlp.up_proj.weight", vec![1536, 576]),
                ("mlp.down_proj.weight", vec![576, 1536]),
                ("input_layernorm.weight", vec![576]),
                ("post_attention_layernorm.weight", vec![576]),
            ] {
                specs.push(TensorSpec {
                    name: format!("model.layers.{l}.{n}"),
                    dtype: DType::BF16,
                    shape: s,
                });
            }
        }
        specs.push(TensorSpec {
            name: "model.norm.weight".into(),
            dtype: DType::BF16,
            shape: vec![576],
        });
        let layout = LayoutSpec {
            scheme: mx_layout::Scheme::Fsdp,
            world_size: fsdp,
        };
        let tp2 = LayoutSpec {
            scheme: mx_layout::Scheme::VllmTp,
            world_size: 2,
        };
        let mut addr = 0x7f00_0000_0000u64;
        let mut shards = Vec::new();
        let mut pieces = Vec::new();
        for t in &specs {
            let rows = t.shape[0].div_ceil(u64::from(fsdp));
            let mut local = t.shape.clone();
            local[0] = rows;
            let mut off = vec![0; t.shape.len()];
            let b = TensorBox {
                global_offset: off.clone(),
                local_shape: local.clone(),
            };
            let len = b.numel().unwrap() * 2;
            shards.push(ShardEntry {
                tensor: t.name.clone(),
                dtype: t.dtype,
                global_shape: t.shape.clone(),
                shard: b,
                addr,
                len,
                device: MemDevice::Vram(0),
                digest: Digest::of(&addr.to_le_bytes()),
            });
            for r in 0..2u64 {
                let half = local[0] / 2;
                off[0] = r * half;
                let mut shape = local.clone();
                shape[0] = half;
                pieces.push(DestPiece {
                    layout: tp2,
                    dest_rank: r as u32,
                    tensor: t.name.clone(),
                    region: TensorBox {
                        global_offset: off.clone(),
                        local_shape: shape,
                    },
                    digest: Digest::of(&(addr + r).to_le_bytes()),
                    packed_addr: Some(addr + (1 << 36) + r * half),
                });
            }
            addr += len;
        }
        let m = SourceManifest {
            slot: 0,
            layout,
            agent_name: "mx-publisher-host-0-1234-slot0".into(),
            agent_metadata: (0..md)
                .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
                .collect(),
            shards,
            pieces,
            pack_seconds: 0.0123,
        };
        (specs, m)
    }

    #[test]
    fn journal_bytes_per_publish_of_a_smollm2_manifest() {
        use prost::Message;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let (specs, m) = smollm2_manifest(4, 8 << 10);
        let proto = crate::convert::manifest_pb(&m).encoded_len();
        let (mut j, _) = Journal::open(&path).unwrap();
        j.append(&Record::Declare {
            label: "v".into(),
            trainer_layout: m.layout,
            tensors: specs,
        })
        .unwrap();
        let before = j.size_bytes();
        j.append(&Record::Publish {
            label: "v".into(),
            manifest: m.clone(),
        })
        .unwrap();
        let line = j.size_bytes() - before;
        eprintln!(
            "MEASURE shards {} pieces {} agent_metadata {} B: proto {proto} B, journal line {line} B ({:.2}x)",
            m.shards.len(),
            m.pieces.len(),
            m.agent_metadata.len(),
            line as f64 / proto as f64
        );
        // The agent metadata is base64: 4 bytes per 3, not an array of numbers (3.6 per byte).
        let (_, big) = smollm2_manifest(4, 128 << 10);
        let before = j.size_bytes();
        j.append(&Record::Publish {
            label: "v".into(),
            manifest: big,
        })
        .unwrap();
        let grew = j.size_bytes() - before - line;
        assert_eq!(
            grew,
            (128u64 << 10).div_ceil(3) * 4 - (8u64 << 10).div_ceil(3) * 4
        );
    }
}
