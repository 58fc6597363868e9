//! Multi-process NIXL READ tests: the test binary re-executes itself as the source process.
//!
//! The source (`source_child`, a no-op unless `MX_NIXL_TEST_SOURCE` is set) creates an agent and
//! an arena filled with a deterministic pattern, prints its metadata and address on stdout, and
//! serves READs until its stdin closes. The parent reads ranges from it and compares them with
//! the pattern computed independently.
//!
//! Without the NIXL libraries these tests print a skip message and pass, unless
//! `MX_REQUIRE_NIXL=1` (CI), where they fail.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests fail loudly on setup errors"
)]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use mx_nixl::{memcpy_gbps, nixl_or_skip, probe_costs, Agent, Arena, Error, ReadOp, ReadOptions};

const ROLE_ENV: &str = "MX_NIXL_TEST_SOURCE";

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The source's byte at `offset`: little-endian bytes of splitmix64(offset / 8).
fn pattern_byte(offset: u64) -> u8 {
    splitmix64(offset / 8).to_le_bytes()[(offset % 8) as usize]
}

fn fill_pattern(buf: &mut [u8]) {
    for (w, chunk) in buf.chunks_mut(8).enumerate() {
        let bytes = splitmix64(w as u64).to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// The source role: runs only in the re-executed child.
#[test]
fn source_child() {
    let Ok(len) = std::env::var(ROLE_ENV) else {
        return;
    };
    let len: u64 = len.parse().unwrap();
    let name = format!("mx-test-source-{}", std::process::id());
    let agent = Agent::new(&name).unwrap();
    let mut arena = Arena::new(&agent, len).unwrap();
    fill_pattern(arena.as_mut_slice());
    let md = agent.local_metadata().unwrap();
    let hex: String = md.iter().map(|b| format!("{b:02x}")).collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "MXSRC {} {} {}", arena.addr(), arena.len(), hex).unwrap();
    out.flush().unwrap();
    drop(out);
    // Serve until the parent closes our stdin; progress answers the reader's connection set-up.
    if std::env::var_os("MX_NIXL_TEST_THP").is_some() {
        let thp = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
        let thp = thp
            .lines()
            .find(|l| l.starts_with("AnonHugePages"))
            .unwrap_or("?");
        eprintln!("source {thp} (arena {len} bytes)");
    }
    let progress = agent.spawn_progress(Duration::from_millis(1));
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(progress);
    drop(arena);
    drop(agent);
}

/// A running source process.
struct Source {
    child: Child,
    stdin: Option<ChildStdin>,
    addr: u64,
    len: u64,
    metadata: Vec<u8>,
}

impl Source {
    fn spawn(len: u64) -> Source {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "source_child", "--nocapture", "--test-threads=1"])
            .env(ROLE_ENV, len.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = loop {
            let line = lines
                .next()
                .expect("source exited before printing its metadata")
                .unwrap();
            // libtest prints "test source_child ... " before our line.
            if let Some(at) = line.find("MXSRC ") {
                break line[at..].to_string();
            }
        };
        let mut parts = line.split(' ').skip(1);
        let addr = parts.next().unwrap().parse().unwrap();
        let len = parts.next().unwrap().parse().unwrap();
        let hex = parts.next().unwrap();
        let metadata = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Source {
            child,
            stdin,
            addr,
            len,
            metadata,
        }
    }

    /// Closes the source's stdin and checks it exited cleanly.
    fn finish(mut self) {
        drop(self.stdin.take());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "source exited with {status}");
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        if self.stdin.take().is_some() {
            // Test failed before finish(): do not leave the child behind.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn check_ranges(arena: &Arena, src_base: u64, ops: &[ReadOp]) {
    let data = arena.as_slice();
    for (i, op) in ops.iter().enumerate() {
        let src_off = op.remote_addr - src_base;
        let got = &data[op.local_offset as usize..(op.local_offset + op.len) as usize];
        for (k, &b) in got.iter().enumerate() {
            let want = pattern_byte(src_off + k as u64);
            assert_eq!(
                b,
                want,
                "op {i} ({op:?}): byte {k} (source offset {}) is {b:#04x}, want {want:#04x}",
                src_off + k as u64
            );
        }
    }
}

/// Packs ranges `(source offset, len)` one after another into the local arena.
fn pack(src_base: u64, ranges: &[(u64, u64)]) -> (Vec<ReadOp>, u64) {
    let mut at = 0;
    let ops = ranges
        .iter()
        .map(|&(off, len)| {
            let op = ReadOp {
                remote_addr: src_base + off,
                len,
                local_offset: at,
            };
            at += len;
            op
        })
        .collect();
    (ops, at)
}

#[test]
fn scattered_reads_are_byte_exact() {
    if !nixl_or_skip("scattered_reads_are_byte_exact") {
        return;
    }
    let src_len: u64 = 64 << 20;
    let source = Source::spawn(src_len);
    let agent = Agent::new(&format!("mx-test-reader-{}", std::process::id())).unwrap();
    let remote = agent.load_remote(&source.metadata).unwrap();
    // Loading the same metadata again is harmless and names the same agent.
    assert_eq!(agent.load_remote(&source.metadata).unwrap(), remote);
    assert_eq!(agent.remotes_loaded(), vec![remote.clone()]);

    // Ranges: the whole arena's first 8 MiB, an unaligned odd-sized run, 2000 small runs of
    // 1..=4096 bytes at pseudo-random offsets (many adjacent pairs among them), 64 KiB runs, and
    // the last byte.
    let mut ranges: Vec<(u64, u64)> = vec![(0, 8 << 20), (12_345, 1_000_003)];
    let mut x = 42u64;
    for _ in 0..2000 {
        x = splitmix64(x);
        let len = 1 + (x >> 40) % 4096;
        let off = x % (src_len - len);
        ranges.push((off, len));
    }
    for i in 0..64 {
        ranges.push((i * 1_000_000 + 7, 64 << 10));
    }
    for i in 0..100 {
        // Adjacent runs on both sides: NIXL may merge them.
        ranges.push((40 << 20 | (i * 100), 100));
    }
    ranges.push((src_len - 1, 1));
    let (ops, total) = pack(source.addr, &ranges);
    let mut local = Arena::new(&agent, total).unwrap();

    for opts in [
        ReadOptions::default(),
        ReadOptions {
            batch: 7,
            max_in_flight: 3,
            timeout: Duration::from_secs(60),
        },
        ReadOptions {
            batch: 1,
            max_in_flight: 1,
            timeout: Duration::from_secs(60),
        },
    ] {
        local.as_mut_slice().fill(0);
        let stats = agent.read(&remote, &ops, &mut local, &opts).unwrap();
        assert_eq!(stats.descriptors, ops.len() as u64);
        assert_eq!(stats.bytes, total);
        assert!(stats.seconds > 0.0);
        check_ranges(&local, source.addr, &ops);
    }

    agent.invalidate_remote(&remote).unwrap();
    assert!(agent.remotes_loaded().is_empty());
    let err = agent
        .read(&remote, &ops[..1], &mut local, &ReadOptions::default())
        .unwrap_err();
    assert!(matches!(err, Error::UnknownRemote { .. }), "{err}");
    // Reloading after invalidation works again.
    assert_eq!(agent.load_remote(&source.metadata).unwrap(), remote);
    agent
        .read(&remote, &ops[..10], &mut local, &ReadOptions::default())
        .unwrap();
    check_ranges(&local, source.addr, &ops[..10]);
    drop(local);
    drop(agent);
    source.finish();
}

#[test]
fn bad_read_ops_are_refused_before_posting() {
    if !nixl_or_skip("bad_read_ops_are_refused_before_posting") {
        return;
    }
    let source = Source::spawn(4 << 20);
    let agent = Agent::new(&format!("mx-test-badops-{}", std::process::id())).unwrap();
    let remote = agent.load_remote(&source.metadata).unwrap();
    let mut local = Arena::new(&agent, 1 << 20).unwrap();
    let good = |i: u64| ReadOp {
        remote_addr: source.addr + i * 4096,
        len: 4096,
        local_offset: i * 4096,
    };
    let cases: Vec<(ReadOp, &str)> = vec![
        (
            ReadOp {
                remote_addr: source.addr,
                len: 4097,
                local_offset: (1 << 20) - 4096,
            },
            "past the arena",
        ),
        (
            ReadOp {
                remote_addr: source.addr,
                len: 2,
                local_offset: u64::MAX,
            },
            "overflows",
        ),
        (
            ReadOp {
                remote_addr: u64::MAX - 1,
                len: 2,
                local_offset: 0,
            },
            "overflows",
        ),
        (
            ReadOp {
                remote_addr: source.addr,
                len: 0,
                local_offset: 0,
            },
            "len is 0",
        ),
    ];
    for (bad, why) in cases {
        // 50 good ops (batch 8: several requests would be posted) and the bad one last.
        let mut ops: Vec<ReadOp> = (0..50).map(good).collect();
        ops.push(bad);
        let opts = ReadOptions {
            batch: 8,
            ..ReadOptions::default()
        };
        let err = agent.read(&remote, &ops, &mut local, &opts).unwrap_err();
        match &err {
            Error::BadReadOp { index, reason } => {
                assert_eq!(*index, 50, "{err}");
                assert!(reason.contains(why), "{reason:?} should say {why:?}");
            }
            other => panic!("expected BadReadOp, got {other}"),
        }
        assert!(
            local.as_slice().iter().all(|&b| b == 0),
            "bytes landed although the list was refused"
        );
    }
    // A remote range outside the peer's registered memory (last of 51, batch 8) is refused by
    // NIXL when the requests are created, before any is posted.
    let mut ops: Vec<ReadOp> = (0..50).map(good).collect();
    ops.push(ReadOp {
        remote_addr: source.addr + source.len,
        len: 4096,
        local_offset: 0,
    });
    let opts = ReadOptions {
        batch: 8,
        ..ReadOptions::default()
    };
    let err = agent.read(&remote, &ops, &mut local, &opts).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Nixl {
                call: "nixl_capi_create_xfer_req",
                ..
            }
        ),
        "{err}"
    );
    assert!(
        local.as_slice().iter().all(|&b| b == 0),
        "bytes landed although a remote range was refused"
    );
    // Garbled or truncated metadata is an error, not a crash.
    for bad in [
        &b"not nixl metadata"[..],
        &source.metadata[..source.metadata.len() / 2],
        &[][..],
    ] {
        let err = agent.load_remote(bad).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Nixl {
                    call: "nixl_capi_load_remote_md",
                    ..
                }
            ),
            "{err}"
        );
    }
    // Bad names and lengths are errors, not aborts.
    assert!(matches!(Agent::new(""), Err(Error::BadAgentName { .. })));
    assert!(matches!(
        Agent::new("a\0b"),
        Err(Error::BadAgentName { .. })
    ));
    assert!(matches!(
        Arena::new(&agent, 0),
        Err(Error::BadLength { len: 0, .. })
    ));
    assert!(matches!(
        Arena::new(&agent, u64::MAX),
        Err(Error::BadLength { .. })
    ));
    // Options are checked too.
    let err = agent
        .read(
            &remote,
            &[good(0)],
            &mut local,
            &ReadOptions {
                batch: 0,
                ..ReadOptions::default()
            },
        )
        .unwrap_err();
    assert!(
        matches!(err, Error::BadReadOptions { field: "batch", .. }),
        "{err}"
    );
    // An arena of another agent is refused.
    let other = Agent::new(&format!("mx-test-other-{}", std::process::id())).unwrap();
    let mut foreign = Arena::new(&other, 4096).unwrap();
    let err = agent
        .read(&remote, &[good(0)], &mut foreign, &ReadOptions::default())
        .unwrap_err();
    assert!(matches!(err, Error::ForeignArena { .. }), "{err}");
    // The same good ops then do land.
    let ops: Vec<ReadOp> = (0..50).map(good).collect();
    agent
        .read(&remote, &ops, &mut local, &ReadOptions::default())
        .unwrap();
    check_ranges(&local, source.addr, &ops);
    drop((local, foreign, other, agent));
    source.finish();
}

