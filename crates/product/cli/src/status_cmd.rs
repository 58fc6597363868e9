//! `mx status`: the fleet at a glance. A header (the control plane, the fleet's version, the
//! open refit, how many workers are admitted and why the others are not), the recent versions
//! with their sources and those sources' liveness, and one line per worker (its resident
//! version by label, its stage, whether it is admitted) with the reason and next command of a
//! gated one on its own line. `--json` prints the same status as one object, per-tensor
//! digests only with `--digests`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use mx_control::{FleetStatus, Gate, Liveness, Release, VersionSummary, WorkerState, WorkerStatus};

/// The versions shown without `--all`: the newest ones, and the fleet's.
pub(crate) const RECENT_VERSIONS: usize = 6;

/// Columns an admission reason is wrapped at.
const WRAP: usize = 100;

/// A digest or version id shortened for reading (12 hex digits, as git shows 7+).
fn short(hex: &str) -> &str {
    let hex = hex.strip_prefix("mx:").unwrap_or(hex);
    hex.get(..12).unwrap_or(hex)
}

/// `0-3`, `0,2,5-6`: a worker's ranks in brief.
fn ranks(r: &[u32]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < r.len() {
        let mut j = i;
        while j + 1 < r.len() && r[j + 1] == r[j].saturating_add(1) {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", r[i], r[j])
        } else {
            r[i].to_string()
        });
        i = j + 1;
    }
    out.join(",")
}

/// Seconds, one decimal: `42.1 s`.
fn ago(ms: u64) -> String {
    format!("{:.1} s ago", ms as f64 / 1000.0)
}

/// What serves a version and whether it is alive: `trainer 2/2 live; peers w0,w1; 1 artifact`.
fn sources(v: &VersionSummary, connected: &BTreeMap<&str, bool>) -> String {
    let mut parts = Vec::new();
    let published = v.publishers.len();
    let mut trainer = format!("trainer {published}/{}", v.slots);
    let mut odd = Vec::new();
    for p in &v.publishers {
        match (&p.retired_by, p.liveness) {
            (Some(by), _) => odd.push(format!("slot {} overwritten by {by}", p.slot)),
            (None, Liveness::Live) => {}
            (None, Liveness::Silent) => odd.push(format!(
                "slot {} SILENT (last heard {})",
                p.slot,
                p.last_seen_ms.map(ago).unwrap_or_default()
            )),
            (None, Liveness::Unknown) => odd.push(format!("slot {} not heard", p.slot)),
        }
    }
    if published > 0 && odd.is_empty() {
        trainer.push_str(" live");
    } else if !odd.is_empty() {
        let _ = write!(trainer, " ({})", odd.join(", "));
    }
    if let Some(r) = &v.release {
        let _ = write!(trainer, ", released ({})", release(r));
    }
    if published > 0 || v.peers.is_empty() && v.artifacts.is_empty() {
        parts.push(trainer);
    }
    if !v.peers.is_empty() {
        let shown: Vec<String> = v
            .peers
            .iter()
            .take(4)
            .map(|p| match connected.get(p.as_str()) {
                Some(true) => p.clone(),
                _ => format!("{p} (DISCONNECTED)"),
            })
            .collect();
        let more = v.peers.len().saturating_sub(shown.len());
        let tail = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        parts.push(format!("peers {}{tail}", shown.join(",")));
    }
    match v.artifacts.as_slice() {
        [] => {}
        [one] => parts.push(format!("artifact {one}")),
        many => parts.push(format!("{} artifacts", many.len())),
    }
    parts.join("; ")
}

/// Why a version's sources may stop serving it, in brief (the worker list of a stage left out).
fn release(r: &Release) -> String {
    match r {
        Release::Staged {
            refit: Some(id), ..
        } => format!("refit {id} staged it"),
        Release::Staged { refit: None, .. } => "staged".into(),
        Release::RefitEnded { refit, outcome } => format!("refit {refit} ended {outcome}"),
        Release::Superseded { by } => format!("superseded by {by}"),
        Release::Source { slot } => format!("by slot {slot}"),
    }
}

/// A worker's resident version: its label where a declared version has that id.
fn resident(w: &WorkerStatus) -> String {
    match (&w.resident_label, &w.resident_id) {
        (Some(l), _) => l.clone(),
        (None, Some(id)) => {
            let s = id.to_string();
            if s.starts_with("mx:") {
                format!("mx:{}", short(&s))
            } else {
                s.chars().take(24).collect()
            }
        }
        (None, None) => "-".into(),
    }
}

/// A worker's stage: the state of its last stage request and its label; a worker whose command
/// stream is closed reports nothing, so what it held is marked as of before it disconnected.
fn stage(w: &WorkerStatus) -> String {
    let s = match (w.state, &w.label) {
        (WorkerState::Idle, _) => return "-".into(),
        (s, Some(l)) => format!("{s} {l}"),
        (s, None) => s.to_string(),
    };
    if w.connected {
        s
    } else {
        format!("was {s}")
    }
}

