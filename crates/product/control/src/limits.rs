//! Bounds on every count and size that reaches the control plane from outside, checked before
//! anything is allocated from it or journaled.
//!
//! Two places enforce them, with the same constants and the same checks:
//! - the RPC edge (`convert`): layouts, labels and the lengths of repeated fields are checked on
//!   the decoded wire message before it is converted, so nothing is sized from a wire value;
//! - [`crate::state::State::check`] (through [`declaration`] and [`manifest`]): every record is
//!   checked again before it is journaled, and again when a journal is replayed, so an absurd
//!   record written by an older control plane is refused at start naming its journal line
//!   ([`crate::Error::Replay`]) instead of being acted on.
//!
//! Every violation is an [`Error::InvalidField`] naming the field and the limit. Products of
//! sizes from outside (elements of a shape, bytes of a tensor) use checked arithmetic.
//!
//! The values are generous for real fleets and far below what would hurt the control plane; each
//! constant says why it is what it is.

use mx_layout::{LayoutSpec, SourceManifest, TensorBox, TensorSpec};

use crate::Error;

/// Largest gRPC message accepted or sent, in bytes (256 MiB: a manifest of a trillion-parameter
/// MoE at FSDP, with its destination pieces and agent metadata, is tens of MiB).
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// Largest world size of any layout (trainer or inference), in ranks: 65,536. The largest
/// published training runs use 16,384-32,768 GPUs, and a trainer layout counts one source slot per
/// rank that publishes. A version keeps state per slot and `GetVersion` lists missing slots, so
/// this also bounds those (256 KiB at most).
pub const MAX_WORLD_SIZE: u32 = 1 << 16;

/// Most tensors one version declares: 1,048,576. An unfused trillion-parameter MoE checkpoint
/// (Kimi-K2: 61 layers x 384 experts x 3 weights, plus scales) has about 150,000.
pub const MAX_TENSORS: usize = 1 << 20;

/// Most dims of one tensor shape or box: 16. Model weights have at most 5 (conv3d).
pub const MAX_DIMS: usize = 16;

/// Largest byte size of one declared tensor: 1 TiB. The largest real ones (embeddings and fused
/// expert stacks) are tens of GiB.
pub const MAX_TENSOR_BYTES: u64 = 1 << 40;

/// Most shards in one manifest: 1,048,576 (one per declared tensor is the common case; a source
/// may hold a few boxes of one tensor).
pub const MAX_SHARDS: usize = 1 << 20;

/// Most destination pieces in one manifest: 4,194,304 (a shard cut for every destination rank of
/// a few inference layouts).
pub const MAX_PIECES: usize = 1 << 22;

/// Longest version label, in bytes: 256 (labels are step names and hashes, and show up in every
/// log line and error message).
pub const MAX_LABEL_BYTES: usize = 256;

/// Most unknown resident versions one `AcceptJournal` record accepts: 65,536 (one per worker
/// of a large fleet at most).
pub const MAX_ACCEPTED_VERSIONS: usize = 1 << 16;

/// Longest tensor or NIXL agent name, in bytes: 1,024 (checkpoint names are under 200).
pub const MAX_NAME_BYTES: usize = 1024;

/// Largest NIXL agent metadata blob of one manifest, in bytes: 16 MiB (UCX metadata of one agent
/// with a few registered arenas is a few KiB).
pub const MAX_AGENT_METADATA_BYTES: usize = 16 << 20;

/// Largest encoded (protobuf) manifest, in bytes: the message limit, [`MAX_MESSAGE_BYTES`].
pub const MAX_MANIFEST_BYTES: usize = MAX_MESSAGE_BYTES;

/// Most times one slot of one version may be published with a different manifest (a publisher
/// restarted with new agent metadata republishes): 32. An identical republish is a no-op and
/// does not count. Past it the slot is refused: a publisher that restarts that often is broken,
/// and each republish adds a manifest to the journal.
pub const MAX_REPUBLISHES: u32 = 32;

/// Most times one slot of one version may be published again with only more destination pieces
/// (the same shards, agent and metadata; the held pieces first): 64. A publisher does that when a
/// destination layout registers after it published (workers of a new inference layout join);
/// fleets run a handful of layouts, and each extension journals the manifest again.
pub const MAX_PIECE_EXTENSIONS: u32 = 64;