#[test]
fn probe_costs_is_sane() {
    if !nixl_or_skip("probe_costs_is_sane") {
        return;
    }
    let source = Source::spawn(32 << 20);
    let agent = Agent::new(&format!("mx-test-probe-{}", std::process::id())).unwrap();
    let remote = agent.load_remote(&source.metadata).unwrap();
    let mut scratch = Arena::new(&agent, 32 << 20).unwrap();
    let model = probe_costs(&agent, &remote, source.addr, source.len, &mut scratch).unwrap();
    eprintln!(
        "probe: {:.2} us per descriptor, {:.2} GB/s, break-even run {:.0} bytes",
        model.per_descriptor_s * 1e6,
        model.wire_gbps,
        model.break_even_bytes()
    );
    assert!(
        model.per_descriptor_s > 0.0 && model.per_descriptor_s < 1e-2,
        "{model:?}"
    );
    assert!(
        model.wire_gbps > 0.0 && model.wire_gbps.is_finite(),
        "{model:?}"
    );
    // A region too small to probe is a clear error.
    let err = probe_costs(&agent, &remote, source.addr, 100, &mut scratch).unwrap_err();
    assert!(matches!(err, Error::Probe { .. }), "{err}");
    drop((scratch, agent));
    source.finish();
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Throughput table (FACTS.md): 256 MiB contiguous, and strided runs of RUN bytes pulled from
/// each 3*RUN-byte row of a 192 MiB source (a TP=3 row-parallel slice), one descriptor per run.
/// Run with `cargo test -p mx-nixl --release --test read -- --ignored --nocapture bench`.
#[test]
#[ignore = "benchmark; prints a table"]
fn bench_read_throughput() {
    if !nixl_or_skip("bench_read_throughput") {
        return;
    }
    let src_len: u64 = 256 << 20;
    let source = Source::spawn(src_len);
    let agent = Agent::new(&format!("mx-test-bench-{}", std::process::id())).unwrap();
    let remote = agent.load_remote(&source.metadata).unwrap();
    let mut local = Arena::new(&agent, src_len).unwrap();
    let opts = ReadOptions::default();
    let thp = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    let thp = thp
        .lines()
        .find(|l| l.starts_with("AnonHugePages"))
        .unwrap_or("?");
    eprintln!("reader {thp} (local arena 256 MiB)");
    let whole = [ReadOp {
        remote_addr: source.addr,
        len: src_len,
        local_offset: 0,
    }];
    agent.read(&remote, &whole, &mut local, &opts).unwrap();
    let runs: Vec<f64> = (0..7)
        .map(|_| {
            agent
                .read(&remote, &whole, &mut local, &opts)
                .unwrap()
                .gbps()
        })
        .collect();
    let best = runs.iter().cloned().fold(0.0, f64::max);
    check_ranges(&local, source.addr, &[whole[0]]);
    let memcpy = memcpy_gbps(src_len, 1);
    eprintln!(
        "contiguous 256 MiB: median {:.2} GB/s, best {best:.2} GB/s (memcpy 1 thread {memcpy:.2} GB/s)",
        median(runs)
    );
    for piece in [64u64 << 20, 8 << 20, 2 << 20, 512 << 10] {
        let ops: Vec<ReadOp> = (0..src_len / piece)
            .map(|i| ReadOp {
                remote_addr: source.addr + i * piece,
                len: piece,
                local_offset: i * piece,
            })
            .collect();
        let g: Vec<f64> = (0..5)
            .map(|_| agent.read(&remote, &ops, &mut local, &opts).unwrap().gbps())
            .collect();
        eprintln!(
            "contiguous 256 MiB as {} KiB pieces: median {:.2} GB/s",
            piece >> 10,
            median(g)
        );
    }
    let region: u64 = 192 << 20;
    eprintln!("| run bytes | descriptors | GB/s (median of 3) |");
    for run in [384u64, 1024, 4096, 16 << 10, 64 << 10, 256 << 10] {
        let row = 3 * run;
        let rows = region / row;
        let ops: Vec<ReadOp> = (0..rows)
            .map(|r| ReadOp {
                remote_addr: source.addr + r * row + run,
                len: run,
                local_offset: r * run,
            })
            .collect();
        let g: Vec<f64> = (0..3)
            .map(|_| agent.read(&remote, &ops, &mut local, &opts).unwrap().gbps())
            .collect();
        check_ranges(&local, source.addr, &ops[..ops.len().min(2000)]);
        eprintln!("| {run} | {rows} | {:.2} |", median(g));
    }
    for (batch, inflight) in [
        (64, 4),
        (256, 4),
        (1024, 1),
        (1024, 4),
        (4096, 2),
        (16384, 2),
    ] {
        let run = 1024;
        let rows = region / (3 * run);
        let ops: Vec<ReadOp> = (0..rows)
            .map(|r| ReadOp {
                remote_addr: source.addr + r * 3 * run + run,
                len: run,
                local_offset: r * run,
            })
            .collect();
        let o = ReadOptions {
            batch,
            max_in_flight: inflight,
            timeout: Duration::from_secs(60),
        };
        let g: Vec<f64> = (0..3)
            .map(|_| agent.read(&remote, &ops, &mut local, &o).unwrap().gbps())
            .collect();
        eprintln!(
            "1 KiB runs, batch {batch}, in flight {inflight}: {:.2} GB/s",
            median(g)
        );
    }
    drop((local, agent));
    source.finish();
}
