//! The durable local store: an append-only file of JSON lines, one [`Entry`] per accepted
//! mutating call, each written and `fsync`ed (`File::sync_data`) before the state changes.
//!
//! A crash can leave a torn last line (bytes with no terminating newline): it was never
//! acknowledged nor applied, so readers ignore it with a warning and [`Journal::open`] cuts it
//! off before appending. Any other line that does not parse is an error naming its line number;
//! so is a `commit` or `applied` record, written by the retired Commit / ReportApplied RPCs
//! before refits became the only commit path (such a journal cannot be replayed: the versions
//! it committed were never refits).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::state::Record;
use crate::Error;

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

/// The parsed contents of a journal file.
struct Parsed {
    entries: Vec<Entry>,
    /// Byte length of the well-formed prefix (everything but a torn last line).
    good_len: u64,
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::JournalIo {
        path: path.to_path_buf(),
        what,
        source,
    }
}

fn parse(path: &Path, bytes: &[u8]) -> Result<Parsed, Error> {
    let mut entries = Vec::new();
    let mut pos = 0usize;
    let mut line_no = 0usize;
    while pos < bytes.len() {
        line_no += 1;
        let rest = &bytes[pos..];
        let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
            tracing::warn!(
                path = %path.display(),
                line = line_no,
                bytes = rest.len(),
                "ignoring a torn last journal line (a write cut short by a crash)"
            );
            break;
        };
        let line = &rest[..nl];
        let corrupt = |reason: String| Error::JournalCorrupt {
            path: path.to_path_buf(),
            line: line_no,
            reason,
        };
        let entry: Entry = serde_json::from_slice(line).map_err(|e| {
            corrupt(match retired_op(line) {
                Some(op) => format!(
                    "record `{op}` of the retired {} RPC: versions are committed only by refits now, so a journal from before cannot be replayed (start the control plane on a new journal)",
                    if op == "commit" { "Commit" } else { "ReportApplied" }
                ),
                None => e.to_string(),
            })
        })?;
        let want = entries.len() as u64 + 1;
        if entry.seq != want {
            return Err(corrupt(format!(
                "sequence number {} where {want} was expected",
                entry.seq
            )));
        }
        entries.push(entry);
        pos += nl + 1;
    }
    Ok(Parsed {
        entries,
        good_len: pos as u64,
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

/// Reads every entry of the journal at `path` (for `mx journal` and for replay). A missing file
/// reads as empty; a torn last line is ignored with a warning.
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
    Ok(parse(path, &bytes)?.entries)
}

/// An open journal, positioned to append.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
    next_seq: u64,
    bytes: u64,
}

impl Journal {
    /// Opens (creating if needed) the journal at `path`, returns it with its existing entries.
    /// A torn last line is cut off so the next append starts on a fresh line.
    ///
    /// # Errors
    /// [`Error::JournalIo`] on I/O failures or when another process holds the journal's lock;
    /// [`Error::JournalCorrupt`] naming a bad line.
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
        if parsed.good_len < bytes.len() as u64 {
            file.set_len(parsed.good_len)
                .map_err(io_err(path, "truncate torn line"))?;
            file.sync_data().map_err(io_err(path, "fsync"))?;
        }
        let journal = Journal {
            path: path.to_path_buf(),
            file,
            next_seq: parsed.entries.len() as u64 + 1,
            bytes: parsed.good_len,
        };
        Ok((journal, parsed.entries))
    }

    /// Appends `record` as one line and syncs it to disk before returning.
    ///
    /// # Errors
    /// [`Error::JournalIo`] when writing or syncing fails (the state must then not change).
    pub fn append(&mut self, record: &Record) -> Result<u64, Error> {
        let mut buf = Vec::new();
        let seq = self.encode(record, &mut buf)?;
        self.write_synced(&buf)?;
        Ok(seq)
    }

    /// Encodes `record` as the next line (taking the next sequence number) onto `buf`, without
    /// writing it: a group commit encodes every record of a batch, then writes and syncs them
    /// all at once with [`Journal::write_synced`]. Returns the record's sequence number.
    ///
    /// # Errors
    /// [`Error::JournalIo`] (`encode`) when the record cannot be serialized; the sequence number
    /// is not consumed then.
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
        if let Err(e) = serde_json::to_writer(
            &mut *buf,
            &EntryRef {
                seq: self.next_seq,
                unix_ms,
                record,
            },
        ) {
            buf.truncate(start);
            return Err(Error::JournalIo {
                path: self.path.clone(),
                what: "encode",
                source: std::io::Error::other(e),
            });
        }
        buf.push(b'\n');
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
        self.file
            .write_all(lines)
            .map_err(io_err(&self.path, "write"))?;
        self.file.sync_data().map_err(io_err(&self.path, "fsync"))?;
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
mod tests {
    use super::*;
    use mx_layout::{LayoutSpec, Scheme};

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
}