/// Largest journal line, in bytes: 1 GiB. A manifest's JSON form is about 2-3x its protobuf form
/// (field names, hex digests), so every manifest under [`MAX_MANIFEST_BYTES`] fits.
pub const MAX_JOURNAL_LINE_BYTES: usize = 1 << 30;

/// Most bytes one group commit writes before its one `fdatasync` (more callers wait for the next
/// batch), beyond the last caller's records: 64 MiB. With [`MAX_JOURNAL_LINE_BYTES`] this bounds
/// what a crash can leave unsynced at the end of the journal.
pub const MAX_BATCH_BYTES: usize = 64 << 20;

fn over(
    field: impl Into<String>,
    what: &str,
    value: impl std::fmt::Display,
    limit: impl std::fmt::Display,
) -> Error {
    Error::InvalidField {
        field: field.into(),
        reason: format!("{what} {value} is over the limit of {limit}"),
    }
}

/// Checks a count (of a repeated field) against its limit.
///
/// # Errors
/// [`Error::InvalidField`] naming `field`, the count and the limit.
pub fn count(field: &str, n: usize, max: usize) -> Result<(), Error> {
    if n > max {
        return Err(over(field, "count", n, max));
    }
    Ok(())
}

/// Checks a byte length against its limit.
///
/// # Errors
/// [`Error::InvalidField`] naming `field`, the length and the limit.
pub fn bytes(field: &str, n: usize, max: usize) -> Result<(), Error> {
    if n > max {
        return Err(over(field, "length in bytes", n, max));
    }
    Ok(())
}

/// Checks a version label: not empty, at most [`MAX_LABEL_BYTES`], and printable ASCII without
/// spaces (`!` to `~`): labels are printed raw in tables, logs and errors, where a newline or an
/// escape sequence could fake a line of output (issue 29).
///
/// # Errors
/// [`Error::InvalidField`] naming `field` and, for a character outside the set, the character
/// (escaped) and its byte offset.
pub fn label(field: &str, s: &str) -> Result<(), Error> {
    if s.is_empty() {
        return Err(Error::InvalidField {
            field: field.to_string(),
            reason: "empty label".into(),
        });
    }
    bytes(field, s.len(), MAX_LABEL_BYTES)?;
    printable(s, false).map_err(|(at, c)| Error::InvalidField {
        field: field.to_string(),
        reason: format!(
            "label {s:?} has {c:?} at byte {at}: a label is printable ASCII without spaces ('!' to '~')"
        ),
    })
}

/// Checks a free text printed by status and logs (a reason): at most [`MAX_LABEL_BYTES`], and
/// printable ASCII with spaces (` ` to `~`).
///
/// # Errors
/// [`Error::InvalidField`] naming `field` and the character at fault.
pub fn text(field: &str, s: &str) -> Result<(), Error> {
    bytes(field, s.len(), MAX_LABEL_BYTES)?;
    printable(s, true).map_err(|(at, c)| Error::InvalidField {
        field: field.to_string(),
        reason: format!("{c:?} at byte {at}: printable ASCII only (' ' to '~')"),
    })
}

/// `Err((byte offset, character))` of the first character of `s` outside printable ASCII (`!`
/// to `~`, and ` ` when `space`).
fn printable(s: &str, space: bool) -> Result<(), (usize, char)> {
    match s
        .char_indices()
        .find(|&(_, c)| !(c.is_ascii_graphic() || (space && c == ' ')))
    {
        Some(bad) => Err(bad),
        None => Ok(()),
    }
}

/// Longest worker id or instance name, in characters (ASCII): 128.
pub const MAX_ID_CHARS: usize = 128;

/// Checks a worker id: 1 to [`MAX_ID_CHARS`] ASCII letters, digits, `.`, `_`, `-` and `:`.
///
/// # Errors
/// [`Error::InvalidField`] naming `field` and the character or length at fault.
pub fn worker_id(field: &str, s: &str) -> Result<(), Error> {
    if s.is_empty() {
        return Err(Error::InvalidField {
            field: field.to_string(),
            reason: "empty worker id".into(),
        });
    }
    identifier(field, s)
}