/// Wraps `text` at [`WRAP`] columns, every line indented by `indent` spaces.
fn wrap(text: &str, indent: usize) -> String {
    let pad = " ".repeat(indent);
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split(' ') {
        if !line.is_empty() && indent + line.len() + 1 + word.len() > WRAP {
            let _ = writeln!(out, "{pad}{line}");
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        let _ = writeln!(out, "{pad}{line}");
    }
    out
}

/// Left-aligned columns, two spaces apart (the last column unpadded).
fn table(rows: &[Vec<String>]) -> String {
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..n)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            if c + 1 == r.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<w$}  ", w = widths[c]);
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}

/// The status as `mx status` prints it (see the module docs). `all`: every version, not only
/// the [`RECENT_VERSIONS`] newest and the fleet's.
pub(crate) fn render(s: &FleetStatus, control: &str, all: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "control  {control}");
    if let Some(why) = &s.halted {
        out.push_str(&wrap(&format!("HALTED: {why}"), 0));
    }
    let fleet = match &s.fleet_version {
        Some(f) => format!(
            "{} ({}), committed",
            f.label,
            short(&f.version_id.to_string())
        ),
        None => "no version committed yet".into(),
    };
    let refit = match s.open_refit {
        Some(id) => format!("refit {id} open"),
        None => "no refit open".into(),
    };
    let _ = writeln!(out, "fleet    {fleet}; {refit}");
    let admitted = s.workers.iter().filter(|w| w.admitted).count();
    let mut gated: BTreeMap<Gate, usize> = BTreeMap::new();
    for w in &s.workers {
        if let Some(g) = w.gate {
            *gated.entry(g).or_default() += 1;
        }
    }
    let why: Vec<String> = gated.iter().map(|(g, n)| format!("{g} {n}")).collect();
    let _ = writeln!(
        out,
        "workers  {} registered, {admitted} admitted{}",
        s.workers.len(),
        if why.is_empty() {
            String::new()
        } else {
            format!(", gated: {}", why.join(", "))
        }
    );

    let connected: BTreeMap<&str, bool> = s
        .workers
        .iter()
        .map(|w| (w.worker_id.as_str(), w.connected))
        .collect();
    if !s.versions.is_empty() {
        let fleet_label = s.fleet_version.as_ref().map(|f| f.label.as_str());
        let first = s.versions.len().saturating_sub(RECENT_VERSIONS);
        let shown: Vec<&VersionSummary> = s
            .versions
            .iter()
            .enumerate()
            .filter(|(i, v)| all || *i >= first || Some(v.label.as_str()) == fleet_label)
            .map(|(_, v)| v)
            .collect();
        let mut rows = vec![vec![
            "VERSION".to_string(),
            "STATE".into(),
            "ID".into(),
            "SOURCES".into(),
        ]];
        for v in &shown {
            let mut state = v.state.to_string();
            if Some(v.label.as_str()) == fleet_label {
                state.push_str(" (fleet)");
            }
            rows.push(vec![
                v.label.clone(),
                state,
                v.version_digest
                    .map(|d| short(&d.to_string()).to_string())
                    .unwrap_or_else(|| "-".into()),
                sources(v, &connected),
            ]);
        }
        out.push('\n');
        out.push_str(&table(&rows));
        let hidden = s.versions.len() - shown.len();
        if hidden > 0 {
            let _ = writeln!(out, "({hidden} older versions: mx status --all)");
        }
    }
    if s.workers.is_empty() {
        let _ = writeln!(out, "\nno workers registered");
        return out;
    }
    out.push('\n');
    let mut rows = vec![vec![
        "WORKER".to_string(),
        "LAYOUT".into(),
        "RANKS".into(),
        "LINK".into(),
        "RESIDENT".into(),
        "STAGE".into(),
        "ADMISSION".into(),
    ]];
    for w in &s.workers {
        rows.push(vec![
            w.worker_id.clone(),
            w.layout.to_string(),
            ranks(&w.ranks),
            if w.connected {
                "connected".into()
            } else {
                "DISCONNECTED".into()
            },
            resident(w),
            stage(w),
            match w.gate {
                None => "admitted".into(),
                Some(g) => format!("GATED ({g})"),
            },
        ]);
    }
    let lines = table(&rows);
    // Each gated worker's reason (with the command that clears it) under its line.
    for (line, w) in lines
        .lines()
        .zip(std::iter::once(None).chain(s.workers.iter().map(Some)))
    {
        let _ = writeln!(out, "{line}");
        if let Some(w) = w {
            if !w.admitted && !w.admission.is_empty() {
                out.push_str(&wrap(&w.admission, 4));
            }
            if let Some(e) = w
                .last_error
                .as_ref()
                .filter(|_| w.state == WorkerState::Failed)
            {
                out.push_str(&wrap(&format!("last error: {e}"), 4));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use mx_control::{FleetVersion, PublisherStatus, VersionState};
    use mx_layout::{Digest, LayoutSpec, ResidentVersion, VersionId};

    fn version(
        label: &str,
        state: VersionState,
        d: u8,
        pubs: Vec<PublisherStatus>,
    ) -> VersionSummary {
        VersionSummary {
            label: label.into(),
            state,
            version_digest: Some(Digest([d; 32])),
            slots: 2,
            publishers: pubs,
            peers: Vec::new(),
            artifacts: Vec::new(),
            release: None,
        }
    }

    fn publisher(slot: u32, seen: Option<u64>) -> PublisherStatus {
        PublisherStatus {
            slot,
            agent_name: format!("mx-pub-{slot}"),
            retired_by: None,
            last_seen_ms: seen,
            liveness: Liveness::of(seen),
        }
    }

    fn worker(
        id: &str,
        resident: Option<(u8, &str)>,
        gate: Option<(Gate, &str)>,
        connected: bool,
    ) -> WorkerStatus {
        WorkerStatus {
            worker_id: id.into(),
            instance: id.into(),
            ranks: vec![0, 1],
            layout: "tp:2".parse::<LayoutSpec>().unwrap(),
            state: WorkerState::Staged,
            label: Some("step-2".into()),
            version_digest: None,
            resident_version: resident.map(|(d, _)| Digest([d; 32])),
            last_error: None,
            last_staged: None,
            engine: None,
            resident_id: resident
                .map(|(d, _)| ResidentVersion::from(VersionId::from(Digest([d; 32])))),
            admitted: gate.is_none(),
            admission: gate.map(|(_, why)| why.to_string()).unwrap_or_default(),
            connected,
            gate: gate.map(|(g, _)| g),
            resident_label: resident.map(|(_, l)| l.to_string()),
        }
    }

    #[test]
    fn a_status_reads_at_a_glance() {
        let mut old = version(
            "step-1",
            VersionState::Committed,
            1,
            vec![publisher(0, Some(50))],
        );
        old.release = Some(Release::Superseded {
            by: "step-2".into(),
        });
        let mut silent = publisher(1, Some(42_100));
        silent.liveness = Liveness::Silent;
        let s = FleetStatus {
            versions: vec![
                old,
                version("step-2", VersionState::Committed, 2, vec![publisher(0, Some(100)), publisher(1, Some(200))]),
                version("step-3", VersionState::Publishing, 3, vec![publisher(0, Some(100)), silent]),
            ],
            workers: vec![
                worker("w0", Some((2, "step-2")), None, true),
                worker(
                    "w1",
                    Some((1, "step-1")),
                    Some((Gate::Stale, "stale: resident mx:0101, the fleet committed step-2: `mx refit --label step-2 --workers w1 --join`")),
                    false,
                ),
            ],
            fleet_version: Some(FleetVersion {
                label: "step-2".into(),
                version_id: VersionId::from(Digest([2; 32])),
            }),
            open_refit: None,
            halted: None,
        };
        let out = render(&s, "http://127.0.0.1:7700", false);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "control  http://127.0.0.1:7700");
        assert_eq!(
            lines[1],
            "fleet    step-2 (020202020202), committed; no refit open"
        );
        assert_eq!(
            lines[2],
            "workers  2 registered, 1 admitted, gated: stale 1"
        );
        assert!(
            out.contains("step-1   COMMITTED          010101010101  trainer 1/2 live, released (superseded by step-2)"),
            "{out}"
        );
        assert!(
            out.contains("step-2   COMMITTED (fleet)  020202020202  trainer 2/2 live\n"),
            "{out}"
        );
        assert!(
            out.contains("trainer 2/2 (slot 1 SILENT (last heard 42.1 s ago))"),
            "{out}"
        );
        assert!(
            out.contains(
                "w0      tp:2    0-1    connected     step-2    STAGED step-2      admitted\n"
            ),
            "{out}"
        );
        assert!(
            out.contains(
                "w1      tp:2    0-1    DISCONNECTED  step-1    was STAGED step-2  GATED (stale)\n"
            ),
            "{out}"
        );
        assert!(out.contains("    stale: resident mx:0101, the fleet committed step-2: `mx refit --label step-2 --workers w1\n    --join`\n"), "{out}");
        for l in &lines {
            assert!(l.len() <= WRAP, "{l}");
        }
    }

    #[test]
    fn old_versions_fold_away_but_the_fleets_stays() {
        let mut versions: Vec<VersionSummary> = (0..10)
            .map(|i| version(&format!("step-{i}"), VersionState::Committed, i, Vec::new()))
            .collect();
        versions[9].state = VersionState::Ready;
        let s = FleetStatus {
            versions,
            workers: Vec::new(),
            fleet_version: Some(FleetVersion {
                label: "step-1".into(),
                version_id: VersionId::from(Digest([1; 32])),
            }),
            open_refit: Some(4),
            halted: None,
        };
        let out = render(&s, "c", false);
        assert!(out.contains("step-1   COMMITTED (fleet)"), "{out}");
        assert!(!out.contains("step-0 "), "{out}");
        assert!(!out.contains("step-3 "), "{out}");
        assert!(out.contains("step-4 "), "{out}");
        assert!(out.contains("(3 older versions: mx status --all)"), "{out}");
        assert!(out.contains("refit 4 open"), "{out}");
        let all = render(&s, "c", true);
        assert!(
            all.contains("step-0 ") && !all.contains("older versions"),
            "{all}"
        );
        assert_eq!(ranks(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }
}