/// Checks an instance name: empty (the worker is its own instance) or as a worker id
/// ([`worker_id`]): it is printed beside one.
///
/// # Errors
/// [`Error::InvalidField`] naming `field` and the character or length at fault.
pub fn instance(field: &str, s: &str) -> Result<(), Error> {
    identifier(field, s)
}

/// At most [`MAX_ID_CHARS`] of ASCII letters, digits, `.`, `_`, `-` and `:`.
fn identifier(field: &str, s: &str) -> Result<(), Error> {
    let bad = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':')));
    let reason = if s.len() > MAX_ID_CHARS {
        format!("{} characters, at most {MAX_ID_CHARS}", s.len())
    } else if let Some(c) = bad {
        format!("{s:?} has {c:?}: use ASCII letters, digits, '.', '_', '-' and ':'")
    } else {
        return Ok(());
    };
    Err(Error::InvalidField {
        field: field.to_string(),
        reason,
    })
}

/// Most bytes of one declaration's tensor list, counted as each tensor's name plus 8 bytes per
/// dim of its shape: 32 MiB. Kimi-K2's ~150,000 tensors with ~100-byte names need ~16 MiB; each
/// count is bounded on its own too, but 100,000 tensors of 1 KiB names (100 MiB, every count
/// within its limit) must not reach the journal (issue 29).
pub const MAX_DECLARATION_BYTES: usize = 32 << 20;

/// Most boxes one `GetVersion` want names: 4,194,304 (a worker lists each box of each tensor its
/// ranks hold once: Kimi-K2's ~150,000 tensors on a few ranks).
pub const MAX_WANT_REGIONS: usize = 1 << 22;

/// Most hashes in one version proof: 8,388,608 (256 MiB, the message limit, of 32-byte hashes).
pub const MAX_PROOF_NODES: usize = MAX_MESSAGE_BYTES / 32;

/// Most artifacts recorded per version.
pub const MAX_ARTIFACTS: usize = 64;

/// Most workers serving one version as peers at once.
pub const MAX_PEERS: usize = 1024;

/// Checks an artifact URL: at most [`MAX_NAME_BYTES`], and `s3://bucket[/prefix]` as
/// [`mx_artifact::ArtifactUrl`] parses it.
///
/// # Errors
/// [`Error::InvalidField`] naming `field` and what is wrong.
pub fn artifact_url(field: &str, s: &str) -> Result<(), Error> {
    bytes(field, s.len(), MAX_NAME_BYTES)?;
    s.parse::<mx_artifact::ArtifactUrl>()
        .map(|_| ())
        .map_err(|e| Error::InvalidField {
            field: field.to_string(),
            reason: e.to_string(),
        })
}

/// Checks a tensor or agent name: at most [`MAX_NAME_BYTES`] and no control characters (names
/// are printed in errors and tables; emptiness is checked where it matters).
///
/// # Errors
/// [`Error::InvalidField`] naming `field` (and the character at fault).
pub fn name(field: &str, s: &str) -> Result<(), Error> {
    bytes(field, s.len(), MAX_NAME_BYTES)?;
    if let Some((at, c)) = s.char_indices().find(|(_, c)| c.is_control()) {
        return Err(Error::InvalidField {
            field: field.to_string(),
            reason: format!("name {s:?} has the control character {c:?} at byte {at}"),
        });
    }
    Ok(())
}

/// Checks a world size: `1..=MAX_WORLD_SIZE`.
///
/// # Errors
/// [`Error::InvalidField`] naming `field` (`<layout>.world_size`).
pub fn world_size(field: &str, n: u32) -> Result<(), Error> {
    if n == 0 {
        return Err(Error::InvalidField {
            field: field.to_string(),
            reason: "must be >= 1".into(),
        });
    }
    if n > MAX_WORLD_SIZE {
        return Err(over(field, "world size", n, MAX_WORLD_SIZE));
    }
    Ok(())
}

/// Checks a layout's world size ([`world_size`] on `<field>.world_size`).
///
/// # Errors
/// [`Error::InvalidField`].
pub fn layout(field: &str, l: &LayoutSpec) -> Result<(), Error> {
    world_size(&format!("{field}.world_size"), l.world_size)
}

/// Checks the number of dims of a shape or box (at most [`MAX_DIMS`]).
///
/// # Errors
/// [`Error::InvalidField`] naming `field`.
pub fn dims(field: &str, n: usize) -> Result<(), Error> {
    if n > MAX_DIMS {
        return Err(over(field, "number of dims", n, MAX_DIMS));
    }
    Ok(())
}

fn tensor_box(field: &str, b: &TensorBox) -> Result<(), Error> {
    dims(&format!("{field}.global_offset"), b.global_offset.len())?;
    dims(&format!("{field}.local_shape"), b.local_shape.len())
}

/// Checks one declared tensor: name length, dims, and its byte size (computed with checked
/// arithmetic) at most [`MAX_TENSOR_BYTES`].
///
/// # Errors
/// [`Error::InvalidField`] naming `field.name` or `field.shape`.
pub fn tensor(field: &str, t: &TensorSpec) -> Result<(), Error> {
    name(&format!("{field}.name"), &t.name)?;
    let shape_field = format!("{field}.shape");
    dims(&shape_field, t.shape.len())?;
    let bytes = t
        .shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .and_then(|n| n.checked_mul(t.dtype.size_bytes()));
    match bytes {
        None => Err(Error::InvalidField {
            field: shape_field,
            reason: format!("byte size of {} overflows u64", t.name),
        }),
        Some(b) if b > MAX_TENSOR_BYTES => Err(over(
            shape_field,
            &format!("byte size of {}", t.name),
            b,
            MAX_TENSOR_BYTES,
        )),
        Some(_) => Ok(()),
    }
}

/// Checks a declaration: its label, trainer layout, tensor count and every tensor.
///
/// # Errors
/// [`Error::InvalidField`] naming the first field over its limit.
pub fn declaration(
    label_: &str,
    trainer: &LayoutSpec,
    tensors: &[TensorSpec],
) -> Result<(), Error> {
    label("label", label_)?;
    layout("trainer_layout", trainer)?;
    count("tensors", tensors.len(), MAX_TENSORS)?;
    let mut total = 0usize;
    for (i, t) in tensors.iter().enumerate() {
        tensor(&format!("tensors[{i}]"), t)?;
        total = total.saturating_add(t.name.len() + 8 * t.shape.len());
        if total > MAX_DECLARATION_BYTES {
            return Err(over(
                "tensors",
                &format!("total size (names + 8 bytes per dim) through tensors[{i}]"),
                total,
                MAX_DECLARATION_BYTES,
            ));
        }
    }
    Ok(())
}

/// Checks a manifest's counts and sizes: layout, agent name and metadata, shard and piece
/// counts, names, dims and piece layouts. `field` prefixes the field paths (`manifest`).
///
/// # Errors
/// [`Error::InvalidField`] naming the first field over its limit.
pub fn manifest(field: &str, m: &SourceManifest) -> Result<(), Error> {
    layout(&format!("{field}.layout"), &m.layout)?;
    name(&format!("{field}.agent_name"), &m.agent_name)?;
    bytes(
        &format!("{field}.agent_metadata"),
        m.agent_metadata.len(),
        MAX_AGENT_METADATA_BYTES,
    )?;
    count(&format!("{field}.shards"), m.shards.len(), MAX_SHARDS)?;
    count(&format!("{field}.pieces"), m.pieces.len(), MAX_PIECES)?;
    for (i, s) in m.shards.iter().enumerate() {
        let f = format!("{field}.shards[{i}]");
        name(&format!("{f}.tensor"), &s.tensor)?;
        dims(&format!("{f}.global_shape"), s.global_shape.len())?;
        tensor_box(&format!("{f}.shard"), &s.shard)?;
    }
    for (i, p) in m.pieces.iter().enumerate() {
        let f = format!("{field}.pieces[{i}]");
        layout(&format!("{f}.layout"), &p.layout)?;
        name(&format!("{f}.tensor"), &p.tensor)?;
        tensor_box(&format!("{f}.region"), &p.region)?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // reason: tests fail loudly on purpose
mod tests {
    use super::*;
    use mx_layout::{DType, Scheme};

    fn field_of(e: Error) -> (String, String) {
        match e {
            Error::InvalidField { field, reason } => (field, reason),
            other => panic!("expected InvalidField, got {other}"),
        }
    }

    #[test]
    fn each_bound_names_its_field_and_limit() {
        let fsdp = |n| LayoutSpec {
            scheme: Scheme::Fsdp,
            world_size: n,
        };
        let (f, r) = field_of(declaration("v", &fsdp(u32::MAX), &[]).unwrap_err());
        assert_eq!(f, "trainer_layout.world_size");
        assert_eq!(r, "world size 4294967295 is over the limit of 65536");
        assert!(declaration("v", &fsdp(MAX_WORLD_SIZE), &[]).is_ok());
        let (f, r) = field_of(declaration(&"x".repeat(257), &fsdp(1), &[]).unwrap_err());
        assert_eq!(
            (f.as_str(), r.as_str()),
            ("label", "length in bytes 257 is over the limit of 256")
        );
        let huge = TensorSpec {
            name: "t".into(),
            dtype: DType::F32,
            shape: vec![1 << 20, 1 << 19],
        };
        let (f, r) = field_of(declaration("v", &fsdp(1), &[huge]).unwrap_err());
        assert_eq!(f, "tensors[0].shape");
        assert_eq!(
            r,
            "byte size of t 2199023255552 is over the limit of 1099511627776"
        );
        let deep = TensorSpec {
            name: "t".into(),
            dtype: DType::F32,
            shape: vec![1; 17],
        };
        let (f, r) = field_of(declaration("v", &fsdp(1), std::slice::from_ref(&deep)).unwrap_err());
        assert_eq!(
            (f.as_str(), r.as_str()),
            (
                "tensors[0].shape",
                "number of dims 17 is over the limit of 16"
            )
        );
    }

    #[test]
    fn labels_and_names_that_could_fake_output_are_refused_naming_the_character() {
        let (f, r) = field_of(label("label", "step-3\nfleet ok").unwrap_err());
        assert_eq!(f, "label");
        assert!(
            r.contains("'\\n' at byte 6") && r.contains("printable ASCII"),
            "{r}"
        );
        for bad in ["a b", "v\u{1b}[2J", "caf\u{e9}", "tab\t"] {
            assert!(label("label", bad).is_err(), "{bad:?}");
        }
        for good in ["step-5", "v1", "run/abc@3:final", "~!#"] {
            label("label", good).unwrap();
        }
        let (f, r) = field_of(name("tensors[0].name", "w\r.weight").unwrap_err());
        assert_eq!(f, "tensors[0].name");
        assert!(r.contains("control character '\\r' at byte 1"), "{r}");
        name("n", "model.layers.0.mlp.experts.7.w1.weight").unwrap();
        assert!(instance("instance", "vllm-a:0").is_ok() && instance("instance", "").is_ok());
        assert!(instance("instance", "a\nb").is_err());
    }

    #[test]
    fn a_declaration_is_bounded_in_total_not_only_per_count() {
        let fsdp = LayoutSpec {
            scheme: Scheme::Fsdp,
            world_size: 1,
        };
        let t = |i: usize| TensorSpec {
            name: format!("{i:0>1000}"),
            dtype: DType::BF16,
            shape: vec![4],
        };
        // 100,000 tensors of 1 KiB names: every count within its limit, 100 MiB in total.
        let tensors: Vec<TensorSpec> = (0..100_000).map(t).collect();
        let (f, r) = field_of(declaration("v", &fsdp, &tensors).unwrap_err());
        assert_eq!(f, "tensors");
        assert!(r.contains("over the limit of 33554432"), "{r}");
        // Kimi-K2's scale (~150,000 tensors of ~100-byte names) is well within it.
        let real: Vec<TensorSpec> = (0..150_000)
            .map(|i| TensorSpec {
                name: format!(
                    "model.layers.{}.mlp.experts.{}.gate_proj.weight_scale_inv",
                    i / 2304,
                    i % 384
                ),
                dtype: DType::F32,
                shape: vec![56, 16],
            })
            .collect();
        declaration("v", &fsdp, &real).unwrap();
    }
}
